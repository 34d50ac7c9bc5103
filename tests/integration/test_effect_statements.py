"""The effect ledger in one statement per call: what a pair costs, and the waits inside one.

BeginEffect and CompleteEffect are one statement each (``begin_effect`` and
``complete_effect`` in ``storage/sql/queries.sql``; calls arriving together
share one). The statements a server sends are counted as the benchmark
counts them (its ``leasekeeper_db_statements_total``, every statement a
pooled connection sends, a transaction's BEGIN and COMMIT included), one
pair after another, on a server whose background loops (health, sweeper,
pruner, limits) wait an hour between passes, after a first pair has opened
the connections the statements keep (a new connection asks the database
about the statement's types once). The waits a statement can meet after it
has decided are made real: another transaction inserting the same key holds
the first reservation up, then commits or rolls back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import RunningServer, running_server
from tests.integration import contract_helpers as h
from tests.integration.effect_helpers import IN_DOUBT, PROCEED, begin, complete, effect_rows

pytestmark = pytest.mark.timeout(60)

PAIRS = 20
# Statements a pair may cost; it costs two (one per call). A background pass
# that started with the server may fall in the window: one each at most.
PAIR_STATEMENTS = 2
BACKGROUND = 4
HOUR_S = 3600.0
CROWD = 100

# The first reservation of key "send" by fence 1, as an effect service's
# transaction would hold it: inserted, not yet committed.
_INSERT = """
INSERT INTO leasekeeper_effects
    (namespace, task_id, effect_key, policy, request_digest, state, fence, attempts, begin_time)
VALUES ($1, 't', 'send', 'once', 'd1'::bytea, 'reserved', 1, 1, clock_timestamp())
"""


@pytest.fixture
async def quiet(database_url: str) -> AsyncIterator[RunningServer]:
    """A server whose background loops wait an hour between passes."""
    async with running_server(
        database_url,
        health_interval_s=HOUR_S,
        sweep_interval_s=HOUR_S,
        history_prune_interval_s=HOUR_S,
        limits_refresh_s=HOUR_S,
    ) as running:
        yield running


@pytest.fixture
async def quiet_stub(quiet: RunningServer) -> AsyncIterator[rpc.LeaseServiceStub]:
    async with grpc.aio.insecure_channel(quiet.target) as channel:
        yield rpc.LeaseServiceStub(channel)


def statements(server: RunningServer) -> float:
    return server.server.metrics.db_statements._value.get()


async def test_a_pair_costs_two_statements(quiet, quiet_stub, namespace):
    lease = await h.grant(quiet_stub, namespace, "t", "a", ttl_s=60)
    await begin(quiet_stub, namespace, lease.fence, effect_key="first")
    await complete(quiet_stub, namespace, lease.fence, effect_key="first")
    before = statements(quiet)
    for i in range(PAIRS):
        begun = await begin(quiet_stub, namespace, lease.fence, effect_key=f"k{i}")
        assert begun.decision == PROCEED
        await complete(quiet_stub, namespace, lease.fence, effect_key=f"k{i}")
    sent = statements(quiet) - before
    # Nine a pair when each call was a transaction of several statements.
    assert sent <= PAIR_STATEMENTS * PAIRS + BACKGROUND, f"{sent} statements for {PAIRS} pairs"


async def test_a_pair_saving_the_next_checkpoint_costs_two_statements(quiet, quiet_stub, namespace):
    lease = await h.grant(quiet_stub, namespace, "t", "a", ttl_s=60)
    before = 0.0
    for i in range(PAIRS + 1):
        if i == 1:  # after the first pair, which opened the connections
            before = statements(quiet)
        await begin(quiet_stub, namespace, lease.fence, effect_key=f"k{i}")
        reply = await quiet_stub.CompleteEffect(
            pb.CompleteEffectRequest(
                namespace=namespace,
                task_id="t",
                fence=lease.fence,
                effect_key=f"k{i}",
                outcome=pb.EFFECT_STATE_SUCCEEDED,
                next_checkpoint=pb.Checkpoint(version=i + 1, data=b"cursor"),
            )
        )
        assert reply.checkpoint.version == i + 1
    sent = statements(quiet) - before
    assert sent <= PAIR_STATEMENTS * PAIRS + BACKGROUND, f"{sent} statements for {PAIRS} pairs"


async def test_a_crowd_of_pairs_shares_statements_and_each_is_recorded(
    quiet, quiet_stub, namespace, db
):
    leases = await asyncio.gather(
        *(h.grant(quiet_stub, namespace, f"t{i}", f"o{i}", ttl_s=60) for i in range(CROWD))
    )
    before = statements(quiet)
    begun = await asyncio.gather(
        *(begin(quiet_stub, namespace, lease.fence, task_id=lease.task_id) for lease in leases)
    )
    done = await asyncio.gather(
        *(complete(quiet_stub, namespace, lease.fence, task_id=lease.task_id) for lease in leases)
    )
    sent = statements(quiet) - before
    assert [reply.decision for reply in begun] == [PROCEED] * CROWD
    assert [(e.task_id, e.complete_fence) for e in done] == [(x.task_id, x.fence) for x in leases]
    # One by one it would take two statements a pair; together, a few dozen in all.
    assert sent < PAIR_STATEMENTS * CROWD * 0.75, f"{sent} statements for {CROWD} pairs"
    recorded = await db.fetchval(
        "SELECT count(*) FROM leasekeeper_effects WHERE namespace = $1 AND state = 'succeeded'",
        namespace,
    )
    assert recorded == CROWD


async def _held_insert(db: asyncpg.Connection, namespace: str) -> None:
    """Inserts the key's first reservation in ``db``'s open transaction."""
    await db.execute(_INSERT, namespace)


async def test_a_first_reservation_that_waited_past_the_lease_is_undone(
    stub, namespace, db, monitor
):
    """The insert decided before its wait is checked on the clock after it, and fails."""
    await h.grant(stub, namespace, "t", "a", ttl_s=0.4)
    transaction = db.transaction()
    await transaction.start()
    try:
        await _held_insert(db, namespace)
        pending = asyncio.create_task(begin(stub, namespace, 1))
        await h.wait_for_lock_waiters(monitor, 1)  # its insert waits for this transaction
        await h.wait_past_expiry(db, namespace, "t")  # the lease ends while it waits
        assert not pending.done()
    finally:
        await transaction.rollback()  # the insert it waited for is gone: it inserts, then checks
    await h.expect_error(pending, grpc.StatusCode.ABORTED, "LEASE_EXPIRED")
    assert await effect_rows(db, namespace) == []


async def test_a_first_reservation_committed_meanwhile_is_found_in_doubt(
    stub, namespace, db, monitor
):
    """A BeginEffect whose statement began before another's first reservation committed."""
    await h.grant(stub, namespace, "t", "a", ttl_s=60)
    async with db.transaction():
        await _held_insert(db, namespace)
        pending = asyncio.create_task(begin(stub, namespace, 1))
        await h.wait_for_lock_waiters(monitor, 1)
        assert not pending.done()
    reply = await pending  # its insert conflicted and wrote nothing; asked again, it finds it
    assert reply.decision == IN_DOUBT
    assert (reply.effect.fence, reply.effect.attempts) == (1, 1)
    rows = await db.fetch(
        "SELECT fence, attempts FROM leasekeeper_effects WHERE namespace = $1", namespace
    )
    assert [tuple(r) for r in rows] == [(1, 1)]  # the one reservation, not a second attempt
