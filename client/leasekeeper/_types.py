"""Value types the client returns, and their conversion from and to protos.

Durations go out as ``google.protobuf.Duration`` and come back as float
seconds; instants come back as timezone-aware UTC ``datetime`` (database clock).
"""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf import duration_pb2, timestamp_pb2

from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import optional_checkpoint
from ._checkpoint import saved as saved_checkpoint
from ._effect_record import EffectRecord as EffectRecord
from ._trust import trust_deadline
from .errors import InvalidArgument
from .v1 import lease_service_pb2 as pb

Seconds = float | int | timedelta
"""A duration: a number of seconds, or a ``timedelta``."""

TASK_STATES = ("FREE", "HELD", "EXPIRED", "COMPLETED", "QUARANTINED", "CANCELLED", "FAILED")
EFFECT_POLICIES = ("ONCE", "LATEST")
EFFECT_STATES = ("RESERVED", "SUCCEEDED", "FAILED")
EFFECT_OUTCOMES = ("SUCCEEDED", "FAILED")


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseInfo:
    """A lease on one task, as the database saw it when the answer was made.

    Attributes:
        namespace: The task's namespace.
        task_id: The task.
        owner_id: The owner the lease was granted to (the last one when FREE/COMPLETED).
        fence: The fencing token; 0 only for a task never claimed.
        state: ``"FREE"``, ``"HELD"``, ``"EXPIRED"``, ``"COMPLETED"``,
            ``"QUARANTINED"`` (attempts used up: claims refused until an operator's
            Retry), ``"CANCELLED"`` or ``"FAILED"`` (COMPLETED, CANCELLED and
            FAILED are terminal).
        expire_time: When the lease ends unless renewed (UTC, database clock); None when FREE.
        remaining_ttl: Seconds left on the lease (database clock); 0 when not live.
        runtime_deadline: End of the runtime budget (UTC), or None.
        claim_time: When the current fence was granted (UTC), or None.
        end_reason: Why the last lease ended (a loss reason name), or None.
        revoke_reason: The operator's reason when the last lease was revoked, else "".
        attempts: Grants of the task that ended without a release (expired,
            runtime exceeded, revoked), counting a lease EXPIRED now; an
            operator's Retry resets it to 0.
        max_attempts: The attempt limit of the current (or last) grant; 0: none.
            When ``attempts`` reaches it and the lease has ended, the task is QUARANTINED.
        cancel_reason: The operator's reason, for a CANCELLED task, else "".
        fail_reason: The owner's reason, for a FAILED task, else "".
        checkpoint_version: The stored checkpoint's version; 0: none.
        checkpoint_size: The stored checkpoint's size in bytes; 0: none.
    """

    namespace: str
    task_id: str
    owner_id: str
    fence: int
    state: str
    expire_time: datetime | None
    remaining_ttl: float
    runtime_deadline: datetime | None
    claim_time: datetime | None
    end_reason: str | None
    revoke_reason: str = ""
    attempts: int = 0
    max_attempts: int = 0
    cancel_reason: str = ""
    fail_reason: str = ""
    checkpoint_version: int = 0
    checkpoint_size: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class RenewedLease(LeaseInfo):
    """A lease as ``LeaseClient.renew`` returns it: the renewed lease and when it was asked.

    A :class:`LeaseInfo` (every field, same meaning), plus:

    Attributes:
        send_time: The client clock (``time.monotonic`` by default) when the
            renewal was sent. With ``remaining_ttl`` it gives the caller's next
            trust deadline: :meth:`trust_deadline`.
    """

    send_time: float = dataclasses.field(kw_only=True)

    def trust_deadline(self, safety_margin: float) -> float:
        """``send_time + remaining_ttl - safety_margin`` on the client clock, in seconds.

        Past it, unless a later renewal was confirmed, the lease counts as lost.
        Pass it to the next ``renew(..., trust_deadline=...)``.

        Args:
            safety_margin: Seconds kept in reserve (e.g. ``min(1 s, ttl / 10)``); >= 0.

        """
        return trust_deadline(self.send_time, self.remaining_ttl, safety_margin)


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimResult:
    """The outcome of one Claim.

    Attributes:
        acquired: True when the caller holds the lease.
        lease: The caller's lease when acquired, else None.
        holder_remaining_ttl: When not acquired: seconds left on the holder's lease.
        send_time: The client clock (``time.monotonic`` by default) when the request
            was sent; the trust deadline is measured from it.
        holder_expire_time: When not acquired: the holder's expire_time (UTC), if sent.
        request_id: The request id the claim was sent with (pass it again to
            retry this claim); empty when it was sent without one.
        retry_after: When not acquired: seconds until the task can be granted,
            as far as the database could tell (holder's ttl plus lock delay).
        checkpoint: When acquired: the task's checkpoint, read in the same
            statement as the grant (resume from it); None when none was ever saved.
    """

    acquired: bool
    lease: LeaseInfo | None
    holder_remaining_ttl: float | None
    send_time: float
    holder_expire_time: datetime | None = None
    request_id: str = ""
    retry_after: float | None = None
    checkpoint: Checkpoint | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TaskEvent:
    """One event of a task, as ``LeaseClient.watch`` delivers it.

    Attributes:
        type: ``"SNAPSHOT"`` (the task as it is: first, and after a possible
            gap), ``"CLAIMED"``, ``"RELEASED"``, ``"EXPIRED"``, ``"COMPLETED"``,
            ``"REVOKED"``, ``"QUARANTINED"``, ``"RETRIED"``, ``"CANCELLED"`` or
            ``"FAILED"``.
        lease: The task's lease as the event left it; None for a namespace
            SNAPSHOT (re-read what you care about).
        event_time: When it happened (UTC, database clock); None when unknown.
    """

    type: str
    lease: LeaseInfo | None
    event_time: datetime | None


