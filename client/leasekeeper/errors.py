"""Client errors, and the one place that decodes a gRPC status into them.

Hierarchy (every class is a :class:`LeaseError`)::

    LeaseError                    any failed call; .code, .reason, .metadata
    ├── LeaseLost                 ABORTED: ownership is gone (claim again, never retry)
    ├── AccessDenied              UNAUTHENTICATED or PERMISSION_DENIED: the token (not retryable)
    ├── LimitExceeded             RESOURCE_EXHAUSTED LEASE_LIMIT, CLAIM_RATE_LIMIT; .retry_after
    ├── TaskEnded                 the task is terminal (claims refused; never granted again)
    │   ├── TaskCompleted         FAILED_PRECONDITION TASK_COMPLETED
    │   ├── TaskCancelled         FAILED_PRECONDITION TASK_CANCELLED: an operator cancelled it
    │   └── TaskFailed            FAILED_PRECONDITION TASK_FAILED: its owner ended it as failed
    ├── TaskQuarantined           FAILED_PRECONDITION TASK_QUARANTINED: attempts used up (Retry)
    ├── TaskNotQuarantined        FAILED_PRECONDITION TASK_NOT_QUARANTINED: Retry refused; .state
    ├── CheckpointNotNewer        FAILED_PRECONDITION CHECKPOINT_NOT_NEWER; .current_version
    ├── ClaimTimeout              hold(): the task stayed held by another owner
    │   └── NotAcquired           hold(wait=None): not acquired on the first claim
    ├── LeaseUnavailable          UNAVAILABLE: database or server out of reach (retry the call)
    ├── InvalidArgument           INVALID_ARGUMENT (also a ValueError); .field_violations
    ├── TaskNotFound              NOT_FOUND TASK_NOT_FOUND (also a LookupError)
    ├── StaleFence                an effect boundary refused a fence; .reason, .current_fence
    ├── MissingFence              fence metadata absent or malformed (also a ValueError)
    └── EffectError               the effect ledger refused or could not settle an effect
        ├── EffectKeyReused       FAILED_PRECONDITION EFFECT_KEY_REUSED: other policy or digest
        ├── EffectNotBegun        FAILED_PRECONDITION EFFECT_NOT_BEGUN: no reservation to complete
        ├── EffectAlreadyCompleted  FAILED_PRECONDITION EFFECT_ALREADY_COMPLETED: another outcome
        ├── EffectInDoubt         an earlier attempt was never confirmed: reconcile; .effect
        └── EffectFailed          the outside system refused the effect; .retryable, .result

A lost lease during an effect is :class:`LeaseLost` (ABORTED), as for every RPC.

The server puts exactly one ``google.rpc.ErrorInfo`` (domain ``leasekeeper``) in
the ``grpc-status-details-bin`` trailer of every non-OK status. Errors are chosen
by status code and that reason, never by message text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import grpc
from google.rpc import error_details_pb2, status_pb2

if TYPE_CHECKING:
    from ._effect_record import EffectRecord

DOMAIN = "leasekeeper"
"""The ``ErrorInfo.domain`` of every leasekeeper error."""

LOSS_REASONS = frozenset(
    {
        "LEASE_EXPIRED",
        "LEASE_SUPERSEDED",
        "LEASE_RELEASED",
        "LEASE_REVOKED",
        "RUNTIME_EXCEEDED",
        "TASK_COMPLETED",
        "NOT_OWNER",
        "FENCE_UNKNOWN",
        "TASK_CANCELLED",
        "TASK_FAILED",
        "TASK_QUARANTINED",
    }
)
"""The ``LossReason`` names without their ``LOSS_REASON_`` prefix.

