"""Prometheus metrics over HTTP: the server's own registry, scraped as Prometheus would.

With ``metrics_listen`` set, ``GET /metrics`` answers the text exposition
format with the effect counters, which count real calls; the endpoint goes
away with the server. Unset (the default), nothing listens.
"""

from __future__ import annotations

import asyncio
import re
import urllib.error
import urllib.request

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import running_server
from tests.integration.contract_helpers import grant


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return reply.read().decode()


def sample(text: str, name: str, event: str) -> float:
    match = re.search(rf'^{name}\{{event="{event}"\}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name}{{event={event!r}}} not in:\n{text}"
    return float(match.group(1))


async def test_metrics_endpoint_counts_real_effect_calls_and_stops_with_server(
    database_url: str, namespace: str
) -> None:
    async with running_server(database_url, metrics_listen="127.0.0.1:0") as running:
        port = running.server.metrics_port
        assert port
        before = await asyncio.to_thread(scrape, port)
        assert sample(before, "leasekeeper_effects_total", "begun") == 0
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            lease = await grant(stub, namespace, "t", "owner-a")
            begin = pb.BeginEffectRequest(
                namespace=namespace,
                task_id="t",
                fence=lease.fence,
                effect_key="email",
                policy=pb.EFFECT_POLICY_ONCE,
            )
            await stub.BeginEffect(begin)
            await stub.BeginEffect(begin)  # the same attempt, unconfirmed: in doubt
        after = await asyncio.to_thread(scrape, port)
        assert sample(after, "leasekeeper_effects_total", "begun") == 2
        assert sample(after, "leasekeeper_effects_total", "proceed") == 1
        assert sample(after, "leasekeeper_effects_total", "in_doubt") == 1
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(scrape, port)


async def test_no_metrics_endpoint_unless_configured(database_url: str) -> None:
    async with running_server(database_url) as running:
        assert running.server.metrics_port is None