@dataclasses.dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """A namespace that holds tasks, as ``LeaseClient.list_namespaces`` returns it.

    Attributes:
        namespace: The namespace.
        task_count: How many tasks it holds, every state, counted up to 1000.
        task_count_capped: True when it holds more than ``task_count`` (1000)
            tasks: the server stops counting there.
    """

    namespace: str
    task_count: int
    task_count_capped: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class NamespaceStats:
    """A namespace's figures at one instant, as ``LeaseClient.namespace_stats`` returns them.

    Every count is an ``int`` counted by the server on the database clock, at
    ``as_of``. Each count stops at 1000 rows: when there were more to count,
    its ``*_capped`` flag is set, and the namespace holds at least that many,
    maybe more. ``leases_held``, ``leases_expired`` and
    ``tasks_quarantined`` are counted together over the namespace's leases
    the expiry sweeper has not announced as expired: past 1000 of those, all
    three are capped. The ``*_last_minute`` counts are of the task history's
    entries whose event time lies in the 60 seconds before ``as_of``.

    Attributes:
        namespace: The namespace.
        leases_held: Tasks whose lease is live (``HELD``).
        leases_expired: Tasks whose lease's expiry passed and that no claim
            has taken over since (``EXPIRED``: the next claim is granted).
        tasks_quarantined: Tasks whose attempts are used up (``QUARANTINED``):
            claims are refused until an operator's retry.
        claims_last_minute: Leases granted in the last 60 seconds.
        stale_fences_last_minute: Stale fences refused in the last 60 seconds
            (by ValidateFence and BeginEffect; each fence, reason and method of
            a task counted at its first refusal).
        leases_lost_last_minute: Leases lost in the last 60 seconds: expired
            (``LEASE_EXPIRED``, ``RUNTIME_EXCEEDED``; counted from the lease's
            expiry, once the server has announced it) or revoked.
        effects_in_doubt: Effects ``RESERVED`` by a fence that is not the
            task's live lease now (superseded, expired, released, revoked, or
            the task ended): the effect may or may not have happened; each
            needs reconciling with the outside system
            (``list_effects(task_id, state="RESERVED")`` lists a task's).
        as_of: When the figures were read (UTC, database clock).
        leases_held_capped: ``leases_held`` stopped at the limit: at least that many.
        leases_expired_capped: ``leases_expired`` stopped at the limit.
        tasks_quarantined_capped: ``tasks_quarantined`` stopped at the limit.
        claims_last_minute_capped: ``claims_last_minute`` stopped at the limit.
        stale_fences_last_minute_capped: ``stale_fences_last_minute`` stopped at the limit.
        leases_lost_last_minute_capped: ``leases_lost_last_minute`` stopped at the limit.
        effects_in_doubt_capped: ``effects_in_doubt`` stopped at the limit.
    """

    namespace: str
    leases_held: int
    leases_expired: int
    tasks_quarantined: int
    claims_last_minute: int
    stale_fences_last_minute: int
    leases_lost_last_minute: int
    effects_in_doubt: int
    as_of: datetime
    leases_held_capped: bool = False
    leases_expired_capped: bool = False
    tasks_quarantined_capped: bool = False
    claims_last_minute_capped: bool = False
    stale_fences_last_minute_capped: bool = False
    leases_lost_last_minute_capped: bool = False
    effects_in_doubt_capped: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class FenceCheck:
    """The answer of ValidateFence.

    Attributes:
        valid: True iff the fence is current, its lease HELD and the task not ended
            (COMPLETED, FAILED or CANCELLED).
        current_fence: The task's current fence (0 for a task never claimed).
        reason: Why not valid (a loss reason name), None when valid.
        remaining_ttl: When valid: seconds left on the lease (database clock).
        expire_time: When valid: the lease's expire_time (UTC).
    """

    valid: bool
    current_fence: int
    reason: str | None
    remaining_ttl: float | None
    expire_time: datetime | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class BeginResult:
    """The answer of BeginEffect.

    Attributes:
        decision: ``"PROCEED"`` (reserved for the caller's fence: do the effect
            now, then complete it), ``"ALREADY_APPLIED"`` (a confirmed outcome
            exists: do not repeat the effect) or ``"IN_DOUBT"`` (an earlier
            attempt was never confirmed: reconcile with the outside system first).
        effect: PROCEED: the new reservation. ALREADY_APPLIED: the confirmed
            outcome. IN_DOUBT: the earlier, unconfirmed attempt.
    """

    decision: str
    effect: EffectRecord


