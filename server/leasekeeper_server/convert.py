"""Domain values -> proto messages (pure)."""

from __future__ import annotations

from leasekeeper.v1 import lease_service_pb2 as pb

from .effects import BeginDecision, Effect, EffectPolicy, EffectState
from .model import LossReason, Task, TaskState

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


def loss_reason(reason: LossReason | None) -> pb.LossReason:
    """The proto enum value of a loss reason (UNSPECIFIED for None)."""
    return _REASON[reason] if reason is not None else pb.LOSS_REASON_UNSPECIFIED


def lease(task: Task) -> pb.Lease:
    """The Lease message for a task as read at ``task.db_now``."""
    state = task.state
    msg = pb.Lease(
        namespace=task.namespace,
        task_id=task.task_id,
        owner_id=task.owner_id,
        fence=task.fence,
        state=_STATE[state],
        end_reason=loss_reason(task.last_loss),
        revoke_reason=task.revoke_reason or "",
    )
    if state is not TaskState.FREE:
        msg.expire_time.FromDatetime(task.expire_time)
    msg.remaining_ttl.FromTimedelta(task.remaining_ttl)
    msg.runtime_deadline.FromDatetime(task.runtime_deadline)
    msg.claim_time.FromDatetime(task.claim_time)
    return msg


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
    )
    msg.begin_time.FromDatetime(record.begin_time)
    if record.complete_time is not None:
        msg.complete_time.FromDatetime(record.complete_time)
    return msg
