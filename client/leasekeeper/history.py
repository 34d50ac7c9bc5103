"""A task's history: what happened to it, oldest first (``LeaseClient.iter_task_history``).

The server writes an entry in the same transaction as each change of a task:
grants, releases, expiries, revokes, quarantines, retries, cancellations,
completions, failures, checkpoint writes, effect reservations and outcomes,
and stale fences refused at ValidateFence and BeginEffect. Entries are kept
for the server's ``history_max_age_s`` and at most ``history_max_per_task``
per task; older ones are pruned.
"""

from __future__ import annotations

import dataclasses
import enum
from datetime import datetime

from ._types import enum_name, instant
from .v1 import lease_service_pb2 as pb


class HistoryKind(enum.StrEnum):
    """What a :class:`HistoryEntry` records (the ``HistoryKind`` names without their prefix)."""

    UNSPECIFIED = "UNSPECIFIED"
    """A kind this client does not know (a newer server's), or none."""
    GRANTED = "GRANTED"
    """A lease was granted: ``fence``, ``owner_id``, ``attempt``."""
    RELEASED = "RELEASED"
    """The owner released its lease."""
    EXPIRED = "EXPIRED"
    """The lease's expire_time passed (``reason`` LEASE_EXPIRED or RUNTIME_EXCEEDED);
    ``event_time`` is the expire_time."""
    REVOKED = "REVOKED"
    """An operator revoked the lease (``reason``)."""
    COMPLETED = "COMPLETED"
    """The task was completed."""
    FAILED = "FAILED"
    """The owner ended the run as failed (``reason``)."""
    CANCELLED = "CANCELLED"
    """An operator cancelled the task (``reason``)."""
    QUARANTINED = "QUARANTINED"
    """The task's attempts were used up (``attempt``: how many)."""
    RETRIED = "RETRIED"
    """An operator put the quarantined task back (``reason``)."""
    CHECKPOINT_SAVED = "CHECKPOINT_SAVED"
    """A checkpoint was saved: ``checkpoint_version``, ``checkpoint_size``, ``fence``."""
    EFFECT_RESERVED = "EFFECT_RESERVED"
    """An effect was reserved: ``effect_key``, ``fence``, ``attempt`` (the effect's)."""
    EFFECT_COMPLETED = "EFFECT_COMPLETED"
    """An effect's outcome was recorded: ``effect_key``, ``fence`` (the recording one),
    ``effect_outcome``, ``external_operation_id``."""
    FENCE_REFUSED = "FENCE_REFUSED"
    """A fence that may not act was refused: ``fence``, ``reason`` (a loss reason
    name), ``method`` (``"ValidateFence"`` or ``"BeginEffect"``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One entry of a task's history. Fields that do not apply to its kind are 0 or "".

    Attributes:
        sequence: Orders the entries: higher is later (unique, not consecutive per task).
        event_time: When it happened (UTC, database clock); None if the server sent none.
        kind: What happened.
        fence: The fence the entry is about (0 when none).
        owner_id: The owner of that fence ("" when not known).
        attempt: GRANTED: which attempt the grant is (1 + the task's attempts
            before it); QUARANTINED: the attempts used; EFFECT_RESERVED: the effect's attempts.
        checkpoint_version: CHECKPOINT_SAVED: the version saved.
        checkpoint_size: CHECKPOINT_SAVED: its size in bytes.
        effect_key: EFFECT_RESERVED, EFFECT_COMPLETED: the effect's idempotency key.
        effect_outcome: EFFECT_COMPLETED: ``"SUCCEEDED"`` or ``"FAILED"``; else None.
        external_operation_id: EFFECT_COMPLETED: the outside system's id for the operation.
        reason: The operator's or owner's words (REVOKED, CANCELLED, RETRIED,
            FAILED), or a loss reason name (EXPIRED, FENCE_REFUSED, QUARANTINED).
        method: FENCE_REFUSED: the RPC that refused the fence.
    """

    sequence: int
    event_time: datetime | None
    kind: HistoryKind
    fence: int = 0
    owner_id: str = ""
    attempt: int = 0
    checkpoint_version: int = 0
    checkpoint_size: int = 0
    effect_key: str = ""
    effect_outcome: str | None = None
    external_operation_id: str = ""
    reason: str = ""
    method: str = ""


def history_kind(value: int) -> HistoryKind:
    """A ``HistoryKind`` proto value as :class:`HistoryKind` (UNSPECIFIED when unknown)."""
    name = enum_name(pb.HistoryKind, value, "HISTORY_KIND_")
    try:
        return HistoryKind(name or "UNSPECIFIED")
    except ValueError:  # a kind newer than this client
        return HistoryKind.UNSPECIFIED


def history_entry(message: pb.HistoryEntry) -> HistoryEntry:
    """Convert a ``HistoryEntry`` proto."""
    return HistoryEntry(
        sequence=message.sequence,
        event_time=instant(message, "event_time"),
        kind=history_kind(message.kind),
        fence=message.fence,
        owner_id=message.owner_id,
        attempt=message.attempt,
        checkpoint_version=message.checkpoint_version,
        checkpoint_size=message.checkpoint_size,
        effect_key=message.effect_key,
        effect_outcome=enum_name(pb.EffectState, message.effect_outcome, "EFFECT_STATE_"),
        external_operation_id=message.external_operation_id,
        reason=message.reason,
        method=message.method,
    )


def list_request(
    namespace: str, task_id: str, page_size: int, page_token: str
) -> pb.ListTaskHistoryRequest:
    """The ``ListTaskHistoryRequest`` of one page."""
    return pb.ListTaskHistoryRequest(
        namespace=namespace, task_id=task_id, page_size=page_size, page_token=page_token
    )


def page(message: pb.ListTaskHistoryResponse) -> tuple[list[HistoryEntry], str]:
    """Convert a ``ListTaskHistoryResponse``: ``(entries, next_page_token)``."""
    return [history_entry(entry) for entry in message.entries], message.next_page_token
