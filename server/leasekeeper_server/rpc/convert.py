"""Domain values -> proto messages (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from google.protobuf import duration_pb2, timestamp_pb2

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.core.effect_rules import BeginDecision, Effect, EffectPolicy, EffectState
from leasekeeper_server.core.model import (
    ZERO,
    Checkpoint,
    HistoryEntry,
    Lease,
    LossReason,
    NamespaceCount,
    NamespaceStats,
    TaskState,
)

# Domain enum -> proto enum value, by name (the proto's values carry a prefix).
_STATE: dict[TaskState, pb.TaskState] = {s: getattr(pb, f"TASK_STATE_{s.value}") for s in TaskState}
_REASON: dict[LossReason, pb.LossReason] = {
    r: getattr(pb, f"LOSS_REASON_{r.value}") for r in LossReason
}

_POLICY: dict[EffectPolicy, pb.EffectPolicy] = {
    p: getattr(pb, f"EFFECT_POLICY_{p.name}") for p in EffectPolicy
}
_EFFECT_STATE: dict[EffectState, pb.EffectState] = {
    s: getattr(pb, f"EFFECT_STATE_{s.name}") for s in EffectState
}
DECISION: dict[BeginDecision, pb.EffectDecision] = {
    d: getattr(pb, f"EFFECT_DECISION_{d.name}") for d in BeginDecision
}


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp(instant: datetime) -> timestamp_pb2.Timestamp:
    """A Timestamp of an aware datetime (microseconds), built in one call.

    The same value as ``Timestamp.FromDatetime``, without its calendar
    arithmetic in Python: every answer carries two to four of these.
    """
    delta = instant - _EPOCH
    return timestamp_pb2.Timestamp(
        seconds=delta.days * 86_400 + delta.seconds, nanos=delta.microseconds * 1000
    )


def duration(span: timedelta) -> duration_pb2.Duration:
    """A Duration of a timedelta (microseconds), built in one call (see ``timestamp``)."""
    if span < ZERO:  # seconds and nanos must share the sign: the library's way
        message = duration_pb2.Duration()
        message.FromTimedelta(span)
        return message
    return duration_pb2.Duration(
        seconds=span.days * 86_400 + span.seconds, nanos=span.microseconds * 1000
    )


def loss_reason(reason: LossReason | None) -> pb.LossReason:
    """The proto enum value of a loss reason (UNSPECIFIED for None)."""
    return _REASON[reason] if reason is not None else pb.LOSS_REASON_UNSPECIFIED


def lease(task: Lease) -> pb.Lease:
    """The Lease message for a task as read at ``task.db_now``."""
    state = task.state
    return pb.Lease(
        namespace=task.namespace,
        task_id=task.task_id,
        owner_id=task.owner_id,
        fence=task.fence,
        state=_STATE[state],
        end_reason=loss_reason(task.last_loss),
        revoke_reason=task.revoke_reason or "",
        expire_time=timestamp(task.expire_time) if state is not TaskState.FREE else None,
        remaining_ttl=duration(task.remaining_ttl),
        runtime_deadline=timestamp(task.runtime_deadline),
        claim_time=timestamp(task.claim_time),
        attempts=task.attempts,
        max_attempts=task.max_attempts or 0,
        cancel_reason=(task.state_reason or "") if state is TaskState.CANCELLED else "",
        fail_reason=(task.state_reason or "") if state is TaskState.FAILED else "",
        checkpoint_version=task.checkpoint_version or 0,
        checkpoint_size=task.checkpoint_size or 0,
    )


def checkpoint(saved: Checkpoint | None, with_data: bool = True) -> pb.Checkpoint | None:
    """The Checkpoint message (None for none); ``with_data`` False leaves data out."""
    if saved is None:
        return None
    return pb.Checkpoint(
        version=saved.version,
        data=saved.data if with_data else b"",
        content_type=saved.content_type,
        fence=saved.fence,
        write_time=timestamp(saved.write_time),
    )


def history_entry(entry: HistoryEntry) -> pb.HistoryEntry:
    """The HistoryEntry message for a stored entry (kind 'granted' -> HISTORY_KIND_GRANTED)."""
    return pb.HistoryEntry(
        sequence=entry.sequence,
        event_time=timestamp(entry.event_time),
        kind=getattr(pb, f"HISTORY_KIND_{entry.kind.upper()}"),
        fence=entry.fence,
        owner_id=entry.owner_id,
        attempt=entry.attempt,
        checkpoint_version=entry.checkpoint_version,
        checkpoint_size=entry.checkpoint_size,
        effect_key=entry.effect_key,
        effect_outcome=(
            getattr(pb, f"EFFECT_STATE_{entry.effect_outcome.upper()}")
            if entry.effect_outcome
            else pb.EFFECT_STATE_UNSPECIFIED
        ),
        external_operation_id=entry.external_operation_id,
        reason=entry.reason,
        method=entry.method,
    )


def namespace_summary(counted: NamespaceCount) -> pb.NamespaceSummary:
    """The NamespaceSummary message of a namespace and its counted tasks."""
    return pb.NamespaceSummary(
        namespace=counted.namespace,
        task_count=counted.tasks,
        task_count_capped=counted.capped,
    )


def namespace_stats(stats: NamespaceStats) -> pb.GetNamespaceStatsResponse:
    """The GetNamespaceStats answer of a namespace's figures (the same names, field by field)."""
    return pb.GetNamespaceStatsResponse(
        namespace=stats.namespace,
        as_of=timestamp(stats.as_of),
        leases_held=stats.leases_held,
        leases_held_capped=stats.leases_held_capped,
        leases_expired=stats.leases_expired,
        leases_expired_capped=stats.leases_expired_capped,
        tasks_quarantined=stats.tasks_quarantined,
        tasks_quarantined_capped=stats.tasks_quarantined_capped,
        claims_last_minute=stats.claims_last_minute,
        claims_last_minute_capped=stats.claims_last_minute_capped,
        stale_fences_last_minute=stats.stale_fences_last_minute,
        stale_fences_last_minute_capped=stats.stale_fences_last_minute_capped,
        leases_lost_last_minute=stats.leases_lost_last_minute,
        leases_lost_last_minute_capped=stats.leases_lost_last_minute_capped,
        effects_in_doubt=stats.effects_in_doubt,
        effects_in_doubt_capped=stats.effects_in_doubt_capped,
    )


def effect(record: Effect) -> pb.Effect:
    """The Effect message for a ledger record."""
    msg = pb.Effect(
        namespace=record.namespace,
        task_id=record.task_id,
        effect_key=record.effect_key,
        policy=_POLICY[record.policy],
        request_digest=record.request_digest,
        state=_EFFECT_STATE[record.state],
        fence=record.fence,
        complete_fence=record.complete_fence or 0,
        retryable=record.retryable,
        result=record.result,
        attempts=record.attempts,
        external_operation_id=record.external_operation_id,
    )
    msg.begin_time.CopyFrom(timestamp(record.begin_time))
    if record.complete_time is not None:
        msg.complete_time.CopyFrom(timestamp(record.complete_time))
    return msg
