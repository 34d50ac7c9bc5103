"""Watch: a task's events as the database commits them, and the elected sweeper's expiries."""

from __future__ import annotations

import asyncio

import grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.settings import MAX_ID_BYTES_LIMIT
from tests.conftest import running_server
from tests.helpers import dur, poll
from tests.integration.contract_helpers import grant, release

T = pb.TaskEventType


async def next_event(stream, timeout_s: float = 5.0) -> pb.TaskEvent:
    return await asyncio.wait_for(stream.read(), timeout_s)


async def test_watch_delivers_a_tasks_events_in_order(stub, namespace):
    stream = stub.Watch(pb.WatchRequest(namespace=namespace, task_id="t"))
    snapshot = await next_event(stream)
    assert snapshot.type == T.TASK_EVENT_TYPE_SNAPSHOT
    assert (snapshot.lease.task_id, snapshot.lease.fence) == ("t", 0)
    assert snapshot.lease.state == pb.TASK_STATE_FREE

    first = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    claimed = await next_event(stream)
    assert claimed.type == T.TASK_EVENT_TYPE_CLAIMED
    assert (claimed.lease.owner_id, claimed.lease.fence) == ("a", first.fence)
    assert claimed.lease.state == pb.TASK_STATE_HELD
    assert claimed.event_time == first.claim_time

    await release(stub, namespace, "t", "a", first.fence)
    released = await next_event(stream)
    assert released.type == T.TASK_EVENT_TYPE_RELEASED
    assert released.lease.end_reason == pb.LOSS_REASON_LEASE_RELEASED

    second = await grant(stub, namespace, "t", "b", ttl_s=30.0)
    assert (await next_event(stream)).lease.fence == second.fence
    await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id="t", reason="maintenance"))
    revoked = await next_event(stream)
    assert revoked.type == T.TASK_EVENT_TYPE_REVOKED
    assert revoked.lease.revoke_reason == "maintenance"
    assert revoked.lease.fence == second.fence

    third = await grant(stub, namespace, "t", "c", ttl_s=30.0)
    assert (await next_event(stream)).type == T.TASK_EVENT_TYPE_CLAIMED
    await release(stub, namespace, "t", "c", third.fence, complete=True)
    completed = await next_event(stream)
    assert completed.type == T.TASK_EVENT_TYPE_COMPLETED
    assert completed.lease.state == pb.TASK_STATE_COMPLETED
    stream.cancel()


async def test_an_expiry_is_announced_once_by_the_elected_sweeper(database_url, namespace, db):
    async with (
        running_server(database_url, sweep_interval_s=0.1) as one,
        running_server(database_url, sweep_interval_s=0.1) as two,
    ):
        sweepers = (one.server.sweeper, two.server.sweeper)

        async def leaders() -> list[bool] | None:
            flags = [s.is_leader for s in sweepers]
            return flags if any(flags) else None

        assert sorted(await poll(leaders, "a sweeper elected")) == [False, True]
        async with (
            grpc.aio.insecure_channel(one.target) as ch1,
            grpc.aio.insecure_channel(two.target) as ch2,
        ):
            stub1, stub2 = rpc.LeaseServiceStub(ch1), rpc.LeaseServiceStub(ch2)
            watches = [
                s.Watch(pb.WatchRequest(namespace=namespace, task_id="t")) for s in (stub1, stub2)
            ]
            for w in watches:
                assert (await next_event(w)).type == T.TASK_EVENT_TYPE_SNAPSHOT
            lease = await grant(stub1, namespace, "t", "a", ttl_s=0.3)
            for w in watches:
                assert (await next_event(w)).type == T.TASK_EVENT_TYPE_CLAIMED
                expired = await next_event(w)
                assert expired.type == T.TASK_EVENT_TYPE_EXPIRED
                assert expired.lease.state == pb.TASK_STATE_EXPIRED
                assert expired.lease.end_reason == pb.LOSS_REASON_LEASE_EXPIRED
                assert expired.event_time == lease.expire_time
            announced = await db.fetchval(
                "SELECT expiry_announced_fence FROM leasekeeper_tasks"
                " WHERE namespace = $1 AND task_id = 't'",
                namespace,
            )
            assert announced == lease.fence
            for w in watches:
                w.cancel()

        # The leader goes away: the other replica takes over.
        leader, other = (one, two) if one.server.sweeper.is_leader else (two, one)
        await leader.server.stop(0)

        async def took_over() -> bool:
            return other.server.sweeper.is_leader

        await poll(took_over, "the other replica elected")


