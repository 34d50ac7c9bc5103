"""A service role with only the rights it needs to serve: no right to change the schema.

Since PostgreSQL 15 the ``public`` schema grants no CREATE to everyone, and a
least-privilege service role has only SELECT, INSERT, UPDATE, DELETE (and
EXECUTE) on a database migrated by its owner. ``serve`` (alone or with
workers) and ``migrate`` must run no DDL when the schema is current, so that
role starts and serves; on a database that needs migrating, the role gets one
line naming the cause and what to do, exit 2, not a traceback.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.fault.dburl import replaced
from tests.fault.processes import server_env, server_process, spawn_server
from tests.helpers import dur
from tests.integration.test_cli import assert_one_line, run_cli

pytestmark = [pytest.mark.timeout(60)]

REFUSED_WITHIN_S = 15.0
NEEDS_SCHEMA_OWNER = "run `leasekeeper migrate` as a role that owns the schema"


@contextlib.asynccontextmanager
async def service_role(db: asyncpg.Connection) -> AsyncIterator[str]:
    """A login role with DML and EXECUTE rights on the database's objects only; dropped after."""
    role = f"leasekeeper_dml_{uuid.uuid4().hex[:10]}"
    await db.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        await db.execute(
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{role}"'
        )
        await db.execute(f'GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO "{role}"')
        assert not await db.fetchval("SELECT has_schema_privilege($1, 'public', 'CREATE')", role), (
            "PostgreSQL 15 grants no CREATE on public to everyone"
        )
        yield role
    finally:
        await db.execute(f'DROP OWNED BY "{role}"')
        await db.execute(f'DROP ROLE "{role}"')


@contextlib.asynccontextmanager
async def empty_database(db: asyncpg.Connection) -> AsyncIterator[str]:
    """A new database with no leasekeeper schema yet; dropped after."""
    name = f"leasekeeper_empty_{uuid.uuid4().hex[:10]}"
    await db.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        await db.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_as_a_role_without_schema_rights_on_a_migrated_database(
    database_url: str, db: asyncpg.Connection, tmp_path: Path, namespace: str, workers: int
) -> None:
    async with service_role(db) as role:
        env = server_env(replaced(database_url, role=role), workers=workers)
        async with (
            server_process(tmp_path, env) as server,
            grpc.aio.insecure_channel(server.target) as channel,
        ):
            claim = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="o", ttl=dur(30))
            lease = (await rpc.LeaseServiceStub(channel).Claim(claim, timeout=5)).lease
            assert lease.fence >= 1
        assert "Traceback" not in server.logs(), server.logs()


async def test_migrate_as_a_role_without_schema_rights_says_up_to_date(
    database_url: str, db: asyncpg.Connection
) -> None:
    async with service_role(db) as role:
        env = {"LEASEKEEPER_DATABASE_URL": replaced(database_url, role=role)}
        code, out, err = await run_cli("migrate", env=env)
    assert (code, out) == (0, "schema up to date\n"), err
    assert "Traceback" not in err, err


async def test_a_role_without_schema_rights_on_a_database_to_migrate_gets_one_line_exit_2(
    database_url: str, db: asyncpg.Connection, tmp_path: Path
) -> None:
    async with service_role(db) as role, empty_database(db) as database:
        url = replaced(database_url, role=role, database=database)
        code, out, err = await run_cli("migrate", env={"LEASEKEEPER_DATABASE_URL": url})
        assert (code, out) == (2, ""), err
        assert_one_line(err, "permission denied for schema public", NEEDS_SCHEMA_OWNER)
        for workers in (1, 2):
            server = await spawn_server(
                tmp_path, server_env(url, log_level="WARNING", workers=workers)
            )
            try:
                code = await server.wait_exit(REFUSED_WITHIN_S)
            finally:
                await server.kill()
            assert code == 2, server.logs()
            assert_one_line(
                server.logs(), "permission denied for schema public", NEEDS_SCHEMA_OWNER
            )