A lease is lost for each of them but TASK_QUARANTINED, which only a claim's
refusal names (:class:`TaskQuarantined`)."""

FENCE_MISSING = "FENCE_MISSING"
"""Reason an effect boundary gives for absent or malformed fence metadata."""

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


class LeaseError(Exception):
    """A leasekeeper call failed.

    Attributes:
        code: The gRPC status code behind the error (None when raised locally).
        reason: The ``ErrorInfo`` reason (e.g. ``"LEASE_SUPERSEDED"``), or None
            when the status carried no leasekeeper ``ErrorInfo`` (a proxy, a
            transport failure).
        metadata: The ``ErrorInfo`` metadata: dynamic values as strings.
    """

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})

    @property
    def retryable(self) -> bool:
        """True when the same call may simply be sent again (UNAVAILABLE)."""
        return self.code is grpc.StatusCode.UNAVAILABLE


class LeaseLost(LeaseError):
    """Ownership of the lease is gone: stop, commit nothing, claim again.

    Raised from RPCs as ABORTED, and by ``hold()`` when the server ends the
    heartbeat with a reason or the local trust deadline passes (reason
    ``LEASE_EXPIRED``, or ``RUNTIME_EXCEEDED`` when the lease was ending at its
    runtime budget), and by ``renew(..., trust_deadline=...)`` when that
    deadline passes unanswered (``LEASE_EXPIRED``).

    Attributes:
        task_id: The task, when known.
        fence: The fence that was lost, when known.
    """

    def __init__(
        self,
        reason: str,
        task_id: str | None = None,
        fence: int | None = None,
        *,
        message: str | None = None,
        code: grpc.StatusCode | None = grpc.StatusCode.ABORTED,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        text = message or f"lease lost: {reason}"
        if task_id is not None:
            text += f" (task_id={task_id!r}, fence={fence})"
        super().__init__(text, code=code, reason=reason, metadata=metadata)
        self.task_id = task_id
        self.fence = fence

    @property
    def current_fence(self) -> int | None:
        """The task's current fence from the error metadata, when the server sent it."""
        return _int_or_none(self.metadata.get("current_fence"))


class AccessDenied(LeaseError):
    """The server refused the caller's credentials.

    ``code`` says which: UNAUTHENTICATED (no token, or one the server does not
    accept: check ``token=`` / ``LEASEKEEPER_TOKEN``) or PERMISSION_DENIED (the
    token's role or namespaces do not cover this call). Not retryable.
    """


class LimitExceeded(LeaseError):
    """A namespace limit refused the call for now (RESOURCE_EXHAUSTED); nothing changed.

    ``reason`` is ``LEASE_LIMIT`` (the namespace holds its maximum of live
    leases) or ``CLAIM_RATE_LIMIT`` (its claims per second are spent).

    Attributes:
        retry_after: Seconds to wait before trying again (google.rpc.RetryInfo),
            or None when the server sent none.
    """

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        code: grpc.StatusCode | None = grpc.StatusCode.RESOURCE_EXHAUSTED,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, code=code, reason=reason, metadata=metadata)
        self.retry_after = retry_after


class TaskEnded(LeaseError):
    """The task is terminal: no claim is ever granted again (FAILED_PRECONDITION).

    One of :class:`TaskCompleted`, :class:`TaskCancelled` and :class:`TaskFailed`;
    ``reason`` says which. A worker skips the task.
    """


class TaskCompleted(TaskEnded):
    """The task is COMPLETED: no claim is ever granted again (FAILED_PRECONDITION)."""


class TaskCancelled(TaskEnded):
    """An operator cancelled the task (FAILED_PRECONDITION, reason TASK_CANCELLED).

    Terminal: no claim is granted and no fence is valid again. ``get_lease``
    tells the operator's words (``LeaseInfo.cancel_reason``). A held lease
    that is cancelled is lost instead: ``LeaseLost`` with reason ``TASK_CANCELLED``.
    """


class TaskFailed(TaskEnded):
    """The task's owner ended its run as failed (FAILED_PRECONDITION, reason TASK_FAILED).

    Terminal, like a completion. ``get_lease`` tells why (``LeaseInfo.fail_reason``).
    """


class TaskQuarantined(LeaseError):
    """The task used up its attempts and waits for an operator (FAILED_PRECONDITION).

    Reason TASK_QUARANTINED: its leases ended without a release (expiry,
    revoke) ``max_attempts`` times. No claim is granted until an operator
    calls ``LeaseClient.retry`` (the task becomes FREE, attempts 0) or
    ``cancel``. Not retryable by waiting.
    """


class TaskNotQuarantined(LeaseError):
    """Retry was refused: the task is not QUARANTINED (FAILED_PRECONDITION).

    Reason TASK_NOT_QUARANTINED. Nothing changed.
    """

    @property
    def state(self) -> str | None:
        """The task's state (e.g. ``"HELD"``) from the error metadata, when the server sent it."""
        return self.metadata.get("state")


