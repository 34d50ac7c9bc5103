"""Behind a real PgBouncer, in each pool mode (storage/pooling.py).

Session mode is served as PostgreSQL itself is. Transaction mode
(``LEASEKEEPER_DATABASE_POOL_MODE=transaction``) is served end to end through a
PgBouncer holding two PostgreSQL sessions for all of a server's connections,
started without ``ignore_startup_parameters`` (so the server may send no
session setting PgBouncer would refuse), with notifications, migrations and
the sweeper's election over ``LEASEKEEPER_DIRECT_DATABASE_URL``; its
statements keep their lock timeouts (``SET LOCAL``). What can never work is
refused at start, with or without ``--workers``, in one line saying what to
set: a pooler in statement mode, a pooler in transaction mode while the pool
mode is session (its prepared statements would land on other sessions:
``prepared statement "__asyncpg_stmt_…" does not exist``), transaction mode
without the direct URL. Health names the path that failed: the pooled
statements (readiness) or the notification connection
(``leasekeeper.notifications``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.storage.pooling import TransactionPooling, check_pool_mode
from tests.conftest import running_server
from tests.fault.dburl import database_address, proxied
from tests.fault.pgbouncer import PgBouncer, pgbouncer
from tests.fault.processes import (
    QUICK_OUTAGE_SETTINGS,
    server_env,
    server_process,
    spawn_server,
)
from tests.fault.proxy import TcpProxy, tcp_proxy
from tests.helpers import dur, poll
from tests.integration.contract_helpers import grant, heartbeat_on, release
from tests.integration.effect_helpers import ALREADY_APPLIED, PROCEED, SUCCEEDED, begin, complete
from tests.integration.test_cli import run_cli
from tests.integration.test_limits import set_limits

pytestmark = [pytest.mark.timeout(60)]

# A start that can never succeed ends within this many seconds (not after the
# 60 s LEASEKEEPER_STARTUP_WAIT_S gives a database out of reach).
REFUSED_WITHIN_S = 10.0
# A pushed loss reaches its stream long before the lease's ttl would end it.
TTL_S = 60.0
PUSHED_WITHIN_S = 15.0
NOTIFICATIONS = "leasekeeper.notifications"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
T = pb.TaskEventType


@contextlib.asynccontextmanager
async def transaction_pooler(target_url: str) -> AsyncIterator[PgBouncer]:
    """PgBouncer in transaction mode before ``target_url``: two PostgreSQL sessions, no
    startup parameter ignored (one the server sent would be refused)."""
    async with pgbouncer(
        target_url, "transaction", pool_size=2, ignore_startup_parameters=()
    ) as bouncer:
        yield bouncer


def transaction_mode(direct_url: str) -> dict[str, Any]:
    """The settings of a server behind a transaction pooler."""
    return {"database_pool_mode": "transaction", "direct_database_url": direct_url}


async def refused_start(tmp_path: Path, env: dict[str, str]) -> str:
    """Starts ``serve`` with ``env``; asserts it exits 2 in one line, no traceback; returns it."""
    server = await spawn_server(tmp_path, env)
    try:
        code = await server.wait_exit(REFUSED_WITHIN_S)
    finally:
        await server.kill()
    output = server.logs()
    assert code == 2, output  # a setting that can never work
    assert "Traceback" not in output, output
    assert output.count("\n") == 1, output
    return output


@pytest.mark.parametrize(("pool_mode_setting", "workers"), [("session", 1), ("transaction", 2)])
async def test_serve_behind_statement_pooling_exits_2_with_one_line(
    database_url: str, tmp_path: Path, pool_mode_setting: str, workers: int
) -> None:
    async with pgbouncer(database_url, "statement") as bouncer:
        # At WARNING, so the start's INFO lines stay out: what is left is the refusal.
        env = server_env(
            bouncer.url(database_url),
            log_level="WARNING",
            workers=workers,
            database_pool_mode=pool_mode_setting,
            direct_database_url=database_url,
        )
        output = await refused_start(tmp_path, env)
    for words in (
        "LEASEKEEPER_DATABASE_URL",
        "pooler in statement mode",
        "PgBouncer pool_mode=statement",
        "use PgBouncer pool_mode=session, or pool_mode=transaction",
    ):
        assert words in output, output


@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_in_session_mode_behind_transaction_pooling_exits_2_naming_the_settings(
    database_url: str, tmp_path: Path, workers: int
) -> None:
    async with transaction_pooler(database_url) as bouncer:
        env = server_env(bouncer.url(database_url), log_level="WARNING", workers=workers)
        output = await refused_start(tmp_path, env)
    for words in (
        "LEASEKEEPER_DATABASE_URL",
        "pooler in transaction mode",
        "PgBouncer pool_mode=transaction",
        "set LEASEKEEPER_DATABASE_POOL_MODE=transaction and LEASEKEEPER_DIRECT_DATABASE_URL",
        "or use PgBouncer pool_mode=session",
    ):
        assert words in output, output


async def test_transaction_mode_without_the_direct_url_exits_2_naming_it(
    database_url: str, tmp_path: Path
) -> None:
    async with transaction_pooler(database_url) as bouncer:
        env = server_env(bouncer.url(database_url), database_pool_mode="transaction", workers=2)
        output = await refused_start(tmp_path, env)
    assert "LEASEKEEPER_DIRECT_DATABASE_URL: required when" in output, output
    assert "LEASEKEEPER_DATABASE_POOL_MODE=transaction" in output, output


async def test_a_direct_url_through_a_transaction_pooler_exits_2_naming_it(
    database_url: str, tmp_path: Path
) -> None:
    async with transaction_pooler(database_url) as bouncer:
        url = bouncer.url(database_url)
        env = server_env(url, log_level="WARNING", **transaction_mode(url))
        output = await refused_start(tmp_path, env)
    assert output.startswith("leasekeeper: LEASEKEEPER_DIRECT_DATABASE_URL: "), output
    assert "the direct connection goes through a pooler in transaction mode" in output, output


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


@pytest.mark.parametrize("workers", [1, 2])
async def test_transaction_mode_serves_every_call_end_to_end(
    database_url: str, tmp_path: Path, namespace: str, workers: int
) -> None:
    async with transaction_pooler(database_url) as bouncer:
        url = bouncer.url(database_url)
        # The pooler does hand sessions out per transaction: what the start probes.
        with pytest.raises(TransactionPooling):
            await check_pool_mode(url, "session", 5.0)
        env = server_env(url, workers=workers, **transaction_mode(database_url))
        async with (
            server_process(tmp_path, env) as server,
            grpc.aio.insecure_channel(server.target) as channel,
        ):
            stub = rpc.LeaseServiceStub(channel)
            await revoke_is_pushed_to_the_heartbeat(stub, namespace)
            await effects_and_checkpoints(stub, namespace)
            await watch_sees_the_changes(stub, namespace)
            await many_calls_at_once(stub, namespace)
        assert "Traceback" not in server.logs(), server.logs()
        assert "prepared statement" not in server.logs(), server.logs()
        # The operator's commands go over the direct URL too.
        cli_env = {f"LEASEKEEPER_{k.upper()}": v for k, v in transaction_mode(database_url).items()}
        cli_env["LEASEKEEPER_DATABASE_URL"] = url
        for command in (("migrate",), ("limits", "list")):
            code, out, err = await run_cli(*command, env=cli_env)
            assert code == 0, (command, out, err)


async def revoke_is_pushed_to_the_heartbeat(stub: rpc.LeaseServiceStub, namespace: str) -> None:
    """A claim, a heartbeat stream's beats, and a revoke that ends the stream without a beat."""
    lease = await grant(stub, namespace, "beat", "w", ttl_s=TTL_S)
    call, first = await heartbeat_on(stub, lease)
    assert first.renewed
    for _ in range(3):
        await call.write(pb.HeartbeatRequest(ttl=dur(TTL_S)))
        assert (await call.read()).fence == lease.fence
    revoked = await stub.Revoke(
        pb.RevokeRequest(namespace=namespace, task_id="beat", reason="moved")
    )
    assert revoked.revoked
    # No beat is sent: only the notification (over the direct URL) can end the stream now.
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await asyncio.wait_for(call.read(), PUSHED_WITHIN_S)
    assert ended.value.code() == grpc.StatusCode.ABORTED, ended.value
    assert "LEASE_REVOKED" in str(ended.value), ended.value


