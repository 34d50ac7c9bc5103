"""Domain values -> proto messages (pure)."""

from __future__ import annotations

from leasekeeper.v1 import lease_service_pb2 as pb

from .model import LossReason, Task, TaskState

# Domain enum -> proto enum value, by name (the proto's values carry a prefix).
_STATE: dict[TaskState, pb.TaskState] = {s: getattr(pb, f"TASK_STATE_{s.value}") for s in TaskState}
_REASON: dict[LossReason, pb.LossReason] = {
    r: getattr(pb, f"LOSS_REASON_{r.value}") for r in LossReason
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
    )
    if state is not TaskState.FREE:
        msg.expire_time.FromDatetime(task.expire_time)
    msg.remaining_ttl.FromTimedelta(task.remaining_ttl)
    msg.runtime_deadline.FromDatetime(task.runtime_deadline)
    msg.claim_time.FromDatetime(task.claim_time)
    return msg
