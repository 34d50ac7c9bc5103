"""Soak: the history workload for a long time, then its counts (violations must be 0).

    .venv/bin/python bench/soak.py --minutes 10 [--seed N] [--workers 6] [--crash-database]

Runs ``tests/fault/history`` (real worker processes, two real servers, random
faults from the seed) against the database in ``LEASEKEEPER_TEST_DATABASE_URL``
or a fresh database on the local PostgreSQL (127.0.0.1:5432), or an embedded
one when none answers; with ``--crash-database``, against a private cluster
(``tests/fault/cluster.py``) that the workload also crashes and restarts.
Server 0 is never killed, so its memory can be watched: its resident set size
(RSS) is sampled every ``--sample-s`` seconds and printed with the counts.
Exits 1 when the checker found a violation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from leasekeeper_server.storage.migrate import migrate  # noqa: E402
from tests.conftest import _embedded_database, _local_database, _local_postgres_answers  # noqa: E402
from tests.fault.cluster import PgCluster  # noqa: E402
from tests.fault.history.workload import Workload, WorkloadConfig  # noqa: E402


def rss_mib(pid: int) -> float | None:
    """Resident set size of a process and its children's group leader, MiB (Linux)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def server_pid(workload: Workload) -> int | None:
    """The pid of server 0's ``leasekeeper serve`` (under faketime it is its only child)."""
    link = workload.links[0] if workload.links else None
    if link is None or link.server is None:
        return None
    pid = link.server.proc.pid
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
    return pid


async def sample_memory(workload: Workload, every_s: float, samples: list[tuple[float, float]]):
    start = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        pid = server_pid(workload)
        mib = rss_mib(pid) if pid else None
        if mib is not None:
            samples.append((time.monotonic() - start, mib))


async def soak(args: argparse.Namespace, database_url: str | None) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="leasekeeper-soak-"))
    if database_url is not None:
        await migrate(database_url)
        return await soak_on(args, database_url, workdir, None)
    async with PgCluster(workdir / "pg") as cluster:
        await cluster.init()
        await cluster.start()
        database_url = cluster.url("postgres")
        await migrate(database_url)
        return await soak_on(args, database_url, workdir, cluster)


async def soak_on(
    args: argparse.Namespace, database_url: str, workdir: Path, cluster: PgCluster | None
) -> int:
    config = WorkloadConfig(
        database_url=database_url,
        workdir=workdir,
        seed=args.seed,
        duration_s=args.minutes * 60,
        workers=args.workers,
        tasks=args.tasks,
        ttl_s=args.ttl,
        spared_servers=1,
        cluster=cluster,
    )
    workload = Workload(config)
    samples: list[tuple[float, float]] = []
    sampler = asyncio.get_running_loop().create_task(
        sample_memory(workload, args.sample_s, samples)
    )
    try:
        report = await workload.run()
    finally:
        sampler.cancel()
    print(report.summary())
    counts = report.verdict.counts
    faults = sum(v for k, v in counts.items() if k.startswith("fault."))
    calls = sum(v for k, v in counts.items() if k.startswith("event."))
    print(f"faults injected: {faults}")
    print(f"worker calls and answers recorded: {calls}")
    print(f"stale fences refused: {counts['stale_fences_refused']}")
    print(f"violations found: {len(report.verdict.violations)}")
    if samples:
        t0, first = samples[0]
        t1, minute = next(((t, mib) for t, mib in samples if t >= 60), samples[0])
        t2, last = samples[-1]
        print(
            f"server 0 RSS: {first:.1f} MiB at {t0:.0f} s, {minute:.1f} MiB at {t1:.0f} s, "
            f"{last:.1f} MiB at {t2:.0f} s (max {max(m for _, m in samples):.1f} MiB, "
            f"{len(samples)} samples)"
        )
    print(f"history and logs: {workdir}")
    return 1 if report.verdict.violations else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=1.0, help="lease ttl, seconds")
    parser.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    parser.add_argument(
        "--crash-database",
        action="store_true",
        help="run on a private PostgreSQL cluster and crash it too",
    )
    args = parser.parse_args()
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    if args.crash_database:
        return asyncio.run(soak(args, None))
    url = os.environ.get("LEASEKEEPER_TEST_DATABASE_URL")
    with contextlib.ExitStack() as stack:
        if not url:
            if asyncio.run(_local_postgres_answers()):
                url = stack.enter_context(_local_database())
            else:
                url = stack.enter_context(_embedded_database(Path(tempfile.mkdtemp())))
        return asyncio.run(soak(args, url))


if __name__ == "__main__":
    sys.exit(main())
