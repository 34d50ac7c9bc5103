"""One LISTEN connection per server process, fanned out to streams and caches.

The database announces every change of ownership (a grant, a release, a
revoke, a completion, an expiry announced by the sweeper or by the change
that ended the expired lease first) on the channel
``leasekeeper_lease`` from a trigger on the task table, whoever made the
change, with the row as the change left it (migrations/0005_operations.sql).
Two kinds of listeners use it:

* heartbeat streams and waiting claims ``watch`` their task: a notification
  is only a doorbell, and the decision is always a fresh read on the database
  clock;
* Watch streams ``subscribe`` to a task or a namespace and receive the
  events themselves, in commit order.

Changes of tokens or limits arrive on ``leasekeeper_config``; callbacks
registered with ``on_config`` reload what they cache.

While the listening connection is down, notifications may be lost, so every
watcher is woken when it comes back (and when it breaks) to check for itself,
every subscription is told it has a gap, and every config callback runs.
``connected`` says whether it is up and ``failure`` why not (the health
service's ``leasekeeper.notifications``: observability/health.py).

The connection needs a PostgreSQL session of its own (LISTEN): the server
opens it on ``direct_database_url`` when set, never through a transaction
pooler (storage/pooling.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

import asyncpg

from leasekeeper_server.core.model import TaskKey
from leasekeeper_server.storage import driver_errors
from leasekeeper_server.storage.driver_errors import translate_errors
from leasekeeper_server.storage.outcomes import describe
from leasekeeper_server.storage.store import APPLICATION_NAME
from leasekeeper_server.storage.subscription import Doorbell, Fanout, Subscription

log = logging.getLogger(__name__)

CHANNEL = "leasekeeper_lease"
CONFIG_CHANNEL = "leasekeeper_config"


class LeaseEvents:
    """Wakes the watchers of a task when its ownership changes."""

    def __init__(self, dsn: str, ping_interval_s: float, connect_timeout_s: float) -> None:
        self._dsn = dsn
        self._ping_interval_s = ping_interval_s
        self._connect_timeout_s = connect_timeout_s
        self._fanout = Fanout()
        self._config_callbacks: list[Callable[[str], None]] = []
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        # Why the listening connection is not up (one line), while it is not.
        self.failure = "not connected yet"

    async def start(self) -> None:
        """Starts listening; returns once the first connection is up or has failed once."""
        self._task = asyncio.create_task(self._run(), name="leasekeeper-events")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.connected.wait(), self._connect_timeout_s)

    async def stop(self) -> None:
        """Stops listening."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def watch(self, key: TaskKey) -> contextlib.AbstractContextManager[asyncio.Event]:
        """An event set whenever ``key``'s ownership may have changed; clear it after checking."""
        return self._fanout.watch(key)

    def ring(self, key: TaskKey, bell: Doorbell) -> contextlib.AbstractContextManager[None]:
        """Calls ``bell.set()`` whenever ``key``'s ownership may have changed (``watch``'s bell)."""
        return self._fanout.ring(key, bell)

    def subscribe(
        self, namespace: str | None, task_id: str | None
    ) -> contextlib.AbstractContextManager[Subscription]:
        """The events of one task, of every task of a namespace (task_id None), or of all (both)."""
        return self._fanout.subscribe(namespace, task_id)

    def on_config(self, callback: Callable[[str], None]) -> None:
        """Calls ``callback(payload)`` on every config change ('tokens', 'limits', or '*').

        '*' means "anything may have changed" (after the listening connection
        came back). Callbacks run on the event loop and must not block.
        """
        self._config_callbacks.append(callback)

    def _wake_all(self) -> None:
        self._fanout.wake_all()
        self._config_changed("*")

    def _config_changed(self, payload: str) -> None:
        for callback in self._config_callbacks:
            try:
                callback(payload)
            except Exception:  # one cache's bug must not silence the others
                log.exception("config change callback failed")

    def _on_config(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        self._config_changed(payload)

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        try:
            data = json.loads(payload)
            key = TaskKey(data["namespace"], data["task_id"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignored a malformed %s notification", CHANNEL)
            return
        self._fanout.deliver(key, data if "event" in data else None)

    async def _run(self) -> None:
        backoff_s = 0.1
        while True:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except _LISTEN_ERRORS as exc:
                log.warning("lease notifications interrupted: %s", exc)
                self.failure = describe(exc)
            else:
                self.failure = "the listening connection closed"
            self.connected.clear()
            self._wake_all()
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)

    async def _listen(self) -> None:
        with translate_errors():
            conn = await asyncpg.connect(
                self._dsn,
                timeout=self._connect_timeout_s,
                server_settings={"application_name": f"{APPLICATION_NAME}-events"},
            )
        try:
            await conn.add_listener(CHANNEL, self._on_notify)
            await conn.add_listener(CONFIG_CHANNEL, self._on_config)
            self.failure = ""
            self.connected.set()
            self._wake_all()  # anything may have happened while we were away
            log.info("listening for lease notifications")
            while not conn.is_closed():
                await asyncio.sleep(self._ping_interval_s)
                # A black-holed connection never reports itself closed: ask.
                with translate_errors():
                    await conn.fetchval("SELECT 1", timeout=self._connect_timeout_s)
        finally:
            conn.terminate()


_LISTEN_ERRORS = driver_errors.BACKGROUND
