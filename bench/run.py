"""The benchmark suite: one command, a Markdown table, a JSON file and a PNG chart.

    .venv/bin/python -m bench.run [--quick] [--out bench/results] [--database-url URL]

For each scenario (``bench/scenarios.py``) and each concurrency, the same
closed-loop load generator (``bench/loadgen.py``) drives, one after the other:

* the leasekeeper server (``leasekeeper serve``, a process of its own);
* its reference: the same client against a bare grpc.aio server of the same
  service whose handlers do no work (``bench/noop_server.py``): a no-op unary
  call, or a bidi echo for the heartbeat;
* for claims, also the same claim SQL through raw asyncpg, and etcd doing the
  same claim (lease grant + transaction) through a Python client.

Every figure is printed with its ratio to its reference, measured minutes
apart on the same machine, because absolute numbers on a shared machine
drift. Server CPU per call is the server process's CPU time (/proc) over the
calls; database statements per call come from the server's
``leasekeeper_db_statements_total``.

First, checkpoints and the task history are measured side by side
(``bench/runs.py``): SaveCheckpoint against Renew, a claim that hands a
checkpoint back against one that does not, and a claim on this tree against
one on the last commit before the history (``--timeline-baseline``), each
pair in alternating windows of one run, as ratios of server CPU per call.
Last, the scale run (``bench/scale.py``) repeats Claim, Renew,
ValidateFence, SaveCheckpoint and ListTaskHistory at 64 concurrent over
tables of 10^3, 10^5 and 10^7 task rows, each with its history, in a
database and server of its own, in windows that rotate over the sizes; then
the console's pages (``bench/console.py``) over namespaces of 10^5 and 10^6
tasks. After the suite's server has stopped, two measurements of their own,
each on a database and server of its own: CPU per operation beside etcd's
(``bench/cpu_per_op.py``: Claim, Renew, ValidateFence against etcd's
counterparts, with a py-spy profile of a claim window), and 100,000 leases
held through 1,000 Session streams (``bench/sessions_scale.py``: the server's
RSS, every renewal acknowledged, a renewal's p99). ``--quick``
runs short windows and small tables (CI runs it to prove the suite works;
nothing asserts a speed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Servers and PostgreSQL are started as subprocesses (fork + exec): grpc's fork
# handlers have nothing to do for them and only log about it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import asyncpg  # noqa: E402

from bench import console as console_pages  # noqa: E402
from bench import report, runs, scale, scenarios, sessions_scale  # noqa: E402
from bench.fleet import run_fleet  # noqa: E402
from bench.loadgen import Op, Sample, closed_loop  # noqa: E402
from bench.paired import Side, Tally, rotate  # noqa: E402
from bench.procstat import (  # noqa: E402
    command_cpu_seconds,
    cpu_seconds,
    own_cpu_seconds,
    rss_bytes,
)
from bench.servers import (  # noqa: E402
    ServerTarget,
    bench_database,
    database_transactions,
    leasekeeper_server,
    sibling_database,
)
from leasekeeper_server.storage.migrate import migrate  # noqa: E402

NAMESPACE = "bench"


@dataclass
class Point:
    """One measured (target, scenario, concurrency) cell."""

    target: str
    scenario: str
    concurrency: int
    rate: float
    p50_ms: float
    p99_ms: float
    calls: int
    errors: dict[str, int]
    cpu_ms_per_call: float | None = None
    client_cpu_ms_per_call: float | None = None
    db_cpu_ms_per_call: float | None = None
    statements_per_call: float | None = None
    transactions_per_call: float | None = None
    rows: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    """How long and how wide a run is."""

    concurrency: tuple[int, ...]
    duration_s: float
    warmup_s: float
    scale_rows: tuple[int, ...]
    scale_duration_s: float
    scale_rounds: int
    fleet_streams: int
    fleet_interval_s: float
    fleet_duration_s: float
    # The sessions run (bench/sessions_scale.py): leases, sessions, a beat every, for, ttl.
    sessions: tuple[int, int, float, float, float] = (100_000, 1_000, 30.0, 90.0, 90.0)
    # CPU per op beside etcd (bench/cpu_per_op.py): each window, its warm-up, the profile.
    cpu_duration_s: float = 5.0
    cpu_warmup_s: float = 0.5
    cpu_profile: bool = True

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            return cls(
                (1, 16, 64, 256),
                0.6,
                0.2,
                (1_000, 10_000),
                0.6,
                2,
                1_000,
                1.0,
                3.0,
                sessions=(2_000, 20, 1.0, 3.0, 30.0),
                cpu_duration_s=0.6,
                cpu_warmup_s=0.2,
                cpu_profile=False,
            )
        return cls(
            (1, 16, 64, 256), 4.0, 1.0, (1_000, 100_000, 10_000_000), 3.0, 3, 20_000, 30.0, 60.0
        )


async def measure(
    target: str,
    scenario: str,
    op: Op,
    concurrency: int,
    plan: Plan,
    pid: int | None,
    server: ServerTarget | None = None,
    database_url: str | None = None,
    duration_s: float | None = None,
) -> Point:
    """Runs one closed loop and reads the costs around it."""
    cpu0 = cpu_seconds(pid) if pid else None
    st0 = server.statements() if server else None
    tx0 = await database_transactions(database_url) if database_url else None
    client0, db0 = own_cpu_seconds(), command_cpu_seconds("postgres")
    sample: Sample = await closed_loop(
        op, concurrency, duration_s or plan.duration_s, plan.warmup_s
    )
    client1, db1 = own_cpu_seconds(), command_cpu_seconds("postgres")
    # A call that makes several renewals (a Session beat) is counted per renewal: its
    # rate and costs per renewal; its latencies stay the call's (a renewal's wait).
    per_call = scenarios.RENEWALS_PER_CALL.get(scenario, 1)
    calls = max(sample.all_calls, 1) * per_call
    point = Point(
        target,
        scenario,
        concurrency,
        sample.rate * per_call,
        sample.percentile_s(50) * 1000,
        sample.percentile_s(99) * 1000,
        sample.calls,
        dict(sample.errors),
    )
    if pid and cpu0 is not None:
        point.cpu_ms_per_call = (cpu_seconds(pid) - cpu0) * 1000 / calls
    point.client_cpu_ms_per_call = (client1 - client0) * 1000 / calls
    point.db_cpu_ms_per_call = (db1 - db0) * 1000 / calls
    st1 = server.statements() if server else None
    if st0 is not None and st1 is not None:
        point.statements_per_call = (st1 - st0) / calls
    if database_url and tx0 is not None:
        # The read itself is one transaction.
        point.transactions_per_call = (await database_transactions(database_url) - tx0 - 1) / calls
    print(
        f"  {target:<12} {scenario:<10} c={concurrency:<4} {point.rate:9.0f}/s "
        f"p50 {point.p50_ms:6.2f} ms p99 {point.p99_ms:6.2f} ms"
        + (f" cpu {point.cpu_ms_per_call:.3f} ms/call" if point.cpu_ms_per_call else "")
        + (f" stmt {point.statements_per_call:.2f}/call" if point.statements_per_call else "")
        + f" client cpu {point.client_cpu_ms_per_call:.3f} db cpu {point.db_cpu_ms_per_call:.3f}"
        + (f" errors {point.errors}" if point.errors else ""),
        flush=True,
    )
    return point


async def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    from bench import reference

    plan = Plan.of(args.quick)
    if args.scale_rows:
        plan.scale_rows = tuple(sorted(args.scale_rows))
    points: list[Point] = []
    out = Path(args.out)
    started = time.time()
    async with bench_database(args.database_url) as database_url:
        server_settings: dict[str, object] = {
            # Every beat is a renewal (no beat answered from memory), so the
            # heartbeat figure measures renewals.
            "min_renew_interval_s": 0,
            "pool_max_size": 20,
        }
        if args.workers > 1:
            server_settings["workers"] = args.workers
        async with (
            leasekeeper_server(database_url, out / "logs", **server_settings) as server,
            reference.noop_server() as noop,
        ):
            print(f"leasekeeper pid {server.pid} on {server.address}; no-op pid {noop.pid}")
            comparisons = []
            if not args.no_comparisons:
                comparisons = await runs.run_comparisons(
                    server,
                    database_url,
                    runs.PairedPlan.of(args.quick, args.comparison_rounds),
                    args.timeline_baseline or None,
                    out / "logs",
                    server_settings,
                )
            for scenario in args.scenarios:
                for concurrency in plan.concurrency:
                    run_id = uuid.uuid4().hex[:8]
                    async with scenarios.scenario_op(
                        scenario, noop.address, NAMESPACE, concurrency, run_id
                    ) as op:
                        points.append(
                            await measure("reference", scenario, op, concurrency, plan, noop.pid)
                        )
                    async with scenarios.scenario_op(
                        scenario, server.address, NAMESPACE, concurrency, run_id
                    ) as op:
                        points.append(
                            await measure(
                                "leasekeeper",
                                scenario,
                                op,
                                concurrency,
                                plan,
                                server.pid,
                                server,
                                database_url,
                            )
                        )
            if args.baseline_src:
                points += await baseline_run(database_url, plan, args, server_settings)
            if "claim" in args.scenarios:
                points += await claim_references(database_url, plan, args)
            fleet = None
            if not args.no_fleet:
                print(
                    f"fleet: {plan.fleet_streams} heartbeat streams, a beat every "
                    f"{plan.fleet_interval_s} s for {plan.fleet_duration_s} s",
                    flush=True,
                )
                try:
                    fleet = await run_fleet(
                        server.address,
                        server.pid,
                        NAMESPACE,
                        plan.fleet_streams,
                        plan.fleet_interval_s,
                        plan.fleet_duration_s,
                    )
                except Exception as exc:  # reported, and the rest of the suite still runs
                    fleet = {
                        "streams": plan.fleet_streams,
                        "error": repr(exc),
                        "sent": 1,
                        "acked": 0,
                    }
                print(f"  {fleet}", flush=True)
                await settle(server)
            scaled = (
                []
                if args.no_scale
                else await scale_run(database_url, plan, out / "logs", server_settings)
            )
            points += scaled
            console = (
                None
                if args.no_console
                else await console_pages.run(
                    database_url,
                    console_pages.ConsolePlan.of(args.quick, args.console_tasks),
                    out / "logs",
                )
            )
            rss = rss_bytes(server.pid)
        # Each on a database and a server of its own, the suite's server stopped.
        cpu_per_op = None if args.no_cpu_per_op else await cpu_per_op_run(database_url, plan, out)
        sessions = (
            None if args.no_sessions_scale else await sessions_scale_run(database_url, plan, out)
        )
    return {
        "quick": args.quick,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "elapsed_s": round(time.time() - started, 1),
        "machine": machine(),
        "server_rss_bytes_end": rss,
        "fleet": fleet,
        "scale_spread": scale_spread(scaled),
        "console": console,
        "cpu_per_op": cpu_per_op,
        "sessions_scale": sessions,
        "comparisons": [c.as_dict() for c in comparisons],
        "points": [asdict(p) for p in points],
    }


# Scenarios whose RPC came later than some earlier checkouts: the "before" server is measured
# on them only when its own proto has the RPC.
NEWER_RPCS = {"session": "Session", "validate_stream": "ValidateFences"}
PROTO = "protos/leasekeeper/v1/lease_service.proto"


async def baseline_run(
    database_url: str, plan: Plan, args: argparse.Namespace, settings: dict[str, object]
) -> list[Point]:
    """The scenarios against a server running an earlier checkout's code (target "before"),
    on a database of its own that its own migrations made (this tree's may be newer)."""
    points: list[Point] = []
    source = Path(args.baseline_src)
    async with (
        sibling_database(database_url, "before") as old_url,
        leasekeeper_server(old_url, Path(args.out) / "logs", source=source, **settings) as old,
    ):
        print(f"before: {source} (pid {old.pid})", flush=True)
        for scenario in args.scenarios:
            rpc = NEWER_RPCS.get(scenario)
            if rpc and f"rpc {rpc}(" not in (source / PROTO).read_text():
                print(f"before: {scenario} left out ({rpc} is not in its {PROTO})", flush=True)
                continue
            for concurrency in plan.concurrency:
                async with scenarios.scenario_op(
                    scenario, old.address, NAMESPACE, concurrency, uuid.uuid4().hex[:8]
                ) as op:
                    points.append(
                        await measure(
                            "before", scenario, op, concurrency, plan, old.pid, old, old_url
                        )
                    )
    return points


async def settle(server: ServerTarget, within_s: float = 120.0) -> None:
    """Waits until the server has closed the fleet's streams (its gauge reads 0)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not await asyncio.to_thread(server.gauge, "leasekeeper_heartbeat_streams_open"):
            return
        await asyncio.sleep(0.5)


HISTORY = "leasekeeper_task_history"
SCALED = ("claim", "renew", "validate", *scenarios.RUN_SCENARIOS)


async def scale_run(
    database_url: str, plan: Plan, log_dir: Path, settings: dict[str, object]
) -> list[Point]:
    """Claim, Renew, ValidateFence, SaveCheckpoint and ListTaskHistory at 64 concurrent over
    tables of each size, side by side.

    Each size gets a database of its own beside the suite's, seeded (tasks and
    their history, ``scale.seed``) and served by a server of its own; each
    scenario then runs in windows that rotate over the sizes, forwards then
    backwards (``paired.rotate``), so a drift of the shared machine weighs on
    every size alike instead of on the size measured last.
    """
    points: list[Point] = []
    async with contextlib.AsyncExitStack() as stack:
        sizes = []
        for rows in plan.scale_rows:
            url = await stack.enter_async_context(sibling_database(database_url, f"rows{rows}"))
            began = time.monotonic()
            await migrate(url)
            await scale.seed(url, rows, namespace="scale")
            await checkpoint(url)  # the seed's writes flushed before anything is measured
            entries = await history_entries(url)
            print(
                f"scale: {rows:,} task rows, {entries:,} history entries seeded "
                f"({time.monotonic() - began:.0f} s)",
                flush=True,
            )
            server = await stack.enter_async_context(leasekeeper_server(url, log_dir, **settings))
            sizes.append((rows, url, server, entries))
        for scenario in SCALED:
            sides = [
                Side(
                    f"{rows:,} rows",
                    server.pid,
                    url,
                    functools.partial(_scale_op, scenario, server.address),
                    server.statements,
                )
                for rows, url, server, _ in sizes
            ]
            before = [await _table_counters(url) for _, url, _, _ in sizes]
            tallies, _ = await rotate(
                sides,
                rounds=plan.scale_rounds,
                concurrency=64,
                duration_s=plan.scale_duration_s,
                warmup_s=plan.warmup_s,
            )
            for (rows, url, _, entries), tally, counters in zip(
                sizes, tallies, before, strict=True
            ):
                point = _scale_point(scenario, rows, tally)
                tasks, history = counters
                delta = scale.stats_delta(tasks, await scale.table_stats(url))
                written = scale.stats_delta(history, await scale.table_stats(url, HISTORY))
                point.extra = {
                    "seq_scans": delta.get("seq_scan"),
                    "index_scans_per_call": (delta.get("idx_scan") or 0) / max(tally.calls, 1),
                    "hot_updates": delta.get("n_tup_hot_upd"),
                    "updates": delta.get("n_tup_upd"),
                    "history_entries": entries,
                    "history_seq_scans": written.get("seq_scan"),
                    "history_entries_written": written.get("n_tup_ins"),
                }
                points.append(point)
    return points


def _scale_op(scenario: str, address: str) -> contextlib.AbstractAsyncContextManager[Op]:
    """A window's op of ``scenario`` against one size's server (new leases each window)."""
    return scenarios.scenario_op(scenario, address, NAMESPACE, 64, uuid.uuid4().hex[:8])


async def _table_counters(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return await scale.table_stats(url), await scale.table_stats(url, HISTORY)


def _scale_point(scenario: str, rows: int, tally: Tally) -> Point:
    """One size's windows of one scenario as a point of the scale table."""
    point = Point(
        "leasekeeper",
        scenario,
        64,
        tally.rate,
        statistics.median(tally.p50_ms),
        statistics.median(tally.p99_ms),
        tally.window_calls,
        dict(tally.errors),
        cpu_ms_per_call=tally.cpu_ms_per_call,
        db_cpu_ms_per_call=tally.db_cpu_ms_per_call,
        statements_per_call=tally.statements_per_call,
        rows=rows,
    )
    print(
        f"  {scenario:<10} {rows:>12,} rows {point.rate:9.0f}/s p50 {point.p50_ms:6.2f} ms "
        f"p99 {point.p99_ms:6.2f} ms cpu {point.cpu_ms_per_call or 0:.3f} ms/call "
        f"database cpu {point.db_cpu_ms_per_call or 0:.3f} ms/call"
        + (f" errors {point.errors}" if point.errors else ""),
        flush=True,
    )
    return point


