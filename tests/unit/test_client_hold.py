"""LeaseClient and hold() against a fake channel: heartbeat, loss, reopen, release.

The fake stands in for the network below the generated stub, so these run
without a server. Leases are short (ttl 0.3 s); tests poll, they never sleep
for a fixed expiry.
"""

import asyncio
import logging
from collections import deque
from datetime import timedelta

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from leasekeeper import (
    ClaimTimeout,
    InvalidArgument,
    LeaseClient,
    LeaseLost,
    LeaseUnavailable,
    TaskCompleted,
    TaskNotFound,
)
from leasekeeper import lease as lease_module
from leasekeeper.errors import NotAcquired
from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import poll

TTL_S = 0.3


def rpc_error(code: grpc.StatusCode, reason: str) -> grpc.aio.AioRpcError:
    packed = any_pb2.Any()
    packed.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="leasekeeper"))
    status = status_pb2.Status(code=code.value[0], message=reason.lower(), details=[packed])
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=reason.lower())


def duration(seconds: float) -> duration_pb2.Duration:
    message = duration_pb2.Duration()
    message.FromNanoseconds(round(seconds * 1e9))
    return message


class FakeHeartbeatCall:
    def __init__(self, server: "FakeLeaseServer") -> None:
        self.server = server
        self.requests: list[pb.HeartbeatRequest] = []
        self.answers: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.half_closed = False
        self.cancelled = False

    async def write(self, request):
        if self.finished or self.half_closed:
            raise asyncio.InvalidStateError("finished")
        self.requests.append(request)
        self.server.on_beat(self, request)

    async def read(self):
        item = await self.answers.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item is grpc.aio.EOF:
            self.finished = True
        return item

    async def done_writing(self):
        self.half_closed = True
        self.answers.put_nowait(grpc.aio.EOF)

    def cancel(self):
        self.cancelled = True
        return not self.finished

    def end(self, error: BaseException) -> None:
        self.answers.put_nowait(error)


class FakeLeaseServer:
    """Scripted server: claims granted unless scripted, beats answered unless silenced."""

    def __init__(self) -> None:
        self.fence = 0
        self.claims: list[pb.ClaimRequest] = []
        self.claim_script: deque = deque()  # ClaimResponse or exception, used before defaults
        self.releases: list[pb.ReleaseRequest] = []
        self.unary_errors: dict[str, BaseException] = {}
        self.streams: list[FakeHeartbeatCall] = []
        self.silent = False  # black-holed: beats are never answered
        self.stream_script: deque = deque()  # per new stream: None or an error after 1st answer
        self.granted_ttl_s = TTL_S
        self.on_release_complete = None
        self.timeouts: dict[str, list[float | None]] = {}  # per method, each call's deadline
        self.hung: set[str] = set()  # methods never answered (a dead network)

    async def unary(self, name: str, request):
        await asyncio.sleep(0)
        if name in self.hung:
            await asyncio.Event().wait()
        if name in self.unary_errors:
            raise self.unary_errors[name]
        if name == "Claim":
            self.claims.append(request)
            if self.claim_script:
                item = self.claim_script.popleft()
                if isinstance(item, BaseException):
                    raise item
                if item.acquired:
                    self.fence += 1
                    item.lease.fence = self.fence
                return item
            self.fence += 1
            return pb.ClaimResponse(acquired=True, lease=self.lease(request))
        if name == "Release":
            self.releases.append(request)
            if request.complete:
                for call in self.streams:  # the server pushes the end of the lease
                    if not call.finished:
                        call.end(rpc_error(grpc.StatusCode.ABORTED, "TASK_COMPLETED"))
            state = pb.TASK_STATE_COMPLETED if request.complete else pb.TASK_STATE_FREE
            return pb.ReleaseResponse(
                lease=pb.Lease(
                    namespace=request.namespace,
                    task_id=request.task_id,
                    owner_id=request.owner_id,
                    fence=request.fence,
                    state=state,
                )
            )
        if name == "GetLease":
            return pb.GetLeaseResponse(lease=pb.Lease(task_id=request.task_id))
        if name == "Renew":
            return pb.RenewResponse(lease=self.lease(request))
        raise AssertionError(f"unexpected {name}")

    def lease(self, request) -> pb.Lease:
        return pb.Lease(
            namespace=request.namespace,
            task_id=request.task_id,
            owner_id=request.owner_id,
            fence=self.fence,
            state=pb.TASK_STATE_HELD,
            remaining_ttl=duration(self.granted_ttl_s),
        )

    def open_stream(self) -> FakeHeartbeatCall:
        call = FakeHeartbeatCall(self)
        call.script = self.stream_script.popleft() if self.stream_script else None
        self.streams.append(call)
        return call

    def on_beat(self, call: FakeHeartbeatCall, request) -> None:
        if self.silent:
            return
        call.answers.put_nowait(
            pb.HeartbeatResponse(
                fence=self.fence, remaining_ttl=duration(self.granted_ttl_s), renewed=True
            )
        )
        if call.script is not None and len(call.requests) == 1:
            call.end(call.script)

    def abort_streams(self, reason: str) -> None:
        for call in self.streams:
            if not call.finished:
                call.end(rpc_error(grpc.StatusCode.ABORTED, reason))


