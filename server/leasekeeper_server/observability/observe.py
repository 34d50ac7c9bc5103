"""The outermost server interceptor: metrics, spans and audit records from every call.

It sees each ``leasekeeper.v1.LeaseService`` call's method, request,
response (for a stream: its first message and its last response) and final
status, and derives from them what ``metrics.py`` lists, the span of
``tracing.py`` and the records of ``audit.py``. The handlers stay free of
observability calls (the effect counts too: from BeginEffect's decision,
CompleteEffect's recorded state, or the refusal; and the checkpoint writes:
from SaveCheckpoint's and CompleteEffect's requests answered OK, and from
each Heartbeat beat read with the answer written to it); the one exception
is the loss-notice time, which only a Heartbeat stream's watchdog sees (the
instant of the loss is in no request, response or status). Being outermost,
it also sees the calls an inner interceptor (authentication) refuses.

The final status is read from the call's context after the handler: errors
leave handlers through ``context.abort`` (``rpc.handling.abort_with``), which sets the
code and the trailing ``grpc-status-details-bin``; the domain error that
caused the abort (and its ErrorInfo reason) is the AbortError's context, or
else the reason is parsed from those details. A handler that is cancelled
counts as CANCELLED; any other exception as UNKNOWN (what grpc answers).

Other services (health, reflection) pass through untouched. With no tracer
provider and the audit logger off, a unary call costs two clock reads, a
histogram observation and its method's counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.core.errors import EffectConflict, LeaseLost, LeaseServiceError
from leasekeeper_server.observability import tracing
from leasekeeper_server.observability.audit import Audit
from leasekeeper_server.observability.metrics import ClaimResult, EffectEvent, Metrics
from leasekeeper_server.rpc.service import SERVICE_NAME
from leasekeeper_server.security.caller import current_principal

log = logging.getLogger(__name__)

PREFIX = "/" + SERVICE_NAME + "/"
_OK = grpc.StatusCode.OK
_ABORTED = grpc.StatusCode.ABORTED
_LIMITED = grpc.StatusCode.RESOURCE_EXHAUSTED
_ENDED = grpc.StatusCode.FAILED_PRECONDITION
_LOSS_PREFIX = "LOSS_REASON_"
# The codes of an effect call refused before the handler asked the ledger: a
# malformed or invalid request, or the auth interceptor's refusal. The ledger
# itself never answers them (ledger.py: ABORTED, FAILED_PRECONDITION, UNAVAILABLE).
_BEFORE_LEDGER = frozenset(
    (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    )
)
# A Claim refused FAILED_PRECONDITION, by ErrorInfo reason: the task has ended or waits.
_CLAIM_REFUSED = {
    "TASK_COMPLETED": ClaimResult.COMPLETED,
    "TASK_QUARANTINED": ClaimResult.QUARANTINED,
    "TASK_CANCELLED": ClaimResult.CANCELLED,
    "TASK_FAILED": ClaimResult.FAILED,
}
_BEGIN_EVENT = {
    pb.EFFECT_DECISION_PROCEED: EffectEvent.PROCEED,
    pb.EFFECT_DECISION_ALREADY_APPLIED: EffectEvent.ALREADY_APPLIED,
    pb.EFFECT_DECISION_IN_DOUBT: EffectEvent.IN_DOUBT,
}


def _principal() -> str | None:
    """The caller's principal name when the auth interceptor recorded one for this call."""
    principal = current_principal()
    name = getattr(principal, "name", None)
    return name if isinstance(name, str) else None


def _cause(error: BaseException | None) -> LeaseServiceError | None:
    """The domain error an abort answered (``abort_with`` aborts while handling it), if any."""
    cause = error.__context__ if error is not None else None
    return cause if isinstance(cause, LeaseServiceError) else None


def _reason(cause: LeaseServiceError | None, context: Any) -> str | None:
    """The ErrorInfo reason of an aborted call."""
    if cause is not None:
        return cause.reason
    try:
        trailing = context.trailing_metadata() or ()
    except Exception:  # a context without trailing metadata
        return None
    for key, value in trailing:
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            st = status_pb2.Status.FromString(value)
            for detail in st.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    reason: str = info.reason
                    return reason
    return None


