"""The database out of reach, through a TCP proxy: UNAVAILABLE, never a hang, never a loss.

An in-process server reaches PostgreSQL only through a proxy (``proxy.py``).
Cutting the proxy resets every connection (the database went away);
black-holing it swallows every byte without a reset (a partition). Either
way every call must end UNAVAILABLE with reason DATABASE_UNAVAILABLE within
the connect/statement timeouts, health must turn NOT_SERVING, and, once the
proxy forwards again, the same server must serve again, with the lease
granted before the outage still in the database under its fence.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import RunningServer, running_server
from tests.fault.dburl import database_address, proxied
from tests.fault.processes import QUICK_OUTAGE_SETTINGS
from tests.fault.proxy import TcpProxy, tcp_proxy
from tests.helpers import dur, error_info, poll

pytestmark = [pytest.mark.timeout(45)]

FAULTS = ["cut", "black_hole"]

FAST = QUICK_OUTAGE_SETTINGS
# The longest a call may take while the database is out of reach. Black-holed,
# a call waits for the driver's own statement timer (statement_timeout_s + 1,
# see Store.open), then asyncpg's pool waits up to the acquire timeout
# (connect_timeout_s) for the query's cancellation before it drops the
# connection. Plus slack for a loaded machine.
SLACK_S = 2.0
UNAVAILABLE_WITHIN_S = FAST["statement_timeout_s"] + 1 + FAST["connect_timeout_s"] + SLACK_S
# A silent heartbeat stream learns of the outage from the notification
# listener's ping (every health_interval_s, bounded by connect_timeout_s), then
# reads the database once, as above.
STREAM_UNAVAILABLE_WITHIN_S = (
    FAST["health_interval_s"] + FAST["connect_timeout_s"] + UNAVAILABLE_WITHIN_S
)
RECOVER_WITHIN_S = 10.0
SERVICE = pb.DESCRIPTOR.services_by_name["LeaseService"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Harness:
    """A server behind a proxy, a channel to it, and stubs."""

    def __init__(self, proxy: TcpProxy, server: RunningServer, channel: grpc.aio.Channel) -> None:
        self.proxy = proxy
        self.server = server
        self.stub = rpc.LeaseServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    async def health_status(self, service: str = "") -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        return (await self.health.Check(request, timeout=2)).status

    async def wait_health(self, wanted: int, within_s: float) -> None:
        """Polls health (overall and the lease service's) until both say ``wanted``."""

        async def both() -> bool:
            return all([await self.health_status(s) == wanted for s in ("", SERVICE)])

        name = health_pb2.HealthCheckResponse.ServingStatus.Name(wanted)
        await poll(both, f"health {name}", within_s=within_s, interval_s=0.05)


@pytest.fixture
async def harness(database_url: str, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Harness]:
    async with (
        tcp_proxy(*database_address(database_url)) as proxy,
        running_server(proxied(database_url, proxy.port), **FAST) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        yield Harness(proxy, server, channel)
    # An outage is expected, not a bug: nothing may be logged as an error (INTERNAL, leaks).
    records = [*caplog.get_records("setup"), *caplog.get_records("call"), *caplog.records]
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def expect_unavailable(call: Awaitable[Any]) -> float:
    """Awaits a call that must fail UNAVAILABLE/DATABASE_UNAVAILABLE; returns its duration."""
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    elapsed = time.monotonic() - start
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    assert error_info(caught.value).reason == "DATABASE_UNAVAILABLE"
    return elapsed


async def held_row(db: asyncpg.Connection, namespace: str, task_id: str) -> asyncpg.Record:
    row = await db.fetchrow(
        "SELECT owner_id, fence, state, expire_time > clock_timestamp() AS live"
        " FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = $2",
        namespace,
        task_id,
    )
    assert row is not None, "the task row is gone"
    return row


async def poll_until_ok(call: Callable[[], Awaitable[Any]], within_s: float) -> tuple[Any, float]:
    """Retries ``call`` on UNAVAILABLE until it succeeds; returns (reply, seconds taken)."""
    start = time.monotonic()

    async def answered() -> Any:
        try:
            return (await call(),)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return None

    (reply,) = await poll(answered, "an answer other than UNAVAILABLE", within_s, 0.1)
    return reply, time.monotonic() - start


@pytest.mark.parametrize("fault", FAULTS)
async def test_database_outage_calls_unavailable_then_same_server_recovers(
    harness: Harness, db: asyncpg.Connection, namespace: str, fault: str
) -> None:
    stub = harness.stub
    claim = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(60))
    granted = await stub.Claim(claim, timeout=5)
    assert granted.acquired and granted.lease.fence == 1
    assert await harness.health_status() == SERVING

    getattr(harness.proxy, fault)()

    other = pb.ClaimRequest(namespace=namespace, task_id="u", owner_id="b", ttl=dur(60))
    renew = pb.RenewRequest(namespace=namespace, task_id="t", owner_id="a", fence=1, ttl=dur(60))
    check = pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=1)
    durations = {
        "claim": await expect_unavailable(stub.Claim(other, timeout=15)),
        "renew": await expect_unavailable(stub.Renew(renew, timeout=15)),
        "validate": await expect_unavailable(stub.ValidateFence(check, timeout=15)),
    }
    assert max(durations.values()) < UNAVAILABLE_WITHIN_S, durations
    await harness.wait_health(NOT_SERVING, within_s=UNAVAILABLE_WITHIN_S)

    harness.proxy.restore()

    valid, _ = await poll_until_ok(
        lambda: stub.ValidateFence(check, timeout=5), within_s=RECOVER_WITHIN_S
    )
    assert valid.valid and valid.current_fence == 1, valid
    await harness.wait_health(SERVING, within_s=RECOVER_WITHIN_S)
    renewed = await stub.Renew(renew, timeout=5)
    assert renewed.lease.fence == 1
    assert (await stub.Claim(other, timeout=5)).acquired

    row = await held_row(db, namespace, "t")
    assert (row["owner_id"], row["fence"], row["state"], row["live"]) == ("a", 1, "held", True)


