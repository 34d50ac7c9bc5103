"""The composition root: wires settings, database, store, streams and the gRPC server.

Start-up order: check what the database URL leads to against the pool mode
(pooling.py: no statement-mode pooler; a transaction-mode one only in transaction mode) and
that the direct URL keeps its session, migrate (over the direct URL), open the pools, listen
for lease notifications (over the direct URL), serve. Shutdown (SIGTERM/SIGINT) order:
health NOT_SERVING, set the server-wide shutdown signal (``LeaseServer.shutdown``, the one
every long call waits on: Heartbeat and Watch streams and waiting claims end UNAVAILABLE,
the leases live on in the database), stop taking calls and let unary calls finish within
the grace period, close the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from leasekeeper_server.core.errors import DatabaseUnavailable
from leasekeeper_server.core.limits import LimitsCache
from leasekeeper_server.observability import tracing
from leasekeeper_server.observability.audit import Audit
from leasekeeper_server.observability.health import HealthMonitor
from leasekeeper_server.observability.metrics import Metrics
from leasekeeper_server.observability.observe import ObserveInterceptor
from leasekeeper_server.rpc.heartbeat import HeartbeatService
from leasekeeper_server.rpc.paging import PageTokens
from leasekeeper_server.rpc.service import SERVICE_NAME
from leasekeeper_server.rpc.servicer import LeaseServicer, method_handlers
from leasekeeper_server.rpc.session import SessionService
from leasekeeper_server.rpc.validate_stream import ValidateFencesService
from leasekeeper_server.rpc.watch import WatchService
from leasekeeper_server.security.authenticator import Authenticator
from leasekeeper_server.security.interceptor import AuthInterceptor
from leasekeeper_server.security.mode import auth_enabled, log_startup
from leasekeeper_server.security.tls import CertificateFiles, TlsFiles
from leasekeeper_server.security.token_file import TokenFile
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage.embedded import EmbeddedPostgres
from leasekeeper_server.storage.events import LeaseEvents
from leasekeeper_server.storage.ledger import EffectLedger
from leasekeeper_server.storage.migrate import migrate
from leasekeeper_server.storage.pooling import check_direct, check_pool_mode, direct_connection
from leasekeeper_server.storage.pruner import HistoryPruner
from leasekeeper_server.storage.store import Store
from leasekeeper_server.storage.sweeper import ExpirySweeper

log = logging.getLogger(__name__)

PENDING_CALLS_MAX = 10_000
"""New calls that may wait in gRPC core for the service to take them (per server process).

