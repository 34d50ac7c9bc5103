"""leasekeeper's capacity model, measured: per-operation costs, and the model checked at two fleets.

    .venv/bin/python -m bench.capacity [--publish] [--checks 5000x5 20000x10 2000x10]
        [--concurrency 16] [--rounds 3] [--window 4] [--duration 60]
    .venv/bin/python -m bench.capacity --render   # bench/published/capacity.md from its .json

One run, on a PostgreSQL cluster of its own (``pgserver``'s PostgreSQL, in a
temporary folder, default durability), so its CPU and its WAL are the run's
alone on a machine shared with other work; ``--database-url`` uses yours
instead (then PostgreSQL's CPU is its backends' for that database only, and
the WAL is the whole cluster's):

1. **Fixed costs.** A fresh ``leasekeeper serve`` (``bench/servers.py``),
   idle for ``--idle`` seconds: its CPU, PostgreSQL's CPU and the WAL
   meanwhile, and its RSS. Then ``--rss-probe`` Heartbeat streams are opened
   (``bench/fleet.py``, no beats): the RSS they add, per stream.
2. **Per-operation costs**, in windows of ``--window`` seconds through the
   suite's closed loop (``bench/loadgen.py``) at ``--concurrency`` load
   workers, the ops in turn, forwards then backwards, ``--rounds`` windows
   each (as ``bench/paired.py`` rotates): a Heartbeat renewal, a Session
   renewal, a task's Claim + Release (complete), ValidateFence (unary), a
   check on the ValidateFences stream, a BeginEffect + CompleteEffect pair.
   Around each window: the server's CPU (/proc), PostgreSQL's CPU (its
   postmaster and every process under it, reaped ones included), the server's
   ``leasekeeper_db_statements_total`` and ``pg_current_wal_lsn()``; each
   figure divided by the operations the window's calls made. An RPC the proto
   does not have (Session, ValidateFences) is left out and said so.
3. **The model checked**: for each ``--checks STREAMSxBEAT_S`` a fresh server
   carries that heartbeat fleet (``bench.fleet.run_fleet``: one stream per
   lease, phases spread) for ``--duration`` seconds;
   the model (``bench/capacity_model.py``) predicts its CPU, PostgreSQL CPU,
   WAL and RSS from the costs of 1 and 2, printed beside what was measured.

It writes ``bench/results/capacity.json`` and ``capacity.md`` (``--out``);
with ``--publish`` also ``bench/published/capacity.json`` and ``.md``, the
figures ``docs/operations/capacity.md`` includes. The machine's load average
is sampled through the run and reported: on a shared machine, rerun it quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import asyncpg  # noqa: E402
import grpc  # noqa: E402

from bench import scenarios  # noqa: E402
from bench.capacity_model import OPS, TITLES, Costs, Fixed, OpCost, render  # noqa: E402
from bench.fleet import run_fleet  # noqa: E402
from bench.loadgen import Op, closed_loop  # noqa: E402
from bench.paired import BackendClock  # noqa: E402
from bench.procstat import children, cpu_seconds, own_cpu_seconds, rss_bytes  # noqa: E402
from bench.servers import ServerTarget, leasekeeper_server  # noqa: E402
from leasekeeper import LeaseClient  # noqa: E402
from leasekeeper.v1 import lease_service_pb2 as pb  # noqa: E402
from leasekeeper_server.settings import Settings  # noqa: E402
from leasekeeper_server.storage.migrate import migrate  # noqa: E402

NAMESPACE = "bench-capacity"
PUBLISHED = REPO_ROOT / "bench" / "published"
# Every beat a renewal (none answered from the last one), as bench/run.py runs its server.
SERVER_SETTINGS: dict[str, object] = {"min_renew_interval_s": 0}  # as leasekeeper_server gets it
# The fleets' ttl, seconds: long enough to outlive claiming and opening 20,000 streams on a
# loaded machine (a ttl changes no cost; the beat interval sets the rate).
CHECK_TTL_S = 300.0
# The RPC each op needs; an op whose RPC the proto lacks is not measured.
NEEDS = {"session": "Session", "validate_stream": "ValidateFences"}
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def has_rpc(name: str) -> bool:
    """Whether LeaseService has the RPC ``name`` (in the generated descriptor)."""
    return name in pb.DESCRIPTOR.services_by_name["LeaseService"].methods_by_name


# ---------------------------------------------------------------------------------------------
# Readings


def _tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants, with the children each has reaped.

    A PostgreSQL backend or autovacuum worker that ends between two readings
    leaves its CPU in its parent's (the postmaster's) reaped-children time, so
    it is still counted.
    """
    total = 0
    for p in [pid, *children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / _TICKS_PER_S


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) + int(low, 16)


