"""The capacity model's arithmetic, and the docs' figures it renders (bench/capacity_model.py).

docs/operations/capacity.md shows no figure of its own: it includes the sections of
bench/published/capacity.md, which ``python -m bench.capacity --publish`` (or ``--render``)
writes from bench/published/capacity.json through the model. These tests hold the model to
arithmetic done by hand, and the published markdown to what the model renders now, so the
formula, the measured costs and the page cannot drift apart.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.capacity_model import (
    BATCH_POOL_CONNECTIONS,
    HEADROOM,
    MILLION,
    PRIMARY,
    Costs,
    Fixed,
    OpCost,
    Primary,
    Workload,
    ceilings,
    estimate,
    render,
)
from leasekeeper_server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "bench" / "published"
PAGE = ROOT / "docs" / "operations" / "capacity.md"
KiB, MiB = 1024, 1 << 20

COSTS = Costs(
    ops={
        "heartbeat": OpCost(server_cpu_ms=0.2, pg_cpu_ms=0.05, statements=0.1, wal_bytes=200),
        "task": OpCost(
            server_cpu_ms=1.0, pg_cpu_ms=0.5, statements=1.5, wal_bytes=2000, table_bytes=600
        ),
        "validate_stream": OpCost(server_cpu_ms=0.05, pg_cpu_ms=0.01, statements=0.05, wal_bytes=0),
        "effect": OpCost(
            server_cpu_ms=0.8, pg_cpu_ms=0.4, statements=0.5, wal_bytes=1800, table_bytes=300
        ),
    },
    fixed=Fixed(
        server_cpu_cores=0.002,
        pg_cpu_cores=0.001,
        wal_bytes_s=10.0,
        rss_bytes=70 * MiB,
        rss_per_stream_bytes=32 * KiB,
        pool_max_size=20,
    ),
)
SMALL = Workload(
    workers=10_000,
    ttl_s=30.0,
    beat_s=10.0,
    task_s=600.0,
    gateways=10,
    validations_per_gateway_s=50.0,
    effects_per_s=2 * 10_000 / 600,
)


def test_a_small_workload_by_hand() -> None:
    est = estimate(SMALL, COSTS)
    # renewals W/B, tasks W/D, checks G*V, effects E
    tasks_s, effects_s = 10_000 / 600, 2 * 10_000 / 600
    assert est.rates == pytest.approx(
        {"heartbeat": 1000.0, "task": tasks_s, "validate_stream": 500.0, "effect": effects_s}
    )
    ops_cores = (1000 * 0.2 + tasks_s * 1.0 + 500 * 0.05 + effects_s * 0.8) / 1000
    assert ops_cores == pytest.approx(0.268333, abs=1e-6)
    assert est.server_processes == 1  # 1.5 x 0.27 cores fits in one process
    assert est.server_cores == pytest.approx(ops_cores + 0.002)
    assert est.server_cores_provisioned == pytest.approx((ops_cores + 0.002) * 1.5)
    pg = (1000 * 0.05 + tasks_s * 0.5 + 500 * 0.01 + effects_s * 0.4) / 1000 + 0.001
    assert est.pg_cores == pytest.approx(pg)
    assert est.wal_bytes_s == pytest.approx(1000 * 200 + tasks_s * 2000 + effects_s * 1800 + 10)
    assert est.statements_s == pytest.approx(
        1000 * 0.1 + tasks_s * 1.5 + 500 * 0.05 + effects_s * 0.5
    )
    assert est.table_bytes_s == pytest.approx(tasks_s * 600 + effects_s * 300)
    assert est.memory_bytes == 70 * MiB + 10_000 * 32 * KiB
    assert est.connections == 20 + 5 + 2  # the call pool, the batch pool, LISTEN and the sweeper
    assert est.pooled_connections == math.ceil(pg * 1.5 * 2) + 2


def test_processes_are_the_fewest_that_keep_each_under_one_core_with_headroom() -> None:
    big = Workload(workers=1_000_000, ttl_s=30.0, beat_s=10.0)  # 100,000 renewals/s
    est = estimate(big, COSTS)
    ops_cores = 100_000 * 0.2 / 1000
    assert ops_cores == 20.0
    p = est.server_processes
    assert HEADROOM * (ops_cores + p * 0.002) <= p  # fits
    assert HEADROOM * (ops_cores + (p - 1) * 0.002) > p - 1  # one fewer does not
    assert p == 31
    assert est.connections == 31 * 27
    assert est.memory_bytes == 31 * 70 * MiB + 1_000_000 * 32 * KiB
    # Given processes (a measured fleet on one server) are taken as they are.
    assert estimate(big, COSTS, processes=1).server_cores == pytest.approx(20.002)


def test_a_session_renewal_costs_what_the_session_op_costs() -> None:
    costs = Costs({**COSTS.ops, "session": OpCost(0.05, 0.02, 0.01, 170)}, COSTS.fixed)
    via_sessions = estimate(
        Workload(workers=10_000, ttl_s=30.0, beat_s=10.0, renewal="session"), costs, processes=1
    )
    assert via_sessions.rates == {"session": 1000.0}
    assert via_sessions.server_cores == pytest.approx(1000 * 0.05 / 1000 + 0.002)
    with pytest.raises(KeyError):  # an op the costs do not have is not guessed
        estimate(Workload(workers=1, ttl_s=30.0, beat_s=10.0, renewal="session"), COSTS)


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("beat_s", {"beat_s": 30.0}),
        ("ttl_s", {"ttl_s": 0.0}),
        ("task_s", {"task_s": 0.0}),
        ("workers", {"workers": -1}),
        ("renewal", {"renewal": "poll"}),
    ],
)
def test_a_workload_out_of_range_names_its_field(field: str, change: dict[str, object]) -> None:
    values: dict[str, object] = {"workers": 10, "ttl_s": 30.0, "beat_s": 10.0, **change}
    with pytest.raises(ValueError, match=f"^{field}: "):
        Workload(**values)  # type: ignore[arg-type]


def test_ceilings_scale_the_workload_to_the_primarys_budget() -> None:
    primary = Primary(cores=10, busy=0.5, wal_bytes_s=1 * MiB, connections=100)
    est = estimate(SMALL, COSTS)
    limits = ceilings(SMALL, COSTS, primary)
    assert limits["PostgreSQL CPU"] == int(5 / (est.pg_cores_provisioned / 10_000))
    assert limits["WAL"] == int(MiB / (est.wal_bytes_s / 10_000))
    assert limits["connections (pooled)"] == int(100 / (est.pooled_connections / 10_000))


def test_the_batch_pool_and_the_call_pool_are_the_servers() -> None:
    # The connections per process the model counts are the server's own pools.
    store = (ROOT / "server" / "leasekeeper_server" / "storage" / "store.py").read_text()
    batch_pool = store[store.index("batch_pool = await asyncpg.create_pool(") :]
    size = re.search(r"max_size=(\d+)", batch_pool)
    assert size is not None and int(size[1]) == BATCH_POOL_CONNECTIONS
    published = json.loads((PUBLISHED / "capacity.json").read_text())
    assert (
        published["costs"]["fixed"]["pool_max_size"]
        == Settings.model_fields["pool_max_size"].default
    )


def test_the_published_markdown_is_what_the_model_renders_from_the_published_run() -> None:
    # Fails after a change to the model or its rendering until
    # `.venv/bin/python -m bench.capacity --render` is run (or a new run --publish'ed).
    results = json.loads((PUBLISHED / "capacity.json").read_text())
    assert (PUBLISHED / "capacity.md").read_text() == render(results)


def test_the_page_includes_every_published_section() -> None:
    page = PAGE.read_text()
    published = (PUBLISHED / "capacity.md").read_text()
    included = re.findall(r'^--8<-- "bench/published/capacity\.md:([a-z-]+)"$', page, re.M)
    assert set(included) == {"run", "per-op", "fixed", "checks", "million"}
    for name in included:
        assert f"[start:{name}]" in published and f"[end:{name}]" in published


def test_the_million_worker_plan_is_the_pages() -> None:
    # The plan the page renders: a million workers, ttl 30 s, a beat every 10 s, tasks of
    # 10 minutes, 200 gateways checking 100 times a second, 2 effects per task.
    assert MILLION == Workload(
        workers=1_000_000,
        ttl_s=30.0,
        beat_s=10.0,
        task_s=600.0,
        gateways=200,
        validations_per_gateway_s=100.0,
        effects_per_s=2 * 1_000_000 / 600,
    )
    assert PRIMARY == Primary(cores=64, busy=0.5, wal_bytes_s=100 * MiB, connections=500)
    rendered = render(json.loads((PUBLISHED / "capacity.json").read_text()))
    assert "| workers W, each holding one lease on its own Heartbeat stream | 1,000,000 |" in (
        rendered
    )
    assert "| ttl T, beat every B | 30 s, 10 s | 100,000 renewals/s |" in rendered


def test_the_pages_estimate_program_prints_what_the_page_says() -> None:
    # The page's estimate() program is a fragment for the docs suite (which runs snippets in a
    # folder of their own, where bench/ is not importable); here it runs as the page tells a
    # reader to: piped to Python from the checkout's root.
    page = PAGE.read_text()
    program = re.search(
        r"```python\n(import json\n\nfrom bench\.capacity_model .*?)```",
        page,
        re.S,
    )
    said = re.search(r"It prints\n`([^`]+)`", page)
    assert program is not None and said is not None
    ran = subprocess.run(
        [sys.executable, "-"],
        input=program.group(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == said.group(1)
