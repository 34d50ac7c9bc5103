"""The closed-loop load generator every benchmark and reference point goes through.

``concurrency`` workers each call ``op(worker_index, call_index)`` back to back
for ``duration_s`` seconds after ``warmup_s`` seconds; the calls that return
within those ``duration_s`` seconds are counted (a closed loop's throughput,
whatever the latency). A call's latency is the time from its start to its return, on this
process's monotonic clock, in seconds. An op that raises is counted as an
error and the worker goes on; the errors' kinds are kept for the report.

The same function drives leasekeeper, the bare gRPC server, raw asyncpg and
etcd, so the ratios between them compare the targets, not the drivers.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Op = Callable[[int, int], Awaitable[object]]


@dataclass
class Sample:
    """What one measured run saw.

    Attributes:
        calls: calls that returned in the measured window.
        errors: calls that raised in the window, by exception type name.
        elapsed_s: the measured window, seconds.
        latencies_s: every counted call's latency, seconds (unsorted).
        all_calls: every call that returned, warm-up and tail included (to
            divide costs read around the whole run, such as CPU time).
    """

    calls: int
    errors: Counter[str]
    elapsed_s: float
    latencies_s: list[float] = field(repr=False)
    all_calls: int = 0

    @property
    def rate(self) -> float:
        """Calls returned per second."""
        return self.calls / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def percentile_s(self, q: float) -> float:
        """The q-th latency percentile (0 < q <= 100), seconds; nan without calls."""
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
        return ordered[index]


def error_name(exc: Exception) -> str:
    """How a failed call is counted: its type, and its status code when it is a gRPC error."""
    code = getattr(exc, "code", None)
    status = code() if callable(code) else None
    name = getattr(status, "name", None)
    return f"{type(exc).__name__} {name}" if isinstance(name, str) else type(exc).__name__


async def closed_loop(op: Op, concurrency: int, duration_s: float, warmup_s: float = 0.5) -> Sample:
    """Runs ``concurrency`` workers calling ``op`` back to back; returns the measured window."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from = start + warmup_s
    stop_at = measure_from + duration_s
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    clock = time.perf_counter
    returned = 0

    async def worker(index: int) -> None:
        nonlocal returned
        call = 0
        while True:
            began = clock()
            now = loop.time()
            if now >= stop_at:
                return
            try:
                await op(index, call)
            except Exception as exc:  # counted, and the load goes on
                if measure_from <= loop.time() <= stop_at:
                    errors[error_name(exc)] += 1
            else:
                returned += 1
                if measure_from <= loop.time() <= stop_at:  # returned in the window
                    latencies.append(clock() - began)
            call += 1

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return Sample(len(latencies), errors, duration_s, latencies, returned)
