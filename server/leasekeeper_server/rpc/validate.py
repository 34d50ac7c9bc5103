"""Request validation: proto messages in, checked domain values out (pure).

Every check raises :class:`~leasekeeper_server.core.errors.InvalidArgument` naming
the field (INVALID_ARGUMENT for the caller) before anything is read or
written. The rules are the lease contract's "Bad input" (docs/guarantees.md):
ids are 1..max_id_bytes bytes of UTF-8 without control characters, bidirectional controls or line
separators, with a visible character, compared byte for byte (a claim's
request_id too, when set; empty means none); ttls lie in [min_ttl, max_ttl]
(unset means the default); fences are >= 1; enum values must be known; page
sizes at most 1000.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from google.protobuf import duration_pb2
from google.protobuf.message import Message

from leasekeeper.ids import refusal
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.core.effect_rules import (
    BeginRequest,
    EffectKey,
    EffectPolicy,
    EffectState,
    Outcome,
)
from leasekeeper_server.core.errors import InvalidArgument
from leasekeeper_server.core.model import CheckpointWrite, LeaseRef, TaskKey, TaskState
from leasekeeper_server.rpc.paging import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from leasekeeper_server.settings import Settings

_MAX_DURATION_SECONDS = 315_576_000_000  # google.protobuf.Duration's own bound
_NANOS_PER_SECOND = 1_000_000_000
MAX_DIGEST_BYTES = 64  # room for SHA-512; SHA-256 is 32


def identifier(field: str, value: str, max_bytes: int) -> str:
    """Checks an opaque id: the one rule of every id (docs/guarantees.md, "Bad input").

    1..max_bytes bytes of UTF-8; no control characters (NUL included), no
    bidirectional controls, no line separators, and at least one visible
    character (:func:`leasekeeper.ids.refusal`: an id of only whitespace or
    zero-width characters would read as empty in a table). Otherwise kept as
    sent: spaces inside or around an id are part of it, compared byte for byte.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) naming ``field``.
    """
    size = len(value.encode("utf-8", "surrogatepass"))
    if size == 0:
        raise InvalidArgument(field, "must not be empty")
    if size > max_bytes:
        raise InvalidArgument(field, f"is {size} bytes long; at most {max_bytes} bytes allowed")
    reason = refusal(value)
    if reason is not None:
        raise InvalidArgument(field, reason)
    return value


def request_id(value: str, max_bytes: int) -> str | None:
    """Checks a claim's ``request_id``: empty means none, else the rules of an id.

    Returns:
        The request id, or None when the request carries none.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT, field ``request_id``) a request id
            that breaks the rules of ids (:func:`identifier`).
    """
    return identifier("request_id", value, max_bytes) if value else None


def task_key(req: Message, settings: Settings) -> TaskKey:
    """Checks ``namespace`` and ``task_id`` of a request."""
    return TaskKey(
        identifier("namespace", req.namespace, settings.max_id_bytes),  # type: ignore[attr-defined]
        identifier("task_id", req.task_id, settings.max_id_bytes),  # type: ignore[attr-defined]
    )


def fence(field: str, value: int) -> int:
    """Checks a fence: >= 1."""
    if value < 1:
        raise InvalidArgument(field, f"must be >= 1, got {value}")
    return value


def lease_ref(req: Message, settings: Settings) -> LeaseRef:
    """Checks namespace, task_id, owner_id and fence of a request."""
    return LeaseRef(
        task_key(req, settings),
        identifier("owner_id", req.owner_id, settings.max_id_bytes),  # type: ignore[attr-defined]
        fence("fence", req.fence),  # type: ignore[attr-defined]
    )


def duration(field: str, value: duration_pb2.Duration) -> timedelta:
    """Converts a well-formed, positive Duration to a timedelta."""
    seconds, nanos = value.seconds, value.nanos
    if (
        abs(seconds) > _MAX_DURATION_SECONDS
        or not -999_999_999 <= nanos <= 999_999_999
        or (seconds > 0 and nanos < 0)
        or (seconds < 0 and nanos > 0)
    ):
        raise InvalidArgument(field, "is not a well-formed google.protobuf.Duration")
    converted = timedelta(seconds=seconds, microseconds=nanos // 1000)
    # PostgreSQL intervals count microseconds: anything shorter would become zero.
    if converted < timedelta(microseconds=1):
        raise InvalidArgument(field, "must be positive, at least 1 microsecond")
    return converted


def bounded_duration(
    field: str, value: duration_pb2.Duration, low_s: float, high_s: float
) -> timedelta:
    """Converts a well-formed Duration that lies in [low_s, high_s] to a timedelta.

    The bounds are compared with the exact value, to the nanosecond: the
    timedelta keeps microseconds only, and 3600 s + 1 ns must not pass a
    3600 s bound because its conversion drops the nanosecond.
    """
    converted = duration(field, value)
    exact_ns = value.seconds * _NANOS_PER_SECOND + value.nanos
    if not round(low_s * _NANOS_PER_SECOND) <= exact_ns <= round(high_s * _NANOS_PER_SECOND):
        raise InvalidArgument(
            field, f"must lie in [{low_s:g} s, {high_s:g} s], got {_seconds_text(exact_ns)}"
        )
    return converted


def _seconds_text(nanos: int) -> str:
    """A duration in nanoseconds as exact decimal seconds ("3600.000000001 s")."""
    whole, fraction = divmod(abs(nanos), _NANOS_PER_SECOND)
    text = f"{whole}.{fraction:09d}".rstrip("0").rstrip(".")
    return f"{'-' if nanos < 0 else ''}{text} s"


def ttl(req: Message, settings: Settings, field: str = "ttl") -> timedelta:
    """The request's ttl, or the default when unset; must lie in [min_ttl, max_ttl]."""
    if not req.HasField(field):
        return timedelta(seconds=settings.default_ttl_s)
    return bounded_duration(field, getattr(req, field), settings.min_ttl_s, settings.max_ttl_s)