def seconds(value: Seconds, name: str) -> float:
    """Convert a duration to float seconds.

    Args:
        value: Seconds as a number, or a ``timedelta``.
        name: The argument name, for the error.

    Returns:
        The duration in seconds.

    Raises:
        InvalidArgument: ``value`` is not finite or not a duration (raised locally).

    """
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(
            f"{name} must be a finite number of seconds or a timedelta, got {value!r}",
            field_violations=[(name, "not a finite duration")],
            code=None,
        )
    return float(value)


def optional_seconds(value: Seconds | None, name: str) -> float | None:
    """:func:`seconds`, with None passed through (same errors)."""
    return None if value is None else seconds(value, name)


def to_duration(value: Seconds | None, name: str) -> duration_pb2.Duration | None:
    """Convert an optional duration to a ``Duration`` proto (None stays unset).

    Raises:
        InvalidArgument: ``value`` is not a finite duration (raised locally).

    """
    if value is None:
        return None
    message = duration_pb2.Duration()
    message.FromNanoseconds(round(seconds(value, name) * 1e9))
    return message


def from_duration(message: duration_pb2.Duration) -> float:
    """A ``Duration`` proto as float seconds."""
    return message.ToNanoseconds() / 1e9


def instant(parent: object, field: str) -> datetime | None:
    """The ``Timestamp`` field ``field`` of a proto as a UTC ``datetime``; None when unset."""
    if not parent.HasField(field):  # type: ignore[attr-defined]
        return None
    stamp: timestamp_pb2.Timestamp = getattr(parent, field)
    return stamp.ToDatetime(tzinfo=UTC)


def enum_name(enum: object, value: int, prefix: str) -> str | None:
    """An enum value's name without its prefix; None for the UNSPECIFIED value."""
    if value == 0:
        return None
    try:
        name: str = enum.Name(value)  # type: ignore[attr-defined]
    except ValueError:  # a value newer than these stubs
        return str(value)
    return name.removeprefix(prefix)


def _lease_fields(message: pb.Lease) -> dict[str, Any]:
    """The :class:`LeaseInfo` fields of a ``Lease`` proto, by name."""
    return {
        "namespace": message.namespace,
        "task_id": message.task_id,
        "owner_id": message.owner_id,
        "fence": message.fence,
        "state": enum_name(pb.TaskState, message.state, "TASK_STATE_") or "UNSPECIFIED",
        "expire_time": instant(message, "expire_time"),
        "remaining_ttl": from_duration(message.remaining_ttl),
        "runtime_deadline": instant(message, "runtime_deadline"),
        "claim_time": instant(message, "claim_time"),
        "end_reason": enum_name(pb.LossReason, message.end_reason, "LOSS_REASON_"),
        "revoke_reason": message.revoke_reason,
        "attempts": message.attempts,
        "max_attempts": message.max_attempts,
        "cancel_reason": message.cancel_reason,
        "fail_reason": message.fail_reason,
        "checkpoint_version": message.checkpoint_version,
        "checkpoint_size": message.checkpoint_size,
    }