class FakeChannel:
    def __init__(self, server: FakeLeaseServer) -> None:
        self.server = server

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, **_):
        name = method.rsplit("/", 1)[1]

        # Same signature as a grpc.aio multicallable, deadline included.
        async def call(request, timeout=None, **__):  # noqa: ASYNC109
            self.server.timeouts.setdefault(name, []).append(timeout)
            try:
                async with asyncio.timeout(timeout):
                    return await self.server.unary(name, request)
            except TimeoutError:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    details="Deadline Exceeded",
                ) from None

        return call

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, **_):
        return lambda *args, **kwargs: self.server.open_stream()

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, **_):
        # Watch: the stub is built with it; these tests never call it.
        def refuse(*args, **kwargs):
            raise AssertionError(f"{method} is not faked")

        return refuse


@pytest.fixture
def server() -> FakeLeaseServer:
    return FakeLeaseServer()


@pytest.fixture
def client(server) -> LeaseClient:
    return LeaseClient(namespace="ns", owner_id="worker-1", channel=FakeChannel(server))


async def test_claim_uses_injected_clock_for_send_time(server):
    ticks = iter([41.0, 42.0])
    client = LeaseClient(
        namespace="ns", owner_id="w", channel=FakeChannel(server), clock=lambda: next(ticks)
    )
    result = await client.claim("t1", ttl=30.0)
    assert result.acquired and result.send_time == 41.0
    assert result.lease.fence == 1 and result.lease.state == "HELD"
    request = server.claims[0]
    assert (request.namespace, request.task_id, request.owner_id) == ("ns", "t1", "w")
    assert request.ttl.seconds == 30 and not request.HasField("max_runtime")


async def test_claim_completed_task_raises_task_completed(server, client):
    server.claim_script.append(rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "TASK_COMPLETED"))
    with pytest.raises(TaskCompleted):
        await client.claim("t1")


async def test_get_lease_unknown_task_raises_task_not_found(server, client):
    server.unary_errors["GetLease"] = rpc_error(grpc.StatusCode.NOT_FOUND, "TASK_NOT_FOUND")
    with pytest.raises(TaskNotFound):
        await client.get_lease("nope")


async def test_renew_lost_lease_raises_lease_lost_with_task_and_fence(server, client):
    server.unary_errors["Renew"] = rpc_error(grpc.StatusCode.ABORTED, "LEASE_SUPERSEDED")
    with pytest.raises(LeaseLost) as caught:
        await client.renew("t1", 3)
    assert (caught.value.reason, caught.value.task_id, caught.value.fence) == (
        "LEASE_SUPERSEDED",
        "t1",
        3,
    )


