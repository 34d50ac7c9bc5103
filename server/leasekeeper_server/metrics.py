"""The service's metrics (prometheus-client), on a registry of the server's own.

Each :class:`~leasekeeper_server.app.LeaseServer` owns one registry, so that
several servers in one process (the tests run many) never share a counter;
``serve_http`` exports it over HTTP for Prometheus (``LEASEKEEPER_METRICS_LISTEN``).

Effects (``leasekeeper_effects_total{event}``), one count per call outcome:

========================  ====================================================
event                     counted when
========================  ====================================================
begun                     BeginEffect passed validation and reached the ledger
proceed                   BeginEffect reserved an attempt
already_applied           BeginEffect found a confirmed outcome
in_doubt                  BeginEffect found an unconfirmed attempt (reconcile)
applied                   CompleteEffect recorded SUCCEEDED
failed                    CompleteEffect recorded FAILED
refused                   BeginEffect or CompleteEffect refused: a stale fence
                          (ABORTED) or a ledger conflict (FAILED_PRECONDITION)
========================  ====================================================
"""

from __future__ import annotations

import enum
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, start_http_server


class EffectEvent(enum.StrEnum):
    """What happened to an effect call; the ``event`` label."""

    BEGUN = "begun"
    PROCEED = "proceed"
    ALREADY_APPLIED = "already_applied"
    IN_DOUBT = "in_doubt"
    APPLIED = "applied"
    FAILED = "failed"
    REFUSED = "refused"


class Metrics:
    """The counters of one server.

    Args:
        registry: Where the metrics are registered; None for a new one.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._effects = Counter(
            "leasekeeper_effects",
            "Effect ledger calls by outcome (see leasekeeper_server.metrics).",
            ["event"],
            registry=self.registry,
        )
        for event in EffectEvent:  # every series exists from the start, at 0
            self._effects.labels(event.value)

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
