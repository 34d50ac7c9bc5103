"""Health follows whether requests can be decided, not whether ``SELECT 1`` answers.

The server runs as a role of its own; the test takes that role's privileges
on one table away (a real fault: every statement on it fails with a
permission error, while the connection and ``SELECT 1`` still work) while a
client keeps calling. Calls must end UNAVAILABLE at once, health must turn
NOT_SERVING with one log line, not one per failed statement, and SERVING
again once the privileges are back. Taking only the write privileges must
turn health too, while reads keep succeeding and while the server is idle:
the health check's ping takes the write path of both tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import running_server
from tests.fault.dburl import replaced
from tests.fault.processes import QUICK_OUTAGE_SETTINGS
from tests.helpers import dur, error_info, poll

pytestmark = [pytest.mark.timeout(30)]

SERVICE = pb.DESCRIPTOR.services_by_name["LeaseService"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A failing statement is answered within its own time; health follows within a
# few checks (health_interval_s 0.2 s). Slack for a loaded machine.
PROMPT_S = 2.0
HEALTH_WITHIN_S = 5.0
FAILED_CALLS = 30


@contextlib.asynccontextmanager
async def service_role(db: asyncpg.Connection) -> AsyncIterator[str]:
    """A login role with every privilege on the service's tables; dropped afterwards.

    CREATE on the schema: the server's migration step creates its bookkeeping
    table if missing.
    """
    role = f"leasekeeper_svc_{uuid.uuid4().hex[:10]}"
    await db.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        await db.execute(f'GRANT CREATE ON SCHEMA public TO "{role}"')
        for kind in ("TABLES", "SEQUENCES"):
            await db.execute(f'GRANT ALL ON ALL {kind} IN SCHEMA public TO "{role}"')
        yield role
    finally:
        await db.execute(f'DROP OWNED BY "{role}"')
        await db.execute(f'DROP ROLE "{role}"')


async def health(stub: health_pb2_grpc.HealthStub, service: str) -> int:
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)).status


async def wait_health(stub: health_pb2_grpc.HealthStub, wanted: int) -> None:
    async def both() -> bool:
        return all([await health(stub, s) == wanted for s in ("", SERVICE)])

    name = health_pb2.HealthCheckResponse.ServingStatus.Name(wanted)
    await poll(both, f"health {name}", HEALTH_WITHIN_S, 0.05)


async def serving_with_a_lease(
    channel: grpc.aio.Channel, namespace: str
) -> tuple[rpc.LeaseServiceStub, health_pb2_grpc.HealthStub, pb.GetLeaseRequest]:
    """Claims task "t" and checks health is SERVING; returns the stubs and a read of that lease."""
    stub = rpc.LeaseServiceStub(channel)
    health_stub = health_pb2_grpc.HealthStub(channel)
    await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="o", ttl=dur(30)), timeout=5
    )
    assert await health(health_stub, "") == SERVING
    return stub, health_stub, pb.GetLeaseRequest(namespace=namespace, task_id="t")


@contextlib.asynccontextmanager
async def calling(call: Callable[[], Awaitable[Any]]) -> AsyncIterator[list[grpc.StatusCode]]:
    """Keeps making ``call`` one after another; yields the status code of each failed one."""
    codes: list[grpc.StatusCode] = []

    async def loop() -> None:
        while True:
            try:
                await call()
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
            await asyncio.sleep(0.02)

    task = asyncio.create_task(loop())
    try:
        yield codes
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("table", ["leasekeeper_tasks", "leasekeeper_effects"])
async def test_health_not_serving_while_statements_fail_then_serving_again(
    database_url: str,
    db: asyncpg.Connection,
    namespace: str,
    table: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="leasekeeper_server")
    async with (
        service_role(db) as role,
        running_server(replaced(database_url, role=role), **QUICK_OUTAGE_SETTINGS) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        health_stub = health_pb2_grpc.HealthStub(channel)
        claim = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="o", ttl=dur(30))
        lease = (await stub.Claim(claim, timeout=5)).lease
        begin = pb.BeginEffectRequest(
            namespace=namespace,
            task_id="t",
            fence=lease.fence,
            effect_key="e",
            policy=pb.EFFECT_POLICY_ONCE,
        )
        # The call each table's statements serve: the effect ledger's, or a claim of a new task.
        claims = iter(range(10**6))

        def call() -> Awaitable[Any]:
            if table == "leasekeeper_effects":
                return stub.BeginEffect(begin, timeout=5)
            claim_other = pb.ClaimRequest(
                namespace=namespace, task_id=f"u{next(claims)}", owner_id="o", ttl=dur(30)
            )
            return stub.Claim(claim_other, timeout=5)

        await call()
        assert await health(health_stub, "") == SERVING
        caplog.clear()

        await db.execute(f'REVOKE ALL ON {table} FROM "{role}"')
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call()
        assert time.monotonic() - started < PROMPT_S
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        assert error_info(caught.value).reason == "DATABASE_UNAVAILABLE"

        async with calling(call) as failures:
            await wait_health(health_stub, NOT_SERVING)

            async def failed_enough() -> bool:
                return len(failures) >= FAILED_CALLS

            await poll(failed_enough, f"{FAILED_CALLS} calls failing", 10, 0.05)
            await db.execute(f'GRANT ALL ON {table} TO "{role}"')
            await wait_health(health_stub, SERVING)
        assert set(failures) == {grpc.StatusCode.UNAVAILABLE}
        await call()

    # One line when health turned, one when it came back: not one per failed statement.
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("leasekeeper_server.observability.health")
    ]
    assert len(lines) == 2, lines
    assert "NOT_SERVING" in lines[0] and "permission denied" in lines[0], lines
    assert "SERVING" in lines[1], lines
    # No failed statement is a bug: none is logged as an internal error (with its traceback).
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


async def test_health_not_serving_while_only_writes_are_refused_even_with_reads_and_idle(
    database_url: str,
    db: asyncpg.Connection,
    namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Reads succeed, every write is refused: no call can be decided, whatever reads answer.

    While reads keep running, and while the server then stays idle, health is
    NOT_SERVING (the ping takes the write path); SERVING once writes are granted back.
    """
    caplog.set_level(logging.INFO, logger="leasekeeper_server")
    async with (
        service_role(db) as role,
        running_server(replaced(database_url, role=role), **QUICK_OUTAGE_SETTINGS) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub, health_stub, inspect = await serving_with_a_lease(channel, namespace)

        await db.execute(f'REVOKE INSERT, UPDATE, DELETE ON leasekeeper_tasks FROM "{role}"')
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Claim(
                pb.ClaimRequest(namespace=namespace, task_id="u", owner_id="o", ttl=dur(30)),
                timeout=5,
            )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value

        async with calling(lambda: stub.GetLease(inspect, timeout=5)) as read_failures:
            await wait_health(health_stub, NOT_SERVING)
            # Several checks later, reads still succeeding: still NOT_SERVING.
            await _stays(health_stub, NOT_SERVING)
        assert not read_failures, read_failures
        # Idle: no call at all; still NOT_SERVING.
        await _stays(health_stub, NOT_SERVING)

        await db.execute(f'GRANT INSERT, UPDATE, DELETE ON leasekeeper_tasks TO "{role}"')
        await wait_health(health_stub, SERVING)
        await stub.Claim(
            pb.ClaimRequest(namespace=namespace, task_id="u", owner_id="o", ttl=dur(30)), timeout=5
        )
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("leasekeeper_server.observability.health")
    ]
    assert len(lines) == 2, lines
    assert "NOT_SERVING" in lines[0] and "permission denied" in lines[0], lines