def max_runtime(req: pb.ClaimRequest, settings: Settings) -> timedelta:
    """The claim's runtime budget, or the server's max_runtime when unset.

    Bounds: [min_ttl, max_runtime]: a shorter budget could not hold even one lease.
    """
    high = timedelta(seconds=settings.max_runtime_s)
    if not req.HasField("max_runtime"):
        return high
    return bounded_duration(
        "max_runtime", req.max_runtime, settings.min_ttl_s, settings.max_runtime_s
    )


def claim_wait(req: pb.ClaimRequest, settings: Settings) -> timedelta:
    """How long a claim may wait for its task; zero when unset or zero.

    Bounds: [0, max_claim_wait_s], compared exactly; a wait shorter than a
    microsecond is no wait.
    """
    if not req.HasField("wait"):
        return timedelta(0)
    value = req.wait
    exact_ns = value.seconds * _NANOS_PER_SECOND + value.nanos
    if 0 <= exact_ns < 1000 and value.seconds == 0:  # zero, or below the clock's resolution
        return timedelta(0)
    return bounded_duration("wait", value, 0.0, settings.max_claim_wait_s)


REVOKE_REASON_MAX_BYTES = 1024


def revoke_reason(value: str) -> str:
    """A revoke's reason: required, at most 1024 bytes of UTF-8, no control characters."""
    return identifier("reason", value, REVOKE_REASON_MAX_BYTES)


def optional_fence(field: str, value: int) -> int:
    """A fence that may be 0 (meaning "any"); otherwise >= 1."""
    if value < 0:
        raise InvalidArgument(field, f"must be 0 (any) or >= 1, got {value}")
    return value


def optional_identifier(field: str, value: str, max_bytes: int) -> str | None:
    """An id that may be empty (None); otherwise the rules of an id."""
    return identifier(field, value, max_bytes) if value else None


def task_state_filter(value: int) -> TaskState | None:
    """The ListLeases state filter; unknown enum values are refused."""
    name = _enum_name("state", pb.TaskState, value, "TASK_STATE_")
    return TaskState(name) if name is not None else None


def page_size(value: int) -> int:
    """The page size: unset (0) means 100; 1..1000 allowed."""
    if value == 0:
        return DEFAULT_PAGE_SIZE
    if not 1 <= value <= MAX_PAGE_SIZE:
        raise InvalidArgument("page_size", f"must lie in [1, {MAX_PAGE_SIZE}], got {value}")
    return value


def _enum_name(field: str, enum_type: Any, value: int, prefix: str) -> str | None:
    """The name of a proto enum value without its prefix; None for UNSPECIFIED."""
    if value == 0:
        return None
    try:
        return str(enum_type.Name(value)).removeprefix(prefix)
    except ValueError:
        raise InvalidArgument(field, f"unknown {enum_type.DESCRIPTOR.name} value {value}") from None


def effect_key(req: Message, settings: Settings) -> EffectKey:
    """Checks ``namespace``, ``task_id`` and ``effect_key`` (the same rules as ids)."""
    task = task_key(req, settings)
    key = identifier("effect_key", req.effect_key, settings.max_id_bytes)  # type: ignore[attr-defined]
    return EffectKey(task.namespace, task.task_id, key)