async def test_hold_renews_and_releases_on_exit(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        assert (lease.namespace, lease.task_id, lease.owner_id, lease.fence) == (
            "ns",
            "t1",
            "worker-1",
            1,
        )
        assert lease.metadata() == (
            ("leasekeeper-namespace", "ns"),
            ("leasekeeper-task-id", "t1"),
            ("leasekeeper-fence", "1"),
        )
        await poll(
            lambda: server.streams and len(server.streams[0].requests) >= 3,
            "server.streams and len(server.streams[0].requests) >= 3",
        )
        assert not lease.lost
        lease.check()
        assert 0.0 < lease.remaining_s() <= TTL_S
    first, later = server.streams[0].requests[0], server.streams[0].requests[1]
    assert (first.task_id, first.owner_id, first.fence) == ("t1", "worker-1", 1)
    assert first.ttl.ToNanoseconds() == round(TTL_S * 1e9)
    assert later == pb.HeartbeatRequest()
    assert server.streams[0].half_closed
    assert [(r.fence, r.complete) for r in server.releases] == [(1, False)]


async def test_hold_pushed_abort_cancels_body_and_raises_reason(server, client):
    reached_end = False
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t1", ttl=TTL_S):
            await poll(lambda: server.streams, "server.streams")
            server.abort_streams("LEASE_REVOKED")
            await asyncio.sleep(10)
            reached_end = True
    assert not reached_end
    assert (caught.value.reason, caught.value.task_id, caught.value.fence) == (
        "LEASE_REVOKED",
        "t1",
        1,
    )
    assert isinstance(caught.value.__cause__, asyncio.CancelledError)
    assert server.releases == []  # revoked: nothing of ours to release
    assert asyncio.current_task().cancelling() == 0


async def test_hold_black_holed_stream_loses_lease_at_trust_deadline(server, client):
    server.silent = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t1", ttl=TTL_S):
            await asyncio.sleep(10)
    elapsed = loop.time() - started
    assert caught.value.reason == "LEASE_EXPIRED"
    # trust deadline = ttl - margin (0.03 s) after the claim was sent
    assert TTL_S - 0.03 - 0.01 <= elapsed < TTL_S + 0.5
    await poll(
        lambda: server.releases, "server.releases"
    )  # expired may still be released: in the background
    assert [r.fence for r in server.releases] == [1]


async def test_hold_unavailable_stream_reopens_with_same_fence(server, client):
    server.stream_script.extend([rpc_error(grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"), None])
    async with client.hold("t1", ttl=TTL_S) as lease:
        await poll(
            lambda: len(server.streams) >= 2 and len(server.streams[1].requests) >= 3,
            "len(server.streams) >= 2 and len(server.streams[1].requests) >= 3",
        )
        assert not lease.lost
    assert [call.requests[0].fence for call in server.streams] == [1, 1]
    assert all(call.requests[0].task_id == "t1" for call in server.streams)
    assert len(server.claims) == 1


async def test_hold_unavailable_stream_sets_renewal_error_until_next_renewal(server, client):
    server.granted_ttl_s = 1.0  # beats every 0.33 s, trust deadline 0.9 s after a renewal
    async with client.hold("t1", ttl=1.0) as lease:
        await poll(
            lambda: server.streams and server.streams[0].requests,
            "server.streams and server.streams[0].requests",
        )
        assert lease.renewal_error is None
        server.silent = True  # the reopened stream is not answered at first
        server.streams[0].end(rpc_error(grpc.StatusCode.UNAVAILABLE, "DATABASE_UNAVAILABLE"))
        await poll(lambda: lease.renewal_error is not None, "lease.renewal_error is not None")
        error = lease.renewal_error
        assert isinstance(error, LeaseUnavailable) and error.reason == "DATABASE_UNAVAILABLE"
        assert not lease.lost
        await poll(
            lambda: len(server.streams) >= 2, "len(server.streams) >= 2"
        )  # resumed, not yet answered
        assert lease.renewal_error is error
        server.silent = False
        await poll(lambda: lease.renewal_error is None, "lease.renewal_error is None")
        assert not lease.lost
    assert {call.requests[0].fence for call in server.streams} == {1}
    assert len(server.claims) == 1


async def test_hold_heartbeat_invalid_argument_is_a_loss(server, client):
    server.stream_script.append(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"))
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t1", ttl=TTL_S):
            await asyncio.sleep(10)
    assert caught.value.reason == "INVALID_ARGUMENT"


async def test_hold_body_exception_propagates_and_lease_is_released(server, client):
    with pytest.raises(KeyError, match="boom"):
        async with client.hold("t1", ttl=TTL_S):
            raise KeyError("boom")
    assert [r.fence for r in server.releases] == [1]


async def test_hold_release_on_exit_false_keeps_lease(server, client):
    async with client.hold("t1", ttl=TTL_S, release_on_exit=False):
        await poll(
            lambda: server.streams and server.streams[0].requests,
            "server.streams and server.streams[0].requests",
        )
    assert server.releases == []
    assert server.streams[0].half_closed


async def test_hold_release_failure_is_best_effort(server, client):
    server.unary_errors["Release"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "DATABASE_UNAVAILABLE")
    async with client.hold("t1", ttl=TTL_S):
        pass


async def test_hold_not_acquired_without_wait_raises_not_acquired(server, client):
    server.claim_script.append(
        pb.ClaimResponse(acquired=False, holder_remaining_ttl=duration(12.0))
    )
    with pytest.raises(NotAcquired) as caught:
        async with client.hold("t1", ttl=TTL_S):
            pytest.fail("must not enter")
    assert isinstance(caught.value, ClaimTimeout)
    assert caught.value.holder_remaining_ttl == 12.0
    assert len(server.claims) == 1


async def test_hold_wait_retries_until_acquired(server, client):
    busy = pb.ClaimResponse(acquired=False, holder_remaining_ttl=duration(0.01))
    server.claim_script.extend([busy, busy, rpc_error(grpc.StatusCode.UNAVAILABLE, "X")])
    async with client.hold("t1", ttl=TTL_S, wait=5.0) as lease:
        assert lease.fence == 1
    assert len(server.claims) == 4


async def test_hold_wait_runs_out_raises_claim_timeout(server, client):
    busy = pb.ClaimResponse(acquired=False, holder_remaining_ttl=duration(30.0))
    server.claim_script.extend([busy] * 1000)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ClaimTimeout) as caught:
        async with client.hold("t1", ttl=TTL_S, wait=0.2):
            pytest.fail("must not enter")
    assert not isinstance(caught.value, NotAcquired)
    assert 0.2 <= loop.time() - started < 1.0
    assert len(server.claims) >= 2


async def test_hold_unavailable_without_wait_raises_lease_unavailable(server, client):
    server.claim_script.append(rpc_error(grpc.StatusCode.UNAVAILABLE, "DATABASE_UNAVAILABLE"))
    with pytest.raises(LeaseUnavailable):
        async with client.hold("t1", ttl=TTL_S):
            pytest.fail("must not enter")


async def test_hold_same_task_twice_on_one_client_is_not_acquired(server, client):
    async with client.hold("t1", ttl=TTL_S):
        with pytest.raises(NotAcquired):
            async with client.hold("t1", ttl=TTL_S):
                pytest.fail("must not enter")
    assert len(server.claims) == 1
    async with client.hold("t1", ttl=TTL_S):  # free again after exit
        pass


async def test_hold_complete_completes_once_and_skips_release_on_exit(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        info = await lease.complete()
        assert info.state == "COMPLETED"
        await asyncio.sleep(0.05)  # the pushed TASK_COMPLETED must not cancel the body
        assert not lease.lost
    assert [(r.fence, r.complete) for r in server.releases] == [(1, True)]


async def test_hold_complete_after_loss_raises_without_calling(server, client):
    with pytest.raises(LeaseLost):
        async with client.hold("t1", ttl=TTL_S) as lease:
            await poll(lambda: server.streams, "server.streams")
            server.abort_streams("LEASE_SUPERSEDED")
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                with pytest.raises(LeaseLost):
                    await lease.complete()
                raise
    assert server.releases == []


async def test_hold_body_swallowing_cancellation_still_raises_lease_lost(server, client):
    with pytest.raises(LeaseLost):
        async with client.hold("t1", ttl=TTL_S):
            await poll(lambda: server.streams, "server.streams")
            server.abort_streams("LEASE_SUPERSEDED")
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass
    assert asyncio.current_task().cancelling() == 0


async def test_hold_external_cancel_propagates_as_cancelled(server, client):
    entered = asyncio.Event()

    async def worker():
        async with client.hold("t1", ttl=TTL_S):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(worker())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [r.fence for r in server.releases] == [1]


async def test_hold_synchronous_overrun_raises_lease_lost_on_normal_exit(client):
    ticks = [0.0]
    client._clock = lambda: ticks[0]
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t1", ttl=TTL_S):
            ticks[0] = 10.0  # the block ran past the trust deadline without yielding
    assert caught.value.reason == "LEASE_EXPIRED"


async def test_iter_leases_follows_page_tokens(server, client):
    pages = {
        "": pb.ListLeasesResponse(leases=[pb.Lease(task_id="a")], next_page_token="p2"),
        "p2": pb.ListLeasesResponse(leases=[pb.Lease(task_id="b")]),
    }
    requests = []

    async def list_leases(name, request):
        requests.append(request)
        return pages[request.page_token]

    original = server.unary

    async def unary(name, request):
        if name == "ListLeases":
            return await list_leases(name, request)
        return await original(name, request)

    server.unary = unary
    ids = [info.task_id async for info in client.iter_leases(state="HELD", page_size=1)]
    assert ids == ["a", "b"]
    assert [r.state for r in requests] == [pb.TASK_STATE_HELD] * 2


async def test_hold_loss_on_hung_network_raises_before_the_release_gives_up(
    server, client, monkeypatch, caplog
):
    monkeypatch.setattr(lease_module, "RELEASE_AFTER_LOSS_TIMEOUT_S", 0.2)
    caplog.set_level(logging.INFO, logger="leasekeeper")
    server.silent = True
    server.hung.add("Release")  # the release is never answered
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(LeaseLost):
        async with client.hold("t1", ttl=TTL_S):
            await asyncio.sleep(10)
    assert loop.time() - started < TTL_S + 0.5  # not behind the release
    await poll(
        lambda: not client._background, "not client._background"
    )  # the release gave up by its own timeout
    assert server.timeouts["Release"] == [0.2]
    records = [r for r in caplog.records if r.name == "leasekeeper.lease"]
    assert [(r.levelname, r.exc_info) for r in records] == [("INFO", None)]  # one quiet line
    assert "release of ns/t1 fence 1 failed" in records[0].getMessage()


async def test_close_lets_a_background_release_get_through(server, client):
    server.silent = True
    with pytest.raises(LeaseLost):
        async with client.hold("t1", ttl=TTL_S):
            await asyncio.sleep(10)
    assert len(client._background) == 1 and server.releases == []  # not started yet
    await client.close()
    assert [r.fence for r in server.releases] == [1]
    assert not client._background


async def test_close_gives_up_on_a_hung_background_release(server, client, monkeypatch):
    monkeypatch.setattr(lease_module, "RELEASE_AFTER_LOSS_TIMEOUT_S", 0.2)
    server.silent = True
    server.hung.add("Release")
    with pytest.raises(LeaseLost):
        async with client.hold("t1", ttl=TTL_S):
            await asyncio.sleep(10)
    loop = asyncio.get_running_loop()
    closing = loop.time()
    await client.close()
    assert loop.time() - closing < 1.0
    assert not client._background


async def test_hold_grant_past_its_trust_deadline_raises_and_sends_nothing(server, client):
    ticks = [0.0]

    async def late_claim(name, request):
        answer = await original(name, request)
        if name == "Claim":
            ticks[0] += TTL_S  # the reply took the whole ttl to arrive
        return answer

    original, server.unary = server.unary, late_claim
    client._clock = lambda: ticks[0]
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t1", ttl=TTL_S):
            pytest.fail("entered a lease whose trust deadline had passed")
    assert (caught.value.reason, caught.value.fence) == ("LEASE_EXPIRED", 1)
    assert "after its trust deadline" in str(caught.value)
    assert server.streams == [] and server.releases == []
    assert client._background == set()
    server.unary = original
    async with client.hold("t1", ttl=TTL_S):  # the task was not left marked held
        pass


async def test_hold_trust_deadline_at_runtime_budget_raises_runtime_exceeded(server, client):
    budget_end = pb.Lease().expire_time
    budget_end.FromSeconds(1_000)

    def lease(request) -> pb.Lease:  # every answer: the lease ends at its runtime budget
        message = pb.Lease(
            namespace=request.namespace,
            task_id=request.task_id,
            owner_id=request.owner_id,
            fence=server.fence,
            state=pb.TASK_STATE_HELD,
            remaining_ttl=duration(TTL_S),
        )
        message.expire_time.CopyFrom(budget_end)
        message.runtime_deadline.CopyFrom(budget_end)
        return message

    server.lease = lease
    server.silent = True
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t1", ttl=TTL_S * 10, safety_margin=0.03):
            await asyncio.sleep(10)
    assert caught.value.reason == "RUNTIME_EXCEEDED"


@pytest.mark.parametrize(
    ("ttl", "interval", "problem"),
    [
        (1.0, 0.51, "at least 2 beats per ttl"),
        (1.0, 1.0, "at least 2 beats per ttl"),
        (1.0, 0.001, "at least 0.01 s"),
        (None, 0.1, "explicit ttl"),
    ],
)
def test_hold_heartbeat_interval_out_of_bounds_raises_value_error_at_the_call(
    server, client, ttl, interval, problem
):
    with pytest.raises(ValueError, match="heartbeat_interval") as caught:
        client.hold("t1", ttl=ttl, heartbeat_interval=interval)
    assert isinstance(caught.value, InvalidArgument)
    [(field, description)] = caught.value.field_violations
    assert field == "heartbeat_interval" and problem in description
    assert server.claims == []


async def test_hold_heartbeat_interval_of_half_the_ttl_is_used(server, client, monkeypatch):
    intervals = []
    original = lease_module.HeartbeatKeeper

    def keeper(**kwargs):
        intervals.append(kwargs["interval_s"])
        return original(**kwargs)

    monkeypatch.setattr(lease_module, "HeartbeatKeeper", keeper)
    async with client.hold("t1", ttl=1.0, heartbeat_interval=timedelta(seconds=0.5)):
        pass
    async with client.hold("t1", ttl=0.9):
        pass
    assert intervals == [0.5, pytest.approx(0.3)]


async def test_renew_returns_send_time_and_is_bounded_by_the_trust_deadline(server, client):
    ticks = [50.0]
    client._clock = lambda: ticks[0]
    renewed = await client.renew("t1", 1, ttl=TTL_S, trust_deadline=52.0)
    assert renewed.send_time == 50.0 and renewed.remaining_ttl == TTL_S
    assert renewed.trust_deadline(0.03) == pytest.approx(50.0 + TTL_S - 0.03)
    assert server.timeouts["Renew"] == [2.0]  # the trust deadline, not the 10 s call timeout
    await client.renew("t1", 1)
    assert server.timeouts["Renew"][-1] == 10.0

    ticks[0] = 52.0
    with pytest.raises(LeaseLost) as caught:
        await client.renew("t1", 1, trust_deadline=52.0)
    assert caught.value.reason == "LEASE_EXPIRED"
    assert len(server.timeouts["Renew"]) == 2  # nothing sent


async def test_renew_unanswered_by_the_trust_deadline_raises_lease_lost(server, client):
    server.hung.add("Renew")
    deadline = client.clock() + 0.1
    with pytest.raises(LeaseLost) as caught:
        await client.renew("t1", 1, trust_deadline=deadline)
    assert caught.value.reason == "LEASE_EXPIRED"
    assert caught.value.__cause__.code is grpc.StatusCode.DEADLINE_EXCEEDED
