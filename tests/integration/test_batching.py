"""Calls arriving together share one statement (batch.py), and each keeps its own answer.

Renewals, claims and reads arriving at once are sent as one statement over
arrays; these tests run them against a real server and database and check
each caller's answer and the row, and count the statements the server sent
(its ``leasekeeper_db_statements_total``).
"""

from __future__ import annotations

import asyncio

import asyncpg
import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import running_server
from tests.integration.contract_helpers import claim, grant, renew, wait_for_lock_waiters

pytestmark = pytest.mark.timeout(30)

CROWD = 200


def statements(server) -> float:
    return server.server.metrics.db_statements._value.get()


async def test_a_crowd_of_renewals_shares_statements_and_each_is_renewed(
    server, stub, namespace, db
):
    leases = await asyncio.gather(
        *(grant(stub, namespace, f"t{i}", f"owner-{i}", ttl_s=5) for i in range(CROWD))
    )
    before = statements(server)
    replies = await asyncio.gather(
        *(
            renew(stub, namespace, lease.task_id, lease.owner_id, lease.fence, 60)
            for lease in leases
        )
    )
    sent = statements(server) - before
    for lease, reply in zip(leases, replies, strict=True):
        assert (reply.lease.task_id, reply.lease.fence) == (lease.task_id, lease.fence)
        assert reply.lease.remaining_ttl.seconds >= 59
    # One by one it would take CROWD statements; batched, 60-80 on an idle machine.
    assert sent < CROWD * 0.75, f"{sent} statements for {CROWD} renewals"
    renewed = await db.fetchval(
        "SELECT count(*) FROM leasekeeper_tasks WHERE namespace = $1"
        " AND expire_time > clock_timestamp() + interval '50 seconds'",
        namespace,
    )
    assert renewed == CROWD


async def test_a_crowd_of_reads_gets_each_its_own_answer(server, stub, namespace):
    lease = await grant(stub, namespace, "t", "a")
    checks = await asyncio.gather(
        *(
            stub.ValidateFence(
                pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=fence)
            )
            for fence in [lease.fence, lease.fence + 1] * (CROWD // 2)
        )
    )
    assert [c.valid for c in checks] == [True, False] * (CROWD // 2)
    assert {c.current_fence for c in checks} == {lease.fence}


async def test_many_owners_claiming_one_task_at_once_one_wins(server, stub, namespace, db):
    replies = await asyncio.gather(
        *(claim(stub, namespace, "hot", f"owner-{i}", ttl_s=30) for i in range(50))
    )
    winners = [r for r in replies if r.acquired]
    assert len(winners) == 1, winners
    assert winners[0].lease.fence == 1
    for r in replies:
        if not r.acquired:
            assert r.holder_remaining_ttl.seconds >= 28
    owner, fence = await db.fetchrow(
        "SELECT owner_id, fence FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = 'hot'",
        namespace,
    )
    assert (owner, fence) == (winners[0].lease.owner_id, 1)


async def test_a_locked_row_does_not_hold_up_the_rest_of_its_batch(
    namespace, database_url, monitor
):
    # A single statement may wait 20 s for a lock; a batch only 50 ms
    # (batch_lock_timeout_s), then its calls run alone.
    async with (
        running_server(database_url, lock_timeout_s=20, statement_timeout_s=30) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        await _locked_row_scene(rpc.LeaseServiceStub(channel), namespace, database_url, monitor)


async def _locked_row_scene(stub, namespace, database_url, monitor):
    leases = [await grant(stub, namespace, f"t{i}", "a", ttl_s=30) for i in range(11)]
    locker = await asyncpg.connect(database_url)
    try:
        tx = locker.transaction()
        await tx.start()
        await locker.execute(
            "SELECT 1 FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = 't0' FOR UPDATE",
            namespace,
        )
        calls = [
            asyncio.ensure_future(renew(stub, namespace, lease.task_id, "a", lease.fence, 60))
            for lease in leases
        ]
        # The ten free rows are renewed while t0 is still locked...
        others = await asyncio.wait_for(asyncio.gather(*calls[1:]), 5)
        assert all(r.lease.remaining_ttl.seconds >= 59 for r in others)
        # ...and t0's renewal waits alone for its row.
        await wait_for_lock_waiters(monitor, 1)
        assert not calls[0].done()
        await tx.rollback()
        locked = await asyncio.wait_for(calls[0], 10)
        assert (locked.lease.task_id, locked.lease.fence) == ("t0", leases[0].fence)
        assert locked.lease.remaining_ttl.seconds >= 59
    finally:
        await locker.close()


async def test_a_claim_the_database_refuses_fails_alone_not_its_batch(
    server, stub, namespace, database_url
):
    # A trigger makes the database refuse one task's row, as it would refuse a
    # value past one of its limits. Claims sent with it in one batch must not
    # share its fate.
    admin = await asyncpg.connect(database_url)
    name = f"refuse_{abs(hash(namespace)):x}"
    await admin.execute(
        f"""CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.namespace = '{namespace}' AND NEW.task_id = 'refused' THEN
                    RAISE EXCEPTION 'refused by the test';
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER {name} BEFORE INSERT OR UPDATE ON leasekeeper_tasks
                FOR EACH ROW EXECUTE FUNCTION {name}();"""
    )
    try:
        bad = claim(stub, namespace, "refused", "owner-x")
        good = [claim(stub, namespace, f"t{i}", f"owner-{i}") for i in range(30)]
        results = await asyncio.gather(bad, *good, return_exceptions=True)
    finally:
        await admin.execute(f"DROP TRIGGER {name} ON leasekeeper_tasks; DROP FUNCTION {name}()")
        await admin.close()
    assert isinstance(results[0], grpc.aio.AioRpcError), results[0]
    assert all(not isinstance(r, BaseException) and r.acquired for r in results[1:]), [
        r for r in results[1:] if isinstance(r, BaseException) or not r.acquired
    ]


async def test_a_stalled_batch_gives_up_soon_and_the_next_renewal_goes_through(
    server, stub, namespace, monitor
):
    import os
    import signal
    import time

    from leasekeeper_server.storage.store import BATCH_TIMEOUT_S

    lease = await grant(stub, namespace, "t", "a", ttl_s=30)
    await renew(stub, namespace, "t", "a", lease.fence, 30)  # the renewals' connection now exists
    pid = await monitor.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'leasekeeper'"
        " AND query LIKE '-- The renewal of a batch%' AND datname = current_database()"
    )
    assert pid, "no connection has run renew_many"
    os.kill(pid, signal.SIGSTOP)  # the backend hangs mid-protocol, as on a stalled host
    try:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await renew(stub, namespace, "t", "a", lease.fence, 30)
        waited_s = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    # The batch's own limit, not the 5 s statement timeout of single statements.
    assert waited_s < BATCH_TIMEOUT_S + 1.5, waited_s
    again = await renew(stub, namespace, "t", "a", lease.fence, 30)
    assert again.lease.fence == lease.fence
