"""The real RPC handlers over the in-memory storage: no PostgreSQL, no network, a hand-moved clock.

``LeaseServicer``, ``HeartbeatService`` and the claim-waiting logic are the
server's own; only storage is the fake (``storage/memory.py``, held to the
same behaviour as PostgreSQL by ``tests/conformance/``). Handlers are called
directly with a minimal context (:class:`FakeContext`: ``read``, ``write``,
``abort``). The storage clock stands still unless a test advances it, so
remaining ttls are exact; nothing waits for real time except the short
bounded waits named below.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.core.limits import LimitsCache
from leasekeeper_server.core.model import ClaimOutcome, TaskKey
from leasekeeper_server.rpc.heartbeat import HeartbeatService
from leasekeeper_server.rpc.paging import PageTokens
from leasekeeper_server.rpc.servicer import LeaseServicer
from leasekeeper_server.rpc.watch import WatchService
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage.memory import ManualClock, MemoryLedger, MemoryStore
from tests.helpers import dur, poll

T = TypeVar("T")

NS = "ns"
# The longest any step may take; every step here is a few event-loop turns.
STEP_S = 5.0


class Aborted(grpc.aio.AbortError):
    """What FakeContext.abort raises: the status the handler ended the call with."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.reason = reason


@dataclass
class FakeContext:
    """The part of ``grpc.aio.ServicerContext`` the handlers use.

    A stream's requests are put with :meth:`send` (``half_close`` ends them);
    its responses are kept in ``written`` and announced on ``answers``.
    """

    written: list[Any] = field(default_factory=list)
    answers: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    _requests: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)

    def send(self, message: Any) -> None:
        self._requests.put_nowait(message)

    def half_close(self) -> None:
        self._requests.put_nowait(grpc.aio.EOF)

    async def read(self) -> Any:
        return await self._requests.get()

    async def write(self, message: Any) -> None:
        self.written.append(message)
        self.answers.put_nowait(message)

    async def next_answer(self) -> Any:
        return await asyncio.wait_for(self.answers.get(), STEP_S)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        raise Aborted(code, details, _reason(trailing_metadata))


def _reason(trailing_metadata: Any) -> str:
    """The ErrorInfo reason of a rich status's trailing metadata."""
    for key, value in trailing_metadata:
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info.reason
    return ""


@dataclass
class Server:
    """The handlers wired as ``app.py`` wires them, over the memory storage."""

    clock: ManualClock
    store: MemoryStore
    servicer: LeaseServicer
    heartbeats: HeartbeatService
    shutdown: asyncio.Event

    async def call(self, method: str, request: Any) -> Any:
        """A unary call; raises Aborted with the status when the handler fails."""
        handler = getattr(self.servicer, method)
        return await asyncio.wait_for(handler(request, FakeContext()), STEP_S)

    async def claim(self, owner_id: str = "w1", task_id: str = "t", **fields: Any) -> Any:
        fields.setdefault("ttl", dur(30))
        request = pb.ClaimRequest(namespace=NS, task_id=task_id, owner_id=owner_id, **fields)
        return await self.call("Claim", request)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    settings = Settings(_env_file=None, min_ttl_s=0.1, default_ttl_s=5.0, min_renew_interval_s=0.0)
    clock = ManualClock()
    store = MemoryStore(clock)
    events = store.events
    shutdown = asyncio.Event()
    heartbeats = HeartbeatService(store, events, settings, shutdown=shutdown)
    servicer = LeaseServicer(
        store,
        MemoryLedger(store),
        heartbeats,
        settings,
        events=events,
        limits=LimitsCache(),
        watches=WatchService(store, events, settings, shutdown=shutdown),
        page_tokens=PageTokens(b"k" * 32),
        shutdown=shutdown,
    )
    yield Server(clock, store, servicer, heartbeats, shutdown)
    shutdown.set()


async def aborted(call: Awaitable[Any]) -> Aborted:
    with pytest.raises(Aborted) as raised:
        await asyncio.wait_for(call, STEP_S)
    return raised.value


# Claim


async def test_claim_grants_then_refuses_with_the_holders_exact_remaining_ttl(
    server: Server,
) -> None:
    granted = await server.claim("w1", ttl=dur(30))
    assert granted.acquired and granted.lease.fence == 1
    assert granted.lease.remaining_ttl.ToTimedelta() == timedelta(seconds=30)
    server.clock.advance(10)
    refused = await server.claim("w2")
    assert not refused.acquired
    assert refused.holder_remaining_ttl.ToTimedelta() == timedelta(seconds=20)
    assert refused.retry_after.ToTimedelta() == timedelta(seconds=20)
    server.clock.advance(20)
    assert (await server.claim("w2")).lease.fence == 2


