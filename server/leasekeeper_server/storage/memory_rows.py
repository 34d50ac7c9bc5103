"""One task of the in-memory storage, as a row of ``leasekeeper_tasks``: ``TaskRow``.

The row holds what the SQL table's columns hold; it is read through
``core/model.py``'s rules (``TaskRow.lease`` builds the ``Lease`` the SQL's
``{{lease_columns}}`` would return with ``db_now``), and it renders what the
task table's trigger sends (``payload``) and writes to the task's history
(``history``) for an event of it. Decisions over rows are ``memory.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from leasekeeper_server.core.model import Checkpoint, Lease, TaskState


@dataclass(slots=True)
class TaskRow:
    """One task, as a row of ``leasekeeper_tasks`` (migrations/0001, 0004, 0005, 0008).

    ``checkpoint`` stands for the checkpoint columns (None: none saved).
    """

    namespace: str
    task_id: str
    owner_id: str
    fence: int
    state: str  # the row state: 'held', 'released', 'revoked', 'retried', 'quarantined', ...
    expire_time: datetime
    runtime_deadline: datetime
    claim_time: datetime
    update_time: datetime
    end_reason: str | None = None
    claim_request_id: str | None = None
    revoke_reason: str | None = None
    expiry_announced_fence: int | None = None
    attempts: int = 0
    max_attempts: int | None = None
    state_reason: str | None = None
    checkpoint: Checkpoint | None = None

    def live(self, now: datetime) -> bool:
        """Whether the row holds a live lease at ``now``: core.model's rule (``Lease.state``)."""
        return self.lease(now).state is TaskState.HELD

    def lease(self, now: datetime) -> Lease:
        """The row as read at ``now`` (``{{lease_columns}}`` with ``db_now``)."""
        return Lease(
            namespace=self.namespace,
            task_id=self.task_id,
            owner_id=self.owner_id,
            fence=self.fence,
            row_state=self.state,
            expire_time=self.expire_time,
            runtime_deadline=self.runtime_deadline,
            claim_time=self.claim_time,
            end_reason=self.end_reason,
            claim_request_id=self.claim_request_id,
            db_now=now,
            revoke_reason=self.revoke_reason,
            recorded_attempts=self.attempts,
            max_attempts=self.max_attempts,
            state_reason=self.state_reason,
            checkpoint_version=self.checkpoint.version if self.checkpoint else None,
            checkpoint_size=len(self.checkpoint.data) if self.checkpoint else None,
        )

    def payload(
        self, event: str, event_time: datetime, previous_end: datetime | None = None
    ) -> dict[str, Any]:
        """The trigger's notification for this row (leasekeeper_notify_row), as parsed JSON.

        ``previous_end``: for a grant that followed an ended lease, that lease's end.
        """
        return {
            "event": event,
            "event_time": event_time.isoformat(),
            "namespace": self.namespace,
            "task_id": self.task_id,
            "owner_id": self.owner_id,
            "fence": self.fence,
            "state": self.state,
            "expire_time": self.expire_time.isoformat(),
            "runtime_deadline": self.runtime_deadline.isoformat(),
            "claim_time": self.claim_time.isoformat(),
            "end_reason": self.end_reason,
            "claim_request_id": self.claim_request_id,
            "revoke_reason": self.revoke_reason,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "state_reason": self.state_reason,
            "checkpoint_version": self.checkpoint.version if self.checkpoint else None,
            "checkpoint_size": len(self.checkpoint.data) if self.checkpoint else None,
            "previous_end": previous_end.isoformat() if previous_end is not None else None,
        }

    def history(self, event: str) -> dict[str, Any]:
        """The history entry's fields for ``event`` of this row (``leasekeeper_task_event``).

        A grant records the attempt it starts (attempts + 1), a quarantine the
        attempts used up; the reason is the expiry's LossReason, the revoke's
        or the quarantine's reason, else the words of the last cancel, fail
        or retry.
        """
        if event == "expired":  # the lease as it was read at its expiry
            loss = self.lease(self.expire_time).last_loss
            reason = loss.value if loss is not None else ""
        elif event == "revoked":
            reason = self.revoke_reason or ""
        elif event == "quarantined":
            reason = self.end_reason or ""
        else:
            reason = self.state_reason or ""
        attempt = {"claimed": self.attempts + 1, "quarantined": self.attempts}.get(event, 0)
        return {
            "kind": "granted" if event == "claimed" else event,
            "fence": self.fence,
            "owner_id": self.owner_id,
            "attempt": attempt,
            "reason": reason,
        }