async def history_entries(database_url: str) -> int:
    """The task history's entries, as the last ANALYZE (the seed's) counted them."""
    conn = await asyncpg.connect(database_url)
    try:
        return int(
            await conn.fetchval(f"SELECT reltuples FROM pg_class WHERE relname = '{HISTORY}'")
        )
    finally:
        await conn.close()


async def checkpoint(database_url: str) -> None:
    """A CHECKPOINT, so a seed's dirty pages are not written out during a measurement."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


def scale_spread(points: list[Point]) -> dict[str, float]:
    """Per scenario, (highest - lowest) / lowest server CPU per call over the table sizes."""
    spread: dict[str, float] = {}
    for scenario in SCALED:
        costs = [p.cpu_ms_per_call for p in points if p.scenario == scenario and p.cpu_ms_per_call]
        if len(costs) > 1:
            spread[scenario] = (max(costs) - min(costs)) / min(costs)
    return spread


async def cpu_per_op_run(database_url: str, plan: Plan, out: Path) -> dict[str, Any]:
    """CPU per operation beside etcd's (``bench.cpu_per_op.collect``) on a database of its own.

    Its figures, or ``{"error": ...}`` when it could not finish (etcd missing, a
    server that did not start): reported, and the rest of the suite still runs.
    """
    from bench import cpu_per_op

    print(
        f"cpu per op: {plan.cpu_duration_s} s windows at 64 concurrent, beside etcd"
        + ("" if plan.cpu_profile else ", no profile"),
        flush=True,
    )

    async def collect(url: str) -> dict[str, Any]:
        options = argparse.Namespace(
            database_url=url,
            out=str(out),
            duration=plan.cpu_duration_s,
            warmup=plan.cpu_warmup_s,
            concurrency=64,
            no_profile=not plan.cpu_profile,
        )
        return await cpu_per_op.collect(options)

    return await _part("cpu per op", database_url, "cpu", collect, {"concurrency": 64})


async def sessions_scale_run(database_url: str, plan: Plan, out: Path) -> dict[str, Any]:
    """Leases held through sessions (``bench.sessions_scale.run``) on a database of its own.

    Its figures, or ``{"leases", "sessions", "error"}`` when it could not finish
    (a claim refused, a session that would not open).
    """
    leases, count, interval_s, duration_s, ttl_s = plan.sessions
    print(
        f"sessions: {leases:,} leases through {count:,} sessions, a beat every {interval_s:g} s "
        f"for {duration_s:g} s",
        flush=True,
    )

    async def hold(url: str) -> dict[str, Any]:
        options = argparse.Namespace(
            leases=leases,
            sessions=count,
            interval=interval_s,
            duration=duration_s,
            ttl=ttl_s,
            database_url=url,
            out=str(out),
        )
        figures = await sessions_scale.run(options)
        print(f"  {figures}", flush=True)
        return figures

    return await _part(
        "sessions", database_url, "sessions", hold, {"leases": leases, "sessions": count}
    )


async def _part(
    name: str,
    database_url: str,
    suffix: str,
    run: Callable[[str], Awaitable[dict[str, Any]]],
    failed: dict[str, Any],
) -> dict[str, Any]:
    """One part of the suite on a database of its own (``sibling_database(..., suffix)``).

    Its figures, or ``failed`` with ``"error"`` when it could not finish: reported,
    and the rest of the suite still runs.
    """
    began = time.monotonic()
    try:
        async with sibling_database(database_url, suffix) as url:
            figures = await run(url)
    except Exception as exc:  # reported, and the rest of the suite still runs
        figures = {**failed, "error": repr(exc)}
        print(f"  {name} failed: {exc!r}", flush=True)
    print(f"  {name}: {time.monotonic() - began:.0f} s in all", flush=True)
    return figures


async def claim_references(database_url: str, plan: Plan, args: argparse.Namespace) -> list[Point]:
    """Claims through raw asyncpg (same SQL) and through etcd, at each concurrency."""
    from bench import etcd, reference

    points: list[Point] = []
    for concurrency in plan.concurrency:
        async with reference.raw_claim(database_url, NAMESPACE) as op:  # new task ids each
            points.append(await measure("asyncpg", "claim", op, concurrency, plan, None))
    if args.no_etcd:
        return points
    async with etcd.etcd_server() as target:
        for concurrency in plan.concurrency:
            async with etcd.etcd_claim(target) as op:
                points.append(await measure("etcd", "claim", op, concurrency, plan, target.pid))
    return points


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options, with what ``--only`` and ``--no-etcd`` leave out applied."""
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short windows, small tables")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    parser.add_argument("--database-url", default=os.environ.get("LEASEKEEPER_BENCH_DATABASE_URL"))
    parser.add_argument(
        "--scenarios", nargs="+", default=list(scenarios.SCENARIOS), choices=scenarios.SCENARIOS
    )
    parser.add_argument("--workers", type=int, default=1, help="leasekeeper serve --workers")
    parser.add_argument("--no-etcd", action="store_true", help="leave out the etcd reference")
    parser.add_argument("--no-fleet", action="store_true", help="leave out the stream fleet")
    parser.add_argument(
        "--baseline-src",
        help="a checkout of an earlier version: its server is measured too (target 'before')",
    )
    parser.add_argument("--no-scale", action="store_true", help="leave out the table sizes")
    parser.add_argument(
        "--timeline-baseline",
        default=runs.TIMELINE_BASELINE,
        help="the commit (or a checkout's folder) whose claims write no task history, for the "
        "side-by-side claim; '' leaves that comparison out",
    )
    parser.add_argument(
        "--no-comparisons", action="store_true", help="leave out the side-by-side comparisons"
    )
    parser.add_argument(
        "--comparison-rounds",
        type=int,
        help="windows per side of each side-by-side comparison (default 6; quick: 2)",
    )
    parser.add_argument("--no-console", action="store_true", help="leave out the console's pages")
    parser.add_argument(
        "--no-cpu-per-op",
        action="store_true",
        help="leave out CPU per operation beside etcd (bench/cpu_per_op.py; --no-etcd does too)",
    )
    parser.add_argument(
        "--no-sessions-scale",
        action="store_true",
        help="leave out the leases held through sessions (bench/sessions_scale.py)",
    )
    parser.add_argument(
        "--console-tasks",
        type=int,
        nargs="+",
        help="the namespace sizes of the console's pages (default 10^5 10^6; quick: 10^3 10^4)",
    )
    parser.add_argument(
        "--only",
        choices=("comparisons", "scale", "console", "cpu-per-op", "sessions-scale"),
        help="run one part alone: the side-by-side comparisons, the table sizes, the "
        "console's pages, CPU per operation beside etcd, or the leases held through sessions",
    )
    parser.add_argument(
        "--scale-rows",
        type=int,
        nargs="+",
        help="the table sizes of the scale run (default 10^3 10^5 10^7; quick: 10^3 10^4)",
    )
    args = parser.parse_args(argv)
    if args.only:
        args.scenarios, args.no_fleet, args.baseline_src = [], True, None
        args.no_comparisons |= args.only != "comparisons"
        args.no_scale |= args.only != "scale"
        args.no_console |= args.only != "console"
        args.no_cpu_per_op |= args.only != "cpu-per-op"
        args.no_sessions_scale |= args.only != "sessions-scale"
    args.no_cpu_per_op |= args.no_etcd
    if args.baseline_src:
        args.baseline_src = os.path.abspath(args.baseline_src)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop

        results = uvloop.run(run_suite(args))
    except ImportError:
        results = asyncio.run(run_suite(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(report.markdown(results))
    report.chart(results, out / "results.png")
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'results.png'}")
    failed = [p for p in results["points"] if p["errors"] or not p["calls"]]
    broken = 0
    for c in results["comparisons"]:
        if c["note"]:  # not run (no baseline to be had): said, not failed
            print(f"{c['title']}: {c['note']}", file=sys.stderr)
        elif c["a"]["errors"] or c["b"]["errors"] or not (c["a"]["calls"] and c["b"]["calls"]):
            print(
                f"{c['title']}: {c['a']['calls']} and {c['b']['calls']} calls, "
                f"errors {c['a']['errors']} and {c['b']['errors']}",
                file=sys.stderr,
            )
            broken += 1
    parts_failed = part_failures(results)
    for line in parts_failed:
        print(line, file=sys.stderr)
    fleet = results.get("fleet")
    if fleet and fleet["acked"] != fleet["sent"]:
        print(f"fleet: {fleet['sent'] - fleet['acked']} beats not acknowledged", file=sys.stderr)
        return 1
    for p in failed:
        print(
            f"{p['target']} {p['scenario']} at {p['concurrency']}: "
            f"{p['calls']} calls, errors {p['errors']}",
            file=sys.stderr,
        )
    pages = (results.get("console") or {}).get("pages", [])
    refused = [p for p in pages if p["errors"] or not p["requests"]]
    for p in refused:
        print(
            f"console {p['title']} at {p['tasks']:,} tasks: {p['requests']} requests, "
            f"errors {p['errors']}",
            file=sys.stderr,
        )
    return 1 if failed or broken or refused or parts_failed else 0


def part_failures(results: dict[str, Any]) -> list[str]:
    """What went wrong in the sessions run and the CPU per op run, a line each (none: [])."""
    lines = []
    sessions = results.get("sessions_scale")
    if sessions and "error" in sessions:
        lines.append(f"sessions scale: failed: {sessions['error']}")
    elif sessions and (
        sessions["renewals_acked"] != sessions["renewals_sent"] or sessions["errors"]
    ):
        lines.append(
            f"sessions scale: {sessions['renewals_sent'] - sessions['renewals_acked']:,} "
            f"renewals not acknowledged, errors {sessions['errors']}"
        )
    cpu = results.get("cpu_per_op")
    if cpu and "error" in cpu:
        lines.append(f"cpu per op: failed: {cpu['error']}")
    elif cpu and cpu["failed_windows"]:
        lines.append(f"cpu per op: windows with errors or no ops: {cpu['failed_windows']}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
