"""One LISTEN connection per server process, fanned out to heartbeat streams.

The database announces every change of ownership (a grant, a release, a
completion) on the channel ``leasekeeper_lease`` from a trigger on the task
table, whoever made the change. Each open heartbeat stream watches its task
here; a notification for the task wakes it, and the stream asks the database
whether its lease is still live. The notification is only a doorbell: the
decision is always a fresh read on the database clock.

While the listening connection is down, notifications may be lost, so every
watcher is woken when it comes back (and when it breaks) to check for itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import Iterator

import asyncpg

from .errors import DatabaseUnavailable
from .model import TaskKey
from .store import APPLICATION_NAME, translate_errors

log = logging.getLogger(__name__)

CHANNEL = "leasekeeper_lease"


class LeaseEvents:
    """Wakes the watchers of a task when its ownership changes."""

    def __init__(self, dsn: str, ping_interval_s: float, connect_timeout_s: float) -> None:
        self._dsn = dsn
        self._ping_interval_s = ping_interval_s
        self._connect_timeout_s = connect_timeout_s
        self._watchers: defaultdict[TaskKey, set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

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

    @contextlib.contextmanager
    def watch(self, key: TaskKey) -> Iterator[asyncio.Event]:
        """An event set whenever ``key``'s ownership may have changed; clear it after checking."""
        event = asyncio.Event()
        self._watchers[key].add(event)
        try:
            yield event
        finally:
            watchers = self._watchers.get(key)
            if watchers is not None:
                watchers.discard(event)
                if not watchers:
                    del self._watchers[key]

    def _wake_all(self) -> None:
        for events in self._watchers.values():
            for event in events:
                event.set()

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        try:
            data = json.loads(payload)
            key = TaskKey(data["namespace"], data["task_id"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignored a malformed %s notification", CHANNEL)
            return
        for event in self._watchers.get(key, ()):
            event.set()

    async def _run(self) -> None:
        backoff_s = 0.1
        while True:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except _LISTEN_ERRORS as exc:
                log.warning("lease notifications interrupted: %s", exc)
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


_LISTEN_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseUnavailable,
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)
