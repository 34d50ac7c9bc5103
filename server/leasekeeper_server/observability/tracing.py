"""OpenTelemetry tracing: a span per LeaseService call, with its SQL statements as children.

A server traces only when it is given a tracer provider (``LeaseServer(...,
tracer_provider=...)``) or ``LEASEKEEPER_OTLP_ENDPOINT`` names an OTLP/gRPC
collector; otherwise no tracing work is done per call.

Each call's span (kind SERVER, named ``leasekeeper.v1.LeaseService/<Method>``,
parented on the caller's W3C ``traceparent`` metadata when sent) carries
``rpc.system``, ``rpc.service``, ``rpc.method``, ``rpc.grpc.status_code`` and
the task's fields as the request and the response give them:
``leasekeeper.namespace``, ``leasekeeper.task_id``, ``leasekeeper.owner_id``,
``leasekeeper.fence``, ``leasekeeper.effect_key``,
``leasekeeper.external_operation_id`` (CompleteEffect),
``leasekeeper.checkpoint_version`` (the version sent, replaced by the one the
answer says is stored), and from the answer's lease ``leasekeeper.expire_time``
(RFC 3339, database clock), ``leasekeeper.attempts`` and
``leasekeeper.max_attempts`` (when the lease has a limit); plus
``leasekeeper.reason`` (the ErrorInfo reason) on errors,
``leasekeeper.acquired`` for Claim, ``leasekeeper.valid`` for ValidateFence,
``leasekeeper.revoked`` for Revoke, and ``leasekeeper.disposition``, how a
call answered OK left the task: ``released``, ``completed`` or ``failed``
for Release, ``cancelled`` for Cancel. Its status is ERROR only for the codes
that mean a server fault (as the OpenTelemetry gRPC conventions say); ABORTED
and the other outcomes a caller provoked leave it unset.

SQL spans come from ``opentelemetry-instrumentation-asyncpg``, which patches
asyncpg once per process. Its tracer is routed, through a context variable
set for the duration of each traced call, to the provider of the server that
serves the call: several servers in one process (the tests) each get their
own spans, and SQL outside a traced call (health pings, listeners, sweeps)
makes none.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.rpc.service import SERVICE_NAME
from leasekeeper_server.settings import Settings

SQL_SCOPE = "opentelemetry.instrumentation.asyncpg"

# The codes that mean the server failed (OpenTelemetry semantic conventions for gRPC servers).
_SERVER_FAULTS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

# How a call answered OK left its task (``leasekeeper.disposition``), by method and
# the answer's task state.
_DISPOSITIONS = {
    ("Release", pb.TASK_STATE_FREE): "released",
    ("Release", pb.TASK_STATE_COMPLETED): "completed",
    ("Release", pb.TASK_STATE_FAILED): "failed",
    ("Cancel", pb.TASK_STATE_CANCELLED): "cancelled",
}
# The fields of a request that may carry a checkpoint.
_CHECKPOINT_FIELDS = ("checkpoint", "next_checkpoint")

_sql_tracer: contextvars.ContextVar[trace.Tracer | None] = contextvars.ContextVar(
    "leasekeeper_sql_tracer", default=None
)
_NO_OP = trace.NoOpTracer()


class _CallTracer(trace.Tracer):
    """Starts SQL spans with the tracer of the call being served, or none."""

    def start_span(self, name: str, *args: Any, **kwargs: Any) -> trace.Span:
        tracer = _sql_tracer.get()
        if tracer is None:
            return trace.INVALID_SPAN
        return tracer.start_span(name, *args, **kwargs)

    @contextlib.contextmanager
    def start_as_current_span(  # type: ignore[override]
        self, name: str, *args: Any, **kwargs: Any
    ) -> Iterator[trace.Span]:
        tracer = _sql_tracer.get() or _NO_OP
        with tracer.start_as_current_span(name, *args, **kwargs) as span:
            yield span


class _CallTracerProvider(trace.TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return _CallTracer()


_instrumented = False
_instrument_lock = threading.Lock()


def instrument_sql() -> None:
    """Patches asyncpg once per process so traced calls get SQL child spans. Idempotent."""
    global _instrumented
    with _instrument_lock:
        if _instrumented:
            return
        from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor

        # opentelemetry-instrumentation-asyncpg leaves its constructor unannotated.
        AsyncPGInstrumentor().instrument(tracer_provider=_CallTracerProvider())  # type: ignore[no-untyped-call]
        _instrumented = True


def provider_from_settings(settings: Settings) -> Any | None:
    """An SDK tracer provider exporting to ``settings.otlp_endpoint``; None when unset.

    The caller owns the provider: ``shutdown()`` flushes and stops it.
    """
    if not settings.otlp_endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "leasekeeper"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(settings.otlp_endpoint)))
    return provider


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _has(message: Any, field: str) -> bool:
    try:
        return bool(message.HasField(field))
    except (ValueError, AttributeError):  # no such field in this message type
        return False


class RpcTracing:
    """Makes the span of each LeaseService call, on one tracer provider.

    Args:
        provider: An OpenTelemetry tracer provider (the SDK's, in practice).
    """

    def __init__(self, provider: trace.TracerProvider) -> None:
        self._tracer = provider.get_tracer("leasekeeper_server")
        self._sql = provider.get_tracer(SQL_SCOPE)
        instrument_sql()

    @contextlib.contextmanager
    def span(
        self, method: str, request: object, metadata: Sequence[tuple[str, Any]] | None
    ) -> Iterator[trace.Span]:
        """The current span of one call, for its duration; SQL spans nest under it.

        Args:
            method: The method's name (``Claim``).
            request: The request message (or, for a stream, None: see ``add_request``).
            metadata: The call's invocation metadata (for ``traceparent``).
        """
        carrier = {k: v for k, v in metadata or () if isinstance(v, str)}
        parent = propagate.extract(carrier) if "traceparent" in carrier else None
        token = _sql_tracer.set(self._sql)
        try:
            with self._tracer.start_as_current_span(
                f"{SERVICE_NAME}/{method}",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={
                    "rpc.system": "grpc",
                    "rpc.service": SERVICE_NAME,
                    "rpc.method": method,
                },
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                if request is not None:
                    add_request(span, request)
                yield span
        finally:
            _sql_tracer.reset(token)


def add_request(span: trace.Span, request: object) -> None:
    """Sets the task's fields named by a request (or a stream's first message) on ``span``."""
    for field in ("namespace", "task_id", "owner_id", "effect_key", "external_operation_id"):
        value = _text(getattr(request, field, None))
        if value is not None:
            span.set_attribute(f"leasekeeper.{field}", value)
    fence = getattr(request, "fence", 0)
    if isinstance(fence, int) and fence:
        span.set_attribute("leasekeeper.fence", fence)
    for field in _CHECKPOINT_FIELDS:
        if _has(request, field):
            span.set_attribute("leasekeeper.checkpoint_version", getattr(request, field).version)


def finish(
    span: trace.Span,
    response: Any,
    code: grpc.StatusCode,
    reason: str | None,
    method: str = "",
) -> None:
    """Sets the answer's attributes and the status on a call's span.

    Args:
        span: The call's span.
        response: The response message (for a stream, its last one), or None.
        code: The call's final status code.
        reason: The ErrorInfo reason for a non-OK status, when known.
        method: The method's name (``Release``), for the disposition.
    """
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if reason:
        span.set_attribute("leasekeeper.reason", reason)
    if code in _SERVER_FAULTS:
        span.set_status(Status(StatusCode.ERROR, code.name))
    if response is None:
        return
    for flag in ("acquired", "valid", "revoked"):
        value = getattr(response, flag, None)
        if isinstance(value, bool):
            span.set_attribute(f"leasekeeper.{flag}", value)
    holder: Any = response.lease if _has(response, "lease") else response
    owner_id = _text(getattr(holder, "owner_id", None))
    if owner_id is not None:
        span.set_attribute("leasekeeper.owner_id", owner_id)
    fence = getattr(holder, "fence", 0)
    if isinstance(fence, int) and fence:
        span.set_attribute("leasekeeper.fence", fence)
    if _has(holder, "expire_time"):
        span.set_attribute("leasekeeper.expire_time", holder.expire_time.ToJsonString())
    version = _stored_version(response, holder)
    if version:
        span.set_attribute("leasekeeper.checkpoint_version", version)
    if isinstance(holder, pb.Lease):
        span.set_attribute("leasekeeper.attempts", holder.attempts)
        if holder.max_attempts:
            span.set_attribute("leasekeeper.max_attempts", holder.max_attempts)
        disposition = _DISPOSITIONS.get((method, holder.state))
        if disposition is not None and code is grpc.StatusCode.OK:
            span.set_attribute("leasekeeper.disposition", disposition)


def _stored_version(response: Any, holder: Any) -> int:
    """The checkpoint version an answer says is stored (0: it says none)."""
    if _has(response, "checkpoint"):
        version: int = response.checkpoint.version
        return version
    stored = getattr(holder, "checkpoint_version", 0)  # a Lease, a HeartbeatResponse
    return stored if isinstance(stored, int) else 0
