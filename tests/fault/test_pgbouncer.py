"""Behind a real PgBouncer: transaction pooling refused at start in one line, session served.

In transaction mode PgBouncer hands a PostgreSQL session to whichever client
starts a transaction, so the statements asyncpg prepares on one session are
run on another (``prepared statement "__asyncpg_stmt_…" does not exist``):
such a server used to migrate, say SERVING and fail every call. It must
refuse to start, saying what is wrong and what to use instead.
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


async def test_serve_behind_transaction_pooling_exits_2_with_one_line(
    database_url: str, tmp_path: Path
) -> None:
    async with pgbouncer(database_url, "transaction") as bouncer:
        # At WARNING, so the start's INFO lines stay out: what is left is the refusal.
        env = server_env(bouncer.url(database_url), log_level="WARNING")
        server = await spawn_server(tmp_path, env)
        try:
            code = await server.wait_exit(REFUSED_WITHIN_S)
        finally:
            await server.kill()
    output = server.logs()
    assert code == 2, output  # a setting that can never work
    assert "Traceback" not in output, output
    assert output.count("\n") == 1, output
    for words in ("transaction", "PgBouncer pool_mode=session", "LEASEKEEPER_DATABASE_URL"):
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
