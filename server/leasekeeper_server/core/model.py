"""Domain types of the lease service, and the state model.

A task is named by ``(namespace, task_id)`` and has one row, created by its
first claim and never deleted (it carries the fence counter). The row's
``state`` records the last transition; whether a lease is live is decided
only against the database's clock (``db_now``, read by the same statement):

==============================  =============================================
row                             task state
==============================  =============================================
no row                          FREE (never claimed; fence 0)
held, expire > db_now           HELD
held, expire <= db_now          EXPIRED: claimable; lost for everything else;
                                QUARANTINED when its ending uses up the last
                                attempt (:attr:`Lease.attempt_used_up`)
released / revoked / retried    FREE
quarantined                     QUARANTINED: claims refused until Retry
completed / failed / cancelled  COMPLETED / FAILED / CANCELLED: terminal, no
                                fence is ever valid
==============================  =============================================

Attempts (``migrations/0008_runs.sql``): the grants that ended without a
release. The row stores those recorded as ended; an EXPIRED lease not yet
taken over is one more (:attr:`Lease.attempts`).

Transitions (each one SQL statement in ``sql/queries.sql``):

* claim: new, FREE or EXPIRED -> HELD with fence + 1. HELD by the claiming
  owner: a claim under another request id (a new incarnation of the owner)
  -> HELD with fence + 1, superseding the earlier fence; the same request id,
  or none -> unchanged (a retry gets the same lease back).
* renew: HELD by (owner, fence) -> HELD with a later expire_time, never past
  the runtime deadline; an EXPIRED lease is never revived.
* release: HELD or EXPIRED by (owner, fence) -> FREE, or COMPLETED.

A fence grows by exactly 1 per grant on one database timeline, jumps above
every earlier timeline's fences after a promotion (the timeline floor of
``migrations/0003_fence_timeline.sql``), and is never reused, so "fence below
the current one" means the lease was superseded, whatever happened since.

This module is pure: no grpc, no asyncpg, no clock of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

ZERO = timedelta(0)

# The most tasks one ListLeases call reads, however rare its filter's matches
# (the `$6` of statement list_leases): a listing's cost never follows the
# namespace's size. A page of a rare filter may be short and not the last.
LIST_SCAN_BUDGET = 1000

# ListNamespaces counts a namespace's tasks up to this many (the `$3` of
# statement list_namespaces reads one more, to know there are more): a page's
# cost never follows a namespace's size.
NAMESPACE_COUNT_LIMIT = 1000

# GetNamespaceStats counts each figure over at most this many rows (statement
# namespace_stats reads one more, to know there are more): a call's cost never
# follows the namespace's size. A figure that reached it is capped.
STATS_COUNT_LIMIT = 1_000

# GetNamespaceStats' "last minute": the history entries whose event_time is
# this close before the read (database clock).
STATS_WINDOW = timedelta(seconds=60)


class TaskState(enum.StrEnum):
    """A task's state, as judged on the database clock."""

    FREE = "FREE"
    HELD = "HELD"
    EXPIRED = "EXPIRED"
    COMPLETED = "COMPLETED"
    QUARANTINED = "QUARANTINED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"


class LossReason(enum.StrEnum):
    """Why an owner does not hold a lease; the ErrorInfo reason on errors."""

    LEASE_EXPIRED = "LEASE_EXPIRED"
    LEASE_SUPERSEDED = "LEASE_SUPERSEDED"
    LEASE_RELEASED = "LEASE_RELEASED"
    LEASE_REVOKED = "LEASE_REVOKED"
    RUNTIME_EXCEEDED = "RUNTIME_EXCEEDED"
    TASK_COMPLETED = "TASK_COMPLETED"
    NOT_OWNER = "NOT_OWNER"
    FENCE_UNKNOWN = "FENCE_UNKNOWN"
    TASK_CANCELLED = "TASK_CANCELLED"
    TASK_FAILED = "TASK_FAILED"
    TASK_QUARANTINED = "TASK_QUARANTINED"