class CheckpointNotNewer(LeaseError):
    """A checkpoint was not saved: its version does not move forward.

    FAILED_PRECONDITION, reason CHECKPOINT_NOT_NEWER: the task's stored
    checkpoint has ``current_version``, at least the version sent. Nothing was
    stored. Save with a higher version (resume from the stored one first if
    another worker wrote it).
    """

    @classmethod
    def of(cls, version: int, current_version: int, task_id: str, fence: int) -> CheckpointNotNewer:
        """The refusal of ``version`` when ``current_version`` is stored (raised locally).

        Args:
            version: The version that was sent.
            current_version: The stored checkpoint's version.
            task_id: The task.
            fence: The fence that tried to save it.

        """
        return cls(
            f"checkpoint version {version} of task {task_id!r} (fence {fence}) does not "
            f"move forward: version {current_version} is stored",
            code=grpc.StatusCode.FAILED_PRECONDITION,
            reason="CHECKPOINT_NOT_NEWER",
            metadata={"current_version": str(current_version)},
        )

    @property
    def current_version(self) -> int:
        """The stored checkpoint's version (ErrorInfo metadata ``current_version``; 0 if absent)."""
        return _int_or_none(self.metadata.get("current_version")) or 0


class ClaimTimeout(LeaseError):
    """``hold()`` could not acquire the task before its wait ran out.

    Attributes:
        task_id: The task.
        holder_remaining_ttl: The current holder's remaining ttl in seconds at
            the last attempt, when the server reported one.
    """

    def __init__(
        self, message: str, *, task_id: str, holder_remaining_ttl: float | None = None
    ) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.holder_remaining_ttl = holder_remaining_ttl


class NotAcquired(ClaimTimeout):
    """``hold(wait=None)``: the task is held by another owner; no wait was asked."""


class LeaseUnavailable(LeaseError):
    """The database or server is out of reach, or shutting down (UNAVAILABLE).

    Also gRPC's own RESOURCE_EXHAUSTED, which carries no reason (``code`` says
    which): a connection the server ended because this process missed its
    keepalive ping (paused, or starved of CPU). The call changed nothing that a
    retry could not repeat: it is safe to retry (a claim with the same request id).
    """

    @property
    def retryable(self) -> bool:
        """Always True: the same call may be sent again."""
        return True


class InvalidArgument(LeaseError, ValueError):
    """The request was malformed and changed nothing (INVALID_ARGUMENT).

    Attributes:
        field_violations: ``(field, description)`` pairs from ``google.rpc.BadRequest``.
    """

    def __init__(
        self,
        message: str,
        *,
        field_violations: Iterable[tuple[str, str]] = (),
        code: grpc.StatusCode | None = grpc.StatusCode.INVALID_ARGUMENT,
        reason: str | None = "INVALID_ARGUMENT",
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, code=code, reason=reason, metadata=metadata)
        self.field_violations: tuple[tuple[str, str], ...] = tuple(field_violations)

    @property
    def field(self) -> str | None:
        """The first offending field, or the ``field`` ErrorInfo metadata value."""
        if self.field_violations:
            return self.field_violations[0][0]
        return self.metadata.get("field")


class TaskNotFound(LeaseError, LookupError):
    """The task was never claimed (NOT_FOUND, reason TASK_NOT_FOUND)."""


class StaleFence(LeaseError):
    """A fence may not act now: it is not the task's current, live fence.

    Attributes:
        reason: Why (a loss reason such as ``LEASE_SUPERSEDED``).
        current_fence: The task's current fence (0 for a task never claimed).
        namespace: The task's namespace.
        task_id: The task.
        fence: The refused fence.
    """

    def __init__(
        self, reason: str, current_fence: int, namespace: str, task_id: str, fence: int
    ) -> None:
        super().__init__(
            f"stale fence {fence} for {namespace}/{task_id}: {reason} "
            f"(current fence {current_fence})",
            code=grpc.StatusCode.ABORTED,
            reason=reason,
            metadata={
                "current_fence": str(current_fence),
                "namespace": namespace,
                "task_id": task_id,
                "fence": str(fence),
            },
        )
        self.current_fence = current_fence
        self.namespace = namespace
        self.task_id = task_id
        self.fence = fence


class MissingFence(LeaseError, ValueError):
    """Fence metadata is absent or malformed.

    Attributes:
        key: The missing or malformed metadata key, e.g. ``"leasekeeper-fence"``.
    """

    def __init__(self, key: str, problem: str = "missing") -> None:
        super().__init__(
            f"metadata {key!r} is {problem}", reason=FENCE_MISSING, metadata={"key": key}
        )
        self.key = key


class EffectError(LeaseError):
    """The effect ledger refused a call, or an effect could not be settled."""


class EffectKeyReused(EffectError):
    """The effect_key was reserved with another policy or request_digest.

    FAILED_PRECONDITION, reason EFFECT_KEY_REUSED: two different effects share
    one key. Nothing was reserved; choose distinct keys.
    """


