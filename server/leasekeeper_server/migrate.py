"""Applies the versioned SQL files of ``migrations/`` (forward only).

Files are named ``NNNN_description.sql`` and never edited once landed. Each
one runs in its own transaction together with the row that records it in
``leasekeeper_schema_migrations``. The whole run holds a session advisory
lock, so replicas starting together apply each migration exactly once: the
others wait, then find it recorded.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import asyncpg

from .store import translate_errors

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
    packaged = Path(str(resources.files(__package__))) / "migrations"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "migrations"


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

    Raises:
        DatabaseUnavailable: the database cannot be reached.
    """
    wanted = load(folder)
    with translate_errors():
        conn = await asyncpg.connect(
            dsn, server_settings={"application_name": "leasekeeper-migrate"}
        )
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", ADVISORY_LOCK_ID)
        await conn.execute(
            """CREATE TABLE IF NOT EXISTS leasekeeper_schema_migrations (
                   version integer PRIMARY KEY,
                   name text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"""
        )
        done = {
            r["version"]
            for r in await conn.fetch("SELECT version FROM leasekeeper_schema_migrations")
        }
        applied = []
        for migration in wanted:
            if migration.version in done:
                continue
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
    finally:
        await conn.close()  # also ends the advisory lock's session
