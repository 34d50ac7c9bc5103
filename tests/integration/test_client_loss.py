"""A worker learns of its loss at once: hold(), complete() and renew() against a real server.

The worker reaches the server through the fault proxy (``tests/fault/proxy.py``):
a black hole makes a dead network, a downstream delay a late reply. What the
server saw is read from its metrics and the task's row, after a barrier call
on the same connection; timings are bounded far below the 10 s call timeout
the old behaviour waited for, and far above what a loaded machine adds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import grpc
import pytest

from leasekeeper import LeaseClient, LeaseError, LeaseInfo, LeaseLost
from leasekeeper._trust import default_safety_margin
from leasekeeper.lease import RELEASE_AFTER_LOSS_TIMEOUT_S
from tests.conftest import RunningServer
from tests.fault.proxy import TcpProxy, tcp_proxy
from tests.helpers import poll

pytestmark = [pytest.mark.timeout(60)]

# Well under the client's 10 s call timeout (what a loss report used to wait for), well
# over what a loaded machine adds to a trust deadline of about 1 s.
AT_ONCE_S = 3.0


def sample_sum(running: RunningServer, name: str, **labels: str) -> float:
    """The sum of the server's samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in running.server.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def heartbeat_streams_seen(running: RunningServer) -> float:
    """Heartbeat streams the server has opened: the ones still open and the ones ended."""
    return sample_sum(running, "leasekeeper_heartbeat_streams_open") + sample_sum(
        running, "leasekeeper_streams_total", method="Heartbeat"
    )


def async_value(probe: Callable[[], object]) -> Callable[[], Awaitable[object]]:
    """``probe`` (a plain function) as the coroutine function ``tests.helpers.poll`` awaits."""

    async def probed() -> object:
        return probe()

    return probed


def client_tasks() -> list[asyncio.Task[object]]:
    """The client's tasks in this loop: heartbeats and background releases."""
    prefixes = ("leasekeeper-heartbeat-", "leasekeeper-release-")
    return [task for task in asyncio.all_tasks() if task.get_name().startswith(prefixes)]


def heartbeat_renewals(running: RunningServer) -> float:
    return sample_sum(running, "leasekeeper_renewals_total", method="Heartbeat", result="ok")


async def row_state(db: asyncpg.Connection, namespace: str, task_id: str) -> tuple[str, int]:
    row = await db.fetchrow(
        "SELECT state, fence FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = $2",
        namespace,
        task_id,
    )
    assert row is not None
    return row["state"], row["fence"]


@pytest.fixture
async def proxy(server: RunningServer) -> AsyncIterator[TcpProxy]:
    async with tcp_proxy("127.0.0.1", server.port) as running:
        yield running


@pytest.fixture
async def client(proxy: TcpProxy, namespace: str) -> AsyncIterator[LeaseClient]:
    """A worker's client whose every byte goes through the proxy; warmed up (connected)."""
    async with LeaseClient(f"127.0.0.1:{proxy.port}", namespace=namespace) as worker:
        await worker.list_leases()
        yield worker


async def test_hold_trust_deadline_on_dead_network_raises_lease_lost_at_once(
    server, proxy, client, namespace
):
    ttl_s = 1.0
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t", ttl=ttl_s):
            await poll(async_value(lambda: heartbeat_renewals(server) >= 2), "beats renewed")
            proxy.black_hole()
            cut_at = time.monotonic()
            await asyncio.sleep(60)
    told_s = time.monotonic() - cut_at
    assert caught.value.reason == "LEASE_EXPIRED"
    # The trust deadline is at most ttl - margin after the black hole; the
    # release that may follow runs in the background, not in front of the error.
    assert told_s < AT_ONCE_S, f"LeaseLost {told_s:.1f} s after the network died"

    # No await since the error: the release the client owns has not even started.
    assert [task.get_name() for task in client_tasks()] == ["leasekeeper-release-t"]
    closing_at = time.monotonic()
    await client.close()
    closed_s = time.monotonic() - closing_at
    # close() gives the release its own short bound, never the call timeout.
    assert closed_s < RELEASE_AFTER_LOSS_TIMEOUT_S + AT_ONCE_S, closed_s
    assert client_tasks() == []  # nothing of the client outlives close()


async def test_hold_lost_lease_is_released_in_the_background(server, proxy, client, namespace, db):
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t", ttl=1.0):
            await poll(async_value(lambda: heartbeat_renewals(server) >= 1), "a beat renewed")
            proxy.black_hole("downstream")  # renewals go through, their answers never come
            await asyncio.sleep(60)
    assert caught.value.reason == "LEASE_EXPIRED"

    async def released() -> bool:
        return (await row_state(db, namespace, "t"))[0] == "released"

    await poll(released, "the lost lease released by the background release")