class EffectNotBegun(EffectError):
    """No reservation exists for the effect_key (FAILED_PRECONDITION, EFFECT_NOT_BEGUN)."""


class EffectAlreadyCompleted(EffectError):
    """Another outcome is already recorded for the effect.

    FAILED_PRECONDITION, reason EFFECT_ALREADY_COMPLETED. Recording the same
    outcome, retryable flag and result again is not an error.
    """


class EffectInDoubt(EffectError):
    """An earlier attempt of the effect was reserved but never confirmed.

    It may or may not have happened in the outside system. Ask the outside
    system (by the effect key, or by what ``effect.begin_time`` and
    ``effect.fence`` tell), then record its answer: pass ``reconcile=`` to
    ``lease.effect``, or call ``LeaseClient.complete_effect`` yourself
    (SUCCEEDED with its result, or FAILED with ``retryable=True`` to allow a
    new attempt). Raised locally, never by the server.

    Attributes:
        effect: The earlier, unconfirmed attempt: its fence, attempts and begin_time.
    """

    def __init__(self, effect: EffectRecord) -> None:
        super().__init__(
            f"effect {effect.effect_key!r} of {effect.namespace}/{effect.task_id} is in doubt: "
            f"attempt {effect.attempts} reserved by fence {effect.fence} at "
            f"{effect.begin_time.isoformat()} was never confirmed; reconcile with the outside "
            "system before trying again",
            metadata={
                "namespace": effect.namespace,
                "task_id": effect.task_id,
                "effect_key": effect.effect_key,
                "fence": str(effect.fence),
                "attempts": str(effect.attempts),
            },
        )
        self.effect = effect


class EffectFailed(EffectError):
    """The outside system definitively refused the effect: it did not happen.

    Raise it from the function run by ``lease.effect`` to record the effect as
    FAILED (then it is raised on to the caller). ``lease.effect`` also raises
    it when the ledger already holds a FAILED outcome that is not retryable.
    Any other exception from the function records nothing: the effect stays
    in doubt.

    Attributes:
        retryable: True when a new attempt may be made later (e.g. the outside
            system was rate limiting); False when it never may (e.g. the request
            was rejected as invalid). Not about resending this call.
        result: Opaque bytes recorded with the outcome, e.g. the refusal's text.
        effect: The ledger's record of the failed effect, once recorded.
    """

    def __init__(
        self,
        message: str = "the effect was refused",
        *,
        retryable: bool = False,
        result: bytes | str = b"",
        effect: EffectRecord | None = None,
    ) -> None:
        super().__init__(message)
        self._retryable = retryable
        self.result = result.encode() if isinstance(result, str) else bytes(result)
        self.effect = effect

    @property
    def retryable(self) -> bool:
        """True when a new attempt of the effect may be made later."""
        return self._retryable


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


_PRECONDITION_ERRORS: dict[str, type[LeaseError]] = {
    "TASK_COMPLETED": TaskCompleted,
    "EFFECT_KEY_REUSED": EffectKeyReused,
    "EFFECT_NOT_BEGUN": EffectNotBegun,
    "EFFECT_ALREADY_COMPLETED": EffectAlreadyCompleted,
    "TASK_CANCELLED": TaskCancelled,
    "TASK_FAILED": TaskFailed,
    "TASK_QUARANTINED": TaskQuarantined,
    "TASK_NOT_QUARANTINED": TaskNotQuarantined,
    "CHECKPOINT_NOT_NEWER": CheckpointNotNewer,
}


def rich_status_of(error: grpc.RpcError) -> status_pb2.Status | None:
    """Decode the ``google.rpc.Status`` in an RPC error's trailing metadata.

    Unlike ``grpc_status.rpc_status.from_call`` this never raises: a status
    whose code or message disagrees with the call is still decoded.

    Args:
        error: A ``grpc.aio.AioRpcError`` or a ``grpc.RpcError`` that is a ``grpc.Call``.

    Returns:
        The decoded status, or None when absent or undecodable.

    """
    trailing = getattr(error, "trailing_metadata", None)
    pairs: Any = trailing() if callable(trailing) else None
    for key, value in pairs or ():
        if key == _STATUS_DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except Exception:  # a malformed trailer is treated as absent
                return None
    return None


