"""CPU per operation, leasekeeper (server + PostgreSQL) beside etcd's server, in one run.

    .venv/bin/python -m bench.cpu_per_op [--duration S] [--concurrency N] [--no-profile]

Issue 20's fourth part: the comparison with etcd as CPU time per operation of
every process that serves it, so it does not depend on how fast the Python
load generator (this process) can drive either. One leasekeeper server
(``leasekeeper serve``, ``bench/servers.py``) with its database and one
private etcd (``bench/etcd.py``) run side by side; each op runs one window of
``--duration`` seconds (after ``--warmup``) through the suite's closed loop
(``bench/loadgen.py``) at ``--concurrency`` workers, its setup (claiming the
leases it renews or validates, opening its streams) done before the window's
readings. Around each window it reads, from /proc:

* the leasekeeper server's CPU (its process and children);
* PostgreSQL's CPU: every process named ``postgres`` on the machine. The
  machine's PostgreSQL also serves other users, so an idle window of the same
  length is measured first, before any load, and its rate (CPU seconds per
  second) times the window's length is subtracted. Beside it, as a check
  that does not depend on the rest of the machine: the CPU of the backends
  serving the server's own database (its connections, ``pg_stat_activity``),
  which leaves out PostgreSQL's shared background work (WAL writer,
  checkpointer);
* etcd's server CPU (its process).

Each figure is divided by the operations the window's calls made, warm-up and
tail included (``Sample.all_calls``; a Session beat renews
``LEASES_PER_SESSION`` leases and counts as that many renewals). The ops:

========  ==============================================  ===========================
op        leasekeeper                                     etcd
========  ==============================================  ===========================
claim     Claim of a new task                             LeaseGrant + Txn (recipe)
renew     Renew (unary); Heartbeat beat; Session renewal  LeaseKeepAlive stream message
validate  ValidateFence (unary); ValidateFences stream    Range of the key (linearizable)
========  ==============================================  ===========================

Each leasekeeper call also runs one window against the bare grpc.aio server of
the same service whose handlers do no work (``bench/noop_server.py``): its
CPU per call is the floor of what that call can cost in Python's gRPC stack,
and ``floor ratio`` (that floor over etcd's CPU per op) the ratio leasekeeper
would reach if all its own work (validation, SQL, PostgreSQL, audit) were free.

It prints a markdown table (ratio: leasekeeper total / etcd) and writes it to
``bench/results/cpu_per_op.md`` and ``.json``. Unless ``--no-profile``, one
more claim window runs under ``py-spy record`` on the leasekeeper server
(after the measured windows, so sampling does not weigh on their figures);
its top frames (own samples, by function) are printed and saved beside.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import aetcd  # noqa: E402
from aetcd import rpc  # noqa: E402

from bench import scenarios  # noqa: E402
from bench.etcd import etcd_claim, etcd_server  # noqa: E402
from bench.loadgen import Op, closed_loop  # noqa: E402
from bench.paired import BackendClock, backend_clock  # noqa: E402
from bench.procstat import command_cpu_seconds, cpu_seconds  # noqa: E402
from bench.reference import noop_server  # noqa: E402
from bench.reference_process import Target  # noqa: E402
from bench.servers import bench_database, leasekeeper_server  # noqa: E402

NAMESPACE = "bench-cpu-per-op"
ETCD_TTL_S = int(scenarios.TTL_S)

# (op, leasekeeper scenario, its label, etcd op of the same row)
ROWS = (
    ("claim", "claim", "Claim", "claim"),
    ("renew", "renew", "Renew (unary)", "keepalive"),
    ("renew", "heartbeat", "Heartbeat stream beat", "keepalive"),
    ("renew", "session", "Session stream renewal", "keepalive"),
    ("validate", "validate", "ValidateFence (unary)", "range"),
    ("validate", "validate_stream", "ValidateFences stream", "range"),
)
ETCD_LABELS = {
    "claim": "LeaseGrant + Txn",
    "keepalive": "LeaseKeepAlive stream message",
    "range": "Range of the key",
}


@dataclass
class Window:
    """One measured window: operations made and CPU seconds each process spent."""

    label: str
    ops: int
    rate: float
    wall_s: float
    server_cpu_s: float
    postgres_cpu_s: float
    postgres_idle_s: float
    backends_cpu_s: float | None
    errors: dict[str, int]

    def ms(self, seconds: float) -> float:
        return 1000 * seconds / self.ops if self.ops else float("nan")


@contextlib.asynccontextmanager
async def etcd_keepalive(target: Target, concurrency: int) -> AsyncIterator[Op]:
    """One lease and one LeaseKeepAlive stream per worker; a call is one message and its answer."""
    host, port = target.address.rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port), timeout=10) as client:
        leases = [await client.lease(ETCD_TTL_S) for _ in range(concurrency)]
        calls: list[Any] = [client.leasestub.LeaseKeepAlive() for _ in leases]
        requests = [rpc.LeaseKeepAliveRequest(ID=lease.id) for lease in leases]
        try:

            async def keepalive(w: int, c: int) -> object:
                await calls[w].write(requests[w])
                reply = await calls[w].read()
                if reply is None or reply.TTL <= 0:
                    raise AssertionError(f"keepalive not renewed: {reply}")
                return reply

            yield keepalive
        finally:
            for call in calls:
                call.cancel()


@contextlib.asynccontextmanager
async def etcd_range(target: Target, concurrency: int) -> AsyncIterator[Op]:
    """One key per worker, held under a lease; a call reads it (a linearizable Range)."""
    host, port = target.address.rsplit(":", 1)
    prefix = f"/bench/{uuid.uuid4().hex[:12]}"
    async with aetcd.Client(host=host, port=int(port), timeout=10) as client:
        keys = []
        for w in range(concurrency):
            key = f"{prefix}/{w}".encode()
            lease = await client.lease(ETCD_TTL_S)
            await client.put(key, f"owner-{w}".encode(), lease=lease)
            keys.append(key)

        async def read(w: int, c: int) -> object:
            got = await client.get(keys[w])
            if got is None or got.value != f"owner-{w}".encode():
                raise AssertionError(f"key {keys[w]!r} read {got}")
            return got

        yield read


async def measure(
    label: str,
    make_op: Callable[[], AbstractAsyncContextManager[Op]],
    pid: int,
    idle_rate: float,
    args: argparse.Namespace,
    per_call: int = 1,
    backends: BackendClock | None = None,
) -> Window:
    """One closed-loop window of ``make_op``'s op; CPU of ``pid`` and of PostgreSQL around it.

    ``backends``: also the CPU of the backends serving that clock's database.
    """
    async with make_op() as op:
        db0 = await backends.read() if backends else None
        server0, pg0, t0 = cpu_seconds(pid), command_cpu_seconds("postgres"), time.monotonic()
        sample = await closed_loop(op, args.concurrency, args.duration, args.warmup)
        server1, pg1, t1 = cpu_seconds(pid), command_cpu_seconds("postgres"), time.monotonic()
        db1 = await backends.read() if backends else None
    wall = t1 - t0
    spent = (
        sum(seconds - db0.get(p, 0.0) for p, seconds in db1.items())
        if db0 is not None and db1 is not None
        else None
    )
    window = Window(
        label,
        sample.all_calls * per_call,
        sample.rate * per_call,
        wall,
        server1 - server0,
        pg1 - pg0,
        idle_rate * wall,
        spent,
        dict(sample.errors),
    )
    print(
        f"  {label:<34} {window.rate:8.0f} ops/s  process {window.ms(window.server_cpu_s):.3f} ms"
        f"  postgres {window.ms(window.postgres_cpu_s - window.postgres_idle_s):.3f} ms"
        + (f"  its backends {window.ms(spent):.3f} ms" if spent is not None else "")
        + (f"  errors {window.errors}" if window.errors else ""),
        flush=True,
    )
    return window


def _py_spy() -> str | None:
    """The py-spy executable: on PATH or beside this Python's; None when missing."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    return spy if os.path.exists(spy) else None


