"""Migrations: applied once, recorded, safe when replicas start together."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit

import asyncpg
import pytest

from leasekeeper_server.storage import migrate as migrate_module


@pytest.fixture
async def fresh_database_url(database_url):
    """An empty database on the same server as the session's."""
    name = f"leasekeeper_mig_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = urlsplit(database_url)._replace(path=f"/{name}").geturl()
    yield url
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def test_migrate_concurrent_replicas_apply_each_version_once(fresh_database_url):
    results = await asyncio.gather(*(migrate_module.migrate(fresh_database_url) for _ in range(5)))
    expected = [m.version for m in migrate_module.load()]
    applied = sorted(v for result in results for v in result)
    assert applied == expected, "each migration must be applied by exactly one replica"
    conn = await asyncpg.connect(fresh_database_url)
    try:
        rows = await conn.fetch("SELECT version FROM leasekeeper_schema_migrations ORDER BY 1")
    finally:
        await conn.close()
    assert [r["version"] for r in rows] == expected


async def test_migrate_up_to_date_applies_nothing(database_url):
    assert await migrate_module.migrate(database_url) == []


def test_load_missing_version_is_refused(tmp_path):
    (tmp_path / "0001_a.sql").write_text("SELECT 1;")
    (tmp_path / "0003_c.sql").write_text("SELECT 1;")
    with pytest.raises(ValueError, match="0002"):
        migrate_module.load(tmp_path)


def test_load_malformed_name_is_refused(tmp_path):
    (tmp_path / "1_a.sql").write_text("SELECT 1;")
    with pytest.raises(ValueError, match="NNNN_description"):
        migrate_module.load(tmp_path)
