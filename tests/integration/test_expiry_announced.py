"""Every expiry is announced once, whichever call comes after it.

A lease that expires is announced (TASK_EVENT_TYPE_EXPIRED on Watch, the
``leases_expired`` metric, the audit record) by the elected sweeper, or, when
a call ends the lease before the sweeper comes by, by that call, just before
its own event (migrations/0006_announce_every_expiry.sql). The servers here
sweep once a minute, right after they start: every lease below expires
(backdated on the database clock) after that sweep, so the call always wins.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.storage.sweeper import SWEEPER_LOCK_ID
from tests.conftest import RunningServer, running_server
from tests.helpers import error_info, poll
from tests.integration.contract_helpers import (
    backdate,
    failure,
    grant,
    release,
    renew,
    row,
    validate,
)
from tests.integration.effect_helpers import begin

pytestmark = pytest.mark.timeout(60)

T = pb.TaskEventType
CLAIMED, EXPIRED = T.TASK_EVENT_TYPE_CLAIMED, T.TASK_EVENT_TYPE_EXPIRED
RELEASED, REVOKED = T.TASK_EVENT_TYPE_RELEASED, T.TASK_EVENT_TYPE_REVOKED
COMPLETED = T.TASK_EVENT_TYPE_COMPLETED
Stub = rpc.LeaseServiceStub
# What follows the expiry of owner "a"'s lease (fence 1) on task "t".
Step = Callable[[Stub, str], Awaitable[object]]


async def sweeper_lock_free(db: asyncpg.Connection) -> bool:
    """True once no session of this database holds the sweeper's advisory lock."""
    held = await db.fetchval(
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database"
        " WHERE d.datname = current_database() AND l.locktype = 'advisory' AND l.granted"
        " AND (l.classid::bigint << 32) | l.objid::bigint = $1",
        SWEEPER_LOCK_ID,
    )
    return held == 0


@pytest.fixture
async def slow_sweeper(database_url: str, db: asyncpg.Connection) -> AsyncIterator[RunningServer]:
    """The elected sweeper of the database, sweeping once a minute."""
    # The previous test's server lets its lock go when its connection ends.
    await poll(lambda: sweeper_lock_free(db), "the sweeper lock released")
    async with running_server(database_url, sweep_interval_s=60.0) as running:

        async def leader() -> bool:
            return running.server.sweeper.is_leader

        await poll(leader, "this server elected sweeper")
        yield running


def expired_count(running: RunningServer, namespace: str) -> float:
    value = running.server.metrics.registry.get_sample_value(
        "leasekeeper_leases_expired_total", {"namespace": namespace}
    )
    return value or 0.0


async def events_until_marker(stream: grpc.aio.StreamStreamCall) -> list[tuple[int, str, int]]:
    """(type, owner_id, fence) of task "t"'s events, read until the claim of task "marker"."""
    seen = []
    while True:
        event = await asyncio.wait_for(stream.read(), 10.0)
        if event.lease.task_id == "marker":
            return seen
        seen.append((event.type, event.lease.owner_id, event.lease.fence))


async def claim_by_other(stub: Stub, namespace: str) -> object:
    return await grant(stub, namespace, "t", "b")


async def claim_again_by_owner(stub: Stub, namespace: str) -> object:
    return await grant(stub, namespace, "t", "a")


async def release_it(stub: Stub, namespace: str) -> object:
    return await release(stub, namespace, "t", "a", 1)


async def complete_it(stub: Stub, namespace: str) -> object:
    return await release(stub, namespace, "t", "a", 1, complete=True)


async def release_then_complete(stub: Stub, namespace: str) -> object:
    await release(stub, namespace, "t", "a", 1)
    return await release(stub, namespace, "t", "a", 1, complete=True)


async def revoke_it(stub: Stub, namespace: str) -> object:
    return await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id="t", reason="ops"))