_ROW_STATE_REASON = {
    "released": LossReason.LEASE_RELEASED,
    "revoked": LossReason.LEASE_REVOKED,
    "completed": LossReason.TASK_COMPLETED,
    "cancelled": LossReason.TASK_CANCELLED,
    "failed": LossReason.TASK_FAILED,
}

# Row states of an ended task: no fence is valid, no claim granted.
_TERMINAL = {
    "completed": TaskState.COMPLETED,
    "cancelled": TaskState.CANCELLED,
    "failed": TaskState.FAILED,
}


@dataclass(frozen=True, slots=True)
class TaskKey:
    """Names one task."""

    namespace: str
    task_id: str


@dataclass(frozen=True, slots=True)
class LeaseRef:
    """Names one lease: a task, its owner and its fence."""

    key: TaskKey
    owner_id: str
    fence: int


@dataclass(frozen=True, slots=True)
class Lease:
    """A task's current lease: its row, together with the database instant it was read at.

    The proto's ``Lease`` message (``rpc.convert.lease``); one row of
    ``leasekeeper_tasks``. A task never claimed has none.

    Attributes:
        row_state: the stored state: 'held', 'released', 'revoked' or 'completed'.
        claim_request_id: the request id of the claim that granted the current
            fence, or None when that claim carried none.
        db_now: ``clock_timestamp()`` of the statement that produced the row.
        revoke_reason: the operator's reason, when the last lease was revoked.
        recorded_attempts: the row's ``attempts``: ended grants recorded so far
            (see :attr:`attempts`).
        max_attempts: the current grant's attempt limit; None for none.
        state_reason: the words of the last cancel, fail or retry.
        checkpoint_version: the stored checkpoint's version; None for none.
        checkpoint_size: its data's length, bytes; None for none.
    """

    namespace: str
    task_id: str
    owner_id: str
    fence: int
    row_state: str
    expire_time: datetime
    runtime_deadline: datetime
    claim_time: datetime
    end_reason: str | None
    claim_request_id: str | None
    db_now: datetime
    revoke_reason: str | None = None
    recorded_attempts: int = 0
    max_attempts: int | None = None
    state_reason: str | None = None
    checkpoint_version: int | None = None
    checkpoint_size: int | None = None

    def is_claim_of(self, owner_id: str, request_id: str | None) -> bool:
        """True when a claim by ``owner_id`` with ``request_id`` is a retry of this lease's claim.

        The same owner, and either the same request id or none at all (a client
        without request ids cannot tell a retry from a new incarnation).
        """
        if self.owner_id != owner_id:
            return False
        return request_id is None or request_id == self.claim_request_id

    @property
    def attempt_used_up(self) -> bool:
        """Whether the current lease's ending uses up the task's last attempt.

        The rule of fragment ``attempt_used_up`` in ``sql/queries.sql``.
        """
        return self.max_attempts is not None and self.recorded_attempts + 1 >= self.max_attempts

    @property
    def state(self) -> TaskState:
        """The task state at ``db_now``."""
        terminal = _TERMINAL.get(self.row_state)
        if terminal is not None:
            return terminal
        if self.row_state == "quarantined":
            return TaskState.QUARANTINED
        if self.row_state != "held":
            return TaskState.FREE
        if self.expire_time > self.db_now:
            return TaskState.HELD
        return TaskState.QUARANTINED if self.attempt_used_up else TaskState.EXPIRED

    @property
    def attempts(self) -> int:
        """Grants that ended without a release, at ``db_now``: an expired lease counts."""
        ended_now = self.row_state == "held" and self.expire_time <= self.db_now
        return self.recorded_attempts + ended_now

    @property
    def unclaimable(self) -> LossReason | None:
        """Why no claim is granted whatever the owner (TASK_COMPLETED, ...), or None."""
        state = self.state
        if state is TaskState.QUARANTINED:
            return LossReason.TASK_QUARANTINED
        if state.value in ("COMPLETED", "CANCELLED", "FAILED"):
            return _ROW_STATE_REASON[self.row_state]
        return None

    @property
    def remaining_ttl(self) -> timedelta:
        """Time left on the lease at ``db_now``; zero unless HELD."""
        if self.state is not TaskState.HELD:
            return ZERO
        return self.expire_time - self.db_now

    @property
    def last_loss(self) -> LossReason | None:
        """Why the current fence's lease is no longer live, or None while it is HELD."""
        if self.row_state == "held":
            if self.expire_time > self.db_now:
                return None
            if self.expire_time >= self.runtime_deadline:
                return LossReason.RUNTIME_EXCEEDED
            return LossReason.LEASE_EXPIRED
        reason = _ROW_STATE_REASON.get(self.row_state)
        if reason is not None:
            return reason
        # quarantined, retried: the lease ended as end_reason says
        return LossReason(self.end_reason) if self.end_reason else LossReason.LEASE_EXPIRED