def lease_info(message: pb.Lease) -> LeaseInfo:
    """Convert a ``Lease`` proto."""
    return LeaseInfo(**_lease_fields(message))


def renewed_lease(message: pb.Lease, send_time: float) -> RenewedLease:
    """Convert a ``RenewResponse``'s ``Lease``; ``send_time`` is the client clock at sending."""
    return RenewedLease(**_lease_fields(message), send_time=send_time)


def task_event(message: pb.TaskEvent) -> TaskEvent:
    """Convert a ``TaskEvent`` proto."""
    return TaskEvent(
        type=enum_name(pb.TaskEventType, message.type, "TASK_EVENT_TYPE_") or "UNSPECIFIED",
        lease=lease_info(message.lease) if message.HasField("lease") else None,
        event_time=instant(message, "event_time"),
    )


def namespace_info(message: pb.NamespaceSummary) -> NamespaceInfo:
    """Convert a ``NamespaceSummary`` proto."""
    return NamespaceInfo(
        namespace=message.namespace,
        task_count=message.task_count,
        task_count_capped=message.task_count_capped,
    )


def namespace_stats(message: pb.GetNamespaceStatsResponse) -> NamespaceStats:
    """Convert a ``GetNamespaceStatsResponse`` (field for field, the same names)."""
    return NamespaceStats(
        namespace=message.namespace,
        leases_held=message.leases_held,
        leases_expired=message.leases_expired,
        tasks_quarantined=message.tasks_quarantined,
        claims_last_minute=message.claims_last_minute,
        stale_fences_last_minute=message.stale_fences_last_minute,
        leases_lost_last_minute=message.leases_lost_last_minute,
        effects_in_doubt=message.effects_in_doubt,
        # Always set by the server; an unset one reads as the epoch, never as now.
        as_of=message.as_of.ToDatetime(tzinfo=UTC),
        leases_held_capped=message.leases_held_capped,
        leases_expired_capped=message.leases_expired_capped,
        tasks_quarantined_capped=message.tasks_quarantined_capped,
        claims_last_minute_capped=message.claims_last_minute_capped,
        stale_fences_last_minute_capped=message.stale_fences_last_minute_capped,
        leases_lost_last_minute_capped=message.leases_lost_last_minute_capped,
        effects_in_doubt_capped=message.effects_in_doubt_capped,
    )


def claim_result(message: pb.ClaimResponse, send_time: float, request_id: str = "") -> ClaimResult:
    """Convert a ``ClaimResponse``; ``send_time`` is the client clock at sending.

    ``request_id`` is the one the claim was sent with (empty for none).
    """
    acquired = message.acquired
    return ClaimResult(
        acquired=acquired,
        lease=lease_info(message.lease) if acquired else None,
        holder_remaining_ttl=(
            None
            if acquired or not message.HasField("holder_remaining_ttl")
            else from_duration(message.holder_remaining_ttl)
        ),
        send_time=send_time,
        holder_expire_time=None if acquired else instant(message, "holder_expire_time"),
        request_id=request_id,
        retry_after=(
            None
            if acquired or not message.HasField("retry_after")
            else from_duration(message.retry_after)
        ),
        checkpoint=optional_checkpoint(message, "checkpoint") if acquired else None,
    )


def fence_check(message: pb.ValidateFenceResponse) -> FenceCheck:
    """Convert a ``ValidateFenceResponse``."""
    return FenceCheck(
        valid=message.valid,
        current_fence=message.current_fence,
        reason=enum_name(pb.LossReason, message.reason, "LOSS_REASON_"),
        remaining_ttl=(
            from_duration(message.remaining_ttl) if message.HasField("remaining_ttl") else None
        ),
        expire_time=instant(message, "expire_time"),
    )


