"""The gRPC health service, SERVING only while the database answers.

A monitor pings the database every ``health_interval_s``; both the overall
health ("") and ``leasekeeper.v1.LeaseService`` follow it (readiness: route
calls here only while the database answers). ``leasekeeper.liveness`` is
SERVING as long as the process serves, whatever the database does (liveness:
a database outage must not restart every replica). On shutdown the health
service enters graceful shutdown (NOT_SERVING, for good).
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from .errors import DatabaseUnavailable
from .store import Store

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LIVENESS = "leasekeeper.liveness"


class HealthMonitor:
    """Keeps the health service in step with the database."""

    def __init__(self, store: Store, service_names: list[str], interval_s: float) -> None:
        self.servicer = health_aio.HealthServicer()
        self._store = store
        self._names = ["", *service_names]
        self._interval_s = interval_s
        self._serving: bool | None = None
        self._task: asyncio.Task[None] | None = None

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
        try:
            await asyncio.wait_for(self._store.ping(), self._interval_s * 2 + 1)
            serving = True
        except (DatabaseUnavailable, TimeoutError) as exc:
            serving = False
            if self._serving is not False:
                log.warning("database unreachable; health NOT_SERVING: %s", exc)
        if serving == self._serving:
            return
        if serving and self._serving is False:
            log.info("database reachable again; health SERVING")
        self._serving = serving
        for name in self._names:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)