async def effects_and_checkpoints(stub: rpc.LeaseServiceStub, namespace: str) -> None:
    """BeginEffect and CompleteEffect (the ledger's transactions), and both checkpoint paths."""
    lease = await grant(stub, namespace, "t", "w", ttl_s=TTL_S)
    assert (await begin(stub, namespace, lease.fence)).decision == PROCEED
    assert (await complete(stub, namespace, lease.fence)).state == SUCCEEDED
    again = await begin(stub, namespace, lease.fence)
    assert again.decision == ALREADY_APPLIED and again.effect.result == b"msg-1"

    saved = await stub.SaveCheckpoint(
        pb.SaveCheckpointRequest(
            namespace=namespace,
            task_id="t",
            owner_id="w",
            fence=lease.fence,
            checkpoint=pb.Checkpoint(version=1, data=b"step 1"),
        )
    )
    assert saved.checkpoint.version == 1
    call, _ = await heartbeat_on(stub, lease)
    await call.write(pb.HeartbeatRequest(checkpoint=pb.Checkpoint(version=2, data=b"step 2")))
    assert (await call.read()).checkpoint_version == 2
    await call.done_writing()
    await release(stub, namespace, "t", "w", lease.fence)
    claim = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="v", ttl=dur(TTL_S))
    )
    assert claim.acquired
    assert (claim.checkpoint.version, claim.checkpoint.data) == (2, b"step 2")