async def test_a_namespace_watch_sees_every_tasks_events(stub, namespace):
    stream = stub.Watch(pb.WatchRequest(namespace=namespace))
    # No snapshot for a namespace: the first event is the first change.
    a = await grant(stub, namespace, "a", "w1", ttl_s=30.0)
    b = await grant(stub, namespace, "b", "w2", ttl_s=30.0)
    seen = [await next_event(stream), await next_event(stream)]
    assert [(e.type, e.lease.task_id, e.lease.fence) for e in seen] == [
        (T.TASK_EVENT_TYPE_CLAIMED, "a", a.fence),
        (T.TASK_EVENT_TYPE_CLAIMED, "b", b.fence),
    ]
    stream.cancel()


async def test_watch_ends_unavailable_on_shutdown(database_url, namespace):
    async with running_server(database_url) as running:
        async with grpc.aio.insecure_channel(running.target) as ch:
            stream = rpc.LeaseServiceStub(ch).Watch(
                pb.WatchRequest(namespace=namespace, task_id="t")
            )
            assert (await next_event(stream)).type == T.TASK_EVENT_TYPE_SNAPSHOT
            await running.server.stop(0.5)
            try:
                await next_event(stream)
                raise AssertionError("the stream outlived the server")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE


async def test_an_expiry_taken_over_by_a_claim_before_the_sweep_is_announced_once(
    database_url, namespace
):
    # The sweeper sweeps once a minute here: a waiting claim takes the task
    # over first, and the claim announces the old lease's expiry itself.
    async with running_server(database_url, sweep_interval_s=60.0) as running:
        async with grpc.aio.insecure_channel(running.target) as ch:
            stub = rpc.LeaseServiceStub(ch)
            stream = stub.Watch(pb.WatchRequest(namespace=namespace, task_id="t"))
            assert (await next_event(stream)).type == T.TASK_EVENT_TYPE_SNAPSHOT
            first = await grant(stub, namespace, "t", "a", ttl_s=0.3)
            waited = await stub.Claim(
                pb.ClaimRequest(
                    namespace=namespace, task_id="t", owner_id="b", wait=dur(5.0), ttl=dur(30.0)
                )
            )
            assert waited.acquired
            events = [await next_event(stream) for _ in range(3)]
            assert [(e.type, e.lease.fence) for e in events] == [
                (T.TASK_EVENT_TYPE_CLAIMED, first.fence),
                (T.TASK_EVENT_TYPE_EXPIRED, first.fence),
                (T.TASK_EVENT_TYPE_CLAIMED, waited.lease.fence),
            ]
            assert events[1].lease.owner_id == "a"
            assert events[1].event_time == first.expire_time
            stream.cancel()


async def test_the_longest_ids_of_quotes_still_reach_watchers(database_url, namespace):
    """The worst change notification fits PostgreSQL's 8000-byte payload (settings.py).

    Ids of the longest allowed size, all quote characters (each doubled as
    JSON), and a revoke reason of 1024 backslashes (doubled too): the claim
    and the revoke succeed, and a watcher receives both events intact.
    """

    def longest(prefix: str) -> str:
        return prefix + '"' * (MAX_ID_BYTES_LIMIT - len(prefix))

    ns, task, owner = longest(namespace), longest("t"), longest("o")
    reason = "\\" * 1024
    async with (
        running_server(database_url, max_id_bytes=MAX_ID_BYTES_LIMIT) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        stream = stub.Watch(pb.WatchRequest(namespace=ns, task_id=task))
        assert (await next_event(stream)).type == T.TASK_EVENT_TYPE_SNAPSHOT
        reply = await stub.Claim(
            pb.ClaimRequest(
                namespace=ns, task_id=task, owner_id=owner, request_id=longest("r"), ttl=dur(30)
            )
        )
        assert reply.acquired
        claimed = await next_event(stream)
        assert claimed.type == T.TASK_EVENT_TYPE_CLAIMED
        assert (claimed.lease.namespace, claimed.lease.task_id, claimed.lease.owner_id) == (
            ns,
            task,
            owner,
        )
        await stub.Revoke(pb.RevokeRequest(namespace=ns, task_id=task, reason=reason))
        revoked = await next_event(stream)
        assert revoked.type == T.TASK_EVENT_TYPE_REVOKED
        assert (revoked.lease.revoke_reason, revoked.lease.owner_id) == (reason, owner)
        stream.cancel()
