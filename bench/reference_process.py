"""Reference servers as child processes: where they listen, and stopping them.

A reference server (the bare gRPC server, etcd) runs in a session (process
group) of its own, so a stop reaches everything it started and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Target:
    """A running reference server.

    Attributes:
        address: ``host:port`` a client connects to.
        pid: the server's process id (for its CPU time and memory).
    """

    address: str
    pid: int


async def stop(process: asyncio.subprocess.Process, grace_s: float = 5.0) -> None:
    """Stops a process started with ``start_new_session=True``: SIGTERM, then SIGKILL.

    The whole process group is signalled, so children the leader started (the
    workers of ``serve --workers``) stop too, even after the leader exited.

    Args:
        process: the child process (the leader of its own process group).
        grace_s: seconds it is given to exit after SIGTERM before it is killed.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' when there is none), for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""