class Database:
    """The run's PostgreSQL: its CPU, its WAL position, the server's connections."""

    def __init__(self, conn: asyncpg.Connection, postmaster: int | None) -> None:
        self._conn = conn
        self._postmaster = postmaster  # None: a database of yours, only its backends are read
        self._backends = BackendClock(conn)

    async def cpu_seconds(self) -> dict[int, float] | float | None:
        if self._postmaster is not None:
            return _tree_cpu_seconds(self._postmaster)
        return await self._backends.read()

    @staticmethod
    def spent(before: Any, after: Any) -> float:
        if isinstance(before, dict) and isinstance(after, dict):
            return sum(s - before.get(pid, 0.0) for pid, s in after.items())
        if before is None or after is None:
            return float("nan")
        return float(after - before)

    async def wal(self) -> int:
        return _lsn(await self._conn.fetchval("SELECT pg_current_wal_lsn()::text"))

    async def connections(self) -> int:
        """Client connections to this database, this one left out."""
        return int(
            await self._conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
        )

    async def table_bytes(self) -> int:
        """The database's tables with their indexes and TOAST, bytes (what it keeps on disk)."""
        return int(
            await self._conn.fetchval(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE c.relkind = 'r' AND n.nspname NOT IN ('pg_catalog', 'information_schema')"
            )
        )

    async def version(self) -> str:
        return str(await self._conn.fetchval("SHOW server_version"))


@dataclass
class Reading:
    at: float
    server_cpu_s: float
    pg_cpu: Any
    wal: int
    statements: float | None
    driver_cpu_s: float
    table_bytes: int


async def read(server: ServerTarget, db: Database) -> Reading:
    return Reading(
        time.monotonic(),
        cpu_seconds(server.pid),
        await db.cpu_seconds(),
        await db.wal(),
        await asyncio.to_thread(server.statements),
        own_cpu_seconds(),
        await db.table_bytes(),
    )


@dataclass
class Spent:
    """What happened between two readings."""

    elapsed_s: float
    server_cpu_s: float
    pg_cpu_s: float
    wal_bytes: int
    statements: float
    driver_cpu_s: float
    table_bytes: int

    @classmethod
    def between(cls, a: Reading, b: Reading) -> Spent:
        return cls(
            b.at - a.at,
            b.server_cpu_s - a.server_cpu_s,
            Database.spent(a.pg_cpu, b.pg_cpu),
            b.wal - a.wal,
            (b.statements or 0.0) - (a.statements or 0.0),
            b.driver_cpu_s - a.driver_cpu_s,
            b.table_bytes - a.table_bytes,
        )

    def __add__(self, other: Spent) -> Spent:
        return Spent(
            self.elapsed_s + other.elapsed_s,
            self.server_cpu_s + other.server_cpu_s,
            self.pg_cpu_s + other.pg_cpu_s,
            self.wal_bytes + other.wal_bytes,
            self.statements + other.statements,
            self.driver_cpu_s + other.driver_cpu_s,
            self.table_bytes + other.table_bytes,
        )


