"""The Python client's operator and waiting calls against a real server."""

from __future__ import annotations

import asyncio

import pytest

from leasekeeper import AccessDenied, LeaseClient, LimitExceeded
from tests.conftest import running_server
from tests.integration.contract_helpers import limits_loaded


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