def error_details(
    status: status_pb2.Status | None,
) -> tuple[str | None, dict[str, str], tuple[tuple[str, str], ...]]:
    """Extract the leasekeeper ``ErrorInfo`` and ``BadRequest`` from a status.

    Args:
        status: A decoded ``google.rpc.Status`` (or None).

    Returns:
        ``(reason, metadata, field_violations)``; reason is None when no
        ``ErrorInfo`` of domain ``leasekeeper`` is present.

    """
    reason: str | None = None
    metadata: dict[str, str] = {}
    violations: list[tuple[str, str]] = []
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN and reason is None:
                reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend((v.field, v.description) for v in bad.field_violations)
    return reason, metadata, tuple(violations)


def from_rpc_error(
    error: grpc.RpcError, *, task_id: str | None = None, fence: int | None = None
) -> LeaseError:
    """Translate a failed RPC into the matching :class:`LeaseError`.

    ====================  ========================  ======================
    status code           reason                    error
    ====================  ========================  ======================
    ABORTED               FENCE_MISSING             MissingFence
    ABORTED               any other / none          LeaseLost
    FAILED_PRECONDITION   TASK_COMPLETED            TaskCompleted
    FAILED_PRECONDITION   EFFECT_KEY_REUSED         EffectKeyReused
    FAILED_PRECONDITION   EFFECT_NOT_BEGUN          EffectNotBegun
    FAILED_PRECONDITION   EFFECT_ALREADY_COMPLETED  EffectAlreadyCompleted
    FAILED_PRECONDITION   TASK_CANCELLED            TaskCancelled
    FAILED_PRECONDITION   TASK_FAILED               TaskFailed
    FAILED_PRECONDITION   TASK_QUARANTINED          TaskQuarantined
    FAILED_PRECONDITION   TASK_NOT_QUARANTINED      TaskNotQuarantined (.state)
    FAILED_PRECONDITION   CHECKPOINT_NOT_NEWER      CheckpointNotNewer (.current_version)
    INVALID_ARGUMENT      any                       InvalidArgument
    NOT_FOUND             any                       TaskNotFound
    UNAVAILABLE           any (or none)             LeaseUnavailable
    UNAUTHENTICATED       any                       AccessDenied
    PERMISSION_DENIED     any                       AccessDenied
    RESOURCE_EXHAUSTED    LEASE_LIMIT, ...          LimitExceeded (retry_after)
    RESOURCE_EXHAUSTED    none                      LeaseUnavailable (gRPC's own)
    anything else         any                       LeaseError
    ====================  ========================  ======================

    Args:
        error: The ``grpc.aio.AioRpcError`` (or sync ``grpc.RpcError``) raised by the call.
        task_id: The task the call was about, recorded on ``LeaseLost``.
        fence: The fence the call used, recorded on ``LeaseLost``.

    Returns:
        The error to raise (the caller chains ``error`` as its cause).

    """
    code_fn = getattr(error, "code", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details_fn = getattr(error, "details", None)
    message = (details_fn() if callable(details_fn) else None) or str(code)
    status = rich_status_of(error)
    reason, metadata, violations = error_details(status)
    if code is grpc.StatusCode.ABORTED:
        if reason == FENCE_MISSING:
            return MissingFence(metadata.get("key", "leasekeeper-fence"))
        return LeaseLost(reason or "UNKNOWN", task_id, fence, message=message, metadata=metadata)
    if code is grpc.StatusCode.FAILED_PRECONDITION and reason in _PRECONDITION_ERRORS:
        kind = _PRECONDITION_ERRORS[reason]
        return kind(message, code=code, reason=reason, metadata=metadata)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(
            message, field_violations=violations, reason=reason, metadata=metadata
        )
    if code is grpc.StatusCode.NOT_FOUND:
        return TaskNotFound(message, code=code, reason=reason, metadata=metadata)
    if code is grpc.StatusCode.UNAVAILABLE:
        return LeaseUnavailable(message, code=code, reason=reason, metadata=metadata)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return AccessDenied(message, code=code, reason=reason, metadata=metadata)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and reason is None:
        # Not a namespace limit (those carry their reason) but gRPC's own: a connection the
        # server ended with ENHANCE_YOUR_CALM (a client paused past its keepalive ping), or a
        # message over a size limit. The call's outcome is unknown, as for UNAVAILABLE.
        return LeaseUnavailable(message, code=code, reason=reason, metadata=metadata)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return LimitExceeded(
            message, retry_after=retry_delay_s(status), reason=reason, metadata=metadata
        )
    return LeaseError(message, code=code, reason=reason, metadata=metadata)


def retry_delay_s(status: status_pb2.Status | None) -> float | None:
    """The ``google.rpc.RetryInfo`` delay of a status in seconds, or None."""
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            delay_s: float = info.retry_delay.ToTimedelta().total_seconds()
            return delay_s
    return None
