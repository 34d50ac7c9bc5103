"""Ops measured side by side: alternating windows, ratios of server CPU per call.

``rotate`` runs several sides in turn, ``rounds`` windows each, forwards then
backwards (A B C, C B A, A B C, ...: a drift of the machine over the run
weighs on every side alike), every window through the suite's closed-loop
load generator (``bench/loadgen.py``) at one concurrency. ``compare`` does so
for two sides, A and B, and divides A's server CPU per call by B's. Around
each window they read

* the CPU time of the side's server process (and its children), from /proc;
* the CPU time of the PostgreSQL backends serving the side's database (the
  server's connections, found in ``pg_stat_activity``), from /proc: the
  statements' and triggers' own work, without the rest of the machine's
  PostgreSQL load.

Each side's figures are summed over its windows; a comparison also keeps
each round's own ratio, so the report shows how far they spread.
A side's op is made afresh for each window (its setup, such as claiming the
leases it renews, happens before the window's readings).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from bench.loadgen import Op, closed_loop
from bench.procstat import cpu_seconds


@dataclass
class Side:
    """One side of a comparison.

    Attributes:
        label: what it runs, e.g. ``SaveCheckpoint (4 KiB)``.
        pid: its server's process id.
        database_url: its server's database (whose backends' CPU is read).
        op: makes the window's op, its setup done, e.g. ``lambda: scenario_op(...)``.
        statements: reads how many database statements the server has sent
            (``ServerTarget.statements``); None: not counted.
    """

    label: str
    pid: int
    database_url: str
    op: Callable[[], AbstractAsyncContextManager[Op]]
    statements: Callable[[], float | None] | None = None


@dataclass
class Tally:
    """What one side's windows added up to.

    Attributes:
        calls: calls that returned, warm-up included (what the CPU readings span).
        window_calls: calls that returned within the measured windows.
        elapsed_s: the measured windows' length, seconds.
        server_cpu_s: the server's CPU time over the windows, seconds.
        db_cpu_s: its database backends' CPU time, seconds; None when not readable
            (a PostgreSQL on another machine).
        statements: database statements the server sent over the windows;
            None when not counted.
        errors: calls that raised, by exception type name.
        p50_ms: the median latency of each window, milliseconds.
        p99_ms: the 99th percentile latency of each window, milliseconds.
    """

    label: str
    calls: int = 0
    window_calls: int = 0
    elapsed_s: float = 0.0
    server_cpu_s: float = 0.0
    db_cpu_s: float | None = 0.0
    statements: float | None = 0.0
    errors: Counter[str] = field(default_factory=Counter)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Calls per second over the measured windows."""
        return self.window_calls / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def cpu_ms_per_call(self) -> float | None:
        """Server CPU per call, milliseconds."""
        return self.server_cpu_s * 1000 / self.calls if self.calls else None

    @property
    def db_cpu_ms_per_call(self) -> float | None:
        """Database backends' CPU per call, milliseconds."""
        if self.db_cpu_s is None or not self.calls:
            return None
        return self.db_cpu_s * 1000 / self.calls

    @property
    def statements_per_call(self) -> float | None:
        """Database statements per call."""
        if self.statements is None or not self.calls:
            return None
        return self.statements / self.calls

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "calls": self.calls,
            "rate": self.rate,
            "cpu_ms_per_call": self.cpu_ms_per_call,
            "db_cpu_ms_per_call": self.db_cpu_ms_per_call,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "errors": dict(self.errors),
        }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass
class Comparison:
    """A side-by-side result: A's server CPU per call over B's, against a target.

    Attributes:
        name: a stable key (``checkpoint_vs_renew``).
        title: what is compared, for the report.
        target: the highest ratio the target allows.
        concurrency: load workers of every window.
        a, b: the two sides' tallies.
        rounds: each round's ratio (A's window over B's window of that round).
        note: why the comparison did not run, when it did not.
    """

    name: str
    title: str
    target: float
    concurrency: int
    a: Tally
    b: Tally
    rounds: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """A's server CPU per call over B's; None when not measured."""
        return _ratio(self.a.cpu_ms_per_call, self.b.cpu_ms_per_call)

    @property
    def db_ratio(self) -> float | None:
        """A's database CPU per call over B's; None when not measured."""
        return _ratio(self.a.db_cpu_ms_per_call, self.b.db_cpu_ms_per_call)

    @property
    def met(self) -> bool | None:
        """Whether the ratio is within the target; None when not measured."""
        return None if self.ratio is None else self.ratio <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "target": self.target,
            "concurrency": self.concurrency,
            "ratio": self.ratio,
            "db_ratio": self.db_ratio,
            "met": self.met,
            "rounds": self.rounds,
            "note": self.note,
            "a": self.a.as_dict(),
            "b": self.b.as_dict(),
        }


def skipped(name: str, title: str, target: float, note: str) -> Comparison:
    """A comparison that did not run, and why (reported, not failed)."""
    return Comparison(name, title, target, 0, Tally("-"), Tally("-"), note=note)


