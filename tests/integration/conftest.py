"""Fixtures shared by the integration tests that drive the Python client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from leasekeeper import LeaseClient

Worker = Callable[..., LeaseClient]


@pytest.fixture
async def worker(server, namespace) -> AsyncIterator[Worker]:
    """Makes worker clients (each its own owner) of the test server; closes them afterwards."""
    clients: list[LeaseClient] = []

    def make(**kwargs) -> LeaseClient:
        client = LeaseClient(server.target, namespace=namespace, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()