def lease_from_row(row: Mapping[str, Any]) -> Lease:
    """A task row (with ``db_now``) as a Lease: an asyncpg record, or a dict of the same keys."""
    return Lease(
        namespace=row["namespace"],
        task_id=row["task_id"],
        owner_id=row["owner_id"],
        fence=row["fence"],
        row_state=row["state"],
        expire_time=row["expire_time"],
        runtime_deadline=row["runtime_deadline"],
        claim_time=row["claim_time"],
        end_reason=row["end_reason"],
        claim_request_id=row["claim_request_id"],
        db_now=row["db_now"],
        revoke_reason=row.get("revoke_reason"),
        recorded_attempts=row.get("attempts") or 0,
        max_attempts=row.get("max_attempts"),
        state_reason=row.get("state_reason"),
        checkpoint_version=row.get("checkpoint_version"),
        checkpoint_size=row.get("checkpoint_size"),
    )


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A task's saved progress (one per task, the latest), as stored.

    Attributes:
        version: chosen by the worker; every write moves it forward.
        data: opaque bytes, at most the server's max_checkpoint_bytes.
        content_type: what ``data`` is (may be empty).
        fence: the fence that wrote it.
        write_time: when it was written (database clock).
    """

    version: int
    data: bytes
    content_type: str
    fence: int
    write_time: datetime


@dataclass(frozen=True, slots=True)
class CheckpointWrite:
    """A checkpoint a worker sends: what SaveCheckpoint, a beat or CompleteEffect carries."""

    version: int
    data: bytes
    content_type: str


def checkpoint_from_row(row: Mapping[str, Any]) -> Checkpoint | None:
    """The checkpoint columns of a task row (``{{checkpoint_columns}}``); None when none."""
    if row.get("checkpoint_version") is None:
        return None
    return Checkpoint(
        version=row["checkpoint_version"],
        data=bytes(row["checkpoint_data"]),
        content_type=row["checkpoint_content_type"] or "",
        fence=row["checkpoint_fence"],
        write_time=row["checkpoint_time"],
    )


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One entry of a task's history (``leasekeeper_task_history``; the proto's HistoryEntry).

    ``kind`` is the stored kind: granted, released, expired, revoked,
    completed, failed, cancelled, quarantined, retried, checkpoint_saved,
    effect_reserved, effect_completed, fence_refused. Fields a kind does not
    use are 0 or empty.
    """

    sequence: int
    event_time: datetime
    kind: str
    fence: int
    owner_id: str
    attempt: int
    checkpoint_version: int
    checkpoint_size: int
    effect_key: str
    effect_outcome: str
    external_operation_id: str
    reason: str
    method: str


