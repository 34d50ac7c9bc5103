"""A server killed and restarted on the same address: its workers resume at once.

A worker's heartbeat stream fails UNAVAILABLE when its server dies; the client
channel then reconnects with its own backoff (``CHANNEL_OPTIONS``) and the
heartbeat reopens its stream with its own (``_heartbeat.py``). With gRPC's
default reconnect backoff (1 s, x1.6, up to 120 s) the restarted server was
picked up seconds late, with a fraction of a second of trust left or none.
Here the worker must keep its lease across the outage and renew within
``RESUMED_WITHIN_S`` of the new server answering health.

Run with ``pytest -s`` to see the measured times.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from leasekeeper import HeldLease, LeaseClient
from tests.fault.processes import server_env, spawn_server
from tests.helpers import poll

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

RESUMED_WITHIN_S = 3.0  # first renewal after the new server answers health
STARTUP_TIMEOUT_S = 20.0


def trust_deadline(lease: HeldLease) -> float:
    """The lease's trust deadline on the monotonic clock."""
    return time.monotonic() + lease.remaining_s()


async def renewed(lease: HeldLease, deadline: float) -> bool:
    """True once a renewal moved the trust deadline past ``deadline``."""
    return trust_deadline(lease) > deadline + 0.5


# (ttl, seconds from the kill to starting the new server). The long outage lets
# gRPC's default reconnect backoff grow to a step of 10.5 s, which it would
# wait out (3-7 s late); the short one checks that a short ttl survives.
@pytest.mark.parametrize(
    ("ttl_s", "outage_s"), [(8.0, 3.0), (30.0, 20.0)], ids=["ttl8-outage3", "ttl30-outage20"]
)
async def test_worker_keeps_its_lease_across_a_server_restart_and_renews_soon_after(
    tmp_path: Path, database_url: str, namespace: str, ttl_s: float, outage_s: float
) -> None:
    env = server_env(database_url, min_ttl_s=0.1, health_interval_s=0.2)
    first = await spawn_server(tmp_path / "first", env)
    second = None
    try:
        await first.wait_serving(STARTUP_TIMEOUT_S)
        env["LEASEKEEPER_LISTEN"] = first.target  # the restart takes the same address
        async with (
            LeaseClient(first.target, namespace=namespace) as client,
            client.hold("t", ttl=ttl_s) as lease,
        ):
            # Kill just after a confirmed renewal: the whole trust window lies ahead.
            deadline = trust_deadline(lease)
            await poll(lambda: renewed(lease, deadline), "a renewal before the kill")
            await first.kill()
            killed = time.monotonic()
            await poll(
                lambda: asyncio.sleep(0, lease.renewal_error is not None),
                "the heartbeat hearing of the dead server",
            )
            await asyncio.sleep(max(0.0, killed + outage_s - time.monotonic()))  # the outage
            second = await spawn_server(tmp_path / "second", env)
            await second.wait_serving(STARTUP_TIMEOUT_S)
            answered = time.monotonic()
            left_s = lease.remaining_s()
            deadline = trust_deadline(lease)
            assert not lease.lost, lease.loss
            await poll(lambda: renewed(lease, deadline), "a renewal after the restart", ttl_s)
            resumed = time.monotonic()
            print(
                f"\nserver answered {answered - killed:.2f} s after the kill with "
                f"{left_s:.2f} s of trust left; renewed {resumed - answered:.2f} s later"
            )
            assert not lease.lost, lease.loss
            assert resumed - answered <= RESUMED_WITHIN_S
            assert lease.renewal_error is None
    finally:
        await first.kill()
        if second is not None:
            await second.kill()
