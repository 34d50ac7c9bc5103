"""hold(wait=...) lets the server wait (Claim with ``wait``) instead of polling, on a fake channel.

The fake server of ``test_client_hold`` answers at once; here it can also take
the time a Claim asked for before answering "not acquired", as the real server
does when a wait runs out.
"""

import asyncio
import functools

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from leasekeeper import ClaimTimeout, LeaseClient
from leasekeeper import _acquire as acquire_module
from leasekeeper._backoff import Backoff
from leasekeeper.v1 import lease_service_pb2 as pb
from tests.unit.test_client_hold import TTL_S, FakeChannel, FakeLeaseServer, duration

CALL_TIMEOUT_S = 10.0  # LeaseClient's default


class WaitingFakeServer(FakeLeaseServer):
    """A scripted "not acquired" comes after the Claim's whole wait, as from the real server."""

    async def unary(self, name: str, request):
        answer = await super().unary(name, request)
        if name == "Claim" and not answer.acquired and request.HasField("wait"):
            await asyncio.sleep(request.wait.ToNanoseconds() / 1e9)
        return answer


def busy() -> pb.ClaimResponse:
    return pb.ClaimResponse(acquired=False, holder_remaining_ttl=duration(30.0))


def wait_refused() -> grpc.aio.AioRpcError:
    """INVALID_ARGUMENT on ``wait``, as a server whose max_claim_wait_s is lower answers."""
    info = error_details_pb2.ErrorInfo(
        reason="INVALID_ARGUMENT", domain="leasekeeper", metadata={"field": "wait"}
    )
    packed = any_pb2.Any()
    packed.Pack(info)
    code = grpc.StatusCode.INVALID_ARGUMENT
    status = status_pb2.Status(code=code.value[0], message="wait too long", details=[packed])
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details="wait too long")


def waits_s(server: FakeLeaseServer) -> list[float | None]:
    return [c.wait.ToNanoseconds() / 1e9 if c.HasField("wait") else None for c in server.claims]


@pytest.fixture
def backoffs(monkeypatch) -> list[float]:
    """Every backoff delay the acquisition drew (each one a sleep before polling again)."""
    drawn: list[float] = []

    class RecordingBackoff(Backoff):
        def next_delay_s(self, hint_s=None):
            drawn.append(super().next_delay_s(hint_s))
            return drawn[-1]

    monkeypatch.setattr(acquire_module, "Backoff", RecordingBackoff)
    return drawn


@pytest.fixture
def server() -> WaitingFakeServer:
    return WaitingFakeServer()


@pytest.fixture
def client(server) -> LeaseClient:
    return LeaseClient(namespace="ns", owner_id="worker-1", channel=FakeChannel(server))


async def test_hold_wait_sends_the_wait_with_a_deadline_a_call_timeout_past_it(server, client):
    async with client.hold("t1", ttl=TTL_S, wait=30.0) as lease:
        assert lease.fence == 1
    [wait_s] = waits_s(server)
    assert 29.0 < wait_s <= 30.0
    # Longer than the 10 s call timeout, and not cut short by it.
    assert server.timeouts["Claim"] == [pytest.approx(wait_s + CALL_TIMEOUT_S)]


async def test_hold_without_wait_sends_no_wait_within_the_call_timeout(server, client):
    async with client.hold("t1", ttl=TTL_S):
        pass
    assert waits_s(server) == [None]
    assert server.timeouts["Claim"] == [CALL_TIMEOUT_S]


async def test_claim_keeps_the_call_timeout_as_its_deadline(server, client):
    # claim() is unchanged: its caller keeps the wait below the call timeout.
    await client.claim("t1", wait=5.0)
    assert waits_s(server) == [5.0]
    assert server.timeouts["Claim"] == [CALL_TIMEOUT_S]


async def test_hold_wait_longer_than_one_claim_may_ask_claims_again_at_once(
    server, client, monkeypatch, backoffs
):
    monkeypatch.setattr(acquire_module, "CLAIM_WAIT_MAX_S", 0.1)
    server.claim_script.extend([busy(), busy()])  # each answered when its wait is over
    async with client.hold("t1", ttl=TTL_S, wait=5.0) as lease:
        assert lease.fence == 1
    # Two waits of 0.1 s, then the grant: no backoff sleep between the Claims.
    assert waits_s(server) == [0.1, 0.1, 0.1]
    assert backoffs == []
    assert len({c.request_id for c in server.claims}) == 1


