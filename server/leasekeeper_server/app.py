"""The composition root: wires settings, database, store, streams and the gRPC server.

Start-up order: migrate, open the pool, listen for lease notifications,
serve. Shutdown (SIGTERM/SIGINT) order: health NOT_SERVING, end heartbeat
streams with UNAVAILABLE (their leases live on in the database), stop taking
calls and let unary calls finish within the grace period, close the database.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .embedded import EmbeddedPostgres
from .events import LeaseEvents
from .health import HealthMonitor
from .heartbeat import HeartbeatService
from .ledger import EffectLedger
from .metrics import Metrics
from .migrate import migrate
from .servicer import SERVICE_NAME, LeaseServicer, method_handlers
from .settings import Settings
from .store import Store

log = logging.getLogger(__name__)

SERVER_OPTIONS = (
    # Two servers on one port would split clients silently; fail instead.
    ("grpc.so_reuseport", 0),
    # Let clients probe idle connections, so a dead peer is found in seconds.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)


def resolve_database(settings: Settings) -> tuple[str, EmbeddedPostgres | None]:
    """The database URL to use, starting the embedded PostgreSQL when none is set."""
    if settings.database_url:
        return settings.database_url, None
    embedded = EmbeddedPostgres(settings.data_dir)
    return embedded.start(), embedded


class LeaseServer:
    """One leasekeeper server process's service, on one database."""

    def __init__(self, settings: Settings, database_url: str) -> None:
        self.settings = settings
        self._dsn = database_url
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._store: Store | None = None
        self._events: LeaseEvents | None = None
        self._health: HealthMonitor | None = None
        self.heartbeats: HeartbeatService | None = None
        self.metrics = Metrics()
        self.metrics_port: int | None = None

    async def start(self) -> int:
        """Migrates the schema and starts serving; returns the bound port.

        Raises:
            DatabaseUnavailable: the database cannot be reached.
            RuntimeError: the listen address cannot be bound.
        """
        s = self.settings
        await migrate(self._dsn)
        self._store = store = await Store.open(self._dsn, s)
        self._events = LeaseEvents(self._dsn, s.health_interval_s, s.connect_timeout_s)
        await self._events.start()
        self.heartbeats = HeartbeatService(store, self._events, s)
        self._health = HealthMonitor(store, [SERVICE_NAME], s.health_interval_s)

        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers(
            (
                method_handlers(
                    LeaseServicer(store, EffectLedger(store), self.heartbeats, self.metrics, s)
                ),
            )
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health.servicer, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        try:
            self.port = server.add_insecure_port(s.listen)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {s.listen}: {exc}") from exc
        self._server = server
        await self._health.start()
        await server.start()
        log.info("leasekeeper serving on %s (port %d)", s.listen, self.port)
        if s.metrics_listen:
            self.metrics_port = self.metrics.serve_http(s.metrics_listen)
            log.info("metrics on http://%s/metrics (port %d)", s.metrics_listen, self.metrics_port)
        return self.port

    async def wait(self) -> None:
        """Waits until the server stops."""
        assert self._server is not None
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains and stops: see the module docstring for the order."""
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        if self._health is not None:
            await self._health.shutdown()
        if self.heartbeats is not None:
            self.heartbeats.close()
        if self._server is not None:
            await self._server.stop(grace)
        if self._events is not None:
            await self._events.stop()
        if self._store is not None:
            await self._store.close()
        self.metrics.stop_http()
        log.info("leasekeeper stopped")
