"""The in-memory change feed: what the task table's trigger announces, delivered at once.

``trigger_events`` is the trigger (``leasekeeper_notify_lease``,
migrations/0005, 0006, 0008) in Python: the events a change of a task's row
announces, in its order; the in-memory store publishes each one's payload on
:class:`MemoryEvents` and writes it to the task's history when it commits the
change. :class:`MemoryEvents` is ``protocol.ChangeFeed`` over the same
:class:`~leasekeeper_server.storage.subscription.Fanout` as ``events.LeaseEvents``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from leasekeeper_server.core.model import TaskKey
from leasekeeper_server.storage.memory_rows import TaskRow
from leasekeeper_server.storage.subscription import Fanout


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """One event of a task (``leasekeeper_task_event``): announced, and written to its history.

    Attributes:
        event: 'claimed', 'expired', or the row state the change stored.
        event_time: when it happened (database clock).
        row: the row it describes (the old one for an expiry a change ends).
        previous_end: for a grant that followed an ended lease, that lease's end.
    """

    event: str
    event_time: datetime
    row: TaskRow
    previous_end: datetime | None = None


def trigger_events(old: TaskRow | None, new: TaskRow) -> list[TaskEvent]:
    """What the task table's trigger announces for a change from ``old`` to ``new``.

    ``leasekeeper_notify_lease`` (migrations/0006, 0008): an expired lease
    nobody announced is announced first when a change ends it (a new fence or
    a new state); then 'claimed' for a new row or fence, else the new state
    ('released', 'completed', 'revoked', 'failed', 'cancelled',
    'quarantined', 'retried'; a revoke that quarantines is 'revoked' then
    'quarantined'), else an expiry the sweeper marks.

    Returns:
        The events, in the trigger's order.
    """
    events = []
    if (
        old is not None
        and old.state == "held"
        and (new.fence != old.fence or new.state != old.state)
        and old.expire_time <= new.update_time
        and old.expiry_announced_fence != old.fence
    ):
        events.append(TaskEvent("expired", old.expire_time, old))
    if old is None:
        events.append(TaskEvent("claimed", new.claim_time, new))
    elif new.fence != old.fence:
        ended = old.state != "held" or old.expire_time <= new.claim_time
        events.append(TaskEvent("claimed", new.claim_time, new, old.expire_time if ended else None))
    elif new.state != old.state:
        if new.state == "quarantined" and new.end_reason == "LEASE_REVOKED":
            events.append(TaskEvent("revoked", new.update_time, new))
        events.append(TaskEvent(new.state, new.update_time, new))
    elif new.owner_id != old.owner_id:
        events.append(TaskEvent("claimed", new.claim_time, new))
    elif (
        new.expiry_announced_fence != old.expiry_announced_fence
        and new.expiry_announced_fence == new.fence
    ):
        events.append(TaskEvent("expired", new.expire_time, new))
    return events


class MemoryEvents(Fanout):
    """The change feed in memory: watchers and subscriptions rung by ``memory.MemoryStore``.

    Implements ``protocol.ChangeFeed`` as ``events.LeaseEvents`` does (the same
    :class:`~leasekeeper_server.storage.subscription.Fanout`), minus the LISTEN
    connection: events are delivered when the change is made. ``wake_all``
    does what a lost listening connection does: every watcher woken, every
    subscription told of a gap; ``watched`` lists the tasks watched now (for
    tests that wait for a waiter to be in place).
    """

    def publish(self, payload: dict[str, Any]) -> None:
        """Delivers one committed change (a trigger payload) to its watchers and subscribers."""
        self.deliver(TaskKey(payload["namespace"], payload["task_id"]), payload)