async def watch_sees_the_changes(stub: rpc.LeaseServiceStub, namespace: str) -> None:
    """A Watch stream gets its snapshot, then each change in commit order."""
    stream = stub.Watch(pb.WatchRequest(namespace=namespace, task_id="w"))
    assert (await asyncio.wait_for(stream.read(), PUSHED_WITHIN_S)).type == (
        T.TASK_EVENT_TYPE_SNAPSHOT
    )
    lease = await grant(stub, namespace, "w", "a", ttl_s=TTL_S)
    await release(stub, namespace, "w", "a", lease.fence)
    kinds = [(await asyncio.wait_for(stream.read(), PUSHED_WITHIN_S)).type for _ in range(2)]
    assert kinds == [T.TASK_EVENT_TYPE_CLAIMED, T.TASK_EVENT_TYPE_RELEASED]
    stream.cancel()


async def many_calls_at_once(stub: rpc.LeaseServiceStub, namespace: str) -> None:
    """Claims, renewals and reads of 60 tasks at once: connections share the two sessions."""
    tasks = [f"many-{i}" for i in range(60)]
    leases = await asyncio.gather(*(grant(stub, namespace, t, "w", ttl_s=TTL_S) for t in tasks))
    renewed = await asyncio.gather(
        *(
            stub.Renew(
                pb.RenewRequest(
                    namespace=namespace, task_id=t, owner_id="w", fence=lease.fence, ttl=dur(TTL_S)
                )
            )
            for t, lease in zip(tasks, leases, strict=True)
        )
    )
    assert len(renewed) == len(tasks)
    gets = await asyncio.gather(
        *(stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id=t)) for t in tasks)
    )
    assert {g.lease.state for g in gets} == {pb.TASK_STATE_HELD}


