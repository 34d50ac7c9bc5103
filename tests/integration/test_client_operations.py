"""The Python client's operator and waiting calls against a real server."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from leasekeeper import CHANNEL_OPTIONS, AccessDenied, LeaseClient, LimitExceeded
from tests.conftest import running_server
from tests.helpers import poll
from tests.integration.contract_helpers import limits_loaded

# Well above what a loaded machine adds to a notification's round trip, well below
# the holder's 30 s ttl (when a waiter that missed the release would get the task).
AT_ONCE_S = 5.0


class CallCounter(grpc.aio.UnaryUnaryClientInterceptor):
    """Counts the unary calls a channel sends, by method name ("Claim", "Release", ...)."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        self.sent.append(method.rsplit("/", 1)[-1])
        return await continuation(client_call_details, request)


async def test_claim_waits_revoke_and_watch_through_the_client(server, namespace):
    async with (
        LeaseClient(server.target, namespace=namespace) as holder,
        LeaseClient(server.target, namespace=namespace) as waiter,
        LeaseClient(server.target, namespace=namespace) as operator,
    ):
        events = operator.watch("t")
        first = await anext(events)
        assert (first.type, first.lease.fence) == ("SNAPSHOT", 0)

        held = await holder.claim("t", ttl=30.0)
        assert held.acquired
        assert (await anext(events)).type == "CLAIMED"

        refused = await waiter.claim("t", ttl=5.0)
        assert not refused.acquired
        assert 0 < refused.retry_after <= 30.0

        waiting = asyncio.ensure_future(waiter.claim("t", ttl=5.0, wait=8.0))
        revoked, lease = await operator.revoke("t", "stuck worker")
        assert revoked and lease.state == "FREE" and lease.revoke_reason == "stuck worker"
        event = await anext(events)
        assert (event.type, event.lease.revoke_reason) == ("REVOKED", "stuck worker")

        granted = await waiting
        assert granted.acquired
        assert granted.lease.fence == held.lease.fence + 1
        assert (await anext(events)).lease.owner_id == waiter.owner_id
        await events.aclose()


async def test_limits_and_access_errors_are_typed(database_url, db, namespace):
    async with running_server(database_url, auth="on") as server:
        async with LeaseClient(server.target, namespace=namespace, token="lk_nope_x") as client:
            with pytest.raises(AccessDenied) as denied:
                await client.claim("t")
            assert denied.value.reason == "UNAUTHENTICATED"

    async with running_server(database_url) as server:
        await db.execute(
            "INSERT INTO leasekeeper_namespace_limits (namespace, max_leases) VALUES ($1, 1)",
            namespace,
        )
        await limits_loaded(server, namespace)
        async with LeaseClient(server.target, namespace=namespace) as client:
            assert (await client.claim("a", ttl=10.0)).acquired
            with pytest.raises(LimitExceeded) as limited:
                await client.claim("b", ttl=10.0)
            assert limited.value.reason == "LEASE_LIMIT"
            assert 0 < limited.value.retry_after <= 10.0


async def test_hold_wait_is_granted_on_release_by_one_waiting_claim(server, namespace):
    counter = CallCounter()
    async with (
        LeaseClient(server.target, namespace=namespace) as holder,
        grpc.aio.insecure_channel(
            server.target, options=CHANNEL_OPTIONS, interceptors=[counter]
        ) as channel,
        LeaseClient(namespace=namespace, channel=channel) as waiter,
    ):
        granted: list[tuple[int, float]] = []

        async def wait_for_the_task() -> None:
            async with waiter.hold("t", ttl=30.0, wait=20.0) as lease:
                granted.append((lease.fence, time.monotonic()))

        async with holder.hold("t", ttl=30.0) as held:
            waiting = asyncio.ensure_future(wait_for_the_task())
            await poll(lambda: "Claim" in counter.sent, "the waiter's Claim was sent")
            # Long enough for a polling client to claim again several times.
            await asyncio.sleep(1.0)
            assert not waiting.done()
        released_at = time.monotonic()  # the holder's exit released the lease
        await asyncio.wait_for(waiting, AT_ONCE_S + 5.0)

    [(fence, granted_at)] = granted
    assert fence == held.fence + 1
    assert granted_at - released_at < AT_ONCE_S  # woken by the release, not the 30 s ttl
    # The server waited for the task: one Claim for the whole wait, no polling.
    assert counter.sent.count("Claim") == 1