class LoadAverage:
    """The machine's 1-minute load average, sampled every few seconds until stopped."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.samples: list[float] = []
        self._every_s = every_s
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            await asyncio.sleep(self._every_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._sample())

    def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
        s = self.samples or [os.getloadavg()[0]]
        return {
            "min": round(min(s), 2),
            "mean": round(sum(s) / len(s), 2),
            "max": round(max(s), 2),
            "samples": len(s),
        }


# ---------------------------------------------------------------------------------------------
# The database


@contextlib.asynccontextmanager
async def run_database(url: str | None) -> AsyncIterator[tuple[str, int | None, str]]:
    """(URL, postmaster pid or None, description): a private cluster unless ``url`` is given."""
    if url:
        yield url, None, "your PostgreSQL (its backends' CPU for this database; WAL: the cluster's)"
        return
    from leasekeeper_server.storage.embedded import EmbeddedPostgres

    with tempfile.TemporaryDirectory(prefix="leasekeeper-capacity-") as folder:
        embedded = EmbeddedPostgres(Path(folder) / "pg")
        try:
            dsn = embedded.start()
            pid = int((Path(folder) / "pg" / "postmaster.pid").read_text().split()[0])
            yield dsn, pid, "a private cluster on pgserver's binaries, default durability"
        finally:
            embedded.stop()


# ---------------------------------------------------------------------------------------------
# The ops


@contextlib.asynccontextmanager
async def task_op(target: str, concurrency: int, run_id: str) -> AsyncIterator[Op]:
    """A task's life but its renewals: Claim of a new task, then Release (complete)."""
    async with grpc.aio.insecure_channel(target) as channel:
        clients = [
            LeaseClient(namespace=NAMESPACE, owner_id=f"{run_id}-w{i}", channel=channel)
            for i in range(concurrency)
        ]

        async def task(w: int, c: int) -> object:
            result = await clients[w].claim(f"{run_id}-{w}-{c}", ttl=scenarios.TTL_S)
            if not result.acquired or result.lease is None:
                raise AssertionError(f"claim refused: {result}")
            return await clients[w].release(result.lease.task_id, result.lease.fence, True)

        yield task


def op_factory(
    op: str, target: str, concurrency: int
) -> Callable[[], AbstractAsyncContextManager[Op]]:
    def make() -> AbstractAsyncContextManager[Op]:
        run_id = uuid.uuid4().hex[:8]
        if op == "task":
            return task_op(target, concurrency, run_id)
        return scenarios.scenario_op(op, target, NAMESPACE, concurrency, run_id)

    return make


async def measure_ops(
    server: ServerTarget, db: Database, args: argparse.Namespace
) -> tuple[dict[str, OpCost], dict[str, str], int]:
    """Each op's cost per operation, its windows rotated; what was not measured; connections."""
    ops = [op for op in OPS if op not in NEEDS or has_rpc(NEEDS[op])]
    missing = {op: f"the proto has no {NEEDS[op]} RPC" for op in OPS if op not in ops}
    spent: dict[str, Spent] = {}
    calls = dict.fromkeys(ops, 0)
    window_calls = dict.fromkeys(ops, 0)
    window_s = dict.fromkeys(ops, 0.0)
    errors: dict[str, int] = {}
    connections = 0
    for r in range(args.rounds):
        for op in ops if r % 2 == 0 else ops[::-1]:
            async with op_factory(op, server.address, args.concurrency)() as run:
                before = await read(server, db)
                sample = await closed_loop(run, args.concurrency, args.window, args.warmup)
                after = await read(server, db)
                connections = max(connections, await db.connections())
            each = Spent.between(before, after)
            spent[op] = spent[op] + each if op in spent else each
            per_call = scenarios.RENEWALS_PER_CALL.get(op, 1)
            calls[op] += sample.all_calls * per_call
            window_calls[op] += sample.calls * per_call
            window_s[op] += sample.elapsed_s
            if sample.errors:
                errors[op] = errors.get(op, 0) + sum(sample.errors.values())
                print(f"  {op}: errors {dict(sample.errors)}", flush=True)
            print(
                f"  round {r + 1} {TITLES[op]}: {sample.rate * per_call:,.0f}/s,"
                f" server {each.server_cpu_s * 1000 / max(sample.all_calls * per_call, 1):.3f}"
                f" ms, PostgreSQL {each.pg_cpu_s * 1000 / max(sample.all_calls * per_call, 1):.3f}"
                f" ms, WAL {each.wal_bytes / max(sample.all_calls * per_call, 1):,.0f} B",
                flush=True,
            )
    if errors:
        raise RuntimeError(f"calls failed: {errors}")
    costs = {
        op: OpCost(
            server_cpu_ms=round(s.server_cpu_s * 1000 / calls[op], 4),
            pg_cpu_ms=round(s.pg_cpu_s * 1000 / calls[op], 4),
            statements=round(s.statements / calls[op], 3),
            wal_bytes=round(s.wal_bytes / calls[op], 1),
            table_bytes=round(s.table_bytes / calls[op], 1),
            rate_per_s=round(window_calls[op] / window_s[op], 1),
        )
        for op, s in spent.items()
    }
    return costs, missing, connections