# Health checks (health_interval_s 0.2 s) that must all keep a state: several
# pings, whatever the machine's load.
STAYS_CHECKS = 10


async def _stays(stub: health_pb2_grpc.HealthStub, wanted: int) -> None:
    """Health keeps ``wanted`` while the server's check runs STAYS_CHECKS times."""
    interval_s = QUICK_OUTAGE_SETTINGS["health_interval_s"]
    seen: list[int] = []
    loop = asyncio.get_running_loop()
    until = loop.time() + STAYS_CHECKS * interval_s
    while loop.time() < until:
        seen.append(await health(stub, ""))
        await asyncio.sleep(interval_s / 4)
    assert set(seen) == {wanted}, seen


async def test_health_serving_while_calls_succeed_and_the_ping_waits_on_a_lock(
    database_url: str, db: asyncpg.Connection, namespace: str
) -> None:
    """A ping left unanswered is one failed statement, not a verdict.

    An operator's lock on the effects table (SHARE: a non-concurrent CREATE
    INDEX takes it) holds the ping's write back until it times out, while
    calls that read keep being decided: health stays SERVING. On a loaded
    machine a slow ping is the same case.
    """
    async with (
        running_server(database_url, **QUICK_OUTAGE_SETTINGS) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub, health_stub, inspect = await serving_with_a_lease(channel, namespace)

        async with calling(lambda: stub.GetLease(inspect, timeout=5)) as read_failures:
            async with db.transaction():
                await db.execute("LOCK TABLE leasekeeper_effects IN SHARE MODE")
                await poll(
                    lambda: lock_waiters(db),
                    "the health ping waiting on the lock",
                    HEALTH_WITHIN_S,
                    0.02,
                )
                await _stays(health_stub, SERVING)
        assert not read_failures, read_failures


async def lock_waiters(db: asyncpg.Connection) -> bool:
    """Whether some session waits for a lock on leasekeeper_effects."""
    return bool(
        await db.fetchval(
            "SELECT count(*) FROM pg_locks"
            " WHERE NOT granted AND relation = 'leasekeeper_effects'::regclass"
        )
    )