async def test_claim_of_a_completed_task_is_failed_precondition(server: Server) -> None:
    lease = (await server.claim("w1")).lease
    await server.call(
        "Release",
        pb.ReleaseRequest(
            namespace=NS, task_id="t", owner_id="w1", fence=lease.fence, complete=True
        ),
    )
    error = await aborted(server.claim("w2"))
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "TASK_COMPLETED")


async def test_claim_with_bad_input_is_invalid_argument(server: Server) -> None:
    error = await aborted(server.claim(""))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")


@contextlib.contextmanager
def claims_seen(store: MemoryStore) -> Any:
    """Records every claim's outcome the store answers (a spy on ``store.claim``)."""
    seen: list[ClaimOutcome] = []
    real = store.claim

    async def claim(*args: Any, **kwargs: Any) -> ClaimOutcome:
        outcome = await real(*args, **kwargs)
        seen.append(outcome)
        return outcome

    store.claim = claim
    try:
        yield seen
    finally:
        store.claim = real


async def test_a_waiting_claim_is_woken_by_the_release(server: Server) -> None:
    holder = (await server.claim("w1", ttl=dur(300))).lease
    with claims_seen(server.store) as seen:
        waiting = asyncio.ensure_future(server.claim("w2", wait=dur(60)))
        # The first try is refused; the timer it sets is the holder's 300 s
        # (real seconds): only the release's announcement can wake it sooner.
        await poll(lambda: seen, "the waiting claim's first try", within_s=STEP_S)
        assert not seen[0].acquired and not waiting.done()
        await server.call(
            "Release",
            pb.ReleaseRequest(namespace=NS, task_id="t", owner_id="w1", fence=holder.fence),
        )
        reply = await asyncio.wait_for(waiting, STEP_S)
    assert reply.acquired and reply.lease.owner_id == "w2" and reply.lease.fence == 2
    assert [outcome.acquired for outcome in seen] == [False, True]


async def test_a_waiting_claim_gives_up_after_its_wait(server: Server) -> None:
    await server.claim("w1", ttl=dur(300))
    reply = await server.claim("w2", wait=dur(0.05))  # 50 ms of real time
    assert not reply.acquired
    assert reply.holder_remaining_ttl.ToTimedelta() == timedelta(seconds=300)


async def test_a_waiting_claim_ends_unavailable_on_shutdown(server: Server) -> None:
    await server.claim("w1", ttl=dur(300))
    with claims_seen(server.store) as seen:
        waiting = asyncio.ensure_future(server.claim("w2", wait=dur(60)))
        await poll(lambda: seen, "the waiting claim's first try", within_s=STEP_S)
        server.shutdown.set()
        error = await aborted(waiting)
    assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")


# Renew and ValidateFence


async def test_renew_extends_from_the_storage_clock_and_never_revives(server: Server) -> None:
    lease = (await server.claim("w1", ttl=dur(30))).lease
    ref = {"namespace": NS, "task_id": "t", "owner_id": "w1", "fence": lease.fence}
    server.clock.advance(20)
    renewed = (await server.call("Renew", pb.RenewRequest(**ref, ttl=dur(60)))).lease
    assert renewed.remaining_ttl.ToTimedelta() == timedelta(seconds=60)
    assert renewed.expire_time.ToDatetime() - lease.expire_time.ToDatetime() == timedelta(
        seconds=50
    )
    server.clock.advance(61)
    error = await aborted(server.call("Renew", pb.RenewRequest(**ref)))
    assert (error.code, error.reason) == (grpc.StatusCode.ABORTED, "LEASE_EXPIRED")