async def measure_fixed(
    server: ServerTarget, db: Database, args: argparse.Namespace
) -> dict[str, Any]:
    """An idle server's CPU, PostgreSQL's and the WAL meanwhile, its RSS; RSS per stream."""
    await asyncio.sleep(2.0)  # past the start's own work
    before = await read(server, db)
    await asyncio.sleep(args.idle)
    idle = Spent.between(before, await read(server, db))
    rss = rss_bytes(server.pid)
    # Each probe stream beats twice: a stream's buffers grow with its first messages.
    probe = await run_fleet(
        server.address,
        server.pid,
        f"{NAMESPACE}-probe",
        args.rss_probe,
        1.0,
        2.0,
        ttl_s=CHECK_TTL_S,
    )
    per_stream = (probe["server_rss_bytes"] - probe["server_rss_bytes_before"]) / args.rss_probe
    print(
        f"idle {idle.elapsed_s:.1f} s: server {idle.server_cpu_s / idle.elapsed_s:.4f} cores,"
        f" PostgreSQL {idle.pg_cpu_s / idle.elapsed_s:.4f} cores,"
        f" WAL {idle.wal_bytes / idle.elapsed_s:,.0f} B/s; RSS {rss / 2**20:.1f} MiB,"
        f" {per_stream / 1024:.1f} KiB per stream ({args.rss_probe:,} streams)",
        flush=True,
    )
    return {
        "server_cpu_cores": round(idle.server_cpu_s / idle.elapsed_s, 5),
        "pg_cpu_cores": round(idle.pg_cpu_s / idle.elapsed_s, 5),
        "wal_bytes_s": round(idle.wal_bytes / idle.elapsed_s, 1),
        "rss_bytes": rss,
        "rss_per_stream_bytes": round(per_stream, 1),
    }


