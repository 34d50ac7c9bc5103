"""Behind a real PgBouncer: transaction and statement pooling refused at start in one line,
session pooling served.

In transaction mode PgBouncer hands a PostgreSQL session to whichever client
starts a transaction, so the statements asyncpg prepares on one session are
run on another (``prepared statement "__asyncpg_stmt_…" does not exist``):
such a server used to migrate, say SERVING and fail every call. In statement
mode PgBouncer closes the connection of a client that opens a transaction
block, and the start was retried for 60 s as a database out of reach. Both
must refuse to start, with or without ``--workers``, saying what is wrong
and what to use instead.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import running_server
from tests.fault.pgbouncer import pgbouncer
from tests.fault.processes import server_env, spawn_server
from tests.helpers import dur

pytestmark = [pytest.mark.timeout(30)]

# A start that can never succeed ends within this many seconds (not after the
# 60 s LEASEKEEPER_STARTUP_WAIT_S gives a database out of reach).
REFUSED_WITHIN_S = 10.0


@pytest.mark.parametrize("pool_mode", ["transaction", "statement"])
@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_behind_transaction_or_statement_pooling_exits_2_with_one_line(
    database_url: str, tmp_path: Path, pool_mode: str, workers: int
) -> None:
    async with pgbouncer(database_url, pool_mode) as bouncer:
        # At WARNING, so the start's INFO lines stay out: what is left is the refusal.
        env = server_env(bouncer.url(database_url), log_level="WARNING", workers=workers)
        server = await spawn_server(tmp_path, env)
        try:
            code = await server.wait_exit(REFUSED_WITHIN_S)
        finally:
            await server.kill()
    output = server.logs()
    assert code == 2, output  # a setting that can never work
    assert "Traceback" not in output, output
    assert output.count("\n") == 1, output
    for words in (
        f"pooler in {pool_mode} mode",
        f"PgBouncer pool_mode={pool_mode}",
        "use PgBouncer pool_mode=session",
        "LEASEKEEPER_DATABASE_URL",
    ):
        assert words in output, output


async def test_serve_behind_session_pooling_serves(database_url: str, namespace: str) -> None:
    async with (
        pgbouncer(database_url, "session") as bouncer,
        running_server(bouncer.url(database_url)) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        for task_id in ("a", "b", "c"):
            claim = pb.ClaimRequest(namespace=namespace, task_id=task_id, owner_id="o", ttl=dur(5))
            assert (await stub.Claim(claim, timeout=5)).acquired