def _final_code(context: Any) -> grpc.StatusCode:
    code = context.code()
    if code is None:
        return _OK
    if isinstance(code, grpc.StatusCode):
        return code
    for candidate in grpc.StatusCode:  # an int, from older grpcio
        if candidate.value[0] == code:
            return candidate
    return grpc.StatusCode.UNKNOWN


class _Outcome:
    """One call's result, as the observers read it."""

    __slots__ = (
        "cause",
        "code",
        "context",
        "error",
        "first",
        "leases",
        "principal",
        "reason",
        "request",
        "response",
    )

    def __init__(self, request: Any, context: Any) -> None:
        self.request = request
        self.context = context
        self.response: Any = None
        self.first: Any = None  # a stream's first message
        self.leases: dict[int, Any] | None = None  # a Session's adds by id, while auditing
        self.code = _OK
        self.error: BaseException | None = None
        self.cause: LeaseServiceError | None = None  # the domain error the call answered
        self.reason: str | None = None
        self.principal: str | None = None

    def ended(self, error: BaseException | None) -> None:
        self.error = error
        if isinstance(error, asyncio.CancelledError | GeneratorExit):
            self.code = grpc.StatusCode.CANCELLED
        elif error is None or isinstance(error, grpc.aio.AbortError):
            self.code = _final_code(self.context)
        else:
            self.code = grpc.StatusCode.UNKNOWN
        if self.code is not _OK:
            self.cause = _cause(error)
            self.reason = _reason(self.cause, self.context)


# Called with each response a stream writes: (outcome, the message read last, the response).
OnWrite = Callable[[_Outcome, Any, Any], None]


class _StreamContext:
    """The real context, with the first message read and each response written recorded.

    A Heartbeat answers each message it reads before it reads the next, so
    the message read last is the one a response answers.
    """

    def __init__(self, context: Any, outcome: _Outcome, on_write: OnWrite) -> None:
        self._context = context
        self._outcome = outcome
        self._on_write = on_write
        self._last_read: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def read(self) -> Any:
        message = await self._context.read()
        if message is not grpc.aio.EOF:
            if self._outcome.first is None:
                self._outcome.first = message
            self._last_read = message
        return message

    async def write(self, message: Any) -> None:
        await self._context.write(message)
        self._outcome.response = message
        read, self._last_read = self._last_read, None
        self._on_write(self._outcome, read, message)