async def test_hold_grant_after_its_trust_deadline_raises_and_sends_nothing(
    server, proxy, client, namespace, db
):
    ttl_s, delay_s = 1.0, 2.0  # the grant's trust deadline is 0.9 s after the claim left
    proxy.delay(delay_s, "downstream")
    started = time.monotonic()
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t", ttl=ttl_s):
            pytest.fail("entered a lease whose trust deadline had passed")
    elapsed_s = time.monotonic() - started
    assert (caught.value.reason, caught.value.fence) == ("LEASE_EXPIRED", 1)
    # Raised on the late reply itself: any round trip after it would take another delay_s.
    assert elapsed_s < 2 * delay_s, f"LeaseLost {elapsed_s:.1f} s after the claim"

    await client.list_leases()  # a barrier: sent after anything hold() could have sent
    assert heartbeat_streams_seen(server) == 0
    assert sample_sum(server, "leasekeeper_rpc_duration_seconds_count", method="Release") == 0
    state, fence = await row_state(db, namespace, "t")
    assert fence == 1 and state != "released"  # never released


async def test_hold_runtime_budget_end_raises_runtime_exceeded(server, client):
    with pytest.raises(LeaseLost) as caught:
        # A runtime budget shorter than the ttl: the grant already ends at the budget.
        async with client.hold("t", ttl=5.0, max_runtime=1.0) as lease:
            assert lease.info.expire_time == lease.info.runtime_deadline
            await asyncio.sleep(60)
    assert caught.value.reason == "RUNTIME_EXCEEDED"


async def test_hold_heartbeat_interval_sets_the_cadence(server, client):
    # The default cadence (ttl / 3 = 10 s) would renew once in the poll's 15 s.
    async with client.hold("t", ttl=30.0, heartbeat_interval=0.2) as lease:
        await poll(async_value(lambda: heartbeat_renewals(server) >= 5), "five beats renewed")
        assert not lease.lost


async def test_renew_returns_send_time_and_remaining_ttl(server, client):
    granted = await client.claim("t", ttl=5.0)
    before = client.clock()
    renewed = await client.renew("t", granted.lease.fence, ttl=5.0)
    after = client.clock()
    assert isinstance(renewed, LeaseInfo)  # what renew() returned before: every field kept
    assert before <= renewed.send_time <= after
    assert 0 < renewed.remaining_ttl <= 5.0
    margin_s = default_safety_margin(5.0)
    expected = renewed.send_time + renewed.remaining_ttl - margin_s
    assert renewed.trust_deadline(margin_s) == pytest.approx(expected)


async def test_renew_on_dead_network_gives_up_at_the_trust_deadline(server, proxy, client):
    granted = await client.claim("t", ttl=1.0)
    assert granted.lease is not None
    trust_deadline = granted.send_time + granted.lease.remaining_ttl - default_safety_margin(1.0)
    proxy.black_hole()
    started = time.monotonic()
    with pytest.raises(LeaseLost) as caught:
        await client.renew("t", granted.lease.fence, trust_deadline=trust_deadline)
    assert caught.value.reason == "LEASE_EXPIRED"
    assert time.monotonic() - started < AT_ONCE_S  # not the 10 s call timeout

    with pytest.raises(LeaseLost):  # past the deadline: refused without sending
        await client.renew("t", granted.lease.fence, trust_deadline=trust_deadline)


async def test_complete_on_dead_network_gives_up_at_the_trust_deadline(
    server, proxy, client, namespace, db
):
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t", ttl=2.0) as lease:  # trusted for at most 1.8 s
            proxy.black_hole()
            started = time.monotonic()
            await lease.complete()  # sent while trusted: no answer ever comes
    told_s = time.monotonic() - started
    assert caught.value.reason == "LEASE_EXPIRED"
    assert told_s < AT_ONCE_S, f"LeaseLost {told_s:.1f} s after complete() was called"
    # Cut off by the trust deadline, not refused before sending: the call's error is the cause.
    assert isinstance(caught.value.__cause__, LeaseError)
    assert caught.value.__cause__.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert (await row_state(db, namespace, "t"))[0] != "completed"


async def test_a_revoke_right_after_the_claim_is_pushed_not_found_at_the_next_beat(
    server, namespace
):
    # The heartbeat subscribes to the task's changes before its first renewal: a revoke
    # committed between that renewal and the subscription used to reach the worker only
    # at its next beat (ttl/3 = 10 s here). Each round revokes as soon as hold() returns,
    # racing the stream's first message; every loss must arrive well before that beat.
    beat_s = 30.0 / 3
    async with (
        LeaseClient(server.target, namespace=namespace) as holder,
        LeaseClient(server.target, namespace=namespace) as operator,
    ):
        for round_ in range(10):
            task = f"revoked-at-once-{round_}"
            started = time.monotonic()
            with pytest.raises(LeaseLost) as lost:
                async with holder.hold(task, ttl=30.0):
                    await operator.revoke(task, reason="race the first beat")
                    await asyncio.sleep(2 * beat_s)  # cancelled by the pushed loss
            assert lost.value.reason == "LEASE_REVOKED"
            assert time.monotonic() - started < beat_s / 2, round_
