"""The gRPC health service, SERVING only while requests can be decided.

Every ``health_interval_s`` the monitor checks: it sends one ping along the
requests' path (``Store.ping``: a pooled connection, a prepared statement,
and the write path of the tables calls write, changing nothing), and takes
the outcomes of the statements calls ran since its previous check
(``Store.outcomes``). **NOT_SERVING when the database refuses the ping
(StatementsRefused: a privilege taken, a read-only session), or when every
statement since the previous check failed** without deciding, the calls'
and an unanswered ping's alike (the database out of reach or too slow: see
``store.py``); SERVING otherwise. A refused ping is decisive because calls
that only read may still succeed while writes are refused; an unanswered one
is not, because on a loaded machine a ping may wait while calls are being
decided. The ping also judges an idle server: a server taken out of rotation
notices when it can serve again.

Both the overall health ("") and ``leasekeeper.v1.LeaseService`` follow it
(readiness: route calls here only while they can be decided).
``leasekeeper.liveness`` is SERVING as long as the process serves, whatever
the database does (liveness: a database outage must not restart every
replica). On shutdown the health service enters graceful shutdown
(NOT_SERVING, for good).

The database has two paths, each failing on its own (most plainly behind a
pooler in transaction mode: storage/pooling.py): the **pooled statements**
(``database_url``), which decide every call, and the **notification
connection** (``direct_database_url``, else ``database_url``: storage/events.py),
which pushes changes to heartbeat streams, waiting claims and Watch streams.
``leasekeeper.notifications`` follows the second: NOT_SERVING while it is
down. Readiness does not: calls are still decided, and a loss other than an
expiry (a revoke, a newer claim) is then found at the stream's next beat
instead of pushed; taking every replica out of rotation for it would turn a
slower loss notice into an outage.

The log says when either changes, in one line naming the path and why
(``...; health NOT_SERVING (the pooled statements, LEASEKEEPER_DATABASE_URL)``,
``lease notifications cannot be received: ...``), and while the statements
stay NOT_SERVING repeats it at most every ``REPEAT_S`` seconds with the count
of failed statements: never one line per failed statement.
"""

from __future__ import annotations

import asyncio
import logging
import time

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from leasekeeper_server.core.errors import DatabaseUnavailable, StatementsRefused
from leasekeeper_server.storage.events import LeaseEvents
from leasekeeper_server.storage.outcomes import describe
from leasekeeper_server.storage.store import Store

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LIVENESS = "leasekeeper.liveness"
NOTIFICATIONS = "leasekeeper.notifications"
# While NOT_SERVING, the least time between two log lines, seconds.
REPEAT_S = 60.0


class HealthMonitor:
    """Keeps the health service in step with whether requests can be decided."""

    def __init__(
        self,
        store: Store,
        service_names: list[str],
        interval_s: float,
        events: LeaseEvents | None = None,
        events_url: str = "LEASEKEEPER_DATABASE_URL",
    ) -> None:
        """A monitor, not yet started.

        Args:
            store: the pooled statements' path: its ping and its outcomes.
            service_names: the names besides "" that follow the statements.
            interval_s: the time between two checks, seconds.
            events: the notification connection, followed by
                ``leasekeeper.notifications``; None: that name is not served.
            events_url: the setting naming the notification connection's URL,
                for the log.
        """
        self.servicer = health_aio.HealthServicer()
        self._store = store
        self._names = ["", *service_names]
        self._interval_s = interval_s
        self._events = events
        self._events_url = events_url
        self._listening: bool | None = None
        self._serving: bool | None = None
        self._task: asyncio.Task[None] | None = None
        # While NOT_SERVING: statements failed since the last log line, and its time.
        self._failed_unlogged = 0
        self._logged_at = 0.0

    async def start(self) -> None:
        """Checks once now, then keeps checking in the background."""
        await self.servicer.set(LIVENESS, SERVING)
        await self._check()
        self._task = asyncio.create_task(self._run(), name="leasekeeper-health")

    async def shutdown(self) -> None:
        """NOT_SERVING from now on; stops checking."""
        if self._task is not None:
            self._task.cancel()
        await self.servicer.enter_graceful_shutdown()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self._check()

    async def _check(self) -> None:
        await self._check_notifications()
        refused = await self._ping()
        tally = self._store.outcomes.take()
        serving = refused is None and (tally.succeeded > 0 or tally.failed == 0)
        failed = tally.failed + (refused is not None)
        self._log(serving, failed, refused or tally.last_failure)
        if serving == self._serving:
            return
        self._serving = serving
        for name in self._names:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)

    async def _check_notifications(self) -> None:
        """``leasekeeper.notifications`` follows the notification connection (a line a change)."""
        if self._events is None:
            return
        listening = self._events.connected.is_set()
        if listening == self._listening:
            return
        if not listening:
            log.warning(
                "lease notifications cannot be received: the notification connection (%s) is "
                "down (last: %s); health %s NOT_SERVING (calls are still decided: losses other "
                "than an expiry reach heartbeat streams at their next beat, Watch streams wait)",
                self._events_url,
                self._events.failure,
                NOTIFICATIONS,
            )
        elif self._listening is not None:
            log.info(
                "lease notifications received again (%s); health %s SERVING",
                self._events_url,
                NOTIFICATIONS,
            )
        self._listening = listening
        await self.servicer.set(NOTIFICATIONS, SERVING if listening else NOT_SERVING)

    async def _ping(self) -> str | None:
        """Pings the database: why it refused (one line), else None.

        An unanswered ping is told to the store's outcomes as one failed
        statement, judged with the calls' (see the module docstring).
        """
        try:
            await asyncio.wait_for(self._store.ping(), self._interval_s * 2 + 1)
        except StatementsRefused as exc:
            return f"health ping: {describe(exc)}"
        except (DatabaseUnavailable, TimeoutError) as exc:
            self._store.outcomes.failure(exc)
        return None

    def _log(self, serving: bool, failed: int, last_failure: str) -> None:
        """One line when health changes; while NOT_SERVING, one every REPEAT_S at most."""
        now = time.monotonic()
        if serving:
            if self._serving is False:
                log.info("database statements succeed again; health SERVING")
            return
        self._failed_unlogged += failed
        if self._serving is not False:
            log.warning(
                "requests cannot be decided: %d database statement(s) failed since the last "
                "check (last: %s); health NOT_SERVING (the pooled statements, "
                "LEASEKEEPER_DATABASE_URL)",
                failed,
                last_failure,
            )
        elif now - self._logged_at >= REPEAT_S:
            log.warning(
                "health still NOT_SERVING: %d database statement(s) failed in the last %.0f s "
                "(last: %s)",
                self._failed_unlogged,
                now - self._logged_at,
                last_failure,
            )
        else:
            return
        self._failed_unlogged = 0
        self._logged_at = now
