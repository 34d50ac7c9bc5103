"""The service's metrics (prometheus-client), on a registry of the server's own.

Each :class:`~leasekeeper_server.app.LeaseServer` owns one registry, so that
several servers in one process (the tests run many) never share a counter;
``serve_http`` exports it over HTTP for Prometheus (``LEASEKEEPER_METRICS_LISTEN``).

The counts of calls are derived from each call's request, response and status
by the outermost server interceptor (``observe.py``), so the handlers stay free
of metric calls. The sweeper and the heartbeat loop report what only they see
through :meth:`Metrics.expired`, :meth:`Metrics.lost`, :meth:`Metrics.recovered`,
:meth:`Metrics.quarantined`, :meth:`Metrics.cancelled`, :meth:`Metrics.set_held`,
:meth:`Metrics.set_sweeper_leader` and :meth:`Metrics.loss_told`; the limits
cache through :meth:`Metrics.set_limits`.

The task events (``leases_expired``, ``leases_lost``, ``recovery_seconds``,
``tasks_quarantined``, ``tasks_cancelled``) are counted by the elected expiry
sweeper from the database's notifications (``storage/sweeper.py``): only the
leader exports them, so a sum over the replicas counts each event once.

Names and labels (every name has the ``leasekeeper_`` prefix; durations in
seconds; counters end in ``_total``):

==================================  =========================  ===============================
metric                              labels                     what
==================================  =========================  ===============================
rpc_duration_seconds (histogram)    method, code               unary LeaseService calls, from
                                                               the call's arrival to its answer
streams_total                       method, code               ended Heartbeat / Watch /
                                                               ValidateFences streams
heartbeat_streams_open (gauge)                                 Heartbeat streams now open
session_streams_open (gauge)                                   Session streams now open
watch_streams_open (gauge)                                     Watch streams now open
claims_total                        namespace, result          Claim answers: ``acquired``,
                                                               ``conflict`` (held by another:
                                                               acquired=false; this is the
                                                               claim-conflict count),
                                                               ``completed``,
                                                               ``quarantined``, ``cancelled``,
                                                               ``failed`` (FAILED_PRECONDITION
                                                               with that TASK_ reason),
                                                               ``limited``
                                                               (RESOURCE_EXHAUSTED), ``error``
                                                               (any other status; namespace
                                                               ``""``)
renewals_total                      method, result             method ``Renew``,
                                                               ``Heartbeat`` (a beat answered
                                                               with a renewal, and a stream
                                                               ended ABORTED) or ``Session``
                                                               (each lease an answer renewed,
                                                               each lease lost); result
                                                               ``ok`` / ``lost``
renewal_failures_total              method, reason             renewals answered ABORTED (a
                                                               Session lease lost), by
                                                               ErrorInfo reason
stale_fence_rejections_total        method, reason             fences refused: ValidateFence
                                                               valid=false (also an answer
                                                               on a ValidateFences stream);
                                                               Renew, Release,
                                                               Heartbeat, BeginEffect,
                                                               CompleteEffect ABORTED; a
                                                               Session lease lost
effects_total                       event                      effect ledger calls (below);
                                                               ``event="in_doubt"`` is the
                                                               reconciliation volume
leases_expired_total                namespace                  leases whose expire_time passed
                                                               unrenewed (expiry sweeper)
leases_lost_total                   namespace, reason          leases taken from their owner:
                                                               ``LEASE_EXPIRED``,
                                                               ``RUNTIME_EXCEEDED`` (an expiry
                                                               at the runtime budget's end),
                                                               ``LEASE_REVOKED``,
                                                               ``TASK_CANCELLED`` (a revoke or
                                                               cancel of a live lease; one
                                                               that had expired counts as
                                                               expired only) (expiry sweeper)
recovery_seconds (histogram)        namespace                  time in recovery: from a lease's
                                                               end (expiry, release, revoke) to
                                                               the task's next grant, lock delay
                                                               and quarantine included (expiry
                                                               sweeper)
tasks_quarantined_total             namespace                  tasks whose attempts were used up
                                                               (expiry sweeper)
tasks_cancelled_total               namespace                  tasks an operator cancelled
                                                               (expiry sweeper)
checkpoint_writes_total             namespace, method          checkpoints answered as stored:
                                                               ``SaveCheckpoint`` and
                                                               ``CompleteEffect`` (with
                                                               next_checkpoint) answered OK,
                                                               ``Heartbeat`` beats whose answer
                                                               has the version sent
checkpoint_bytes_total              namespace, method          the data bytes of those writes
leases_held (gauge)                 namespace                  live leases (expiry sweeper's
                                                               leader)
sweeper_leader (gauge)                                         1 while this server is the
                                                               elected expiry sweeper
loss_notice_seconds (histogram)                                from a lease's loss to its
                                                               heartbeat stream ending ABORTED
                                                               (or its session pushing it)
namespace_max_leases (gauge)        namespace                  the namespace's lease limit
namespace_claims_per_second (gauge) namespace                  its claim rate limit
namespace_lock_delay_seconds        namespace                  its lock delay
limit_rejections_total              namespace, reason          RESOURCE_EXHAUSTED answers:
                                                               LEASE_LIMIT, CLAIM_RATE_LIMIT
db_pool_connections (gauge)         state                      ``idle`` / ``in_use``
db_pool_max (gauge)                                            the pool's maximum size
db_statements_total                                            statements the pool's connections
                                                               sent to the database (each
                                                               BEGIN and COMMIT counts): the
                                                               database cost per call
==================================  =========================  ===============================

One name per concept: ``method`` is always the LeaseService method's gRPC
name (``Renew``, ``Heartbeat``, ``ValidateFence``, ...).

Label cardinality: ``namespace`` labels only values that passed validation
and reached the database (a granted, refused or limited claim; the sweeper's
and the limits' namespaces). Namespaces are chosen by operators and are few
per deployment; never are ``task_id`` or ``owner_id`` labels.

Effects (``leasekeeper_effects_total{event}``), one count per call outcome:

========================  ====================================================
event                     counted when
========================  ====================================================
begun                     BeginEffect passed validation and reached the ledger
                          (any answer but INVALID_ARGUMENT, UNAUTHENTICATED,
                          PERMISSION_DENIED)
proceed                   BeginEffect reserved an attempt
already_applied           BeginEffect found a confirmed outcome
in_doubt                  BeginEffect found an unconfirmed attempt (reconcile)
applied                   CompleteEffect recorded SUCCEEDED
failed                    CompleteEffect recorded FAILED
refused                   BeginEffect or CompleteEffect refused: a stale fence
                          (ABORTED) or a ledger conflict (FAILED_PRECONDITION)
========================  ====================================================

Every series whose labels are known in advance exists from the start, at 0.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterator, Mapping
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from leasekeeper_server.core.model import LossReason

PREFIX = "leasekeeper_"

LEASE_METHODS = (
    "Claim",
    "Renew",
    "Release",
    "ValidateFence",
    "Heartbeat",
    "Session",
    "GetLease",
    "ListLeases",
    "ListNamespaces",
    "GetNamespaceStats",
    "BeginEffect",
    "CompleteEffect",
    "ListEffects",
    "Revoke",
    "SaveCheckpoint",
    "Cancel",
    "Retry",
    "ListTaskHistory",
    "Watch",
    "ValidateFences",
)
STREAM_METHODS = ("Heartbeat", "Watch", "ValidateFences", "Session")
RENEWING_METHODS = ("Renew", "Heartbeat", "Session")
FENCED_METHODS = (
    "ValidateFence",
    "Renew",
    "Release",
    "Heartbeat",
    "Session",
    "BeginEffect",
    "CompleteEffect",
    "SaveCheckpoint",
)
LIMIT_REASONS = ("LEASE_LIMIT", "CLAIM_RATE_LIMIT")

# A database round trip is about a millisecond; a claim that waits (Claim.wait)
# may take as long as the call's deadline.
RPC_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
LOSS_NOTICE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# From a lock delay's fraction of a second to an operator's Retry hours later.
RECOVERY_BUCKETS_S = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
    14400.0,
)


class EffectEvent(enum.StrEnum):
    """What happened to an effect call; the ``event`` label."""

    BEGUN = "begun"
    PROCEED = "proceed"
    ALREADY_APPLIED = "already_applied"
    IN_DOUBT = "in_doubt"
    APPLIED = "applied"
    FAILED = "failed"
    REFUSED = "refused"


class ClaimResult(enum.StrEnum):
    """How a Claim call ended; the ``result`` label."""

    ACQUIRED = "acquired"
    CONFLICT = "conflict"
    COMPLETED = "completed"
    QUARANTINED = "quarantined"
    CANCELLED = "cancelled"
    FAILED = "failed"
    LIMITED = "limited"
    ERROR = "error"


class _NamespaceGauges(Collector):
    """Gauges by namespace whose whole set is replaced at once (no half-updated scrape)."""

    def __init__(self, specs: tuple[tuple[str, str], ...]) -> None:
        self._specs = specs  # (name, help) per value column
        self._values: Mapping[str, tuple[float | None, ...]] = {}

    def replace(self, values: Mapping[str, tuple[float | None, ...]]) -> None:
        self._values = dict(values)  # one reference swap: a scrape sees old or new

    def collect(self) -> Iterator[GaugeMetricFamily]:
        values = self._values
        for column, (name, help_text) in enumerate(self._specs):
            family = GaugeMetricFamily(name, help_text, labels=["namespace"])
            for namespace, row in sorted(values.items()):
                if row[column] is not None:
                    family.add_metric([namespace], float(row[column]))  # type: ignore[arg-type]
            yield family


class Metrics:
    """The metrics of one server. Thread-safe (prometheus-client's own locks).

    Args:
        registry: Where the metrics are registered; None for a new one.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self._effects = Counter(
            PREFIX + "effects",
            "Effect ledger calls by outcome; event=in_doubt is the reconciliation volume.",
            ["event"],
            registry=r,
        )
        self.rpc_duration = Histogram(
            PREFIX + "rpc_duration_seconds",
            "Unary LeaseService calls: time from arrival to answer (s), by method and code.",
            ["method", "code"],
            buckets=RPC_BUCKETS_S,
            registry=r,
        )
        self.streams = Counter(
            PREFIX + "streams",
            "Ended LeaseService streams (Heartbeat, Watch, ValidateFences) by method and code.",
            ["method", "code"],
            registry=r,
        )
        self.heartbeat_streams_open = Gauge(
            PREFIX + "heartbeat_streams_open", "Heartbeat streams now open.", registry=r
        )
        self.watch_streams_open = Gauge(
            PREFIX + "watch_streams_open", "Watch streams now open.", registry=r
        )
        self.session_streams_open = Gauge(
            PREFIX + "session_streams_open", "Session streams now open.", registry=r
        )
        self.claims = Counter(
            PREFIX + "claims",
            "Claim answers by namespace and result; result=conflict: held by another owner.",
            ["namespace", "result"],
            registry=r,
        )
        self.renewals = Counter(
            PREFIX + "renewals",
            "Renewals by method (Renew; Heartbeat: a stream's beats) and result (ok, lost).",
            ["method", "result"],
            registry=r,
        )
        self.renewal_failures = Counter(
            PREFIX + "renewal_failures",
            "Renewals answered ABORTED, by method and reason.",
            ["method", "reason"],
            registry=r,
        )
        self.stale_fence_rejections = Counter(
            PREFIX + "stale_fence_rejections",
            "Fences refused (ValidateFence valid=false, or ABORTED), by method and reason.",
            ["method", "reason"],
            registry=r,
        )
        self._expired = Counter(
            PREFIX + "leases_expired",
            "Leases whose expire_time passed without a renewal (expiry sweeper).",
            ["namespace"],
            registry=r,
        )
        self._lost = Counter(
            PREFIX + "leases_lost",
            "Leases taken from their owner, by reason: LEASE_EXPIRED, RUNTIME_EXCEEDED,"
            " LEASE_REVOKED, TASK_CANCELLED (expiry sweeper).",
            ["namespace", "reason"],
            registry=r,
        )
        self._recovery = Histogram(
            PREFIX + "recovery_seconds",
            "Time from a lease's end to its task's next grant (s) (expiry sweeper).",
            ["namespace"],
            buckets=RECOVERY_BUCKETS_S,
            registry=r,
        )
        self._quarantined = Counter(
            PREFIX + "tasks_quarantined",
            "Tasks whose attempts were used up: quarantined (expiry sweeper).",
            ["namespace"],
            registry=r,
        )
        self._cancelled = Counter(
            PREFIX + "tasks_cancelled",
            "Tasks an operator cancelled (expiry sweeper).",
            ["namespace"],
            registry=r,
        )
        self.checkpoint_writes = Counter(
            PREFIX + "checkpoint_writes",
            "Checkpoints answered as stored, by namespace and method.",
            ["namespace", "method"],
            registry=r,
        )
        self.checkpoint_bytes = Counter(
            PREFIX + "checkpoint_bytes",
            "Data bytes of the checkpoints answered as stored, by namespace and method.",
            ["namespace", "method"],
            registry=r,
        )
        self._sweeper_leader = Gauge(
            PREFIX + "sweeper_leader",
            "1 while this server is the elected expiry sweeper, else 0.",
            registry=r,
        )
        self._loss_notice = Histogram(
            PREFIX + "loss_notice_seconds",
            "Time from a lease's loss to its holder's stream telling it: Heartbeat, Session (s).",
            buckets=LOSS_NOTICE_BUCKETS_S,
            registry=r,
        )
        self._held = _NamespaceGauges(((PREFIX + "leases_held", "Live leases by namespace."),))
        self._limits = _NamespaceGauges(
            (
                (PREFIX + "namespace_max_leases", "The namespace's most live leases (limit)."),
                (
                    PREFIX + "namespace_claims_per_second",
                    "The namespace's claim rate limit (claims per second).",
                ),
                (
                    PREFIX + "namespace_lock_delay_seconds",
                    "How long an expired lease's task stays unclaimable (s).",
                ),
            )
        )
        r.register(self._held)
        r.register(self._limits)
        # Registered after the limit gauges, so a scrape (which collects in
        # registration order) reads the gauges first: set_limits creates a
        # namespace's rejection series before its gauges, so a scrape that
        # sees the gauges also sees the series.
        self.limit_rejections = Counter(
            PREFIX + "limit_rejections",
            "Calls refused RESOURCE_EXHAUSTED by a namespace limit, by reason.",
            ["namespace", "reason"],
            registry=r,
        )
        pool = Gauge(
            PREFIX + "db_pool_connections",
            "Database pool connections by state (idle, in_use).",
            ["state"],
            registry=r,
        )
        self._pool_idle = pool.labels("idle")
        self._pool_in_use = pool.labels("in_use")
        self._pool_max = Gauge(
            PREFIX + "db_pool_max", "The database pool's maximum size.", registry=r
        )
        self.db_statements = Counter(
            PREFIX + "db_statements",
            "Statements sent to the database by the pool's connections (BEGIN, COMMIT count).",
            registry=r,
        )

        # Every series whose labels are known exists from the start, at 0.
        for event in EffectEvent:
            self._effects.labels(event.value)
        for method in RENEWING_METHODS:
            for result in ("ok", "lost"):
                self.renewals.labels(method, result)
            for loss in LossReason:
                self.renewal_failures.labels(method, loss.value)
        for method in FENCED_METHODS:
            for loss in LossReason:
                self.stale_fence_rejections.labels(method, loss.value)
        for method in LEASE_METHODS:
            if method in STREAM_METHODS:
                self.streams.labels(method, "OK")
            else:
                self.rpc_duration.labels(method, "OK")

        self._http: tuple[WSGIServer, threading.Thread] | None = None

    def serve_http(self, listen: str) -> int:
        """Exports the registry at ``http://{listen}/metrics`` (prometheus-client's server).

        Args:
            listen: ``host:port``; port 0 picks a free port.

        Returns:
            The bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        host, _, port = listen.rpartition(":")
        httpd, thread = start_http_server(int(port), host.strip("[]"), registry=self.registry)
        self._http = (httpd, thread)
        return int(httpd.server_address[1])

    def stop_http(self) -> None:
        """Stops the metrics endpoint, if it runs. Idempotent."""
        if self._http is not None:
            httpd, thread = self._http
            self._http = None
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)

    def effect(self, event: EffectEvent) -> None:
        """Counts one effect event."""
        self._effects.labels(event.value).inc()

    def effects_count(self, event: EffectEvent | str) -> float:
        """The current count of one effect event."""
        labels = {"event": EffectEvent(event).value}
        value = self.registry.get_sample_value("leasekeeper_effects_total", labels)
        return value or 0.0

    def expired(self, namespace: str, count: int = 1) -> None:
        """Counts announced expiries, once each (``leases_expired_total``; the sweeper's leader).

        Args:
            namespace: The leases' namespace.
            count: How many leases expired (>= 0).
        """
        self._expired.labels(namespace).inc(count)

    def lost(self, namespace: str, reason: LossReason, count: int = 1) -> None:
        """Counts leases taken from their owner (``leases_lost_total``; the sweeper's leader).

        Args:
            namespace: The leases' namespace.
            reason: LEASE_EXPIRED, RUNTIME_EXCEEDED, LEASE_REVOKED or TASK_CANCELLED.
            count: How many leases (>= 0).
        """
        self._lost.labels(namespace, reason.value).inc(count)

    def recovered(self, namespace: str, seconds: float) -> None:
        """Observes a task's time in recovery (``recovery_seconds``; the sweeper's leader).

        Args:
            namespace: The task's namespace.
            seconds: From its last lease's end to its new grant (database
                clock); a negative value counts as 0.
        """
        self._recovery.labels(namespace).observe(max(0.0, seconds))

    def quarantined(self, namespace: str, count: int = 1) -> None:
        """Counts tasks whose attempts were used up (``tasks_quarantined_total``; the leader)."""
        self._quarantined.labels(namespace).inc(count)

    def cancelled(self, namespace: str, count: int = 1) -> None:
        """Counts tasks an operator cancelled (``tasks_cancelled_total``; the leader)."""
        self._cancelled.labels(namespace).inc(count)

    def checkpoint_written(self, namespace: str, method: str, size: int) -> None:
        """Counts one checkpoint answered as stored and its data bytes.

        Args:
            namespace: The task's namespace (it passed validation).
            method: SaveCheckpoint, CompleteEffect or Heartbeat.
            size: The checkpoint's data, bytes.
        """
        self.checkpoint_writes.labels(namespace, method).inc()
        self.checkpoint_bytes.labels(namespace, method).inc(size)

    def set_held(self, counts: Mapping[str, int]) -> None:
        """Replaces the whole set of ``leases_held`` series (the sweeper leader's count).

        Args:
            counts: Live leases by namespace; a namespace left out has no series.
        """
        self._held.replace({namespace: (n,) for namespace, n in counts.items()})

    def set_sweeper_leader(self, leader: bool) -> None:
        """Sets ``sweeper_leader`` to 1 while this server is the elected sweeper, else 0."""
        self._sweeper_leader.set(1 if leader else 0)

    def loss_told(self, seconds: float) -> None:
        """Observes the time from a lease's loss to its holder being told.

        Args:
            seconds: From the loss (the lease's expire_time, or the instant of
                the revoke, supersede or release, on the database clock) to the
                heartbeat stream ending ABORTED; a negative value counts as 0.
        """
        self._loss_notice.observe(max(0.0, seconds))

    def set_limits(self, limits: Mapping[str, tuple[int | None, float | None, float]]) -> None:
        """Replaces the limit gauges (``namespace_*``) with the namespaces' limits.

        Args:
            limits: By namespace, ``(max_leases, claims_per_second,
                lock_delay_s)``; None means unlimited and gives no series. A
                namespace left out has no series. Its ``limit_rejections_total``
                series are created at 0.
        """
        # The counters first: a scrape (another thread; it collects the gauges
        # before the counters, see __init__) that sees a namespace's limits
        # then also sees its rejection series.
        for namespace in limits:
            for reason in LIMIT_REASONS:
                self.limit_rejections.labels(namespace, reason)
        self._limits.replace(
            {ns: (max_leases, rate, delay_s) for ns, (max_leases, rate, delay_s) in limits.items()}
        )

    def watch_pool(self, size: Callable[[], int], idle: Callable[[], int], max_size: int) -> None:
        """Reads the database pool's state at each scrape.

        Args:
            size: Returns the pool's open connections.
            idle: Returns how many of them are idle.
            max_size: The pool's maximum size.
        """
        self._pool_idle.set_function(lambda: float(idle()))
        self._pool_in_use.set_function(lambda: float(size() - idle()))
        self._pool_max.set(max_size)
