"""The effect ledger's cost beside a claim's: one ratio of server CPU per call, in one run.

    .venv/bin/python -m bench.effect_pair [--before REV] [--rounds N] [--duration S]

The suite's ``effect`` scenario (a BeginEffect + CompleteEffect pair through
the Python client, one lease per load worker) and its ``claim`` scenario
(Claim of a new task) run on one server in alternating windows
(``bench.paired.rotate``: A B, B A, ...), so a drift of the shared machine
weighs on both alike. Per side it prints calls per second, the server's CPU
per call, its database backends' CPU per call and the database statements per
call (the server's ``leasekeeper_db_statements_total``, as ``bench/run.py``
counts them), then the pair's server CPU over the claim's: the ratio issue 20
sets at 1.5 at most.

``--before REV`` also runs a server of an earlier commit (``bench.checkout``:
its own files, on a database its own migrations made), its two sides rotated
with this tree's in the same windows, so both ratios come from one run.
``--tree REV`` runs a commit's (or a folder's) server instead of this
checkout's. ``--scenarios`` measures other scenarios of the suite the same way
(default: ``effect claim``); with ``--before``, each scenario's server CPU per
call on this tree over the earlier commit's is printed too: the suite's
before-and-after table measures the two servers minutes apart, this in the
same windows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import uuid
from pathlib import Path

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import scenarios  # noqa: E402
from bench.checkout import source_tree  # noqa: E402
from bench.paired import Side, Tally, rotate  # noqa: E402
from bench.servers import (  # noqa: E402
    ServerTarget,
    bench_database,
    leasekeeper_server,
    sibling_database,
)

NAMESPACE = "bench-effects"
# As bench/run.py runs its server: every beat a renewal, a pool of 20.
SETTINGS: dict[str, object] = {"min_renew_interval_s": 0, "pool_max_size": 20}
TARGET = 1.5


def _sides(
    label: str,
    server: ServerTarget,
    database_url: str,
    concurrency: int,
    names: list[str],
) -> list[Side]:
    """Each scenario of ``names`` on ``server``, each window with its own leases and tasks."""

    def side(scenario: str) -> Side:
        return Side(
            f"{scenarios.TITLES[scenario]} ({label})",
            server.pid,
            database_url,
            lambda: scenarios.scenario_op(
                scenario, server.address, NAMESPACE, concurrency, uuid.uuid4().hex[:8]
            ),
            server.statements,
        )

    return [side(name) for name in names]


def _line(tally: Tally) -> str:
    def figure(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    return (
        f"  {tally.label:<48} {tally.rate:8.0f}/s  server cpu {figure(tally.cpu_ms_per_call)} ms"
        f"  db cpu {figure(tally.db_cpu_ms_per_call)} ms"
        f"  statements {figure(tally.statements_per_call, 2)}/call"
        f"  p50 {sorted(tally.p50_ms)[len(tally.p50_ms) // 2]:.2f} ms"
        + (f"  errors {dict(tally.errors)}" if tally.errors else "")
    )


async def main_async(args: argparse.Namespace) -> int:
    log_dir = Path(args.out) / "logs"
    async with contextlib.AsyncExitStack() as stack:
        url = await stack.enter_async_context(bench_database(args.database_url))
        tree = stack.enter_context(source_tree(args.tree)) if args.tree else None
        server = await stack.enter_async_context(
            leasekeeper_server(url, log_dir, source=tree, **SETTINGS)
        )
        label = args.tree or "this tree"
        names = args.scenarios
        versions = [(label, _sides(label, server, url, args.concurrency, names))]
        for before in args.before:
            source = stack.enter_context(source_tree(before))
            old_url = await stack.enter_async_context(sibling_database(url, "before"))
            old = await stack.enter_async_context(
                leasekeeper_server(old_url, log_dir, source=source, **SETTINGS)
            )
            versions.append((before, _sides(before, old, old_url, args.concurrency, names)))
        sides = [side for _, pair in versions for side in pair]
        print(
            f"{args.rounds} windows of {args.duration} s per side, {args.concurrency} concurrent",
            flush=True,
        )
        tallies, _ = await rotate(
            sides,
            rounds=args.rounds,
            concurrency=args.concurrency,
            duration_s=args.duration,
            warmup_s=args.warmup,
        )
    failed = False
    by_version = [tallies[i * len(names) : (i + 1) * len(names)] for i in range(len(versions))]
    for (label, _), mine in zip(versions, by_version, strict=True):
        print(f"{label}:")
        for tally in mine:
            print(_line(tally))
            failed |= bool(tally.errors or not tally.calls)
        cost = {name: t.cpu_ms_per_call for name, t in zip(names, mine, strict=True)}
        pair, claim = cost.get("effect"), cost.get("claim")
        if pair and claim:
            print(f"  pair / claim server CPU per call: {pair / claim:.2f} (target <= {TARGET})")
    for (label, _), theirs in zip(versions[1:], by_version[1:], strict=True):
        print(f"{versions[0][0]} over {label}, server CPU per call:")
        for name, ours, old in zip(names, by_version[0], theirs, strict=True):
            if ours.cpu_ms_per_call and old.cpu_ms_per_call:
                ratio = ours.cpu_ms_per_call / old.cpu_ms_per_call
                print(f"  {scenarios.TITLES[name]:<32} {ratio:.2f}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.effect_pair", description=__doc__)
    parser.add_argument("--database-url", default=os.environ.get("LEASEKEEPER_BENCH_DATABASE_URL"))
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    parser.add_argument(
        "--before",
        action="append",
        default=[],
        help="a commit (or a checkout's folder) measured beside (may be repeated)",
    )
    parser.add_argument(
        "--tree", help="a commit (or a checkout's folder) to run instead of this checkout's server"
    )
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=["effect", "claim"],
        choices=scenarios.SCENARIOS,
        help="the suite's scenarios to measure (default: effect claim)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="windows per side")
    parser.add_argument("--duration", type=float, default=3.0, help="each window, seconds")
    parser.add_argument("--warmup", type=float, default=0.5, help="before each window, seconds")
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    try:
        import uvloop

        return uvloop.run(main_async(args))
    except ImportError:
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
