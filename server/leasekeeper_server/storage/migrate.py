"""Applies the versioned SQL files of ``migrations/`` (forward only).

Files are named ``NNNN_description.sql`` and never edited once landed. Each
one runs in its own transaction together with the row that records it in
``leasekeeper_schema_migrations``. A run that finds every migration recorded
changes nothing (a role without CREATE on the schema can start the service);
otherwise it holds a session advisory lock, so replicas starting together
apply each migration exactly once: the others wait, then find it recorded.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import asyncpg

from leasekeeper_server.core.errors import DatabaseRefused
from leasekeeper_server.storage.driver_errors import translate_errors

log = logging.getLogger(__name__)

# A constant shared by every leasekeeper replica; names the migration lock.
ADVISORY_LOCK_ID = 0x1EA5E_6EE9
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    """One migration file."""

    version: int
    name: str
    sql: str


def migrations_dir() -> Path:
    """The migrations folder: packaged with the server, or the source tree's."""
    packaged = Path(str(resources.files("leasekeeper_server"))) / "migrations"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[3] / "migrations"


def load(folder: Path | None = None) -> list[Migration]:
    """Every migration, by version; refuses gaps and malformed names."""
    folder = folder or migrations_dir()
    found = []
    for path in sorted(folder.glob("*.sql")):
        match = _FILE.match(path.name)
        if not match:
            raise ValueError(f"migration file name {path.name!r} is not NNNN_description.sql")
        found.append(Migration(int(match[1]), match[2], path.read_text("utf-8")))
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise ValueError(f"migration {expected:04d} is missing (found {migration.version:04d})")
    return found


async def migrate(dsn: str, folder: Path | None = None) -> list[int]:
    """Applies the migrations not yet recorded; returns the versions applied now.

    A schema already current is only read: no DDL and no lock, so a role with
    no right to change the schema (only the service's reads and writes) can
    start. Otherwise the migrations run under the migration lock, re-read
    once it is held (another starter may have applied them meanwhile).

    Raises:
        DatabaseRefused: the database refuses the connection for good, or the
            role may not change the schema while a migration is due.
        DatabaseUnavailable: the database cannot be reached.
    """
    wanted = load(folder)
    with translate_errors(connecting=True):
        conn = await asyncpg.connect(
            dsn, server_settings={"application_name": "leasekeeper-migrate"}
        )
    try:
        with translate_errors(), _schema_rights():
            if not _due(wanted, await _applied(conn)):
                return []
            return await _apply(conn, wanted)
    finally:
        await conn.close()  # also ends the advisory lock's session


async def _applied(conn: asyncpg.Connection) -> set[int] | None:
    """The versions recorded as applied; None when the bookkeeping table does not exist."""
    if await conn.fetchval("SELECT to_regclass('leasekeeper_schema_migrations')") is None:
        return None
    return {
        r["version"] for r in await conn.fetch("SELECT version FROM leasekeeper_schema_migrations")
    }


def _due(wanted: list[Migration], applied: set[int] | None) -> list[Migration]:
    """The migrations of ``wanted`` not in ``applied`` (all of them when None)."""
    return [m for m in wanted if applied is None or m.version not in applied]


async def _apply(conn: asyncpg.Connection, wanted: list[Migration]) -> list[int]:
    """Applies the due migrations under the migration lock; returns their versions."""
    await conn.execute("SELECT pg_advisory_lock($1)", ADVISORY_LOCK_ID)
    # Read again under the lock: another starter may have applied them meanwhile.
    recorded = await _applied(conn)
    if recorded is None:
        await conn.execute(
            """CREATE TABLE leasekeeper_schema_migrations (
                   version integer PRIMARY KEY,
                   name text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"""
        )
    applied = []
    for migration in _due(wanted, recorded):
        async with conn.transaction():
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO leasekeeper_schema_migrations (version, name) VALUES ($1, $2)",
                migration.version,
                migration.name,
            )
        log.info("applied migration %04d_%s", migration.version, migration.name)
        applied.append(migration.version)
    return applied


@contextlib.contextmanager
def _schema_rights() -> Iterator[None]:
    """A privilege error while migrating: DatabaseRefused, in one line saying what to do."""
    try:
        yield
    except asyncpg.exceptions.InsufficientPrivilegeError as exc:
        raise DatabaseRefused(
            f"cannot migrate the schema: {exc}: run `leasekeeper migrate` as a role that owns "
            "the schema (or has CREATE on it), then start the service with this one"
        ) from exc
