"""Shared fixtures: one real PostgreSQL per test session, real servers on loopback ports.

The database is, in order of preference:
1. ``LEASEKEEPER_TEST_DATABASE_URL`` when set (used as is; tests add unique namespaces);
2. the PostgreSQL on 127.0.0.1:5432 (user postgres), in a fresh database dropped afterwards;
3. an embedded PostgreSQL (pgserver) in a temporary folder (also when
   ``LEASEKEEPER_TEST_EMBEDDED=1``).
The schema is migrated once. Every test works in a namespace of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile

# Tests start subprocesses (fork+exec) from a process running grpc; its fork
# handlers have nothing to do then and only log noise. Read at grpc's import.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.app import LeaseServer
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage.migrate import migrate

LOCAL_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


async def _local_postgres_answers() -> bool:
    try:
        conn = await asyncpg.connect(LOCAL_ADMIN_URL, timeout=2)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True


@contextlib.contextmanager
def _local_database() -> Iterator[str]:
    name = f"leasekeeper_test_{uuid.uuid4().hex[:10]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(LOCAL_ADMIN_URL)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def embedded_data_dir() -> Path:
    """A new folder for an embedded PostgreSQL's data, outside pytest's temporary folders.

    As root, pgserver runs PostgreSQL as its own user and opens the folders above the data
    (o+rx); pytest closes its /tmp/pytest-of-<user> to 0700 again whenever another pytest
    session starts (``make test`` runs two side by side), and PostgreSQL then could not
    reach its data ("Permission denied").
    """
    return Path(tempfile.mkdtemp(prefix="leasekeeper-pgdata-"))


@contextlib.contextmanager
def _embedded_database(tmp: Any) -> Iterator[str]:
    import pgserver

    server = pgserver.get_server(tmp, cleanup_mode="delete")
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()


def pytest_configure(config: pytest.Config) -> None:
    """As root, makes the system user pgserver runs PostgreSQL as, before any worker starts.

    pgserver (the embedded PostgreSQL, and tests/fault's clusters) creates the ``pgserver`` user
    when it is missing; ``make test``'s pytest-xdist workers would all run ``useradd`` at once,
    and all but the first would fail. A failure here is left to pgserver to report as before.
    """
    if os.geteuid() != 0:
        return
    with contextlib.suppress(ImportError, OSError, subprocess.CalledProcessError):
        from pgserver.utils import ensure_user_exists

        ensure_user_exists("pgserver")


def pytest_report_header(config: pytest.Config) -> str:
    """Says which PostgreSQL the session will use."""
    if os.environ.get("LEASEKEEPER_TEST_DATABASE_URL"):
        return "leasekeeper: PostgreSQL from LEASEKEEPER_TEST_DATABASE_URL"
    if os.environ.get("LEASEKEEPER_TEST_EMBEDDED") != "1" and asyncio.run(
        _local_postgres_answers()
    ):
        return "leasekeeper: PostgreSQL on 127.0.0.1:5432 (a fresh database, dropped afterwards)"
    return "leasekeeper: embedded PostgreSQL (pgserver), no PostgreSQL answers on 127.0.0.1:5432"


@pytest.fixture(scope="session")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated PostgreSQL database for the whole session."""
    with contextlib.ExitStack() as stack:
        url = os.environ.get("LEASEKEEPER_TEST_DATABASE_URL")
        if not url:
            force_embedded = os.environ.get("LEASEKEEPER_TEST_EMBEDDED") == "1"
            if not force_embedded and asyncio.run(_local_postgres_answers()):
                url = stack.enter_context(_local_database())
            else:
                url = stack.enter_context(_embedded_database(embedded_data_dir()))
        asyncio.run(migrate(url))
        yield url


@pytest.fixture
def namespace() -> str:
    """A namespace no other test uses."""
    return f"test-{uuid.uuid4().hex[:12]}"


def make_settings(database_url: str, **overrides: Any) -> Settings:
    """Test settings: loopback, any free port, short ttls allowed."""
    values: dict[str, Any] = {
        "database_url": database_url,
        "listen": "127.0.0.1:0",
        "min_ttl_s": 0.1,
        "default_ttl_s": 5.0,
        "min_renew_interval_s": 0.05,
        "health_interval_s": 0.2,
        "shutdown_grace_s": 1.0,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@dataclass
class RunningServer:
    """A LeaseServer listening on a loopback port."""

    server: LeaseServer
    port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def running_server(database_url: str, **overrides: Any) -> AsyncIterator[RunningServer]:
    """Starts a server in this event loop; stops it afterwards."""
    server = LeaseServer(make_settings(database_url, **overrides), database_url)
    port = await server.start()
    try:
        yield RunningServer(server, port)
    finally:
        await server.stop(0.5)


@pytest.fixture
async def server(database_url: str) -> AsyncIterator[RunningServer]:
    """A real server on a loopback port, with test settings."""
    async with running_server(database_url) as running:
        yield running


@pytest.fixture
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> rpc.LeaseServiceStub:
    return rpc.LeaseServiceStub(channel)


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A direct connection to the test database, for looking behind the service."""
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def monitor(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A second direct connection, kept out of transactions, for watching the service wait."""
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()