async def lost_calls_then_release(stub: Stub, namespace: str) -> object:
    """Calls that find the lease lost change nothing, announce nothing; the release does."""
    exc = await failure(renew(stub, namespace, "t", "a", 1))
    assert (exc.code(), error_info(exc).reason) == (grpc.StatusCode.ABORTED, "LEASE_EXPIRED")
    call = stub.Heartbeat()
    await call.write(pb.HeartbeatRequest(namespace=namespace, task_id="t", owner_id="a", fence=1))
    exc = await failure(call.read())
    assert (exc.code(), error_info(exc).reason) == (grpc.StatusCode.ABORTED, "LEASE_EXPIRED")
    exc = await failure(begin(stub, namespace, 1))
    assert (exc.code(), error_info(exc).reason) == (grpc.StatusCode.ABORTED, "LEASE_EXPIRED")
    assert not (await validate(stub, namespace, "t", 1)).valid
    return await release(stub, namespace, "t", "a", 1)


STEPS: list[tuple[Step, list[tuple[int, str, int]]]] = [
    (claim_by_other, [(CLAIMED, "b", 2)]),
    (claim_again_by_owner, [(CLAIMED, "a", 2)]),
    (release_it, [(RELEASED, "a", 1)]),
    (complete_it, [(COMPLETED, "a", 1)]),
    (release_then_complete, [(RELEASED, "a", 1), (COMPLETED, "a", 1)]),
    (revoke_it, [(REVOKED, "a", 1)]),
    (lost_calls_then_release, [(RELEASED, "a", 1)]),
]


@pytest.mark.parametrize(
    ("step", "after"), [pytest.param(step, after, id=step.__name__) for step, after in STEPS]
)
async def test_an_expiry_ended_by_a_call_before_the_sweep_is_announced_once(
    slow_sweeper, namespace, db, step, after
):
    async with grpc.aio.insecure_channel(slow_sweeper.target) as channel:
        stub = rpc.LeaseServiceStub(channel)
        stream = stub.Watch(pb.WatchRequest(namespace=namespace))
        await grant(stub, namespace, "t", "a", ttl_s=30.0)
        await backdate(db, namespace, "t")
        await step(stub, namespace)
        await grant(stub, namespace, "marker", "m", ttl_s=30.0)

        events = await events_until_marker(stream)
        assert events == [(CLAIMED, "a", 1), (EXPIRED, "a", 1), *after]
        stream.cancel()
    # The call announced it: the sweeper never marked the lease.
    assert (await row(db, namespace, "t"))["expiry_announced_fence"] is None

    async def counted() -> float:
        return expired_count(slow_sweeper, namespace)

    assert await poll(counted, "the expiry counted") == 1.0


async def test_an_expiry_the_sweeper_announced_is_not_announced_again_by_the_release(
    database_url, namespace, db
):
    await poll(lambda: sweeper_lock_free(db), "the sweeper lock released")
    async with (
        running_server(database_url, sweep_interval_s=0.05) as running,
        grpc.aio.insecure_channel(running.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        stream = stub.Watch(pb.WatchRequest(namespace=namespace))
        await grant(stub, namespace, "t", "a", ttl_s=30.0)
        await backdate(db, namespace, "t")
        announced = await asyncio.wait_for(stream.read(), 10.0)
        assert announced.type == CLAIMED
        announced = await asyncio.wait_for(stream.read(), 10.0)
        assert (announced.type, announced.lease.fence) == (EXPIRED, 1)
        await release(stub, namespace, "t", "a", 1)
        await grant(stub, namespace, "t", "b", ttl_s=30.0)
        await grant(stub, namespace, "marker", "m", ttl_s=30.0)

        assert await events_until_marker(stream) == [(RELEASED, "a", 1), (CLAIMED, "b", 2)]
        stream.cancel()

        async def counted() -> float:
            return expired_count(running, namespace)

        assert await poll(counted, "the expiry counted") == 1.0
