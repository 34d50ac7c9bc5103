"""The one wait of the long calls (rpc/waiting.py), without a server or a database.

A waiting Claim, a Heartbeat stream's watchdog and a Watch stream all wait
through ``first_of``: a change or the timer returns, a shutdown or lost
credentials raise, and nothing it started is left running.
"""

from __future__ import annotations

import asyncio

import pytest

from leasekeeper_server.core.errors import PermissionDenied, ShuttingDown
from leasekeeper_server.rpc.waiting import Woken, first_of, guarding_credentials


def events() -> tuple[asyncio.Event, asyncio.Event]:
    return asyncio.Event(), asyncio.Event()


async def test_a_change_wakes_the_wait() -> None:
    changed, shutdown = events()
    asyncio.get_running_loop().call_later(0.01, changed.set)
    woken = await first_of(
        changed=changed, shutdown=shutdown, credentials=None, timeout_s=5.0, then="x"
    )
    assert woken is Woken.CHANGED
    assert changed.is_set()  # the caller clears it after acting


async def test_the_timer_ends_the_wait() -> None:
    changed, shutdown = events()
    woken = await first_of(
        changed=changed, shutdown=shutdown, credentials=None, timeout_s=0.01, then="x"
    )
    assert woken is Woken.TIMEOUT


async def test_a_change_already_set_returns_at_once() -> None:
    changed, shutdown = events()
    changed.set()
    woken = await first_of(
        changed=changed, shutdown=shutdown, credentials=None, timeout_s=None, then="x"
    )
    assert woken is Woken.CHANGED


async def test_shutdown_raises_shutting_down_with_what_to_do_even_beside_a_change() -> None:
    changed, shutdown = events()
    asyncio.get_running_loop().call_later(0.01, shutdown.set)
    with pytest.raises(ShuttingDown, match="server is shutting down; watch again"):
        await first_of(
            changed=changed, shutdown=shutdown, credentials=None, timeout_s=None, then="watch again"
        )
    changed.set()
    with pytest.raises(ShuttingDown):
        await first_of(
            changed=changed, shutdown=shutdown, credentials=None, timeout_s=None, then="x"
        )


async def test_lost_credentials_raise_their_error() -> None:
    changed, shutdown = events()
    credentials: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(
        0.01, credentials.set_exception, PermissionDenied("no longer covers")
    )
    with pytest.raises(PermissionDenied, match="no longer covers"):
        await first_of(
            changed=changed, shutdown=shutdown, credentials=credentials, timeout_s=5.0, then="x"
        )


async def test_no_waiter_outlives_the_wait() -> None:
    changed, shutdown = events()
    before = asyncio.all_tasks()
    await first_of(changed=changed, shutdown=shutdown, credentials=None, timeout_s=0.01, then="x")
    await asyncio.sleep(0)  # the cancelled waiters finish
    assert asyncio.all_tasks() == before


async def test_the_credentials_guard_waits_forever_without_auth_and_stops_on_leaving() -> None:
    async with guarding_credentials("ns") as credentials:
        assert not credentials.done()
    assert credentials.cancelled()
