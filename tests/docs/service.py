"""The real service the documentation's snippets run against: one ``leasekeeper serve``.

It runs in a process of its own on a loopback port, on a database of its own, with its
metrics on another loopback port. Between two documents the database is emptied, so each
page starts as a new user's would: no tasks, no limits, no tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from leasekeeper_server.cli.healthcheck import probe
from tests.fault.processes import leasekeeper_command, server_env

_PORT_LINE = re.compile(r"leasekeeper listening on \S+:(\d+)")
START_TIMEOUT_S = 60.0

# Every table a user's calls write (migrations/), children first.
_TABLES = (
    "leasekeeper_task_history",
    "leasekeeper_effects",
    "leasekeeper_tasks",
    "leasekeeper_namespace_limits",
    "leasekeeper_tokens",
)


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class DocsService:
    """The running service: its address, database and metrics address."""

    target: str
    database_url: str
    metrics_listen: str

    def reset(self) -> None:
        """Empties every table a user's calls write (DELETE, so change notifications fire)."""

        async def empty() -> None:
            conn = await asyncpg.connect(self.database_url)
            try:
                for table in _TABLES:
                    await conn.execute(f"DELETE FROM {table}")
            finally:
                await conn.close()

        asyncio.run(empty())


@contextlib.contextmanager
def docs_service(database_url: str, log_dir: Path) -> Iterator[DocsService]:
    """Starts ``leasekeeper serve`` and waits until it serves; stops it afterwards (SIGTERM).

    Raises:
        AssertionError: it exited or did not serve within ``START_TIMEOUT_S`` (with its log).
    """
    metrics_listen = f"127.0.0.1:{free_port()}"
    env = server_env(database_url, metrics_listen=metrics_listen)
    log_path = log_dir / "docs-server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*leasekeeper_command(), "serve"],
            cwd=log_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        target = ""
        while True:
            logs = log_path.read_text(errors="replace")
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the docs' server did not serve:\n{logs}")
            match = _PORT_LINE.search(logs)
            if match and not target:
                target = f"127.0.0.1:{match.group(1)}"
            if target and probe(target, 0.5):
                break
            time.sleep(0.05)
        yield DocsService(target, database_url, metrics_listen)
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
