"""A real PgBouncer between a server and the test database, for fault tests.

``pgbouncer(database_url, pool_mode)`` starts Debian's ``pgbouncer`` (``.ci/run``
installs it) with a config written to a folder of its own: it listens on a
free loopback port, forwards every database name to the test database's
PostgreSQL as the URL's role (``auth_type = any``: no passwords), with at most
``pool_size`` PostgreSQL sessions per database and role, and ignores the
startup parameters named (by default the session settings a server in session
mode sends; PgBouncer refuses unknown ones). PgBouncer will not run as root:
as root it is started with ``-u postgres`` (or ``nobody``), so its folder is
world-readable.

Skips the test, saying why, only when ``pgbouncer`` is not installed or the
test database is reached through a Unix socket (the embedded PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import asyncpg
import pytest

from tests.fault.dburl import database_address, proxied
from tests.helpers import poll

# PgBouncer's startup, seconds; a port taken between our choice and its bind is tried again.
START_WITHIN_S = 10.0
_PORT_TRIES = 3
# The session settings a server in session mode sends when it connects (store.connection_settings).
SESSION_SETTINGS = ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout")


class PgBouncer:
    """A running pgbouncer process: its port and its log."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path

    def url(self, database_url: str) -> str:
        """``database_url`` through this PgBouncer (same role and database name)."""
        return proxied(database_url, self.port)

    def logs(self) -> str:
        """What pgbouncer wrote so far."""
        return self.log_path.read_text(errors="replace")


def _binary() -> str:
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/sbin")
    if found is None:
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer; .ci/run installs it)")
    return found


def _run_as() -> list[str]:
    """``-u USER`` when root (pgbouncer refuses to run as root), else nothing."""
    if os.geteuid() != 0:
        return []
    for user in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(user)
            return ["-u", user]
    pytest.skip("pgbouncer refuses to run as root and there is no postgres or nobody user")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Config:
    """What a test asks of its PgBouncer (pgbouncer.ini's settings of the same names)."""

    pool_mode: str
    pool_size: int = 20  # default_pool_size: PostgreSQL sessions per database and role
    ignore_startup_parameters: tuple[str, ...] = SESSION_SETTINGS


def _config(database_url: str, port: int, config: Config) -> str:
    host, db_port = database_address(database_url)
    if host.startswith("/"):
        pytest.skip(
            "the test database is the embedded PostgreSQL (a Unix socket): "
            "no PostgreSQL on 127.0.0.1:5432 for pgbouncer to forward to"
        )
    parts = urlsplit(database_url)
    target = f"host={host} port={db_port} user={unquote(parts.username or 'postgres')}"
    if parts.password:
        target += f" password={unquote(parts.password)}"
    return "\n".join(
        [
            "[databases]",
            f"* = {target}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {port}",
            "unix_socket_dir =",
            "auth_type = any",
            f"pool_mode = {config.pool_mode}",
            f"default_pool_size = {config.pool_size}",
            f"ignore_startup_parameters = {','.join(config.ignore_startup_parameters)}",
            # After a failed connection to PostgreSQL, try again in a second (15 by default).
            "server_login_retry = 1",
            "",
        ]
    )


async def _answers(url: str) -> bool:
    try:
        conn = await asyncpg.connect(url, timeout=1, statement_cache_size=0)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _start(command: list[str], folder: Path, database_url: str, config: Config) -> PgBouncer:
    """Starts pgbouncer on a free port and waits until it answers, or until it exits."""
    port = _free_port()
    ini = folder / "pgbouncer.ini"
    ini.write_text(_config(database_url, port, config))
    ini.chmod(0o644)
    log_path = folder / "pgbouncer.log"
    with log_path.open("ab") as log_file:
        proc = await asyncio.create_subprocess_exec(
            *command,
            str(ini),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
        )
    bouncer = PgBouncer(proc, port, log_path)

    async def up_or_exited() -> bool:
        return proc.returncode is not None or await _answers(bouncer.url(database_url))

    try:
        await poll(up_or_exited, "pgbouncer answering", START_WITHIN_S, 0.05)
    except BaseException:
        await _stop(proc)
        raise
    return bouncer


@contextlib.asynccontextmanager
async def pgbouncer(
    database_url: str,
    pool_mode: str,
    *,
    pool_size: int = 20,
    ignore_startup_parameters: tuple[str, ...] = SESSION_SETTINGS,
) -> AsyncIterator[PgBouncer]:
    """A pgbouncer in ``pool_mode`` (session, transaction or statement) before ``database_url``.

    ``pool_size``: its PostgreSQL sessions per database and role (fewer than a
    server's connections: they must share them). Stopped (SIGTERM, then
    SIGKILL) on exit.
    """
    config = Config(pool_mode, pool_size, ignore_startup_parameters)
    command = [_binary(), *_run_as()]
    with tempfile.TemporaryDirectory(prefix="leasekeeper-pgbouncer-") as name:
        os.chmod(name, 0o755)  # readable by the user pgbouncer switches to
        folder = Path(name)
        for _ in range(_PORT_TRIES):
            bouncer = await _start(command, folder, database_url, config)
            if bouncer.proc.returncode is None:
                break
            # It exited: most likely its port was taken since we chose it; another one.
        else:
            raise AssertionError(f"pgbouncer did not start:\n{bouncer.logs()}")
        try:
            yield bouncer
        finally:
            await _stop(bouncer.proc)
