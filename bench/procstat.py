"""CPU time and memory of a process (and its children), read from /proc (Linux)."""

from __future__ import annotations

import os
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time, seconds, of process ``pid`` and its live child processes.

    Raises:
        ProcessLookupError: no such process.
    """
    total = 0.0
    for p in [pid, *children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            if p == pid:
                raise ProcessLookupError(pid) from None
            continue
        # fields[0] is state (field 3); utime and stime are fields 14 and 15.
        total += (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    return total


def own_cpu_seconds() -> float:
    """User + system CPU time, seconds, of this process (all its threads)."""
    times = os.times()
    return times.user + times.system


def command_cpu_seconds(command: str) -> float:
    """User + system CPU time, seconds, of every live process whose command name is ``command``.

    For PostgreSQL (``postgres``: the postmaster and every backend), whichever
    databases they serve: on a quiet machine, the cost of the run's database.
    """
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            head, tail = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)
        except (FileNotFoundError, ProcessLookupError):
            continue
        if head.split("(", 1)[1] != command:
            continue
        fields = tail.split()
        total += int(fields[11]) + int(fields[12])
    return total / _TICKS_PER_S


def rss_bytes(pid: int) -> int:
    """Resident set size, bytes, of process ``pid`` and its live child processes."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except FileNotFoundError:
            continue
    return total


def children(pid: int) -> list[int]:
    """Every descendant process of ``pid`` (depth first)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for tid in tasks:
        try:
            kids = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except FileNotFoundError:
            continue
        for kid in map(int, kids):
            found.append(kid)
            found.extend(children(kid))
    return found


def thread_cpu_ns(pid: int) -> int:
    """CPU time, nanoseconds, of the live threads of process ``pid`` (not its children).

    The scheduler's own account (``/proc/PID/task/TID/schedstat``, time on a
    CPU, user and system), exact to the nanosecond where ``cpu_seconds`` counts
    clock ticks (10 ms): fine enough for the CPU of one request. A thread
    that ended between two readings takes its time with it.

    Raises:
        ProcessLookupError: no such process.
    """
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    total = 0
    for tid in tasks:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total