async def test_hold_wait_runs_out_on_a_waiting_server_with_one_claim(server, client, backoffs):
    server.claim_script.extend([busy()] * 10)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ClaimTimeout) as caught:
        async with client.hold("t1", ttl=TTL_S, wait=0.3):
            pytest.fail("must not enter")
    assert 0.3 <= loop.time() - started < 1.0
    assert len(server.claims) == 1 and backoffs == []  # the server waited; nothing polled
    assert caught.value.holder_remaining_ttl == 30.0


async def test_hold_wait_refused_by_the_server_asks_half_then_polls(server, client):
    # wait 1.5 s refused -> 0.75 s would be below CLAIM_WAIT_MIN_S: claim without a wait.
    server.claim_script.extend([wait_refused()])
    async with client.hold("t1", ttl=TTL_S, wait=1.5) as lease:
        assert lease.fence == 1
    first, second = waits_s(server)
    assert 1.4 < first <= 1.5 and second is None


async def test_hold_wait_refused_by_the_server_asks_half(server, client, backoffs):
    server.claim_script.extend([wait_refused(), wait_refused()])
    async with client.hold("t1", ttl=TTL_S, wait=100.0) as lease:
        assert lease.fence == 1
    assert waits_s(server) == [60.0, 30.0, 15.0]  # CLAIM_WAIT_MAX_S, halved per refusal
    assert backoffs == []  # nothing was claimed: asked again at once
    assert len({c.request_id for c in server.claims}) == 1


async def test_hold_wait_for_a_server_that_answers_at_once_backs_off(server, client, backoffs):
    # A server older than ClaimRequest.wait answers at once: polled with backoff.
    server.claim_script.extend([busy()] * 1000)
    server.unary = functools.partial(FakeLeaseServer.unary, server)
    with pytest.raises(ClaimTimeout):
        async with client.hold("t1", ttl=TTL_S, wait=0.3):
            pytest.fail("must not enter")
    assert len(server.claims) >= 2
    assert len(backoffs) == len(server.claims) - 1  # a sleep before each poll but the last


class SlowGrantServer(FakeLeaseServer):
    """Grants a Claim with ``wait`` only after ``grant_after_s`` (the holder's lease ran out).

    A Claim repeating the last granted request id gets that lease back, as the
    real server hands a retry its lease.
    """

    def __init__(self, grant_after_s: float) -> None:
        super().__init__()
        self.grant_after_s = grant_after_s
        self.granted: dict[str, int] = {}  # request id -> fence

    async def unary(self, name: str, request):
        if name == "Claim" and request.request_id in self.granted:
            self.claims.append(request)
            reply = pb.ClaimResponse(acquired=True, lease=self.lease(request))
            reply.lease.fence = self.granted[request.request_id]
            return reply
        if name == "Claim" and request.HasField("wait"):
            await asyncio.sleep(self.grant_after_s)
        answer = await super().unary(name, request)
        if name == "Claim" and answer.acquired:
            self.granted[request.request_id] = answer.lease.fence
        return answer


async def test_a_grant_after_a_long_wait_is_confirmed_before_it_is_used():
    # The grant came 1.05 s after the Claim was sent, on a 2 s ttl: trusting it from
    # the send time leaves under half of it. A Claim without wait and with the same
    # request id gets the same lease back, read now, and the hold starts from that.
    server = SlowGrantServer(grant_after_s=1.05)
    server.granted_ttl_s = 2.0
    client = LeaseClient(namespace="ns", owner_id="worker-1", channel=FakeChannel(server))
    async with client.hold("t1", ttl=TTL_S, wait=5.0) as lease:
        assert lease.fence == 1
        assert lease.loss is None
    first, second = server.claims
    assert first.HasField("wait") and not second.HasField("wait")
    assert first.request_id == second.request_id
    assert server.fence == 1  # one grant


async def test_a_grant_soon_after_the_claim_is_used_as_it_is():
    server = SlowGrantServer(grant_after_s=0.0)
    server.granted_ttl_s = 30.0  # answered well within half of it, however loaded the machine
    client = LeaseClient(namespace="ns", owner_id="worker-1", channel=FakeChannel(server))
    async with client.hold("t1", ttl=TTL_S, wait=5.0) as lease:
        assert lease.fence == 1
    assert len(server.claims) == 1