# grpc ships no type stubs, so its ServerInterceptor is Any.
class ObserveInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Counts, traces and audits every LeaseService call (see the module docstring).

    Args:
        metrics: The server's metrics.
        audit: Where audit records go.
        rpc_tracing: Makes spans; None for no tracing.
    """

    def __init__(
        self, metrics: Metrics, audit: Audit, rpc_tracing: tracing.RpcTracing | None = None
    ) -> None:
        self._metrics = metrics
        self._audit = audit
        self._tracing = rpc_tracing
        # method -> (the inner handler, our wrapper of it): one wrapper per method
        # while the inner handler stays the same, so no allocation per call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._duration: dict[tuple[str, grpc.StatusCode], Any] = {}
        # Counted on every renewal: the series looked up once, not per beat.
        self._beat_renewed = metrics.renewals.labels("Heartbeat", "ok")
        self._session_renewed = metrics.renewals.labels("Session", "ok")
        self._rpc_renewed = metrics.renewals.labels("Renew", "ok")
        self._observers: dict[str, Callable[[_Outcome], object]] = {
            "Claim": self._claimed,
            "Renew": self._renewed,
            "Release": self._released,
            "ValidateFence": self._validated,
            "BeginEffect": self._effect_begun,
            "CompleteEffect": self._effect_completed,
            "Revoke": self._revoked,
            "SaveCheckpoint": self._checkpoint_saved,
            "Cancel": self._cancelled,
            "Retry": self._retried,
            "Heartbeat": self._heartbeat_ended,
        }

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wraps the handler of a LeaseService method; others pass through."""
        handler = await continuation(handler_call_details)
        path = handler_call_details.method
        if handler is None or not path.startswith(PREFIX):
            return handler
        method = path[len(PREFIX) :]
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary), **kwargs
            )
        if handler.stream_stream is not None:
            behavior = self._stream(method, handler.stream_stream)
            return grpc.stream_stream_rpc_method_handler(behavior, **kwargs)
        if handler.unary_stream is not None:
            behavior = self._stream(method, handler.unary_stream)
            return grpc.unary_stream_rpc_method_handler(behavior, **kwargs)
        return handler  # client streaming: LeaseService has none

    def _unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        observe = self._observers.get(method)
        rpc_tracing = self._tracing

        async def call(request: Any, context: Any, outcome: _Outcome | None = None) -> Any:
            started = time.perf_counter()
            if outcome is None:
                outcome = _Outcome(request, context)
            try:
                outcome.response = await behavior(request, context)
                return outcome.response
            except BaseException as exc:
                outcome.ended(exc)
                raise
            finally:
                if outcome.error is None:
                    outcome.ended(None)
                self._observe_duration(method, outcome.code, time.perf_counter() - started)
                self._after(observe, outcome)

        if rpc_tracing is None:
            return call

        async def traced(request: Any, context: Any) -> Any:
            outcome = _Outcome(request, context)
            with rpc_tracing.span(method, request, context.invocation_metadata()) as span:
                try:
                    return await call(request, context, outcome)
                finally:
                    tracing.finish(span, outcome.response, outcome.code, outcome.reason, method)

        return traced

    def _after(self, observe: Callable[[_Outcome], object] | None, outcome: _Outcome) -> None:
        """Runs the method's observer; a failure there is logged, never the call's."""
        try:
            if observe is not None:
                outcome.principal = _principal()
                observe(outcome)
            self._limited(outcome)
        except Exception:
            log.exception("observing a call failed")

    def _stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        observe = self._observers.get(method)
        gauge = {
            "Heartbeat": self._metrics.heartbeat_streams_open,
            "Watch": self._metrics.watch_streams_open,
            "Session": self._metrics.session_streams_open,
        }.get(method)
        on_write = {
            "Heartbeat": self._heartbeat_beat,
            "ValidateFences": self._fences_validated,
            "Session": self._session_answered,
        }.get(method, _ignore)

        @contextlib.contextmanager
        def observed(request: Any, context: Any) -> Any:
            outcome = _Outcome(request, context)
            proxy = _StreamContext(context, outcome, on_write)
            first = request if not isinstance(request, AsyncIterator) else None
            span_cm = (
                self._tracing.span(method, first, context.invocation_metadata())
                if self._tracing is not None
                else contextlib.nullcontext(None)
            )
            if gauge is not None:
                gauge.inc()
            with span_cm as span:
                try:
                    yield proxy
                except BaseException as exc:
                    outcome.ended(exc)
                    raise
                finally:
                    if gauge is not None:
                        gauge.dec()
                    if outcome.error is None:
                        outcome.ended(None)
                    self._metrics.streams.labels(method, outcome.code.name).inc()
                    self._after(observe, outcome)
                    if span is not None:
                        if outcome.first is not None:
                            tracing.add_request(span, outcome.first)
                        tracing.finish(span, outcome.response, outcome.code, outcome.reason, method)

        if inspect.isasyncgenfunction(behavior):

            async def generate(request: Any, context: Any) -> AsyncIterator[Any]:
                with observed(request, context) as proxy:
                    async for response in behavior(request, proxy):
                        proxy._outcome.response = response
                        yield response

            return generate

        async def run(request: Any, context: Any) -> Any:
            with observed(request, context) as proxy:
                return await behavior(request, proxy)

        return run

    def _observe_duration(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        child = self._duration.get((method, code))
        if child is None:
            child = self._duration[(method, code)] = self._metrics.rpc_duration.labels(
                method, code.name
            )
        child.observe(seconds)

    def _limited(self, o: _Outcome) -> None:
        if o.code is _LIMITED and o.reason:
            namespace = getattr(o.request, "namespace", "") or getattr(o.first, "namespace", "")
            self._metrics.limit_rejections.labels(namespace, o.reason).inc()

    def _stale(self, method: str, o: _Outcome) -> bool:
        """Counts an ABORTED fenced call; True when it was one."""
        if o.code is not _ABORTED or not o.reason:
            return False
        self._metrics.stale_fence_rejections.labels(method, o.reason).inc()
        return True

    def _claimed(self, o: _Outcome) -> None:
        m = self._metrics
        namespace = getattr(o.request, "namespace", "")
        if o.code is _OK:
            response = o.response
            if not response.acquired:
                m.claims.labels(namespace, ClaimResult.CONFLICT).inc()
                return
            m.claims.labels(namespace, ClaimResult.ACQUIRED).inc()
            if self._audit.enabled:
                lease = response.lease
                self._audit.grant(
                    lease.namespace,
                    lease.task_id,
                    lease.owner_id,
                    lease.fence,
                    lease.expire_time.ToJsonString(),
                    o.principal,
                )
        elif o.code is _ENDED and o.reason in _CLAIM_REFUSED:
            m.claims.labels(namespace, _CLAIM_REFUSED[o.reason]).inc()
        elif o.code is _LIMITED:
            m.claims.labels(namespace, ClaimResult.LIMITED).inc()
        else:
            m.claims.labels("", ClaimResult.ERROR).inc()

    def _lost(self, method: str, renewal: bool, o: _Outcome, named: Any) -> None:
        if not self._stale(method, o):
            return
        if renewal:
            self._metrics.renewals.labels(method, "lost").inc()
            self._metrics.renewal_failures.labels(method, o.reason).inc()
        if self._audit.enabled and named is not None:
            self._audit.loss(
                method,
                named.namespace,
                named.task_id,
                named.owner_id,
                named.fence,
                o.reason or "",
                o.principal,
            )

    def _renewed(self, o: _Outcome) -> None:
        if o.code is _OK:
            self._rpc_renewed.inc()
        else:
            self._lost("Renew", True, o, o.request)

    def _released(self, o: _Outcome) -> None:
        if o.code is _OK:
            if self._audit.enabled:
                r = o.request
                self._audit.release(
                    r.namespace,
                    r.task_id,
                    r.owner_id,
                    r.fence,
                    r.complete,
                    o.principal,
                    fail=r.fail,
                    fail_reason=r.fail_reason if r.fail else None,
                )
        else:
            self._lost("Release", False, o, o.request)

    def _heartbeat_beat(self, o: _Outcome, beat: Any, answer: Any) -> None:
        """Counts a beat's renewal, and its checkpoint when the answer says it is stored."""
        if answer.renewed:
            self._beat_renewed.inc()
        if (
            isinstance(beat, pb.HeartbeatRequest)
            and beat.HasField("checkpoint")
            and answer.checkpoint_version == beat.checkpoint.version
        ):
            namespace = getattr(o.first, "namespace", "")
            self._metrics.checkpoint_written(namespace, "Heartbeat", len(beat.checkpoint.data))

    def _heartbeat_ended(self, o: _Outcome) -> None:
        self._lost("Heartbeat", True, o, o.first)

    def _session_answered(self, o: _Outcome, read: Any, answer: Any) -> None:
        """Counts the renewals and losses a Session message tells, as a Heartbeat's.

        Each lease an answer says was renewed is a renewal; each lease lost
        (found by a renewal, or pushed) a lost renewal and a refused fence, and
        an audit record. An answer names leases by id only: while the audit
        log is on, the adds read (``read``: the message read since the last
        write, which every answer follows) are kept to name a lost lease's
        task, owner and fence.
        """
        leases = o.leases
        if self._audit.enabled and isinstance(read, pb.SessionRequest):
            if leases is None:
                leases = o.leases = {}
            for added in read.add:
                leases[added.id] = added
            for lease_id in read.drop:
                leases.pop(lease_id, None)
        renewed = sum(held.renewed for held in answer.held)
        if renewed:
            self._session_renewed.inc(renewed)
        m = self._metrics
        for lost in answer.lost:
            reason = pb.LossReason.Name(lost.reason).removeprefix(_LOSS_PREFIX)
            m.renewals.labels("Session", "lost").inc()
            m.renewal_failures.labels("Session", reason).inc()
            m.stale_fence_rejections.labels("Session", reason).inc()
            add = leases.pop(lost.id, None) if leases is not None else None
            if add is not None:
                self._audit.loss(
                    "Session",
                    add.namespace,
                    add.task_id,
                    add.owner_id,
                    add.fence,
                    reason,
                    _principal(),
                )

    def _validated(self, o: _Outcome) -> None:
        if o.code is _OK and not o.response.valid:
            name = pb.LossReason.Name(o.response.reason).removeprefix(_LOSS_PREFIX)
            self._metrics.stale_fence_rejections.labels("ValidateFence", name).inc()

    def _fences_validated(self, o: _Outcome, read: Any, answers: Any) -> None:
        """Counts the stale fences a ValidateFences message answers, as ValidateFence's.

        The same decision as the unary call's, so the same series: alerts on
        ``method="ValidateFence"`` see the fences refused on streams too.
        """
        for answer in answers.answers:
            if answer.HasField("response") and not answer.response.valid:
                name = pb.LossReason.Name(answer.response.reason).removeprefix(_LOSS_PREFIX)
                self._metrics.stale_fence_rejections.labels("ValidateFence", name).inc()

    def _effect_begun(self, o: _Outcome) -> None:
        """Counts a BeginEffect that reached the ledger (begun) and what the ledger answered."""
        self._stale("BeginEffect", o)
        if o.code in _BEFORE_LEDGER:
            return
        self._metrics.effect(EffectEvent.BEGUN)
        if o.code is _OK:
            self._metrics.effect(_BEGIN_EVENT[o.response.decision])
        else:
            self._effect_refused(o)

    def _effect_completed(self, o: _Outcome) -> None:
        """Counts a CompleteEffect by the outcome recorded (applied, failed) and its checkpoint."""
        self._stale("CompleteEffect", o)
        if o.code is _OK:
            applied = o.response.effect.state == pb.EFFECT_STATE_SUCCEEDED
            self._metrics.effect(EffectEvent.APPLIED if applied else EffectEvent.FAILED)
            r = o.request
            if r.HasField("next_checkpoint"):
                self._metrics.checkpoint_written(
                    r.namespace, "CompleteEffect", len(r.next_checkpoint.data)
                )
        else:
            self._effect_refused(o)

    def _effect_refused(self, o: _Outcome) -> None:
        """Counts a stale fence (LeaseLost, ABORTED) or a ledger conflict (FAILED_PRECONDITION)."""
        if isinstance(o.cause, LeaseLost | EffectConflict):
            self._metrics.effect(EffectEvent.REFUSED)

    def _revoked(self, o: _Outcome) -> None:
        if o.code is _OK and self._audit.enabled:
            r = o.request
            lease = o.response.lease
            self._audit.revoke(
                r.namespace, r.task_id, lease.fence, o.response.revoked, r.reason, o.principal
            )

    def _checkpoint_saved(self, o: _Outcome) -> None:
        if o.code is _OK:
            r = o.request
            self._metrics.checkpoint_written(r.namespace, "SaveCheckpoint", len(r.checkpoint.data))
        else:
            self._lost("SaveCheckpoint", False, o, o.request)

    def _cancelled(self, o: _Outcome) -> None:
        if o.code is _OK and self._audit.enabled:
            r = o.request
            lease = o.response.lease
            self._audit.cancel(
                r.namespace, r.task_id, lease.fence, o.response.cancelled, r.reason, o.principal
            )

    def _retried(self, o: _Outcome) -> None:
        if o.code is _OK and self._audit.enabled:
            r = o.request
            lease = o.response.lease
            self._audit.retry(r.namespace, r.task_id, lease.fence, r.reason, o.principal)


def _ignore(o: _Outcome, read: Any, message: Any) -> None:
    pass