def history_from_row(row: Mapping[str, Any]) -> HistoryEntry:
    """A row of ``leasekeeper_task_history`` as a HistoryEntry."""
    return HistoryEntry(**{name: row[name] for name in HistoryEntry.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class NamespaceCount:
    """A namespace that holds tasks, with its count of tasks (ListNamespaces).

    Attributes:
        namespace: the namespace.
        tasks: how many tasks it holds, every state, counted up to
            ``NAMESPACE_COUNT_LIMIT``.
        capped: True when it holds more than ``tasks`` (the count stopped).
    """

    namespace: str
    tasks: int
    capped: bool


@dataclass(frozen=True, slots=True)
class StatsScans:
    """What one read of a namespace's figures found, scan by scan (statement ``namespace_stats``).

    Each scan reads at most ``limit + 1`` rows of its index (``limit`` is the
    count limit of :func:`namespace_stats`), so every number here is at most
    ``limit + 1``; a scan that read ``limit + 1`` rows stopped before the end.

    Attributes:
        unswept: rows read of the namespace's unswept leases (row state
            'held', expiry not announced: index ``leasekeeper_tasks_unswept``),
            in task_id order. The next three are among them, judged at ``db_now``:
        unswept_live: leases live (HELD).
        unswept_expired: leases expired, the ending not using up the last
            attempt (EXPIRED).
        unswept_quarantined: leases expired whose ending uses up the last
            attempt (QUARANTINED, not yet stored by the sweeper).
        announced_expired: rows 'held' whose expiry the sweeper announced
            (EXPIRED: its announcement stores a quarantine instead).
        stored_quarantined: rows 'quarantined'.
        granted: GRANTED history entries in the window.
        refused: FENCE_REFUSED history entries in the window.
        expired: EXPIRED history entries in the window.
        revoked: REVOKED history entries in the window.
        reserved: RESERVED effects read, in (task_id, effect_key) order.
        in_doubt: those of them whose fence is not the task's live lease.
        db_now: the instant the figures describe (the storage's clock).
    """

    unswept: int
    unswept_live: int
    unswept_expired: int
    unswept_quarantined: int
    announced_expired: int
    stored_quarantined: int
    granted: int
    refused: int
    expired: int
    revoked: int
    reserved: int
    in_doubt: int
    db_now: datetime


@dataclass(frozen=True, slots=True)
class NamespaceStats:
    """A namespace's figures at one instant (GetNamespaceStats).

    Each count is at most the count limit; its ``*_capped`` flag says the
    count stopped there, so the true figure is at least the count. The
    first three are counted together over the unswept leases: past the
    limit of those, all three are capped.

    Attributes:
        leases_held: tasks whose lease is live (HELD).
        leases_expired: tasks whose lease expired and no claim took over (EXPIRED).
        tasks_quarantined: tasks whose attempts are used up (QUARANTINED).
        claims_last_minute: GRANTED history entries in the window.
        stale_fences_last_minute: FENCE_REFUSED history entries in the window.
        leases_lost_last_minute: EXPIRED and REVOKED history entries in the window.
        effects_in_doubt: RESERVED effects whose fence is not the task's live lease.
        as_of: when the figures were read (the storage's clock).
    """

    namespace: str
    leases_held: int
    leases_held_capped: bool
    leases_expired: int
    leases_expired_capped: bool
    tasks_quarantined: int
    tasks_quarantined_capped: bool
    claims_last_minute: int
    claims_last_minute_capped: bool
    stale_fences_last_minute: int
    stale_fences_last_minute_capped: bool
    leases_lost_last_minute: int
    leases_lost_last_minute_capped: bool
    effects_in_doubt: int
    effects_in_doubt_capped: bool
    as_of: datetime


def namespace_stats(
    namespace: str, scans: StatsScans, limit: int = STATS_COUNT_LIMIT
) -> NamespaceStats:
    """The figures of ``scans`` (each read at most ``limit + 1`` rows), each capped at ``limit``.

    A figure is capped when a scan it is counted from stopped before the end
    (read ``limit + 1`` rows), or when its count passes ``limit``. The one
    rule, applied to the PostgreSQL statement's scans and to the in-memory
    store's alike.
    """

    def figure(count: int, *scanned: int) -> tuple[int, bool]:
        return min(count, limit), count > limit or any(n > limit for n in scanned)

    held = figure(scans.unswept_live, scans.unswept)
    expired = figure(scans.unswept_expired + scans.announced_expired, scans.unswept)
    quarantined = figure(scans.unswept_quarantined + scans.stored_quarantined, scans.unswept)
    claims = figure(scans.granted)
    refused = figure(scans.refused)
    lost = figure(scans.expired + scans.revoked)
    in_doubt = figure(scans.in_doubt, scans.reserved)
    return NamespaceStats(
        namespace,
        *held,
        *expired,
        *quarantined,
        *claims,
        *refused,
        *lost,
        *in_doubt,
        as_of=scans.db_now,
    )


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    """What a claim did.

    Attributes:
        acquired: the caller holds ``lease``.
        lease: the task's lease after the claim (the holder's when not acquired).
        checkpoint: when acquired, the task's checkpoint (None: none saved).
        retry_after: when not acquired, how long until the task can be granted
            as far as the database can tell now (the holder's remaining ttl,
            plus the namespace's lock delay should the lease expire).
    """

    acquired: bool
    lease: Lease
    retry_after: timedelta = ZERO
    checkpoint: Checkpoint | None = None


def fence_loss(lease: Lease | None, fence: int) -> LossReason | None:
    """Says why ``fence`` may not act on ``lease`` now, or None if it may.

    The rule behind ValidateFence: a fence is valid iff it is the current
    fence, the lease is HELD on the database clock and the task has not
    ended (COMPLETED, FAILED or CANCELLED: every fence of an ended task gets
    the task's reason).
    """
    current = lease.fence if lease is not None else 0
    if fence > current:
        return LossReason.FENCE_UNKNOWN
    assert lease is not None
    terminal = _TERMINAL.get(lease.row_state)
    if terminal is not None:  # every fence of an ended task: the task's own reason
        return _ROW_STATE_REASON[lease.row_state]
    if fence < current:
        return LossReason.LEASE_SUPERSEDED
    return lease.last_loss


def owner_loss(lease: Lease | None, owner_id: str, fence: int) -> LossReason | None:
    """Says why ``owner_id`` with ``fence`` does not hold ``lease`` now, or None if it does.

    Like :func:`fence_loss`, and NOT_OWNER when the fence is the task's current
    one but was granted to another owner.
    """
    reason = fence_loss(lease, fence)
    if (
        lease is not None
        and fence == lease.fence
        and lease.owner_id != owner_id
        and lease.row_state not in _TERMINAL
    ):
        return LossReason.NOT_OWNER
    return reason


def release_refusal(
    lease: Lease | None, ref: LeaseRef, complete: bool, fail: bool
) -> LossReason | None:
    """Why a release that changed no row is refused, or None when it was already made.

    The rule behind Release's idempotency (SQL ``release`` decides the rest):
    this owner and fence ended the lease already, the same way (released,
    completed, failed), or asks a plain release after the task ended (it stays
    ended). Otherwise ``owner_loss``'s reason (LEASE_SUPERSEDED when none).
    """
    reason = owner_loss(lease, ref.owner_id, ref.fence)
    ended = (LossReason.LEASE_RELEASED, LossReason.TASK_COMPLETED, LossReason.TASK_FAILED)
    if (
        lease is not None
        and reason in ended
        and (lease.fence, lease.owner_id) == (ref.fence, ref.owner_id)
    ):
        asked = (
            LossReason.TASK_COMPLETED
            if complete
            else LossReason.TASK_FAILED
            if fail
            else LossReason.LEASE_RELEASED
        )
        if reason is asked or asked is LossReason.LEASE_RELEASED:
            return None
    return reason or LossReason.LEASE_SUPERSEDED
