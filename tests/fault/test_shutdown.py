"""Graceful shutdown of a real ``leasekeeper serve`` process on SIGTERM and SIGINT.

The order promised in app.py: health NOT_SERVING, heartbeat streams end
UNAVAILABLE (their leases live on in the database), unary calls in flight
finish within the grace period, the process exits 0. A unary call is held in
flight by a row lock the test takes on its task; the test lets it go after the
signal, or never (then the grace period ends it).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.fault.processes import NOT_SERVING, SERVING, ServerProcess, server_env, server_process
from tests.helpers import dur, error_info, poll

pytestmark = [pytest.mark.timeout(45), pytest.mark.process]

GRACE_S = 2.0
SETTINGS = {
    "shutdown_grace_s": GRACE_S,
    "min_ttl_s": 0.1,
    "health_interval_s": 0.2,
    # The slow call waits on a row lock: let it wait longer than the grace period.
    "lock_timeout_s": 10,
    "statement_timeout_s": 10,
}
# Time for the interpreter to exit after the server stopped.
EXIT_SLACK_S = 3.0  # process teardown on a loaded 2-core machine


@pytest.fixture
async def lease_server(tmp_path: Path, database_url: str) -> AsyncIterator[ServerProcess]:
    async with server_process(tmp_path, server_env(database_url, **SETTINGS)) as server:
        yield server


async def held_row(db: asyncpg.Connection, namespace: str, task_id: str) -> tuple[object, ...]:
    row = await db.fetchrow(
        "SELECT owner_id, fence, state, expire_time > clock_timestamp() AS live"
        " FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = $2",
        namespace,
        task_id,
    )
    assert row is not None
    return tuple(row.values())


async def wait_blocked_on(db: asyncpg.Connection, within_s: float) -> None:
    """Waits until some session waits for a lock held by ``db``'s session."""

    async def blocked() -> int:
        return await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))"
        )

    await poll(blocked, "the slow call reached the row lock", within_s)


class Scene:
    """A heartbeat stream, a health watch and a slow Renew, all open on one server."""

    def __init__(self, server: ServerProcess, db: asyncpg.Connection, namespace: str) -> None:
        self.server = server
        self.db = db
        self.ns = namespace
        self.stop_beats = asyncio.Event()

    async def open(self, channel: grpc.aio.Channel) -> None:
        stub = rpc.LeaseServiceStub(channel)
        for task_id in ("beating", "slow"):
            claim = pb.ClaimRequest(namespace=self.ns, task_id=task_id, owner_id="a", ttl=dur(60))
            assert (await stub.Claim(claim, timeout=5)).lease.fence == 1

        self.watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=20
        )
        assert (await asyncio.wait_for(self.watch.read(), 5)).status == SERVING

        first = pb.HeartbeatRequest(
            namespace=self.ns, task_id="beating", owner_id="a", fence=1, ttl=dur(60)
        )

        async def beats() -> AsyncIterator[pb.HeartbeatRequest]:
            yield first
            await self.stop_beats.wait()

        self.heartbeat = stub.Heartbeat(beats(), timeout=20)
        assert (await asyncio.wait_for(self.heartbeat.read(), 5)).renewed

        # Hold the "slow" row so a Renew of it stays in flight.
        self.lock = self.db.transaction()
        await self.lock.start()
        await self.db.execute(
            "SELECT 1 FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = 'slow' FOR UPDATE",
            self.ns,
        )
        renew = pb.RenewRequest(
            namespace=self.ns, task_id="slow", owner_id="a", fence=1, ttl=dur(60)
        )
        self.slow_renew = asyncio.ensure_future(stub.Renew(renew, timeout=20))
        await wait_blocked_on(self.db, within_s=5)

    async def close(self) -> None:
        self.stop_beats.set()
        self.slow_renew.cancel()
        if self.lock is not None:
            await self.lock.rollback()
            self.lock = None

    async def expect_not_serving(self, within_s: float) -> None:
        async def next_status() -> int:
            while True:
                reply = await self.watch.read()
                assert reply is not grpc.aio.EOF, "health watch ended before NOT_SERVING"
                if reply.status != SERVING:
                    return reply.status

        assert await asyncio.wait_for(next_status(), within_s) == NOT_SERVING

    async def expect_heartbeat_unavailable(self, within_s: float) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            reply = await asyncio.wait_for(self.heartbeat.read(), within_s)
            pytest.fail(f"heartbeat went on after the signal: {reply}")
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        assert error_info(caught.value).reason == "SHUTTING_DOWN"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_shutdown_signal_drains_streams_finishes_calls_exits_zero(
    lease_server: ServerProcess, db: asyncpg.Connection, namespace: str, sig: int
) -> None:
    scene = Scene(lease_server, db, namespace)
    async with grpc.aio.insecure_channel(lease_server.target) as channel:
        try:
            await scene.open(channel)
            lease_server.send_signal(sig)
            signalled = time.monotonic()

            await scene.expect_not_serving(within_s=GRACE_S)
            scene.watch.cancel()  # an open Watch would hold the server for the whole grace
            await scene.expect_heartbeat_unavailable(within_s=GRACE_S)
            assert not scene.slow_renew.done(), "the slow call ended before its row was free"
            await scene.lock.commit()
            scene.lock = None
            renewed = await asyncio.wait_for(scene.slow_renew, GRACE_S)
            assert renewed.lease.fence == 1

            code = await lease_server.wait_exit(GRACE_S + EXIT_SLACK_S)
            took_s = time.monotonic() - signalled
        finally:
            await scene.close()
    assert code == 0, lease_server.logs()
    # Nothing left in flight once the slow call is answered: no need to sit out the grace.
    assert took_s < GRACE_S, f"exit took {took_s:.2f} s:\n{lease_server.logs()}"
    logs = lease_server.logs()
    assert "Traceback" not in logs and " ERROR " not in logs, logs
    for task_id in ("beating", "slow"):
        assert await held_row(db, namespace, task_id) == ("a", 1, "held", True), task_id


async def test_shutdown_call_outlasting_grace_is_cut_exit_zero(
    lease_server: ServerProcess, db: asyncpg.Connection, namespace: str
) -> None:
    scene = Scene(lease_server, db, namespace)
    async with grpc.aio.insecure_channel(lease_server.target) as channel:
        try:
            await scene.open(channel)
            lease_server.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await scene.expect_heartbeat_unavailable(within_s=GRACE_S)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(scene.slow_renew, GRACE_S + EXIT_SLACK_S)
            cut_after_s = time.monotonic() - signalled
            code = await lease_server.wait_exit(GRACE_S + EXIT_SLACK_S)
            took_s = time.monotonic() - signalled
        finally:
            await scene.close()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    assert GRACE_S - 0.2 < cut_after_s < GRACE_S + EXIT_SLACK_S, cut_after_s
    assert code == 0, lease_server.logs()
    assert took_s < GRACE_S + EXIT_SLACK_S, f"exit took {took_s:.2f} s:\n{lease_server.logs()}"
    assert await held_row(db, namespace, "beating") == ("a", 1, "held", True)
    assert await held_row(db, namespace, "slow") == ("a", 1, "held", True)