async def test_validate_fence_follows_the_storage_clock(server: Server) -> None:
    first = (await server.claim("w1", ttl=dur(30))).lease

    async def validate(fence: int) -> Any:
        request = pb.ValidateFenceRequest(namespace=NS, task_id="t", fence=fence)
        return await server.call("ValidateFence", request)

    valid = await validate(first.fence)
    assert valid.valid and valid.current_fence == first.fence
    assert valid.remaining_ttl.ToTimedelta() == timedelta(seconds=30)
    server.clock.advance(30)  # expire_time == now: EXPIRED
    expired = await validate(first.fence)
    assert not expired.valid and expired.reason == pb.LOSS_REASON_LEASE_EXPIRED
    second = (await server.claim("w2")).lease
    stale = await validate(first.fence)
    assert (stale.valid, stale.reason, stale.current_fence) == (
        False,
        pb.LOSS_REASON_LEASE_SUPERSEDED,
        second.fence,
    )
    unknown = await validate(second.fence + 1)
    assert unknown.reason == pb.LOSS_REASON_FENCE_UNKNOWN
    never = await server.call(
        "ValidateFence", pb.ValidateFenceRequest(namespace=NS, task_id="never", fence=1)
    )
    assert (never.valid, never.current_fence, never.reason) == (
        False,
        0,
        pb.LOSS_REASON_FENCE_UNKNOWN,
    )


# Heartbeat


def beat(fence: int, **fields: Any) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(namespace=NS, task_id="t", owner_id="w1", fence=fence, **fields)


@contextlib.asynccontextmanager
async def heartbeat(server: Server) -> AsyncIterator[tuple[FakeContext, asyncio.Future[Any]]]:
    """An open Heartbeat stream: its context and the running handler."""
    context = FakeContext()
    stream = asyncio.ensure_future(server.servicer.Heartbeat(None, context))
    try:
        yield context, stream
    finally:
        if not stream.done():
            stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)


async def test_each_beat_renews_from_the_storage_clock(server: Server) -> None:
    lease = (await server.claim("w1", ttl=dur(30))).lease
    async with heartbeat(server) as (context, stream):
        context.send(beat(lease.fence, ttl=dur(30)))
        first = await context.next_answer()
        assert (first.fence, first.renewed) == (lease.fence, True)
        assert first.remaining_ttl.ToTimedelta() == timedelta(seconds=30)
        server.clock.advance(10)
        context.send(beat(lease.fence))
        second = await context.next_answer()
        assert second.renewed
        assert second.expire_time.ToDatetime() - first.expire_time.ToDatetime() == timedelta(
            seconds=10
        )
        stored = server.store.read(TaskKey(NS, "t"))
        assert stored is not None and stored.expire_time == second.expire_time.ToDatetime(
            tzinfo=stored.expire_time.tzinfo
        )
        context.half_close()
        await asyncio.wait_for(stream, STEP_S)  # OK: the lease stays HELD
    assert server.heartbeats.open_streams == 0


async def test_a_lost_lease_ends_the_stream_without_waiting_for_a_beat(server: Server) -> None:
    lease = (await server.claim("w1", ttl=dur(300))).lease
    async with heartbeat(server) as (context, stream):
        context.send(beat(lease.fence))
        await context.next_answer()
        await server.call("Revoke", pb.RevokeRequest(namespace=NS, task_id="t", reason="ops"))
        error = await aborted(stream)
    assert (error.code, error.reason) == (grpc.StatusCode.ABORTED, "LEASE_REVOKED")


async def test_a_beat_for_an_expired_lease_is_aborted(server: Server) -> None:
    lease = (await server.claim("w1", ttl=dur(30))).lease
    server.clock.advance(31)
    async with heartbeat(server) as (context, stream):
        context.send(beat(lease.fence))
        error = await aborted(stream)
    assert (error.code, error.reason) == (grpc.StatusCode.ABORTED, "LEASE_EXPIRED")


async def test_shutdown_ends_the_stream_unavailable(server: Server) -> None:
    lease = (await server.claim("w1", ttl=dur(300))).lease
    async with heartbeat(server) as (context, stream):
        context.send(beat(lease.fence))
        await context.next_answer()
        server.shutdown.set()
        error = await aborted(stream)
    assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")


# Watch


async def test_watch_starts_with_a_snapshot_then_streams_the_changes(server: Server) -> None:
    lease = (await server.claim("w1", ttl=dur(30))).lease
    context = FakeContext()
    stream = asyncio.ensure_future(
        server.servicer.Watch(pb.WatchRequest(namespace=NS, task_id="t"), context)
    )
    try:
        snapshot = await context.next_answer()
        assert snapshot.type == pb.TASK_EVENT_TYPE_SNAPSHOT
        assert snapshot.lease.fence == lease.fence
        server.clock.advance(31)
        await server.claim("w2")  # announces the expiry, then the grant
        kinds = [(await context.next_answer()).type for _ in range(2)]
        assert kinds == [pb.TASK_EVENT_TYPE_EXPIRED, pb.TASK_EVENT_TYPE_CLAIMED]
        assert context.written[-1].lease.owner_id == "w2"
    finally:
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
