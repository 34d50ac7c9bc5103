"""Request ids: one per logical claim, the same on every retry of it (claim() and hold())."""

import uuid

import grpc
import pytest

from leasekeeper import LeaseClient, LeaseError, LeaseUnavailable, new_request_id
from leasekeeper.v1 import lease_service_pb2 as pb
from tests.unit.test_client_hold import (
    TTL_S,
    FakeChannel,
    FakeLeaseServer,
    duration,
    rpc_error,
)


@pytest.fixture
def fake() -> FakeLeaseServer:
    return FakeLeaseServer()


@pytest.fixture
def client(fake) -> LeaseClient:
    return LeaseClient(namespace="ns", owner_id="worker-1", channel=FakeChannel(fake))


def is_uuid4(value: str) -> bool:
    try:
        return uuid.UUID(value).version == 4 and str(uuid.UUID(value)) == value
    except ValueError:
        return False


def test_new_request_id_is_a_fresh_uuid4_each_call():
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(is_uuid4(i) for i in ids)


async def test_claim_sends_a_fresh_request_id_per_call_and_returns_it(fake, client):
    first = await client.claim("t1")
    second = await client.claim("t1")

    sent = [c.request_id for c in fake.claims]
    assert [first.request_id, second.request_id] == sent
    assert sent[0] != sent[1] and all(is_uuid4(i) for i in sent)


@pytest.mark.parametrize("request_id", ["retry-of-42", ""], ids=["given", "empty-sends-none"])
async def test_claim_given_request_id_is_sent_as_is(fake, client, request_id):
    result = await client.claim("t1", request_id=request_id)

    assert fake.claims[0].request_id == request_id
    assert result.request_id == request_id


async def test_hold_retries_unknown_outcomes_with_the_same_request_id(fake, client):
    busy = pb.ClaimResponse(acquired=False, holder_remaining_ttl=duration(0.01))
    fake.claim_script.extend(
        [
            rpc_error(grpc.StatusCode.UNAVAILABLE, "DATABASE_UNAVAILABLE"),
            rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "X"),  # granted? reply lost?
            busy,
        ]
    )
    async with client.hold("t1", ttl=TTL_S, wait=5.0) as lease:
        assert lease.fence == 1

    sent = [c.request_id for c in fake.claims]
    assert len(sent) == 4
    assert len(set(sent)) == 1 and is_uuid4(sent[0])


async def test_hold_retries_grpcs_own_resource_exhausted_with_the_same_request_id(fake, client):
    # A connection the server ended after this process missed its keepalive ping (paused) ends
    # the claim RESOURCE_EXHAUSTED with no reason: its outcome is unknown, not a namespace limit.
    calm = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="Bandwidth exhausted or memory limit exceeded",
    )
    fake.claim_script.append(calm)
    async with client.hold("t1", ttl=TTL_S, wait=5.0) as lease:
        assert lease.fence == 1

    sent = [c.request_id for c in fake.claims]
    assert len(sent) == 2 and sent[0] == sent[1]


async def test_hold_each_acquisition_has_its_own_request_id(fake, client):
    async with client.hold("t1", ttl=TTL_S):
        pass
    async with client.hold("t1", ttl=TTL_S):
        pass

    first, second = (c.request_id for c in fake.claims)
    assert first != second


@pytest.mark.parametrize(
    ("code", "raised"),
    [
        (grpc.StatusCode.DEADLINE_EXCEEDED, LeaseError),
        (grpc.StatusCode.UNAVAILABLE, LeaseUnavailable),
    ],
    ids=["deadline-exceeded", "unavailable"],
)
async def test_hold_unknown_outcome_without_wait_raises(fake, client, code, raised):
    fake.claim_script.append(rpc_error(code, "X"))
    with pytest.raises(raised) as caught:
        async with client.hold("t1", ttl=TTL_S):
            pytest.fail("must not enter")
    assert caught.value.code is code
    assert len(fake.claims) == 1