async def settle(server: ServerTarget, within_s: float = 120.0) -> None:
    """Waits until the server has closed the probe's streams (its gauge reads 0)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not await asyncio.to_thread(server.gauge, "leasekeeper_heartbeat_streams_open"):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("the server kept heartbeat streams open")


async def check_point(
    start_server: Callable[[], AbstractAsyncContextManager[ServerTarget]],
    db: Database,
    streams: int,
    beat_s: float,
    duration_s: float,
) -> dict[str, Any]:
    """A fresh server carrying ``streams`` Heartbeat streams beating every ``beat_s`` seconds."""
    ttl_s = CHECK_TTL_S
    readings: list[Reading] = []
    async with start_server() as server:

        def window() -> AbstractAsyncContextManager[object]:
            @contextlib.asynccontextmanager
            async def around() -> AsyncIterator[None]:
                readings.append(await read(server, db))
                yield
                readings.append(await read(server, db))

            return around()

        print(f"check: {streams:,} streams, a beat every {beat_s:g} s", flush=True)
        fleet = await run_fleet(
            server.address,
            server.pid,
            f"{NAMESPACE}-{streams}",
            streams,
            beat_s,
            duration_s,
            ttl_s=ttl_s,
            window=window,
        )
        connections = await db.connections()
    spent = Spent.between(*readings)
    t = spent.elapsed_s
    measured = {
        "beats_per_s": round(fleet["sent"] / t, 1),
        "server_cores": round(spent.server_cpu_s / t, 4),
        "pg_cores": round(spent.pg_cpu_s / t, 4),
        "wal_bytes_s": round(spent.wal_bytes / t, 1),
        "statements_s": round(spent.statements / t, 1),
        "rss_bytes": fleet["server_rss_bytes"],
        "rss_bytes_before_streams": fleet["server_rss_bytes_before"],
        "driver_cores": round(spent.driver_cpu_s / t, 3),
        "elapsed_s": round(t, 1),
    }
    print(f"  {measured}", flush=True)
    return {
        "streams": streams,
        "beat_s": beat_s,
        "ttl_s": ttl_s,
        "duration_s": duration_s,
        "sent": fleet["sent"],
        "acked": fleet["acked"],
        "p50_ms": round(fleet["p50_ms"], 2),
        "p99_ms": round(fleet["p99_ms"], 2),
        "connections": connections,
        "measured": measured,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    load = LoadAverage()
    load.start()
    started = time.time()
    out = Path(args.out)
    pool_max_size = Settings.model_fields["pool_max_size"].default
    async with run_database(args.database_url) as (url, postmaster, description):
        await migrate(url)
        conn = await asyncpg.connect(url)
        try:
            db = Database(conn, postmaster)

            def start_server() -> AbstractAsyncContextManager[ServerTarget]:
                return leasekeeper_server(url, out / "logs", min_renew_interval_s=0)

            async with start_server() as server:
                print(f"server pid {server.pid} on {server.address}; {description}", flush=True)
                fixed = await measure_fixed(server, db, args)
                await settle(server)
                ops, missing, connections = await measure_ops(server, db, args)
            checks = []
            for streams, beat_s in args.checks:
                checks.append(await check_point(start_server, db, streams, beat_s, args.duration))
            version = await db.version()
        finally:
            await conn.close()
    costs = Costs(ops, Fixed(**fixed, pool_max_size=pool_max_size))
    return {
        "run": {
            "started": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(
                timespec="seconds"
            ),
            "elapsed_s": round(time.time() - started, 1),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "database": f"PostgreSQL {version} ({description})",
            "settings": {**SERVER_SETTINGS, "pool_max_size": pool_max_size},
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "window_s": args.window,
            "load": load.stop(),
        },
        "costs": costs.to_json(),
        "missing": missing,
        "connections_seen": max([connections, *(c["connections"] for c in checks)]),
        "checks": checks,
    }


def write(results: dict[str, Any], folder: Path) -> Path:
    """``capacity.json`` and ``capacity.md`` in ``folder``; the markdown's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "capacity.json").write_text(json.dumps(results, indent=2) + "\n")
    markdown = folder / "capacity.md"
    markdown.write_text(render(results))
    return markdown


def _check(text: str) -> tuple[int, float]:
    streams, _, beat = text.partition("x")
    try:
        return int(streams), float(beat)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: STREAMSxBEAT_S, e.g. 5000x5") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--database-url", default=os.environ.get("LEASEKEEPER_BENCH_DATABASE_URL"))
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    parser.add_argument("--publish", action="store_true", help="also write bench/published/")
    parser.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: render bench/published/capacity.md from its capacity.json",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="load workers per window")
    parser.add_argument("--rounds", type=int, default=3, help="windows per op")
    parser.add_argument("--window", type=float, default=4.0, help="each window, seconds")
    parser.add_argument("--warmup", type=float, default=0.5, help="before each window, seconds")
    parser.add_argument("--idle", type=float, default=10.0, help="the idle window, seconds")
    parser.add_argument("--rss-probe", type=int, default=2000, help="streams of the RSS probe")
    parser.add_argument(
        "--checks",
        type=_check,
        nargs="+",
        default=[(5000, 5.0), (20000, 10.0), (2000, 10.0)],
        metavar="STREAMSxBEAT_S",
        help="the fleets the model is checked at (default: 5000x5 20000x10 2000x10, the last"
        " below the rate per process the per-op costs hold from)",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="each check's beats, seconds")
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads((PUBLISHED / "capacity.json").read_text())
        print(f"wrote {write(results, PUBLISHED)}")
        return 0
    try:
        import uvloop

        results = uvloop.run(run(args))
    except ImportError:
        results = asyncio.run(run(args))
    markdown = write(results, Path(args.out))
    print(markdown.read_text())
    if args.publish:
        print(f"published: {write(results, PUBLISHED)}")
    checks = results["checks"]
    return 0 if all(c["acked"] == c["sent"] > 0 for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