grpc.aio takes calls from gRPC core one at a time, so a burst of calls (2,000
Claims fired at once on one channel) waits there. gRPC's defaults
(``grpc.server.max_pending_requests`` 1,000, ``..._hard_limit`` 3,000) cancel a
random share of the calls past 1,000 waiting, and every one past 3,000: the
client sees CANCELLED, as if it had cancelled them itself, from a call the
service never saw. With both at this bound a burst up to it waits instead
(within the client's deadline, and at most 30 s, gRPC's
``grpc.server_max_unrequested_time_in_server``); a call past it is still CANCELLED.
4,000 Claims fired at once raised a server's peak memory by about 60 MB.
"""

SERVER_OPTIONS = (
    # Let clients probe idle connections (up to a ping a second), so they find a dead server fast.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    # A burst of new calls waits for the service rather than ending CANCELLED (PENDING_CALLS_MAX).
    ("grpc.server.max_pending_requests", PENDING_CALLS_MAX),
    ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS_MAX),
)


def keepalive_options(settings: Settings) -> tuple[tuple[str, int], ...]:
    """The server's pings: a dead or cut-off client is dropped within keepalive_time_s + timeout_s.

    gRPC core waits for a ping's ack for ``grpc.http2.ping_timeout_ms`` (60 s
    when unset), not for ``grpc.keepalive_timeout_ms``: without the former, a
    black-holed connection stayed open 70 s with a 10 s + 5 s promise. The
    latter still sets TCP_USER_TIMEOUT on the accepted sockets (Linux): data
    unacknowledged that long by the client's kernel closes the connection too.
    """
    timeout_ms = round(settings.keepalive_timeout_s * 1000)
    return (
        ("grpc.keepalive_time_ms", round(settings.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
    )


def server_options(settings: Settings) -> tuple[tuple[str, int], ...]:
    """SERVER_OPTIONS, the keepalive options, and ``grpc.so_reuseport``.

    ``grpc.so_reuseport`` is 1 in one of several workers, else 0: two
    unrelated servers on one port would split clients silently, so a lone
    server fails on a taken port; ``serve --workers N`` shares it on purpose.
    """
    reuseport = ("grpc.so_reuseport", 1 if settings.workers > 1 else 0)
    return (reuseport, *SERVER_OPTIONS, *keepalive_options(settings))


def resolve_database(settings: Settings) -> tuple[str, EmbeddedPostgres | None]:
    """The database URL to use, starting the embedded PostgreSQL when none is set."""
    if settings.database_url:
        return settings.database_url, None
    embedded = EmbeddedPostgres(settings.data_dir)
    return embedded.start(), embedded


def direct_database(settings: Settings, dsn: str) -> str:
    """The URL of connections that keep their session: ``direct_database_url``, else ``dsn``.

    The notification listener, the sweeper's election, the migrations and the
    ``tokens`` and ``limits`` commands connect there (pooling.py).
    """
    return settings.direct_database_url or dsn


async def prepare_database(dsn: str, settings: Settings) -> None:
    """Refuses a pooler that cannot work in the pool mode (pooling.py), then applies the migrations.

    Before migrating: a pooler in the wrong mode is said in one line rather
    than found by a migration that fails. Run by every LeaseServer's start, and
    once by the ``serve --workers`` supervisor before its workers.

    Args:
        dsn: The PostgreSQL URL (``database_url``, or the embedded PostgreSQL's).
        settings: The pool mode, the direct URL, and the probes' longest wait
            (``connect_timeout_s``).

    Raises:
        DatabaseUnavailable: the database cannot be reached.
        TransactionPooling: (a DatabaseRefused) the URL leads to a pooler in
            statement mode, or in transaction mode while the pool mode is session.
        DirectDatabaseRefused: (a DatabaseRefused) the direct URL is refused
            for good, or does not keep its session.
        DatabaseRefused: the database refuses the connection for good.
    """
    await check_pool_mode(dsn, settings.database_pool_mode, settings.connect_timeout_s)
    direct = settings.direct_database_url
    if direct is None:  # database_url keeps its session: the probe said so
        await migrate(dsn)
        return
    await check_direct(direct, settings.connect_timeout_s)
    with direct_connection():
        await migrate(direct)


class LeaseServer:
    """One leasekeeper server process's service, on one database."""

    def __init__(
        self, settings: Settings, database_url: str, tracer_provider: Any | None = None
    ) -> None:
        """A server, not yet started.

        Args:
            settings: The service's settings.
            database_url: The PostgreSQL URL.
            tracer_provider: An OpenTelemetry tracer provider for a span per call
                and per SQL statement; None: the OTLP exporter of
                ``settings.otlp_endpoint`` when set (shut down with the server),
                else no tracing.
        """
        self.settings = settings
        self._dsn = database_url
        self._direct_dsn = direct_database(settings, database_url)
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._store: Store | None = None
        self._events: LeaseEvents | None = None
        self._health: HealthMonitor | None = None
        self.heartbeats: HeartbeatService | None = None
        self.sessions: SessionService | None = None
        self.validations: ValidateFencesService | None = None
        self.watches: WatchService | None = None
        self.sweeper: ExpirySweeper | None = None
        self.pruner: HistoryPruner | None = None
        self.limits = LimitsCache()
        self._limits_task: asyncio.Task[None] | None = None
        self._limits_changed = asyncio.Event()
        self.metrics = Metrics()
        # Owned here, set once by stop(): ends every stream and waiting claim.
        self.shutdown = asyncio.Event()
        self._owned_tracer_provider = (
            tracing.provider_from_settings(settings) if tracer_provider is None else None
        )
        self._tracer_provider = tracer_provider or self._owned_tracer_provider
        self.metrics_port: int | None = None
        self.health_port: int | None = None
        self._health_server: grpc.aio.Server | None = None
        self.authenticator: Authenticator | None = None
        self.certificates: CertificateFiles | None = None

    async def start(self) -> int:
        """Migrates the schema and starts serving; returns the bound port.

        Raises:
            DatabaseUnavailable: the database cannot be reached.
            RuntimeError: the listen address cannot be bound.
            ValueError: the token file or the TLS files cannot be loaded.
            TransactionPooling: (a DatabaseRefused) the database URL leads to
                a pooler in statement mode, or in transaction mode while the
                pool mode is session.
            DirectDatabaseRefused: (a DatabaseRefused) the direct URL is
                refused for good, or does not keep its session.
        """
        s = self.settings
        # Files first: a bad token file or certificate fails the start at once.
        tls_files = TlsFiles.from_settings(s)
        self.certificates = CertificateFiles(tls_files) if tls_files else None
        token_file = TokenFile(s.tokens_file) if auth_enabled(s) and s.tokens_file else None
        log_startup(s, tls=tls_files is not None)
        await prepare_database(self._dsn, s)
        self._store = store = await Store.open(self._dsn, s, self.metrics.db_statements.inc)
        page_tokens = PageTokens(await store.page_token_key())
        self._events = LeaseEvents(self._direct_dsn, s.health_interval_s, s.connect_timeout_s)
        await self._events.start()
        self.heartbeats = HeartbeatService(
            store, self._events, s, self.metrics, shutdown=self.shutdown
        )
        self.sessions = SessionService(store, self._events, s, self.metrics, shutdown=self.shutdown)
        self.validations = ValidateFencesService(store, s, shutdown=self.shutdown)
        self.watches = WatchService(store, self._events, s, shutdown=self.shutdown)
        await self._load_limits()
        self._events.on_config(self._on_config_change)
        self._limits_task = asyncio.create_task(self._refresh_limits(), name="leasekeeper-limits")
        self.sweeper = ExpirySweeper(self._direct_dsn, store, self.metrics, s, self._events)
        self.pruner = HistoryPruner(store, s)
        self._health = HealthMonitor(
            store,
            [SERVICE_NAME],
            s.health_interval_s,
            self._events,
            f"LEASEKEEPER_{'DIRECT_' if s.direct_database_url else ''}DATABASE_URL",
        )

        pool = store.pool  # read-only gauges of the pool's state
        self.metrics.watch_pool(pool.get_size, pool.get_idle_size, pool.get_max_size())
        # First in the list, so outermost: it also sees the calls auth refuses.
        interceptors: list[grpc.aio.ServerInterceptor] = [
            ObserveInterceptor(
                self.metrics,
                Audit(),
                tracing.RpcTracing(self._tracer_provider) if self._tracer_provider else None,
            )
        ]
        if auth_enabled(s):
            # Last in the list: interceptors before it (metrics) see its refusals too.
            self.authenticator = Authenticator(
                store.transaction, token_file, self._events.connected
            )
            self._events.on_config(self.authenticator.on_config_change)
            interceptors.append(AuthInterceptor(self.authenticator))
        server = grpc.aio.server(options=server_options(s), interceptors=interceptors)
        server.add_generic_rpc_handlers(
            (
                method_handlers(
                    LeaseServicer(
                        store,
                        EffectLedger(store),
                        self.heartbeats,
                        s,
                        events=self._events,
                        limits=self.limits,
                        watches=self.watches,
                        page_tokens=page_tokens,
                        shutdown=self.shutdown,
                        sessions=self.sessions,
                        validations=self.validations,
                    )
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
            if self.certificates is not None:
                self.port = server.add_secure_port(s.listen, self.certificates.credentials())
                log.info(
                    "TLS on %s (certificate %s; client certificates %s)",
                    s.listen,
                    s.tls_cert_file,
                    f"required, signed by {s.tls_client_ca_file}"
                    if s.tls_client_ca_file
                    else "not asked for",
                )
            else:
                self.port = server.add_insecure_port(s.listen)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {s.listen}: {exc}") from exc
        self._server = server
        await self._health.start()
        await server.start()
        self.sweeper.start()
        self.pruner.start()
        log.info("leasekeeper serving on %s (port %d)", s.listen, self.port)
        if s.health_listen:
            self.health_port = await self._serve_health_only(s.health_listen)
            log.info("plaintext health service on %s (port %d)", s.health_listen, self.health_port)
        if s.metrics_listen:
            self.metrics_port = self.metrics.serve_http(s.metrics_listen)
            log.info("metrics on http://%s/metrics (port %d)", s.metrics_listen, self.metrics_port)
        return self.port

    async def _serve_health_only(self, listen: str) -> int:
        """A second, plaintext port with only grpc.health.v1 (probes that cannot speak TLS)."""
        assert self._health is not None
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health.servicer, health_server)
        try:
            port: int = health_server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {listen}: {exc}") from exc
        await health_server.start()
        self._health_server = health_server
        return port

    def _on_config_change(self, payload: str) -> None:
        if payload in ("limits", "*"):
            self._limits_changed.set()

    async def _refresh_limits(self) -> None:
        """Reloads the namespace limits when they change, and every limits_refresh_s."""
        assert self._store is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._limits_changed.wait(), self.settings.limits_refresh_s)
            self._limits_changed.clear()
            try:
                await self._load_limits()
            except DatabaseUnavailable as exc:
                log.warning("namespace limits not reloaded: %s", exc)
                await asyncio.sleep(self.settings.health_interval_s)
                self._limits_changed.set()  # try again soon

    async def _load_limits(self) -> None:
        assert self._store is not None
        self.limits.replace(await self._store.load_limits())
        self.metrics.set_limits(
            {
                ns: (lim.max_leases, lim.claims_per_second, lim.lock_delay.total_seconds())
                for ns, lim in self.limits.all().items()
            }
        )

    async def wait(self) -> None:
        """Waits until the server stops."""
        assert self._server is not None
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains and stops: see the module docstring for the order."""
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        if self._health is not None:
            await self._health.shutdown()
        self.shutdown.set()
        if self.sweeper is not None:
            await self.sweeper.stop()
        if self.pruner is not None:
            await self.pruner.stop()
        if self._limits_task is not None:
            self._limits_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._limits_task
        if self._server is not None:
            await self._server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._events is not None:
            await self._events.stop()
        if self._store is not None:
            await self._store.close()
        self.metrics.stop_http()
        if self._owned_tracer_provider is not None:
            self._owned_tracer_provider.shutdown()
        log.info("leasekeeper stopped")