def begin_request(req: pb.BeginEffectRequest, settings: Settings) -> BeginRequest:
    """Checks a BeginEffect request: ids, fence >= 1, a policy, a digest of at most 64 bytes."""
    key = effect_key(req, settings)
    checked_fence = fence("fence", req.fence)
    policy = _enum_name("policy", pb.EffectPolicy, req.policy, "EFFECT_POLICY_")
    if policy is None:
        raise InvalidArgument("policy", "must be ONCE or LATEST: the caller chooses explicitly")
    if len(req.request_digest) > MAX_DIGEST_BYTES:
        raise InvalidArgument(
            "request_digest",
            f"is {len(req.request_digest)} bytes long; at most {MAX_DIGEST_BYTES} bytes allowed",
        )
    return BeginRequest(key, checked_fence, EffectPolicy(policy.lower()), req.request_digest)


def outcome(req: pb.CompleteEffectRequest, settings: Settings) -> Outcome:
    """Checks CompleteEffect's outcome: SUCCEEDED, or FAILED (retryable or not), and its result."""
    name = _enum_name("outcome", pb.EffectState, req.outcome, "EFFECT_STATE_")
    if name not in ("SUCCEEDED", "FAILED"):
        raise InvalidArgument("outcome", "must be SUCCEEDED or FAILED")
    state = EffectState(name.lower())
    if req.retryable and state is EffectState.SUCCEEDED:
        raise InvalidArgument("retryable", "must be false when the outcome is SUCCEEDED")
    if len(req.result) > settings.max_effect_result_bytes:
        raise InvalidArgument(
            "result",
            f"is {len(req.result)} bytes long; "
            f"at most {settings.max_effect_result_bytes} bytes allowed",
        )
    external_id = req.external_operation_id
    if external_id:
        external_id = identifier("external_operation_id", external_id, settings.max_id_bytes)
    return Outcome(state, req.retryable, req.result, external_id)


MAX_ATTEMPTS_BOUND = 1_000_000
CONTENT_TYPE_MAX_BYTES = 128


def max_attempts(req: pb.ClaimRequest, namespace_default: int | None) -> int | None:
    """The claim's attempt limit: its own, else the namespace's default, else None (none).

    Bounds: [0, 1000000]; 0 means "the namespace's default".
    """
    value = req.max_attempts
    if not 0 <= value <= MAX_ATTEMPTS_BOUND:
        raise InvalidArgument(
            "max_attempts", f"must lie in [0, {MAX_ATTEMPTS_BOUND}] (0: the default), got {value}"
        )
    return value or namespace_default


def checkpoint(field: str, message: pb.Checkpoint, settings: Settings) -> CheckpointWrite:
    """A checkpoint a worker sends: version >= 1, data within max_checkpoint_bytes, content type.

    ``field`` is the request's field holding it (``checkpoint`` or
    ``next_checkpoint``); errors name ``field.version`` etc. The message's
    fence and write_time are the server's to set and are ignored.
    """
    if message.version < 1:
        raise InvalidArgument(f"{field}.version", f"must be >= 1, got {message.version}")
    limit = settings.max_checkpoint_bytes
    if len(message.data) > limit:
        raise InvalidArgument(
            f"{field}.data", f"is {len(message.data)} bytes long; at most {limit} bytes allowed"
        )
    content_type = message.content_type
    if len(content_type) > CONTENT_TYPE_MAX_BYTES or not all(
        " " <= ch <= "~" for ch in content_type
    ):
        raise InvalidArgument(
            f"{field}.content_type",
            f"must be at most {CONTENT_TYPE_MAX_BYTES} characters of printable ASCII "
            '(e.g. "application/json")',
        )
    return CheckpointWrite(message.version, message.data, content_type)


def fail_reason(req: pb.ReleaseRequest) -> str:
    """Release's fail_reason: only with fail; may be empty; the rules of a revoke's reason."""
    if req.fail and req.complete:
        raise InvalidArgument("fail", "a run ends either completed or failed, not both")
    if not req.fail_reason:
        return ""
    if not req.fail:
        raise InvalidArgument("fail_reason", "is given only with fail")
    return identifier("fail_reason", req.fail_reason, REVOKE_REASON_MAX_BYTES)


def effect_state_filter(value: int) -> EffectState | None:
    """The ListEffects state filter; unknown enum values are refused."""
    name = _enum_name("state", pb.EffectState, value, "EFFECT_STATE_")
    return EffectState(name.lower()) if name is not None else None
