"""Prometheus metrics over HTTP: the server's own registry, scraped as Prometheus would.

With ``metrics_listen`` set, ``GET /metrics`` answers the text exposition
format; every count here comes from real calls on a real server, read back
from a real scrape. The endpoint goes away with the server; unset (the
default), nothing listens. The Grafana dashboard in ``deploy/`` uses only
metric names a real scrape has.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import running_server
from tests.helpers import error_info, poll
from tests.integration.contract_helpers import claim, grant, heartbeat_on

DASHBOARD = Path(__file__).parents[2] / "deploy/grafana/leasekeeper-dashboard.json"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return reply.read().decode()


async def scrape(port: int) -> Samples:
    """Every sample of a real scrape, by (name, labels)."""
    text = await asyncio.to_thread(scrape_text, port)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} not scraped; have: {sorted(k for k in samples)}"
    return samples[key]


async def until_scraped(port: int, name: str, expected: float, **labels: str) -> Samples:
    """Scrapes until the sample has the expected value (at most 10 s); returns a later scrape.

    A scrape is not atomic across metric families: it may collect one family
    before the server counts an event and the next after, so counters the
    server increments together (leases_expired then leases_lost) can straddle
    it. The scrape returned is taken after the awaited sample was seen, so it
    holds everything counted before that sample.
    """

    async def scraped() -> Samples | None:
        samples = await scrape(port)
        return samples if samples.get((name, frozenset(labels.items()))) == expected else None

    await poll(scraped, f"{name}{labels} == {expected}", within_s=10)
    return await scrape(port)


async def test_metrics_endpoint_counts_real_effect_calls_and_stops_with_server(
    database_url: str, namespace: str
) -> None:
    async with running_server(database_url, metrics_listen="127.0.0.1:0") as running:
        port = running.server.metrics_port
        assert port
        before = await scrape(port)
        assert value(before, "leasekeeper_effects_total", event="begun") == 0
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
        after = await scrape(port)
        assert value(after, "leasekeeper_effects_total", event="begun") == 2
        assert value(after, "leasekeeper_effects_total", event="proceed") == 1
        assert value(after, "leasekeeper_effects_total", event="in_doubt") == 1
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(scrape_text, port)


async def test_no_metrics_endpoint_unless_configured(database_url: str) -> None:
    async with running_server(database_url) as running:
        assert running.server.metrics_port is None


async def test_metrics_count_claims_renewals_stale_fences_latency_and_pool(
    database_url: str, namespace: str
) -> None:
    async with running_server(database_url, metrics_listen="127.0.0.1:0") as running:
        port = running.server.metrics_port
        assert port
        before = await scrape(port)
        assert value(before, "leasekeeper_renewals_total", method="Renew", result="ok") == 0
        assert (
            value(before, "leasekeeper_rpc_duration_seconds_count", method="Claim", code="OK") == 0
        )
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            first = await grant(stub, namespace, "t", "owner-a", ttl_s=30.0)
            conflict = await claim(stub, namespace, "t", "owner-b")
            assert not conflict.acquired
            renew = pb.RenewRequest(
                namespace=namespace, task_id="t", owner_id="owner-a", fence=first.fence
            )
            await stub.Renew(renew)
            await stub.Release(
                pb.ReleaseRequest(
                    namespace=namespace, task_id="t", owner_id="owner-a", fence=first.fence
                )
            )
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await stub.Renew(renew)
            assert lost.value.code() == grpc.StatusCode.ABORTED
            assert error_info(lost.value).reason == "LEASE_RELEASED"
            await grant(stub, namespace, "t", "owner-b")
            old = await stub.ValidateFence(
                pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=first.fence)
            )
            assert not old.valid and old.reason == pb.LOSS_REASON_LEASE_SUPERSEDED
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.Claim(pb.ClaimRequest(namespace=namespace, task_id="", owner_id="x"))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        s = await scrape(port)
        assert value(s, "leasekeeper_claims_total", namespace=namespace, result="acquired") == 2
        assert value(s, "leasekeeper_claims_total", namespace=namespace, result="conflict") == 1
        assert value(s, "leasekeeper_claims_total", namespace="", result="error") == 1
        assert value(s, "leasekeeper_renewals_total", method="Renew", result="ok") == 1
        assert value(s, "leasekeeper_renewals_total", method="Renew", result="lost") == 1
        assert (
            value(s, "leasekeeper_renewal_failures_total", method="Renew", reason="LEASE_RELEASED")
            == 1
        )
        stale = "leasekeeper_stale_fence_rejections_total"
        assert value(s, stale, method="Renew", reason="LEASE_RELEASED") == 1
        assert value(s, stale, method="ValidateFence", reason="LEASE_SUPERSEDED") == 1
        assert value(s, stale, method="Release", reason="LEASE_SUPERSEDED") == 0

        duration = "leasekeeper_rpc_duration_seconds"
        assert value(s, duration + "_count", method="Claim", code="OK") == 3
        assert value(s, duration + "_count", method="Claim", code="INVALID_ARGUMENT") == 1
        assert value(s, duration + "_count", method="Renew", code="ABORTED") == 1
        assert value(s, duration + "_bucket", method="Claim", code="OK", le="+Inf") == 3
        assert value(s, duration + "_sum", method="Claim", code="OK") > 0

        settings = running.server.settings
        assert value(s, "leasekeeper_db_pool_max") == settings.pool_max_size
        open_connections = value(s, "leasekeeper_db_pool_connections", state="idle") + value(
            s, "leasekeeper_db_pool_connections", state="in_use"
        )
        assert settings.pool_min_size <= open_connections <= settings.pool_max_size


async def test_heartbeat_stream_gauge_renewals_and_loss_by_revoke(
    database_url: str, namespace: str
) -> None:
    async with running_server(database_url, metrics_listen="127.0.0.1:0") as running:
        port = running.server.metrics_port
        assert port
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            # A stream the client half-closes: open while it runs, ends OK.
            lease = await grant(stub, namespace, "calm", "owner-a", ttl_s=30.0)
            calm, reply = await heartbeat_on(stub, lease)
            assert reply.renewed
            s = await scrape(port)
            assert value(s, "leasekeeper_heartbeat_streams_open") == 1
            assert value(s, "leasekeeper_renewals_total", method="Heartbeat", result="ok") == 1
            await calm.done_writing()
            assert await calm.code() == grpc.StatusCode.OK
            await until_scraped(port, "leasekeeper_heartbeat_streams_open", 0)

            # A stream whose lease an operator revokes: it ends ABORTED LEASE_REVOKED.
            lease = await grant(stub, namespace, "doomed", "owner-a", ttl_s=30.0)
            doomed, _ = await heartbeat_on(stub, lease)
            revoked = await stub.Revoke(
                pb.RevokeRequest(namespace=namespace, task_id="doomed", reason="test")
            )
            assert revoked.revoked
            assert await doomed.code() == grpc.StatusCode.ABORTED

        s = await until_scraped(port, "leasekeeper_heartbeat_streams_open", 0)
        assert value(s, "leasekeeper_streams_total", method="Heartbeat", code="OK") == 1
        assert value(s, "leasekeeper_streams_total", method="Heartbeat", code="ABORTED") == 1
        assert value(s, "leasekeeper_renewals_total", method="Heartbeat", result="lost") == 1
        assert (
            value(
                s, "leasekeeper_renewal_failures_total", method="Heartbeat", reason="LEASE_REVOKED"
            )
            == 1
        )
        assert (
            value(
                s,
                "leasekeeper_stale_fence_rejections_total",
                method="Heartbeat",
                reason="LEASE_REVOKED",
            )
            == 1
        )
        assert value(s, "leasekeeper_loss_notice_seconds_count") == 1


async def test_limits_and_limit_rejections_are_scraped(
    database_url: str, namespace: str, db
) -> None:
    async with running_server(database_url, metrics_listen="127.0.0.1:0") as running:
        port = running.server.metrics_port
        assert port
        await db.execute(
            "INSERT INTO leasekeeper_namespace_limits (namespace, max_leases, claims_per_second,"
            " lock_delay) VALUES ($1, 1, 50, interval '0.25 seconds')",
            namespace,
        )
        s = await until_scraped(port, "leasekeeper_namespace_max_leases", 1, namespace=namespace)
        assert value(s, "leasekeeper_namespace_claims_per_second", namespace=namespace) == 50
        assert value(s, "leasekeeper_namespace_lock_delay_seconds", namespace=namespace) == 0.25
        rejections = "leasekeeper_limit_rejections_total"
        assert value(s, rejections, namespace=namespace, reason="LEASE_LIMIT") == 0

        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            await grant(stub, namespace, "t1", "owner-a", ttl_s=30.0)
            with pytest.raises(grpc.aio.AioRpcError) as limited:
                await claim(stub, namespace, "t2", "owner-a")
            assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        s = await scrape(port)
        assert value(s, rejections, namespace=namespace, reason="LEASE_LIMIT") == 1
        assert value(s, rejections, namespace=namespace, reason="CLAIM_RATE_LIMIT") == 0
        assert value(s, "leasekeeper_claims_total", namespace=namespace, result="limited") == 1


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert exprs, "the dashboard has no queries"
    return {name for expr in exprs for name in re.findall(r"\bleasekeeper_[a-z_]+\b", expr)}


async def test_dashboard_uses_only_metrics_a_real_server_exports(
    database_url: str, namespace: str
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["__inputs"][0]["name"] == "DS_PROMETHEUS"
    async with running_server(database_url, metrics_listen="127.0.0.1:0") as running:
        port = running.server.metrics_port
        assert port
        async with grpc.aio.insecure_channel(running.target) as channel:
            await grant(rpc.LeaseServiceStub(channel), namespace, "t", "owner-a")
        text = await asyncio.to_thread(scrape_text, port)
    exported: set[str] = set()
    for family in text_string_to_metric_families(text):
        exported.add(family.name)
        exported.update(s.name for s in family.samples)
        if family.type == "counter":
            exported.add(family.name + "_total")
        if family.type == "histogram":
            exported.update(family.name + suffix for suffix in ("_bucket", "_count", "_sum"))
    used = dashboard_metric_names()
    assert used - exported == set(), (
        f"the dashboard uses metrics no server exports: {used - exported}"
    )
    # and it shows every family the server exports
    shown = {name.removesuffix("_total") for name in used} | {
        re.sub(r"_(bucket|count|sum)$", "", name) for name in used
    }
    families = {
        f.name
        for f in text_string_to_metric_families(text)
        if f.name.startswith("leasekeeper_") and not f.name.endswith("_created")
    }
    assert families - shown == set()


def test_dashboard_runs_row_shows_the_run_metrics() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    start = next(i for i in rows if panels[i]["title"] == "Runs")
    end = min([i for i in rows if i > start], default=len(panels))
    exprs = " ".join(t["expr"] for p in panels[start + 1 : end] for t in p.get("targets", []))
    for name in (
        "leasekeeper_leases_lost_total",
        "leasekeeper_recovery_seconds_bucket",
        "leasekeeper_tasks_quarantined_total",
        "leasekeeper_tasks_cancelled_total",
        "leasekeeper_checkpoint_writes_total",
        "leasekeeper_checkpoint_bytes_total",
    ):
        assert name in exprs, f"the Runs row does not show {name}"
    assert "histogram_quantile(0.95" in exprs and "histogram_quantile(0.5" in exprs


async def test_calls_refused_by_authentication_are_counted(
    database_url: str, namespace: str
) -> None:
    async with running_server(database_url, metrics_listen="127.0.0.1:0", auth="on") as running:
        port = running.server.metrics_port
        assert port
        async with grpc.aio.insecure_channel(running.target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await claim(rpc.LeaseServiceStub(channel), namespace, "t", "owner-a")
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        s = await scrape(port)
        duration = "leasekeeper_rpc_duration_seconds_count"
        assert value(s, duration, method="Claim", code="UNAUTHENTICATED") == 1
        assert value(s, "leasekeeper_claims_total", namespace="", result="error") == 1