# Leaf frames of a thread waiting, not running: left out of the profile's shares.
IDLE_LEAVES = frozenset(
    {"poll", "epoll_wait", "epoll_pwait", "select", "pselect", "accept", "accept4", "syscall",
     "pthread_cond_wait", "pthread_cond_timedwait", "sem_wait", "sem_timedwait", "nanosleep",
     "clock_nanosleep", "__futex_abstimed_wait_common"}
)  # fmt: skip
# Where a busy sample's time goes: the frame nearest the leaf that names one of these.
COMPONENTS = (
    ("garbage collector", ("gc_collect",)),
    ("logging (log and audit lines)", ("logging/", "observability/audit.py")),
    ("asyncpg (database protocol)", ("asyncpg/", "pgproto")),
    ("protobuf", ("protobuf/", "_message.abi3")),
    ("gRPC (cygrpc, C-core, socket I/O)", ("cygrpc", "grpc/")),
    ("leasekeeper's own Python", ("leasekeeper_server/", "leasekeeper/")),
    ("event loop (uvloop, asyncio)", ("loop.c", "uvloop", "asyncio", "_asynciomodule")),
)


def profile_summary(raw: Path, top: int = 5) -> list[str]:
    """Shares of the busy samples in py-spy's raw (collapsed, --native) output.

    Samples whose leaf frame is a wait (IDLE_LEAVES) are left out. Each busy
    sample goes to the component (COMPONENTS) of the frame nearest its leaf
    that names one, else "other". Returns one line per component (largest
    first), then the ``top`` leaf frames; empty when the file is missing or
    holds no busy samples.
    """
    if not raw.exists():
        return []
    parts: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    busy = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        leaf = frames[-1].partition(" (")[0]
        if leaf in IDLE_LEAVES:
            continue
        n = int(count)
        busy += n
        own[frames[-1].rsplit(":", 1)[0] + (")" if ":" in frames[-1] else "")] += n
        for frame in reversed(frames):
            name = next((c for c, marks in COMPONENTS if any(m in frame for m in marks)), None)
            if name is not None:
                parts[name] += n
                break
        else:
            parts["other"] += n
    if not busy:
        return []
    lines = [f"{100 * n / busy:5.1f}%  {name}" for name, n in parts.most_common()]
    lines.append(f"top leaf frames of {busy} busy samples:")
    lines += [f"{100 * n / busy:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    return lines


async def profile_claim(
    server_pid: int, address: str, args: argparse.Namespace, out: Path
) -> list[str]:
    """A claim window under ``py-spy record`` on the server; its top frames."""
    spy = _py_spy()
    if spy is None:
        return ["py-spy not installed: pip install py-spy (pyproject's dev extra)"]
    raw = out / "cpu_per_op_claim_profile.txt"
    seconds = max(1, int(args.duration))
    async with scenarios.scenario_op(
        "claim", address, NAMESPACE, args.concurrency, uuid.uuid4().hex[:8]
    ) as op:
        spy_proc = await asyncio.create_subprocess_exec(
            spy, "record", "--pid", str(server_pid), "--subprocesses", "--format", "raw",
            "--native", "--rate", "200", "--duration", str(seconds), "--output", str(raw),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        await closed_loop(op, args.concurrency, seconds + 1.0, args.warmup)
        _, err = await spy_proc.communicate()
    summary = profile_summary(raw) if spy_proc.returncode == 0 else []
    return summary or [
        f"py-spy failed ({spy_proc.returncode}): {err.decode(errors='replace')[-300:]}"
    ]


def _cell(value: float | None, fmt: str = "{:.3f}") -> str:
    """``value`` formatted, or "-" when it is missing (None, or NaN: no ops to divide by)."""
    if value is None or math.isnan(value):
        return "-"
    return fmt.format(value)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`collect` as a Markdown table (ratio: leasekeeper total / etcd)."""
    lines = [
        "| op | leasekeeper call | leasekeeper server ms | PostgreSQL ms | leasekeeper total ms"
        " | etcd call | etcd ms | ratio | PostgreSQL: its backends ms | ratio, backends only"
        " | no-op server ms | floor ratio |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['leasekeeper']} | {_cell(r['server_ms'])}"
            f" | {_cell(r['postgres_ms'])} | {_cell(r['total_ms'])} | {r['etcd']}"
            f" | {_cell(r['etcd_ms'])} | {_cell(r['ratio'], '{:.2f}')}"
            f" | {_cell(r['backends_ms'])} | {_cell(r['backends_ratio'], '{:.2f}')}"
            f" | {_cell(r.get('floor_ms'))} | {_cell(r.get('floor_ratio'), '{:.2f}')} |"
        )
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """NaN (a window without ops) as None, so the figures are JSON that every reader takes."""
    return None if isinstance(value, float) and math.isnan(value) else value


async def collect(args: argparse.Namespace) -> dict[str, Any]:
    """The whole measurement; its figures as a dict (what ``cpu_per_op.json`` holds).

    ``args``: ``database_url`` (None: a new database, ``bench.servers.bench_database``),
    ``out`` (the folder of the server's log and the profile), ``duration``, ``warmup``
    (seconds), ``concurrency``, ``no_profile``. The dict's ``rows`` are the table's
    (:func:`table`; a figure that had no ops to divide by is None), ``note`` the run's
    conditions in a sentence, ``claim_profile`` the profile summary's lines (empty
    without one) and ``failed_windows`` the labels of windows with errors or no ops.
    """
    out = Path(args.out)
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(bench_database(args.database_url))
        server = await stack.enter_async_context(
            leasekeeper_server(
                # As bench/run.py runs its server: every beat a renewal, a pool of 20.
                url,
                out / "logs",
                min_renew_interval_s=0,
                pool_max_size=20,
            )
        )
        etcd = await stack.enter_async_context(etcd_server())
        noop = await stack.enter_async_context(noop_server())
        clock = await stack.enter_async_context(backend_clock(url))
        idle_wall = args.duration + args.warmup
        pg0, lk0, et0, t0 = (
            command_cpu_seconds("postgres"), cpu_seconds(server.pid), cpu_seconds(etcd.pid),
            time.monotonic(),
        )  # fmt: skip
        await asyncio.sleep(idle_wall)
        elapsed = time.monotonic() - t0
        idle = {
            "postgres_cpu_per_s": (command_cpu_seconds("postgres") - pg0) / elapsed,
            "leasekeeper_cpu_per_s": (cpu_seconds(server.pid) - lk0) / elapsed,
            "etcd_cpu_per_s": (cpu_seconds(etcd.pid) - et0) / elapsed,
            "window_s": elapsed,
        }
        print(
            f"idle window {elapsed:.1f} s: postgres {idle['postgres_cpu_per_s']:.3f} CPU-s/s"
            f" (subtracted), leasekeeper {idle['leasekeeper_cpu_per_s']:.3f},"
            f" etcd {idle['etcd_cpu_per_s']:.3f}",
            flush=True,
        )
        print(f"{args.duration} s windows, {args.concurrency} concurrent", flush=True)
        pg_rate = idle["postgres_cpu_per_s"]
        lk: dict[str, Window] = {}
        floor: dict[str, Window] = {}  # the same call on the bare grpc.aio server
        et: dict[str, Window] = {}
        etcd_ops: dict[str, Callable[[], AbstractAsyncContextManager[Op]]] = {
            "claim": lambda: etcd_claim(etcd, ttl_s=ETCD_TTL_S),
            "keepalive": lambda: etcd_keepalive(etcd, args.concurrency),
            "range": lambda: etcd_range(etcd, args.concurrency),
        }
        for _, scenario, label, etcd_op in ROWS:

            def make(scenario: str = scenario) -> AbstractAsyncContextManager[Op]:
                return scenarios.scenario_op(
                    scenario, server.address, NAMESPACE, args.concurrency, uuid.uuid4().hex[:8]
                )

            def make_noop(scenario: str = scenario) -> AbstractAsyncContextManager[Op]:
                return scenarios.scenario_op(
                    scenario, noop.address, NAMESPACE, args.concurrency, uuid.uuid4().hex[:8]
                )

            per_call = scenarios.RENEWALS_PER_CALL.get(scenario, 1)
            lk[scenario] = await measure(
                f"leasekeeper {label}", make, server.pid, pg_rate, args, per_call, clock
            )
            floor[scenario] = await measure(
                f"no-op server {label}", make_noop, noop.pid, pg_rate, args, per_call
            )
            if etcd_op not in et:
                et[etcd_op] = await measure(
                    f"etcd {ETCD_LABELS[etcd_op]}", etcd_ops[etcd_op], etcd.pid, pg_rate, args
                )
        profile = (
            [] if args.no_profile else await profile_claim(server.pid, server.address, args, out)
        )
    load_after = os.getloadavg()
    rows = []
    for op, scenario, label, etcd_op in ROWS:
        w, e, f = lk[scenario], et[etcd_op], floor[scenario]
        server_ms = w.ms(w.server_cpu_s)
        floor_ms = f.ms(f.server_cpu_s)
        postgres_ms = w.ms(w.postgres_cpu_s - w.postgres_idle_s)
        etcd_ms = e.ms(e.server_cpu_s)
        backends_ms = w.ms(w.backends_cpu_s) if w.backends_cpu_s is not None else float("nan")
        row = {
            "op": op,
            "leasekeeper": label,
            "server_ms": server_ms,
            "postgres_ms": postgres_ms,
            "total_ms": server_ms + postgres_ms,
            "etcd": ETCD_LABELS[etcd_op],
            "etcd_ms": etcd_ms,
            "ratio": (server_ms + postgres_ms) / etcd_ms if etcd_ms else float("nan"),
            "backends_ms": backends_ms,
            "backends_ratio": (server_ms + backends_ms) / etcd_ms if etcd_ms else float("nan"),
            "floor_ms": floor_ms,
            "floor_ratio": floor_ms / etcd_ms if etcd_ms else float("nan"),
            "leasekeeper_rate": w.rate,
            "etcd_rate": e.rate,
        }
        rows.append({k: _finite(v) for k, v in row.items()})
    note = (
        f"{started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, {args.concurrency} concurrent,"
        f" {args.duration} s windows; load average (1/5/15 min) before"
        f" {'/'.join(f'{x:.2f}' for x in load_before)}, after"
        f" {'/'.join(f'{x:.2f}' for x in load_after)}. PostgreSQL: every postgres process on"
        f" the machine, minus an idle window's {idle['postgres_cpu_per_s']:.3f} CPU-s/s;"
        " its backends: the server's connections (pg_stat_activity), without the rest of the"
        " machine's PostgreSQL work (WAL writer, checkpointer, other databases)."
    )
    return {
        "started": started.isoformat(),
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_after,
        "idle": idle,
        "rows": rows,
        "note": note,
        "windows": {
            "leasekeeper": {k: asdict(v) for k, v in lk.items()},
            "etcd": {k: asdict(v) for k, v in et.items()},
            "floor": {k: asdict(v) for k, v in floor.items()},
        },
        "claim_profile": profile,
        "failed_windows": [
            w.label for w in [*lk.values(), *floor.values(), *et.values()] if w.errors or not w.ops
        ],
    }


PROFILE_HEADING = "Claim profile (py-spy --native, share of busy samples):"


def markdown(results: dict[str, Any]) -> str:
    """:func:`collect`'s figures as Markdown: the table, the note, the profile's lines."""
    md = f"{table(results['rows'])}\n\n{results['note']}\n"
    if results["claim_profile"]:
        md += f"\n{PROFILE_HEADING}\n\n" + "".join(
            f"    {line}\n" for line in results["claim_profile"]
        )
    return md


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.out)
    results = await collect(args)
    md = markdown(results)
    print()
    print(md)
    (out / "cpu_per_op.md").write_text(md)
    (out / "cpu_per_op.json").write_text(json.dumps(results, indent=2))
    return 1 if results["failed_windows"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_per_op", description=__doc__)
    parser.add_argument("--database-url", default=os.environ.get("LEASEKEEPER_BENCH_DATABASE_URL"))
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    parser.add_argument("--duration", type=float, default=5.0, help="each window, seconds")
    parser.add_argument("--warmup", type=float, default=0.5, help="before each window, seconds")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy claim window")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        import uvloop

        return uvloop.run(main_async(args))
    except ImportError:
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