def _effect_fields(message: pb.Effect) -> dict[str, Any]:
    """The :class:`EffectRecord` fields of an ``Effect`` proto, by name."""
    return {
        "namespace": message.namespace,
        "task_id": message.task_id,
        "effect_key": message.effect_key,
        "policy": enum_name(pb.EffectPolicy, message.policy, "EFFECT_POLICY_") or "UNSPECIFIED",
        "request_digest": message.request_digest,
        "state": enum_name(pb.EffectState, message.state, "EFFECT_STATE_") or "UNSPECIFIED",
        "fence": message.fence,
        "complete_fence": message.complete_fence,
        "retryable": message.retryable,
        "result": message.result,
        "attempts": message.attempts,
        # Always set by the server; an unset one reads as the epoch, never as now.
        "begin_time": message.begin_time.ToDatetime(tzinfo=UTC),
        "complete_time": instant(message, "complete_time"),
        "external_operation_id": message.external_operation_id,
    }


def effect_record(message: pb.Effect) -> EffectRecord:
    """Convert an ``Effect`` proto."""
    return EffectRecord(**_effect_fields(message))


def completed_effect(
    message: pb.CompleteEffectResponse, sent: pb.Checkpoint | None, fence: int
) -> EffectRecord:
    """Convert a ``CompleteEffectResponse``.

    ``sent`` is the ``next_checkpoint`` the request carried (None: none): the
    answer's checkpoint leaves the data out, the caller has it. ``fence`` is the
    request's, the checkpoint's writer when the answer does not say.
    """
    checkpoint = None
    if sent is not None:
        stored = message.checkpoint if message.HasField("checkpoint") else None
        checkpoint = saved_checkpoint(sent, stored, fence)
    return EffectRecord(**_effect_fields(message.effect), checkpoint=checkpoint)


def begin_result(message: pb.BeginEffectResponse) -> BeginResult:
    """Convert a ``BeginEffectResponse``."""
    return BeginResult(
        decision=enum_name(pb.EffectDecision, message.decision, "EFFECT_DECISION_")
        or "UNSPECIFIED",
        effect=effect_record(message.effect),
    )


def _enum_value(
    value: str, *, field: str, names: tuple[str, ...], enum: object, prefix: str, what: str
) -> int:
    name = value.upper().removeprefix(prefix) if isinstance(value, str) else None
    if name not in names:
        raise InvalidArgument(
            f"{field} must be one of {', '.join(names)}, got {value!r}",
            field_violations=[(field, f"unknown {what}")],
            code=None,
        )
    return int(enum.Value(prefix + name))  # type: ignore[attr-defined]


def effect_policy(policy: str) -> int:
    """A policy name (``"ONCE"`` or ``"EFFECT_POLICY_ONCE"``) as the ``EffectPolicy`` value.

    Raises:
        InvalidArgument: Not ``ONCE`` or ``LATEST`` (raised locally, field ``policy``).

    """
    return _enum_value(
        policy,
        field="policy",
        names=EFFECT_POLICIES,
        enum=pb.EffectPolicy,
        prefix="EFFECT_POLICY_",
        what="effect policy",
    )


def effect_state(state: str | None) -> int:
    """A state name (``"RESERVED"`` or ``"EFFECT_STATE_RESERVED"``) as the ``EffectState`` value.

    None is ``EFFECT_STATE_UNSPECIFIED`` (no filter).

    Raises:
        InvalidArgument: Unknown state name (raised locally, field ``state``).

    """
    if state is None:
        return pb.EFFECT_STATE_UNSPECIFIED
    return _enum_value(
        state,
        field="state",
        names=EFFECT_STATES,
        enum=pb.EffectState,
        prefix="EFFECT_STATE_",
        what="effect state",
    )


def effect_outcome(outcome: str) -> int:
    """An outcome name (``"SUCCEEDED"`` or ``"FAILED"``) as the ``EffectState`` value.

    Raises:
        InvalidArgument: Not ``SUCCEEDED`` or ``FAILED`` (raised locally, field ``outcome``).

    """
    return _enum_value(
        outcome,
        field="outcome",
        names=EFFECT_OUTCOMES,
        enum=pb.EffectState,
        prefix="EFFECT_STATE_",
        what="effect outcome",
    )


def task_state(state: str | None) -> int:
    """A state name (``"HELD"`` or ``"TASK_STATE_HELD"``) as the ``TaskState`` value.

    Raises:
        InvalidArgument: Unknown state name (raised locally).

    """
    if state is None:
        return pb.TASK_STATE_UNSPECIFIED
    return _enum_value(
        state,
        field="state",
        names=TASK_STATES,
        enum=pb.TaskState,
        prefix="TASK_STATE_",
        what="task state",
    )
