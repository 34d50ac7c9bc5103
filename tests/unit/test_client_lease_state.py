"""HeldLease's states through hold(), complete() and a loss, on test_client_hold's fake channel."""

import asyncio

import grpc
import pytest

from leasekeeper import LeaseClient, LeaseLost, LeaseUnavailable
from leasekeeper.lease import LeaseState
from tests.helpers import poll
from tests.unit.test_client_hold import TTL_S, FakeChannel, FakeLeaseServer, rpc_error


@pytest.fixture
def server() -> FakeLeaseServer:
    return FakeLeaseServer()


@pytest.fixture
def client(server) -> LeaseClient:
    return LeaseClient(namespace="ns", owner_id="worker-1", channel=FakeChannel(server))


async def test_a_block_that_ends_on_a_trusted_lease_closes_it(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        assert lease.state is LeaseState.HOLDING
    assert lease.state is LeaseState.CLOSED
    assert [r.fence for r in server.releases] == [1]


async def test_a_lease_kept_to_its_ttl_is_closed_then_lost_when_its_trust_window_ends(
    server, client
):
    async with client.hold("t1", ttl=TTL_S, release_on_exit=False) as lease:
        pass
    assert lease.state is LeaseState.CLOSED and server.releases == []
    await poll(lambda: lease.lost, "lease.lost")  # the trust window runs on after the block
    assert lease.state is LeaseState.LOST and lease.loss.reason == "LEASE_EXPIRED"


async def test_a_pushed_loss_is_final(server, client):
    with pytest.raises(LeaseLost):
        async with client.hold("t1", ttl=TTL_S) as lease:
            await poll(lambda: server.streams, "server.streams")
            server.abort_streams("LEASE_REVOKED")
            await asyncio.sleep(10)
    assert lease.state is LeaseState.LOST and lease.loss.reason == "LEASE_REVOKED"
    with pytest.raises(LeaseLost):
        await lease.complete()  # nothing is sent for a lost lease
    assert lease.state is LeaseState.LOST


async def test_a_completed_lease_stays_completed_and_is_never_lost(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        await lease.complete()
        assert lease.state is LeaseState.COMPLETED
    assert lease.state is LeaseState.COMPLETED
    await asyncio.sleep(TTL_S)  # past the trust deadline: a completed lease has no loss
    assert lease.loss is None and lease.state is LeaseState.COMPLETED


async def test_a_completion_that_fails_without_a_loss_goes_back_to_holding(server, client):
    server.unary_errors["Release"] = rpc_error(grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
    async with client.hold("t1", ttl=TTL_S) as lease:
        with pytest.raises(LeaseUnavailable):
            await lease.complete()
        assert lease.state is LeaseState.HOLDING and not lease.lost
        del server.unary_errors["Release"]
    assert lease.state is LeaseState.CLOSED


async def test_a_completion_refused_as_lost_is_lost(server, client):
    server.unary_errors["Release"] = rpc_error(grpc.StatusCode.ABORTED, "LEASE_SUPERSEDED")
    with pytest.raises(LeaseLost):
        async with client.hold("t1", ttl=TTL_S) as lease:
            with pytest.raises(LeaseLost):
                await lease.complete()
            assert lease.state is LeaseState.LOST
    assert lease.loss.reason == "LEASE_SUPERSEDED"


async def test_a_transition_the_machine_does_not_have_is_refused(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        await lease.complete()
    with pytest.raises(RuntimeError, match="from COMPLETED to HOLDING"):
        lease._move(LeaseState.HOLDING)