@pytest.mark.parametrize("fault", FAULTS)
async def test_heartbeat_database_lost_stream_ends_unavailable_lease_kept(
    harness: Harness, db: asyncpg.Connection, namespace: str, fault: str
) -> None:
    stub = harness.stub
    granted = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(30)), timeout=5
    )
    assert granted.acquired
    beats: asyncio.Queue[pb.HeartbeatRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.HeartbeatRequest]:
        while (message := await beats.get()) is not None:
            yield message

    call = stub.Heartbeat(requests(), timeout=20)
    await beats.put(
        pb.HeartbeatRequest(namespace=namespace, task_id="t", owner_id="a", fence=1, ttl=dur(30))
    )
    first = await asyncio.wait_for(call.read(), 5)
    assert first.fence == 1 and first.renewed

    getattr(harness.proxy, fault)()
    start = time.monotonic()
    # No further beat: the server must notice the loss by itself and end the stream.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        while (reply := await call.read()) is not grpc.aio.EOF:
            pytest.fail(f"unexpected reply while the database is out of reach: {reply}")
        pytest.fail(f"stream ended {await call.code()} instead of UNAVAILABLE")
    elapsed = time.monotonic() - start
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    assert error_info(caught.value).reason == "DATABASE_UNAVAILABLE"
    assert elapsed < STREAM_UNAVAILABLE_WITHIN_S, f"stream ended only after {elapsed:.2f} s"
    await beats.put(None)

    harness.proxy.restore()
    row = await held_row(db, namespace, "t")
    assert (row["owner_id"], row["fence"], row["state"], row["live"]) == ("a", 1, "held", True)
    valid, _ = await poll_until_ok(
        lambda: stub.ValidateFence(
            pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=1), timeout=5
        ),
        within_s=RECOVER_WITHIN_S,
    )
    assert valid.valid

    # The lease lived on: a new stream resumes it with the same fence.
    resumed = stub.Heartbeat(timeout=10)
    await resumed.write(
        pb.HeartbeatRequest(namespace=namespace, task_id="t", owner_id="a", fence=1, ttl=dur(30))
    )
    reply = await asyncio.wait_for(resumed.read(), 5)
    assert (reply.fence, reply.renewed) == (1, True)
    await resumed.done_writing()
    assert await asyncio.wait_for(resumed.read(), 5) is grpc.aio.EOF
    assert await resumed.code() == grpc.StatusCode.OK
