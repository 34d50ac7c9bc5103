"""The one wait of the long calls: the first of a change, shutdown, lost credentials or a timer.

A waiting Claim, a Heartbeat stream's watchdog and a Watch stream each sleep
until something may have changed for them, and each must also end at once
when the server begins to shut down or when the caller's token is revoked
while it waits. :func:`first_of` is that wait; it raises for the two endings,
so each caller only handles a change or its timer.

The caller owns the ``changed`` event and clears it after acting on it (a
Watch subscription clears its own when read). Nothing here reads a clock
to decide anything: the timer only schedules the caller's next look at the
database.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Collection
from typing import Any

from leasekeeper_server.core.errors import ShuttingDown
from leasekeeper_server.security import caller as auth

# Added to a timer set for an instant the database named (a lease's expiry, a
# task's retry_after), seconds: the look it schedules lands just after the
# instant the database will judge over, not just before it.
TIMER_SLACK_S = 0.02


class Woken(enum.Enum):
    """Why :func:`first_of` returned (shutdown and lost credentials raise instead)."""

    CHANGED = "changed"  # ``changed`` is set
    TIMEOUT = "timeout"  # ``timeout_s`` passed with nothing set


async def first_of(
    *,
    changed: asyncio.Event | None,
    shutdown: asyncio.Event,
    credentials: asyncio.Future[Any] | None,
    timeout_s: float | None,
    then: str,
) -> Woken:
    """Waits for the first of: ``changed`` set, ``shutdown`` set, ``credentials`` failed, a timer.

    Returns at once when one of them has already happened.

    Args:
        changed: Set when what the caller waits on may have changed; None for none.
        shutdown: The server-wide shutdown signal (set once, by the composition root).
        credentials: The call's credentials guard (:func:`guarding_credentials`);
            None for a call that has none.
        timeout_s: The longest wait, seconds; None waits without a timer.
        then: What the caller should do after a shutdown, for the error's
            message (``"claim again on a replica"``).

    Returns:
        CHANGED when ``changed`` is set (also when the timer ran out at the
        same moment), else TIMEOUT.

    Raises:
        ShuttingDown: the server is shutting down (UNAVAILABLE; the caller may
            go on on another replica). Checked first: a shutdown ends every wait.
        Unauthenticated: the caller's token was revoked or expired (UNAUTHENTICATED).
        PermissionDenied: it no longer covers the namespace (PERMISSION_DENIED).
    """
    if not _happened(changed, shutdown, credentials):
        # Events have no callbacks: a waiter task for each, cancelled after.
        waiters = [asyncio.ensure_future(shutdown.wait())]
        if changed is not None:
            waiters.append(asyncio.ensure_future(changed.wait()))
        watched: set[asyncio.Future[Any]] = set(waiters)
        if credentials is not None:
            watched.add(credentials)
        try:
            await asyncio.wait(watched, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
    if shutdown.is_set():
        raise ShuttingDown(f"server is shutting down; {then}")
    if credentials is not None and credentials.done():
        credentials.result()  # raises: the token was revoked, or no longer covers the namespace
    if changed is not None and changed.is_set():
        return Woken.CHANGED
    return Woken.TIMEOUT


def _happened(
    changed: asyncio.Event | None,
    shutdown: asyncio.Event,
    credentials: asyncio.Future[Any] | None,
) -> bool:
    return (
        shutdown.is_set()
        or (credentials is not None and credentials.done())
        or (changed is not None and changed.is_set())
    )


@contextlib.asynccontextmanager
async def guarding_credentials(
    namespace: str | Collection[str],
) -> AsyncIterator[asyncio.Future[Any]]:
    """The current call's credentials guard for ``namespace`` (or each of them), stopped on leaving.

    Yields:
        A future that fails when the call's token stops being valid for
        ``namespace`` (``security.caller.guard_credentials``); with
        authentication off, one that never completes. Pass it to
        :func:`first_of`.
    """
    credentials = auth.guard_credentials(namespace)
    try:
        yield credentials
    finally:
        credentials.cancel()
        # Collected, so a failure that raced the cancel is never logged as unretrieved.
        await asyncio.gather(credentials, return_exceptions=True)
