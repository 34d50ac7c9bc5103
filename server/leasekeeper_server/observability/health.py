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

The log says when health changes, in one line, and while it stays
NOT_SERVING repeats it at most every ``REPEAT_S`` seconds with the count of
failed statements: never one line per failed statement.
"""

from __future__ import annotations

import asyncio
import logging
import time

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from leasekeeper_server.core.errors import DatabaseUnavailable, StatementsRefused
from leasekeeper_server.storage.outcomes import describe
from leasekeeper_server.storage.store import Store

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LIVENESS = "leasekeeper.liveness"
# While NOT_SERVING, the least time between two log lines, seconds.
REPEAT_S = 60.0


class HealthMonitor:
    """Keeps the health service in step with whether requests can be decided."""

    def __init__(self, store: Store, service_names: list[str], interval_s: float) -> None:
        self.servicer = health_aio.HealthServicer()
        self._store = store
        self._names = ["", *service_names]
        self._interval_s = interval_s
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
                "check (last: %s); health NOT_SERVING",
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
