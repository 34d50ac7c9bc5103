"""The leasekeeper server under test, as a process of its own, and its database.

The server is started with ``leasekeeper serve`` (the command users run) on a
loopback port, with its Prometheus endpoint on another, so the bench reads
its CPU time from /proc and its database statements from
``leasekeeper_db_statements_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import tempfile
import time
import tomllib
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg

from bench.reference_process import stop

_PORT_LINE = re.compile(r"serving on \S+ \(port (\d+)\)")
_METRICS_LINE = re.compile(r"metrics on http://\S+ \(port (\d+)\)")
LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
BENCH_DATABASE = "leasekeeper_bench"


@dataclass
class ServerTarget:
    """A running server: where it listens, its process, its metrics endpoint."""

    address: str
    pid: int
    metrics_url: str
    log_path: Path

    def gauge(self, name: str) -> float | None:
        """The value of an unlabelled metric (or counter sample) the server exports, or None."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return None

    def statements(self) -> float | None:
        """Database statements the server has sent so far; None from a server without the
        counter (an earlier version, --baseline-src)."""
        return self.gauge("leasekeeper_db_statements_total")


def _command(source: Path | None = None) -> list[str]:
    """The ``leasekeeper`` command: this checkout's, or the one ``source``'s pyproject names.

    An earlier checkout may keep its command elsewhere (``leasekeeper_server.cli:main``
    before the server's modules moved into folders), so its own entry point is run.
    """
    if source is not None:
        scripts = tomllib.loads((source / "pyproject.toml").read_text())["project"]["scripts"]
        module, function = scripts["leasekeeper"].split(":")
        run = f"import sys; from {module} import {function} as main; sys.exit(main())"
        return [sys.executable, "-c", run]
    script = Path(sys.executable).with_name("leasekeeper")
    return (
        [str(script)] if script.exists() else [sys.executable, "-m", "leasekeeper_server.cli.main"]
    )


def _new_log(log_dir: Path) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / f"server-{time.monotonic_ns()}.log"


@contextlib.asynccontextmanager
async def leasekeeper_server(
    database_url: str, log_dir: Path, *, source: Path | None = None, **settings: object
) -> AsyncIterator[ServerTarget]:
    """Runs ``leasekeeper serve`` until the block ends (SIGTERM, then SIGKILL).

    Args:
        database_url: the (migrated or empty) database.
        log_dir: where the server's log file goes.
        source: another checkout of the project whose server and client code
            the process runs instead of this one's (an earlier version, for a
            before/after comparison in one run); None: this checkout's.
        **settings: ``LEASEKEEPER_<NAME>`` settings, e.g. ``workers=2``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    if source is not None:
        env["PYTHONPATH"] = f"{source / 'server'}{os.pathsep}{source / 'client'}"
    env.update(
        LEASEKEEPER_DATABASE_URL=database_url,
        LEASEKEEPER_LISTEN="127.0.0.1:0",
        LEASEKEEPER_CONSOLE_LISTEN="off",  # the console is measured on its own (bench/console.py)
        LEASEKEEPER_METRICS_LISTEN="127.0.0.1:0",
        LEASEKEEPER_LOG_LEVEL="INFO",
    )
    for name, value in settings.items():
        env[f"LEASEKEEPER_{name.upper()}"] = str(value)
    log_path = _new_log(log_dir)
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *_command(source), "serve", env=env, stdout=log, stderr=log, start_new_session=True
        )
    try:
        port = metrics_port = 0
        deadline = time.monotonic() + 60
        while not (port and metrics_port):
            if proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{log_path.read_text()}")
            text = log_path.read_text(errors="replace")
            if m := _PORT_LINE.search(text):
                port = int(m.group(1))
            if m := _METRICS_LINE.search(text):
                metrics_port = int(m.group(1))
            await asyncio.sleep(0.05)
        yield ServerTarget(
            f"127.0.0.1:{port}", proc.pid, f"http://127.0.0.1:{metrics_port}/metrics", log_path
        )
    finally:
        await stop(proc, grace_s=15)


@contextlib.asynccontextmanager
async def bench_database(url: str | None) -> AsyncIterator[str]:
    """A database for the run: ``url`` as given; else a new one on 127.0.0.1:5432; else embedded.

    The new database (``leasekeeper_bench_<random>``, so two runs on one
    machine never share one) is dropped at the end; the embedded PostgreSQL
    lives in a temporary folder removed at the end.
    """
    if url:
        yield url
        return
    try:
        admin = await asyncpg.connect(LOCAL_POSTGRES, timeout=2)
    except (OSError, asyncpg.PostgresError):
        admin = None
    if admin is not None:
        name = f"{BENCH_DATABASE}_{uuid.uuid4().hex[:8]}"
        try:
            await admin.execute(f"CREATE DATABASE {name}")
        finally:
            await admin.close()
        try:
            yield LOCAL_POSTGRES.rsplit("/", 1)[0] + "/" + name
        finally:
            admin = await asyncpg.connect(LOCAL_POSTGRES, timeout=5)
            try:
                await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            finally:
                await admin.close()
        return
    from leasekeeper_server.storage.embedded import EmbeddedPostgres

    with tempfile.TemporaryDirectory(prefix="leasekeeper-bench-") as folder:
        embedded = EmbeddedPostgres(Path(folder))
        try:
            yield embedded.start()
        finally:
            embedded.stop()


@contextlib.asynccontextmanager
async def sibling_database(url: str, suffix: str) -> AsyncIterator[str]:
    """A new, empty database beside ``url``'s (same server), dropped when the block ends.

    For a second server that must not share the first one's tables (an
    earlier version, migrated by its own migrations). Needs the CREATEDB
    privilege.
    """
    parts = urlsplit(url)
    name = f"{parts.path.lstrip('/')}_{suffix}_{uuid.uuid4().hex[:6]}"
    admin = parts._replace(path="/postgres").geturl()
    await _admin(admin, f'CREATE DATABASE "{name}"')
    try:
        yield parts._replace(path=f"/{name}").geturl()
    finally:
        await _admin(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _admin(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def database_transactions(url: str) -> int:
    """Committed plus rolled-back transactions of the database so far (pg_stat_database)."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        row = await conn.fetchrow(
            "SELECT xact_commit + xact_rollback AS n FROM pg_stat_database"
            " WHERE datname = current_database()"
        )
        return int(row["n"])
    finally:
        await conn.close()