class BackendClock:
    """The CPU time of the PostgreSQL backends serving one database, read from /proc.

    Holds one connection of its own (opened once, so reading does not fork a
    backend each time) and leaves that connection's backend out.
    """

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    async def read(self) -> dict[int, float] | None:
        """{backend pid: CPU seconds so far}; None when no backend is a process of this machine
        (a PostgreSQL elsewhere)."""
        pids = await self._conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        return _postgres_seconds([row["pid"] for row in pids]) or None


def _postgres_seconds(pids: list[int]) -> dict[int, float]:
    """{pid: CPU seconds} of those of ``pids`` that are postgres processes of this machine."""
    seconds: dict[int, float] = {}
    for pid in pids:
        with contextlib.suppress(OSError, ProcessLookupError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "postgres":
                seconds[pid] = cpu_seconds(pid)
    return seconds


@contextlib.asynccontextmanager
async def backend_clock(database_url: str) -> AsyncIterator[BackendClock]:
    """A :class:`BackendClock` of the database at ``database_url`` until the block ends."""
    conn = await asyncpg.connect(database_url)
    try:
        yield BackendClock(conn)
    finally:
        await conn.close()


def _spent(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    """Backend CPU between two readings; a backend started in between counts from zero."""
    if before is None or after is None:
        return None
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def _add(before: float | None, more: float | None) -> float | None:
    return None if before is None or more is None else before + more


async def _window(
    side: Side,
    tally: Tally,
    clock: BackendClock,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
) -> float | None:
    """Runs one window of ``side``; adds it to ``tally``; its server CPU ms per call."""
    async with side.op() as op:
        st0 = side.statements() if side.statements else None
        db0, cpu0 = await clock.read(), cpu_seconds(side.pid)
        sample = await closed_loop(op, concurrency, duration_s, warmup_s)
        cpu1, db1 = cpu_seconds(side.pid), await clock.read()
        st1 = side.statements() if side.statements else None
    tally.calls += sample.all_calls
    tally.window_calls += sample.calls
    tally.elapsed_s += sample.elapsed_s
    tally.server_cpu_s += cpu1 - cpu0
    tally.db_cpu_s = _add(tally.db_cpu_s, _spent(db0, db1))
    tally.statements = _add(tally.statements, None if st0 is None or st1 is None else st1 - st0)
    tally.errors.update(sample.errors)
    tally.p50_ms.append(round(sample.percentile_s(50) * 1000, 2))
    tally.p99_ms.append(round(sample.percentile_s(99) * 1000, 2))
    return (cpu1 - cpu0) * 1000 / sample.all_calls if sample.all_calls else None


async def rotate(
    sides: list[Side],
    *,
    rounds: int,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
) -> tuple[list[Tally], list[list[float | None]]]:
    """Measures ``sides`` in turn, forwards then backwards, ``rounds`` windows each.

    Args:
        sides: what to measure, each with its server and database.
        rounds: windows per side (at least 1).
        concurrency: load workers of every window.
        duration_s: each window's measured length, seconds.
        warmup_s: calls before each window's measured part, seconds (their
            CPU is counted with their calls).

    Returns:
        Each side's tally, and each round's server CPU ms per call, by side.
    """
    tallies = [Tally(side.label) for side in sides]
    costs: list[list[float | None]] = []
    async with contextlib.AsyncExitStack() as stack:
        clocks = [await stack.enter_async_context(backend_clock(s.database_url)) for s in sides]
        order = list(range(len(sides)))
        for r in range(max(rounds, 1)):
            cost: list[float | None] = [None] * len(sides)
            for i in order if r % 2 == 0 else order[::-1]:
                cost[i] = await _window(
                    sides[i], tallies[i], clocks[i], concurrency, duration_s, warmup_s
                )
            costs.append(cost)
    return tallies, costs


async def compare(
    name: str,
    title: str,
    target: float,
    a: Side,
    b: Side,
    *,
    rounds: int,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
) -> Comparison:
    """Measures ``a`` and ``b`` in alternating windows (A B, B A, ...); their comparison.

    Args:
        name, title, target: as in :class:`Comparison`.
        a, b: the sides; ``a`` is the numerator of the ratio.
        rounds, concurrency, duration_s, warmup_s: as for :func:`rotate`.
    """
    (ta, tb), costs = await rotate(
        [a, b], rounds=rounds, concurrency=concurrency, duration_s=duration_s, warmup_s=warmup_s
    )
    result = Comparison(name, title, target, concurrency, ta, tb)
    for cost in costs:
        round_ratio = _ratio(*cost)
        if round_ratio is not None:
            result.rounds.append(round(round_ratio, 3))
    print(
        f"  {title}: {ta.cpu_ms_per_call or 0:.3f} / {tb.cpu_ms_per_call or 0:.3f}"
        f" ms server CPU per call = {result.ratio or 0:.2f} (target <= {target})"
        f", rounds {result.rounds}"
        + (f", database CPU ratio {result.db_ratio:.2f}" if result.db_ratio else "")
        + (f" errors {dict(ta.errors + tb.errors)}" if ta.errors or tb.errors else ""),
        flush=True,
    )
    return result