async def test_transaction_mode_statements_keep_their_lock_timeout(
    database_url: str, namespace: str, db: asyncpg.Connection
) -> None:
    """A row held by another session: each kind of statement gives up after lock_timeout_s.

    PgBouncer passes no lock_timeout from the startup packet, so only the
    ``SET LOCAL`` of each transaction can make these LockNotAvailableError;
    without it each call would wait out its statement timeout (TimeoutError).
    """
    settings = {**transaction_mode(database_url), "lock_timeout_s": 0.3}
    async with (
        transaction_pooler(database_url) as bouncer,
        running_server(bouncer.url(database_url), statement_timeout_s=20.0, **settings) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        lease = await grant(stub, namespace, "t", "w", ttl_s=TTL_S)
        renew = pb.RenewRequest(
            namespace=namespace, task_id="t", owner_id="w", fence=lease.fence, ttl=dur(TTL_S)
        )
        calls = {
            # A batch (its own short lock timeout), then alone with lock_timeout_s.
            "Renew": lambda: stub.Renew(renew, timeout=10),
            # One statement alone.
            "Revoke": lambda: stub.Revoke(
                pb.RevokeRequest(namespace=namespace, task_id="t", reason="r"), timeout=10
            ),
            # The effect ledger's statement.
            "BeginEffect": lambda: begin(stub, namespace, lease.fence),
            # A claim in a namespace with a lease limit: a transaction of several statements.
            "Claim": lambda: stub.Claim(
                pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="x", ttl=dur(TTL_S)),
                timeout=10,
            ),
        }
        # Loaded by the server when told on the direct connection (or its refresh).
        await set_limits(server, db, namespace, max_leases=10)
        async with db.transaction():
            await db.execute(
                "SELECT 1 FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = $2 FOR UPDATE",
                namespace,
                "t",
            )
            for name, call in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await call()
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, (name, failed.value)
                assert "LockNotAvailableError" in (failed.value.details() or ""), (
                    name,
                    failed.value,
                )
        assert (await stub.Renew(renew, timeout=10)).lease.fence == lease.fence


async def health_of(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return reply.status


async def wait_health(target: str, wanted: dict[str, int]) -> None:
    async def all_as_wanted() -> bool:
        return all([await health_of(target, name) == status for name, status in wanted.items()])

    await poll(all_as_wanted, f"health {wanted}", 15.0, 0.05)


def health_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("leasekeeper_server.observability.health")
    ]


async def test_health_names_the_path_that_failed(
    database_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Cut the direct connection's path to PostgreSQL, then the pooler's: each is told apart."""
    caplog.set_level(logging.INFO, logger="leasekeeper_server")
    host, port = database_address(database_url)
    async with (
        tcp_proxy(host, port) as direct_path,
        tcp_proxy(host, port) as pooled_path,
        transaction_pooler(proxied(database_url, pooled_path.port)) as bouncer,
        running_server(
            bouncer.url(database_url),
            **transaction_mode(proxied(database_url, direct_path.port)),
            **QUICK_OUTAGE_SETTINGS,
        ) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        await wait_health(server.target, {"": SERVING, NOTIFICATIONS: SERVING})
        assert health_lines(caplog) == []

        await cut_and_restore(direct_path, server.target, NOTIFICATIONS, "")
        # Calls were decided all along: the pooled path was never cut.
        await grant(stub, namespace, "after-direct-cut", "w")
        down, back = health_lines(caplog)
        assert "lease notifications cannot be received" in down, down
        assert "notification connection (LEASEKEEPER_DIRECT_DATABASE_URL) is down" in down, down
        assert f"{NOTIFICATIONS} NOT_SERVING" in down and "calls are still decided" in down, down
        assert f"{NOTIFICATIONS} SERVING" in back, back

        caplog.clear()
        await cut_and_restore(pooled_path, server.target, "", NOTIFICATIONS)
        await grant(stub, namespace, "after-pooled-cut", "w")
        down, back = health_lines(caplog)
        assert "requests cannot be decided" in down, down
        assert "NOT_SERVING (the pooled statements, LEASEKEEPER_DATABASE_URL)" in down, down
        assert "health SERVING" in back, back


async def cut_and_restore(path: TcpProxy, target: str, failing: str, unaffected: str) -> None:
    """Cuts ``path``: ``failing`` turns NOT_SERVING while ``unaffected`` stays SERVING; restores."""
    path.cut()
    await wait_health(target, {failing: NOT_SERVING, unaffected: SERVING})
    path.restore()
    await wait_health(target, {failing: SERVING, unaffected: SERVING})
