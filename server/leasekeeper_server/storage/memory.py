"""In-memory storage for tests: the seam's Protocols with a clock the test moves by hand.

TEST SUPPORT, NOT A PRODUCTION BACKEND. Nothing is persisted, nothing is
shared between processes, and there is no database clock: time is whatever
the injected ``clock`` says (a :class:`ManualClock` in tests, advanced by
hand, so no test waits for real time to pass). It exists so the RPC layer
(servicer, heartbeat streams, waiting claims, Watch) can be tested in
milliseconds without PostgreSQL.

It takes the same decisions as the PostgreSQL statements of
``sql/queries.sql`` and the Python around them in ``store.py`` and
``ledger.py``, and ``tests/conformance/`` runs one behaviour suite over both:

* claim: fence + 1 per grant (1 for a new task); a retry (the same owner and
  request id, or none) hands the live lease back unchanged; another request
  id of the same owner is a new incarnation (fence + 1); an expired lease
  stays unclaimable for the lock delay; ``expire_time = now + min(ttl,
  max_runtime)``, ``runtime_deadline = now + max_runtime``; taking over an
  expired lease counts an attempt; a task whose last attempt is used up
  (``Lease.attempt_used_up``), cancelled, failed or completed is refused
  (``Lease.unclaimable``); a grant comes with the task's checkpoint;
* renew never revives and never reaches past the runtime deadline; it stores
  a checkpoint of a higher version (``ttl`` None: the checkpoint only);
* release, complete and fail are idempotent per fence; revoke by any or one
  fence counts an attempt and quarantines when it was the last; cancel ends
  the task; retry puts a quarantined task back with its attempts at 0;
* list_leases: state and owner filters, keyset paging, the same scan budget;
* the effect ledger: ``core/effect_rules.py``'s pure rules (reused, not
  rewritten), behind ``core/model.fence_loss``; an outcome and a checkpoint
  saved together are both kept or neither;
* the change feed: every committed change of a task rings its watchers and
  pushes the event the task table's trigger would send
  (``migrations/0005_operations.sql``, ``0006_announce_every_expiry.sql``,
  ``0008_runs.sql``), expiries included when a change ends an unannounced
  expired lease; :meth:`MemoryStore.announce_expiries` plays the sweeper,
  quarantine included;
* the task history: the entries the triggers of ``migrations/0008_runs.sql``
  write (grants, endings, checkpoints, effects) and ``record_refusal``'s,
  numbered by one sequence for the whole store.

The rules are ``core/model.py``'s (``Lease.state``, ``attempt_used_up``,
``attempts``, ``last_loss``, ``unclaimable``, ``fence_loss``,
``owner_loss``), applied to the row read at the decision's instant; this
module adds only what the SQL writes.

Every decision runs without an ``await`` between its read and its write, so
it is atomic on the event loop, as the single SQL statement is in the
database. Each call yields to the loop once before deciding (a call is never
instantaneous for its caller).

Namespace limits: the lock delay passed with a claim applies as in SQL;
``max_leases`` and ``claims_per_second`` are judged, as in SQL, on the
storage's own copy set with :meth:`MemoryStore.set_limits` (the table
``leasekeeper_namespace_limits``), and only when the claim's ``limits`` ask
for it (``needs_lock``). The namespace's default attempt limit is applied
by the caller, which passes it as ``max_attempts``, as to ``Store.claim``.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from leasekeeper_server.core.effect_rules import (
    BeginDecision,
    BeginRequest,
    Effect,
    EffectKey,
    EffectState,
    Outcome,
    check_complete,
    decide_begin,
)
from leasekeeper_server.core.errors import (
    CheckpointNotNewer,
    ClaimRateLimit,
    LeaseLimit,
    LeaseLost,
    TaskNotClaimable,
    TaskNotFound,
    TaskNotQuarantined,
)
from leasekeeper_server.core.limits import (
    NO_LIMITS,
    Bucket,
    NamespaceLimits,
    refill,
    wait_for_token_s,
)
from leasekeeper_server.core.model import (
    LIST_SCAN_BUDGET,
    Checkpoint,
    CheckpointWrite,
    ClaimOutcome,
    HistoryEntry,
    Lease,
    LeaseRef,
    LossReason,
    TaskKey,
    TaskState,
    fence_loss,
    owner_loss,
)
from leasekeeper_server.storage.subscription import Fanout

if TYPE_CHECKING:
    from leasekeeper_server.storage.protocol import ChangeFeed, EffectStore, LeaseStore

Clock = Callable[[], datetime]

# The first fence of a task: leasekeeper_fence_floor() on timeline 1.
FIRST_FENCE = 1

# Task states no transition leaves (no fence valid, no claim granted).
_ENDED = (TaskState.COMPLETED, TaskState.CANCELLED, TaskState.FAILED)


def utc_now() -> datetime:
    """The machine's wall clock in UTC (the default clock)."""
    return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to: ``clock()`` is the instant, ``advance`` moves it.

    Args:
        start: the first instant (timezone-aware); now, in UTC, by default.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start if start is not None else utc_now()
        _check_aware(self._now)

    def __call__(self) -> datetime:
        """The current instant."""
        return self._now

    def advance(self, by: timedelta | float) -> None:
        """Moves the clock forward by ``by`` (a timedelta, or seconds); never backwards.

        Raises:
            ValueError: ``by`` is negative.
        """
        step = by if isinstance(by, timedelta) else timedelta(seconds=by)
        if step < timedelta(0):
            raise ValueError("a ManualClock never goes backwards")
        self._now += step


def _check_aware(instant: datetime) -> datetime:
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError(f"the storage clock must be timezone-aware, got {instant!r}")
    return instant


@dataclass(slots=True)
class _Row:
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


@dataclass(frozen=True, slots=True)
class _Event:
    """One event of a task (``leasekeeper_task_event``): announced, and written to its history.

    Attributes:
        event: 'claimed', 'expired', or the row state the change stored.
        event_time: when it happened (database clock).
        row: the row it describes (the old one for an expiry a change ends).
        previous_end: for a grant that followed an ended lease, that lease's end.
    """

    event: str
    event_time: datetime
    row: _Row
    previous_end: datetime | None = None


def _trigger_events(old: _Row | None, new: _Row) -> list[_Event]:
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
        events.append(_Event("expired", old.expire_time, old))
    if old is None:
        events.append(_Event("claimed", new.claim_time, new))
    elif new.fence != old.fence:
        ended = old.state != "held" or old.expire_time <= new.claim_time
        events.append(_Event("claimed", new.claim_time, new, old.expire_time if ended else None))
    elif new.state != old.state:
        if new.state == "quarantined" and new.end_reason == "LEASE_REVOKED":
            events.append(_Event("revoked", new.update_time, new))
        events.append(_Event(new.state, new.update_time, new))
    elif new.owner_id != old.owner_id:
        events.append(_Event("claimed", new.claim_time, new))
    elif (
        new.expiry_announced_fence != old.expiry_announced_fence
        and new.expiry_announced_fence == new.fence
    ):
        events.append(_Event("expired", new.expire_time, new))
    return events


class MemoryEvents(Fanout):
    """The change feed in memory: watchers and subscriptions rung by :class:`MemoryStore`.

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


@dataclass(slots=True)
class _Grant:
    """A claim's decision before it is committed (a limit may still refuse it)."""

    old: _Row | None
    new: _Row


class MemoryStore:
    """Lease decisions in memory (implements ``protocol.LeaseStore``); see the module docstring.

    Args:
        clock: returns the storage's instant, timezone-aware (``ManualClock``
            in tests); the machine's UTC clock by default.
        events: the change feed to ring; a new :class:`MemoryEvents` by default.
    """

    def __init__(self, clock: Clock | None = None, events: MemoryEvents | None = None) -> None:
        self._clock = clock if clock is not None else utc_now
        self.events = events if events is not None else MemoryEvents()
        self._rows: dict[TaskKey, _Row] = {}
        self._limits: dict[str, NamespaceLimits] = {}
        self._buckets: dict[str, Bucket] = {}
        self._history: dict[TaskKey, list[HistoryEntry]] = {}
        self._sequence = 0

    def now(self) -> datetime:
        """The storage's clock (timezone-aware).

        Raises:
            ValueError: the injected clock returned a naive datetime.
        """
        return _check_aware(self._clock())

    def set_limits(self, namespace: str, limits: NamespaceLimits | None) -> None:
        """Sets (or, with None, removes) a namespace's limits row: what ``limits set`` writes.

        Claims judge ``max_leases`` and ``claims_per_second`` on this copy,
        and only when the limits they are given ask for it (``needs_lock``),
        as the SQL path does; a new rate starts with a full bucket.
        """
        self._buckets.pop(namespace, None)
        if limits is None:
            self._limits.pop(namespace, None)
        else:
            self._limits[namespace] = limits

    def read(self, key: TaskKey) -> Lease | None:
        """The task's lease now, without yielding (for the ledger and for tests)."""
        row = self._rows.get(key)
        return row.lease(self.now()) if row is not None else None

    def write_history(self, key: TaskKey, event_time: datetime, **fields: Any) -> None:
        """Appends one entry to the task's history (a row of ``leasekeeper_task_history``).

        ``fields`` are HistoryEntry's (``kind`` at least); those left out are
        0 or empty, as the table's defaults. The sequence is the store's next.
        """
        self._sequence += 1
        entry = {
            "fence": 0,
            "owner_id": "",
            "attempt": 0,
            "checkpoint_version": 0,
            "checkpoint_size": 0,
            "effect_key": "",
            "effect_outcome": "",
            "external_operation_id": "",
            "reason": "",
            "method": "",
            **fields,
        }
        self._history.setdefault(key, []).append(
            HistoryEntry(sequence=self._sequence, event_time=event_time, **entry)
        )

    def _commit(self, key: TaskKey, old: _Row | None, new: _Row) -> None:
        """Stores ``new``; announces and records what the task trigger would (migrations/0008)."""
        self._rows[key] = new
        for event in _trigger_events(old, new):
            row = event.row
            self.events.publish(row.payload(event.event, event.event_time, event.previous_end))
            self.write_history(key, event.event_time, **row.history(event.event))
        written = new.checkpoint
        if written is not None and (old is None or old.checkpoint is not written):
            self.write_history(
                key,
                written.write_time,
                kind="checkpoint_saved",
                fence=written.fence,
                owner_id=new.owner_id,
                checkpoint_version=written.version,
                checkpoint_size=len(written.data),
            )

    async def claim(
        self,
        key: TaskKey,
        owner_id: str,
        ttl: timedelta,
        max_runtime: timedelta,
        request_id: str | None = None,
        limits: NamespaceLimits = NO_LIMITS,
        take_token: bool = True,
        max_attempts: int | None = None,
    ) -> ClaimOutcome:
        """Claims a task (``protocol.LeaseStore.claim``; SQL ``claim`` and ``Store.claim``)."""
        await asyncio.sleep(0)
        now = self.now()
        delay = limits.lock_delay
        # Limits are judged on the storage's copy, and only when the claim's
        # limits ask for it (as Store.claim takes the limited path).
        stored = self._limits.get(key.namespace) if limits.needs_lock else None
        bucket = None
        if stored is not None and stored.claims_per_second is not None and take_token:
            bucket = self._take_token(key.namespace, stored, stored.claims_per_second, now)
        grant = self._decide_claim(
            key, owner_id, ttl, max_runtime, request_id, delay, max_attempts, now
        )
        if grant is not None and stored is not None and stored.max_leases is not None:
            # Raises before the bucket is stored: SQL rolls the token back with the claim.
            self._check_lease_limit(key, stored.max_leases, now)
        if bucket is not None:  # taken by a granted and by a refused claim alike
            self._buckets[key.namespace] = bucket
        if grant is not None:
            self._commit(key, grant.old, grant.new)
            return ClaimOutcome(True, grant.new.lease(now), checkpoint=grant.new.checkpoint)
        # No grant: say why, as Store.claim does with its read after the statement.
        row = self._rows[key]  # a claim of a task without a row always grants
        task = row.lease(now)
        if task.unclaimable is not None:
            raise TaskNotClaimable.of(task)
        if task.state is TaskState.HELD:
            if task.is_claim_of(owner_id, request_id):  # a retry: its lease, its checkpoint
                return ClaimOutcome(True, task, checkpoint=row.checkpoint)
            return ClaimOutcome(False, task, task.remaining_ttl + delay)
        assert task.state is TaskState.EXPIRED and task.expire_time + delay > now
        return ClaimOutcome(False, task, task.expire_time + delay - now)

    def _decide_claim(
        self,
        key: TaskKey,
        owner_id: str,
        ttl: timedelta,
        max_runtime: timedelta,
        request_id: str | None,
        delay: timedelta,
        max_attempts: int | None,
        now: datetime,
    ) -> _Grant | None:
        """The SQL ``claim`` statement's decision: the row it would write, or None for no row."""
        old = self._rows.get(key)
        granted = _Row(
            namespace=key.namespace,
            task_id=key.task_id,
            owner_id=owner_id,
            fence=FIRST_FENCE,
            state="held",
            expire_time=now + min(ttl, max_runtime),
            runtime_deadline=now + max_runtime,
            claim_time=now,
            update_time=now,
            claim_request_id=request_id,
            max_attempts=max_attempts,
        )
        if old is None:
            return _Grant(None, granted)
        task = old.lease(now)
        free = old.state in ("released", "revoked", "retried")
        # An expired lease past its lock delay, unless its ending used up the last attempt.
        past_delay = old.state == "held" and not old.live(now - delay) and not task.attempt_used_up
        new_incarnation = (
            old.state == "held"
            and old.owner_id == owner_id
            and request_id is not None
            and old.claim_request_id != request_id
            and (old.live(now) or not task.attempt_used_up)
        )
        if not (free or past_delay or new_incarnation):
            return None
        # The row keeps its expiry announcement (it names an older fence) and
        # its checkpoint; an expired lease taken over is an attempt (Lease.attempts).
        return _Grant(
            old,
            replace(
                granted,
                fence=old.fence + 1,
                expiry_announced_fence=old.expiry_announced_fence,
                attempts=task.attempts,
                checkpoint=old.checkpoint,
            ),
        )

    def _take_token(
        self, namespace: str, stored: NamespaceLimits, rate: float, now: datetime
    ) -> Bucket:
        """The namespace's claim bucket after taking one token (SQL ``lock_limits``).

        The caller stores it when the claim commits (SQL ``take_claim_token``).

        Raises:
            ClaimRateLimit: the bucket holds less than one token (RESOURCE_EXHAUSTED).
        """
        burst = stored.burst if stored.burst is not None else max(1.0, rate)
        last = self._buckets.get(namespace)
        bucket = refill(last.tokens if last else None, last.at if last else None, now, rate, burst)
        if bucket.tokens < 1.0:
            raise ClaimRateLimit(
                namespace,
                wait_for_token_s(bucket, rate),
                f"namespace {namespace!r} is limited to {rate:g} claims per second",
            )
        return Bucket(bucket.tokens - 1.0, bucket.at)

    def _check_lease_limit(self, key: TaskKey, max_leases: int, now: datetime) -> None:
        """Refuses a grant past ``max_leases`` (SQL ``count_live_leases``).

        Counts the live leases of the namespace other than this task, in
        task_id order, stopping at the limit; the retry hint is the earliest
        expiry among those counted.

        Raises:
            LeaseLimit: the namespace holds ``max_leases`` live leases
                (RESOURCE_EXHAUSTED); nothing changes (the transaction rolls
                back, the claim's token included).
        """
        live = sorted(
            (row.task_id, row.expire_time)
            for row in self._rows.values()
            if row.namespace == key.namespace
            and row.task_id != key.task_id
            and row.live(now)
            and row.expiry_announced_fence != row.fence
        )[:max_leases]
        if len(live) >= max_leases:
            first = min((expiry for _, expiry in live), default=None)
            wait = (first - now).total_seconds() if first is not None else 0.0
            raise LeaseLimit(
                key.namespace,
                max(0.0, wait),
                f"namespace {key.namespace!r} holds its maximum of {max_leases} live leases",
            )

    def _decide_renewal(
        self,
        ref: LeaseRef,
        ttl: timedelta | None,
        checkpoint: CheckpointWrite | None,
        now: datetime,
    ) -> _Row | None:
        """The row SQL ``renew`` would write for one renewal, or None: no live lease of ``ref``.

        ``ttl`` None keeps the expiry; a checkpoint of a higher version than
        the stored one (or the first) is stored, by the lease's fence, at ``now``.
        """
        row = self._rows.get(ref.key)
        if not (
            row is not None
            and row.owner_id == ref.owner_id
            and row.fence == ref.fence
            and row.live(now)
            and row.runtime_deadline > now
        ):
            return None
        new = replace(
            row,
            expire_time=row.expire_time if ttl is None else min(now + ttl, row.runtime_deadline),
            update_time=now,
        )
        if checkpoint is not None and (
            row.checkpoint is None or checkpoint.version > row.checkpoint.version
        ):
            new.checkpoint = Checkpoint(
                checkpoint.version, checkpoint.data, checkpoint.content_type, row.fence, now
            )
        return new

    def _loss(self, ref: LeaseRef, now: datetime) -> LeaseLost:
        """Why ``ref`` holds no live lease now (``Store._loss``)."""
        row = self._rows.get(ref.key)
        task = row.lease(now) if row is not None else None
        return LeaseLost.of(
            task, owner_loss(task, ref.owner_id, ref.fence) or LossReason.LEASE_EXPIRED
        )

    async def renew(
        self, ref: LeaseRef, ttl: timedelta | None, checkpoint: CheckpointWrite | None = None
    ) -> Lease:
        """Extends a live lease and stores a checkpoint (``LeaseStore.renew``; SQL ``renew``).

        Only the expiry, the update instant and the checkpoint change: no
        event (not news to anyone); a checkpoint stored is a history entry.
        """
        await asyncio.sleep(0)
        now = self.now()
        new = self._decide_renewal(ref, ttl, checkpoint, now)
        if new is None:
            raise self._loss(ref, now)
        self._commit(ref.key, self._rows[ref.key], new)
        return new.lease(now)

    def _decide_save(
        self, ref: LeaseRef, checkpoint: CheckpointWrite, now: datetime
    ) -> tuple[_Row, Checkpoint]:
        """``Store.save_checkpoint``'s decision: the row to write and the checkpoint stored.

        Raises:
            LeaseLost: (ABORTED) ``ref`` holds no live lease.
            CheckpointNotNewer: (FAILED_PRECONDITION) the version does not move
                forward, and the stored one is not this very write.
        """
        new = self._decide_renewal(ref, None, checkpoint, now)
        if new is None:
            raise self._loss(ref, now)
        stored = new.checkpoint
        if stored is not None and stored is not self._rows[ref.key].checkpoint:
            return new, stored  # written now
        this_write = (checkpoint.version, ref.fence, checkpoint.data, checkpoint.content_type)
        if stored is not None and (
            (stored.version, stored.fence, stored.data, stored.content_type) == this_write
        ):
            return new, stored  # a retry of this very write
        raise CheckpointNotNewer(checkpoint.version, stored.version if stored else 0)

    async def save_checkpoint(
        self, ref: LeaseRef, checkpoint: CheckpointWrite
    ) -> tuple[Checkpoint, Lease]:
        """Stores a checkpoint (``LeaseStore.save_checkpoint``; ``Store.save_checkpoint``)."""
        await asyncio.sleep(0)
        return self.save_checkpoint_after(ref, checkpoint, lambda: None)

    def save_checkpoint_after(
        self, ref: LeaseRef, checkpoint: CheckpointWrite, first: Callable[[], None]
    ) -> tuple[Checkpoint, Lease]:
        """Decides a checkpoint write; if it stands, runs ``first``, then stores it. No yield.

        For ``MemoryLedger.complete_and_save``: ``first`` records the effect's
        outcome, so a refused checkpoint leaves both unwritten, as the
        PostgreSQL transaction that holds both rolls back.

        Raises:
            LeaseLost, CheckpointNotNewer: as :meth:`save_checkpoint`;
                ``first`` is not run.
        """
        now = self.now()
        new, stored = self._decide_save(ref, checkpoint, now)
        first()
        self._commit(ref.key, self._rows[ref.key], new)
        return stored, new.lease(now)

    async def get_checkpoint(self, key: TaskKey) -> Checkpoint | None:
        """The task's checkpoint (``LeaseStore.get_checkpoint``; SQL ``get_checkpoint``)."""
        await asyncio.sleep(0)
        row = self._rows.get(key)
        return row.checkpoint if row is not None else None

    async def release(
        self, ref: LeaseRef, complete: bool, fail: bool = False, fail_reason: str = ""
    ) -> Lease:
        """Releases, completes or fails a lease (``LeaseStore.release``; SQL ``release``)."""
        await asyncio.sleep(0)
        now = self.now()
        old = self._rows.get(ref.key)
        if (
            old is not None
            and old.owner_id == ref.owner_id
            and old.fence == ref.fence
            and (_releasable_held(old, now) or ((complete or fail) and old.state == "released"))
        ):
            state, end_reason = (
                ("completed", "TASK_COMPLETED")
                if complete
                else ("failed", "TASK_FAILED")
                if fail
                else ("released", "LEASE_RELEASED")
            )
            new = replace(
                old,
                state=state,
                end_reason=end_reason,
                state_reason=fail_reason if fail else old.state_reason,
                expire_time=min(old.expire_time, now),
                update_time=now,
            )
            self._commit(ref.key, old, new)
            return new.lease(now)
        task = old.lease(now) if old is not None else None
        reason = owner_loss(task, ref.owner_id, ref.fence)
        ended = (LossReason.LEASE_RELEASED, LossReason.TASK_COMPLETED, LossReason.TASK_FAILED)
        if (
            task is not None
            and reason in ended
            and (task.fence, task.owner_id) == (ref.fence, ref.owner_id)
        ):
            asked = (
                LossReason.TASK_COMPLETED
                if complete
                else LossReason.TASK_FAILED
                if fail
                else LossReason.LEASE_RELEASED
            )
            # Done already by this fence: the same ending again, or a plain
            # release after the task ended (it stays ended).
            if reason is asked or asked is LossReason.LEASE_RELEASED:
                return task
        raise LeaseLost.of(task, reason or LossReason.LEASE_SUPERSEDED)

    async def get_lease(self, key: TaskKey) -> Lease | None:
        """The task's lease now, or None (``protocol.LeaseStore.get_lease``)."""
        await asyncio.sleep(0)
        return self.read(key)

    async def list_leases(
        self,
        namespace: str,
        after_task_id: str,
        limit: int,
        state: TaskState | None,
        owner_id: str | None = None,
    ) -> tuple[builtins.list[Lease], str | None]:
        """A page of a namespace's tasks (``protocol.LeaseStore.list_leases``; SQL list_leases)."""
        await asyncio.sleep(0)
        now = self.now()
        budget = max(LIST_SCAN_BUDGET, limit)
        # Python orders str by code point, which is UTF-8 byte order: COLLATE "C".
        scanned = sorted(
            (row for row in self._rows.values() if row.namespace == namespace),
            key=lambda row: row.task_id,
        )
        scanned = [row for row in scanned if row.task_id > after_task_id][:budget]
        leases = [row.lease(now) for row in scanned]
        tasks = [
            lease
            for lease in leases
            if (owner_id is None or lease.owner_id == owner_id)
            and (state is None or lease.state is state)
        ][:limit]
        if len(tasks) < limit and len(scanned) >= budget:
            return tasks, scanned[-1].task_id
        return tasks, None

    def _existing(self, key: TaskKey) -> _Row:
        row = self._rows.get(key)
        if row is None:
            raise TaskNotFound(
                f"task {key.task_id!r} in namespace {key.namespace!r} was never claimed"
            )
        return row

    async def revoke(self, key: TaskKey, reason: str, fence: int) -> tuple[bool, Lease]:
        """Ends the task's lease now (``protocol.LeaseStore.revoke``; SQL ``revoke``).

        The revoked grant is an attempt; when it was the last
        (``Lease.attempt_used_up``) the task is QUARANTINED instead of FREE.
        """
        await asyncio.sleep(0)
        now = self.now()
        old = self._rows.get(key)
        if old is not None and _releasable_held(old, now) and fence in (0, old.fence):
            new = replace(
                old,
                state="quarantined" if old.lease(now).attempt_used_up else "revoked",
                attempts=old.attempts + 1,
                end_reason="LEASE_REVOKED",
                revoke_reason=reason,
                expire_time=min(old.expire_time, now),
                update_time=now,
            )
            self._commit(key, old, new)
            return True, new.lease(now)
        task = self._existing(key).lease(now)
        if task.state in _ENDED:
            raise TaskNotClaimable.of(task)
        return False, task

    async def cancel(self, key: TaskKey, reason: str) -> Lease:
        """Cancels the task: CANCELLED, terminal (``LeaseStore.cancel``; SQL ``cancel``)."""
        await asyncio.sleep(0)
        now = self.now()
        old = self._existing(key)
        task = old.lease(now)
        if task.state not in _ENDED:
            new = replace(
                old,
                state="cancelled",
                end_reason="TASK_CANCELLED",
                state_reason=reason,
                expire_time=min(old.expire_time, now),
                update_time=now,
            )
            self._commit(key, old, new)
            return new.lease(now)
        if task.state is not TaskState.CANCELLED:
            raise TaskNotClaimable.of(task)
        return task  # cancelled already

    async def retry(self, key: TaskKey, reason: str) -> Lease:
        """Puts a QUARANTINED task back (``protocol.LeaseStore.retry``; SQL ``retry``).

        FREE (row state 'retried'), attempts 0, fence kept; an expired lease
        not yet swept keeps the reason it ended for (``Lease.last_loss``).
        """
        await asyncio.sleep(0)
        now = self.now()
        old = self._existing(key)
        task = old.lease(now)
        if task.state is not TaskState.QUARANTINED:
            raise TaskNotQuarantined(task.state.value)
        ended = task.last_loss
        new = replace(
            old,
            state="retried",
            attempts=0,
            state_reason=reason,
            end_reason=ended.value if old.state == "held" and ended else old.end_reason,
            update_time=now,
        )
        self._commit(key, old, new)
        return new.lease(now)

    async def record_refusal(self, key: TaskKey, fence: int, loss: LossReason, method: str) -> None:
        """A FENCE_REFUSED history entry (``protocol.LeaseStore.record_refusal``).

        Nothing for a task never claimed; the owner only when ``fence`` is
        the current one (SQL ``record_refusal``).
        """
        await asyncio.sleep(0)
        row = self._rows.get(key)
        if row is None:
            return
        self.write_history(
            key,
            self.now(),
            kind="fence_refused",
            fence=fence,
            owner_id=row.owner_id if row.fence == fence else "",
            reason=loss.value,
            method=method,
        )

    async def list_history(
        self, key: TaskKey, after_sequence: int, limit: int
    ) -> builtins.list[HistoryEntry]:
        """A page of the task's history (``protocol.LeaseStore.list_history``), oldest first."""
        await asyncio.sleep(0)
        entries = self._history.get(key, [])
        return [entry for entry in entries if entry.sequence > after_sequence][:limit]

    def announce_expiries(self) -> int:
        """Plays the expiry sweeper (SQL ``sweep_expired``): announces every unannounced expiry.

        An expiry that uses up its task's last attempt also stores the
        quarantine (row state 'quarantined', attempts + 1, the expiry's
        reason), so it lasts.

        Returns:
            How many expiries were announced (each sends an 'expired' event).
        """
        now = self.now()
        announced = 0
        for key, old in sorted(
            self._rows.items(), key=lambda item: (item[0].namespace, item[0].task_id)
        ):
            if old.state != "held" or old.expiry_announced_fence == old.fence or old.live(now):
                continue
            task = old.lease(now)
            new = replace(old, expiry_announced_fence=old.fence)
            loss = task.last_loss
            if task.attempt_used_up and loss is not None:
                new = replace(
                    new,
                    state="quarantined",
                    attempts=old.attempts + 1,
                    end_reason=loss.value,
                    update_time=now,
                )
            self._commit(key, old, new)
            announced += 1
        return announced


class MemoryLedger:
    """The effect ledger in memory (``protocol.EffectStore``), over a MemoryStore's tasks.

    The decisions are ``core/effect_rules.py``'s (``decide_begin``,
    ``check_complete``), behind the fence check ``ledger.EffectLedger`` makes
    (``core/model.fence_loss`` on the task read at the same instant). Each
    reservation and each outcome recorded is a history entry of the task, as
    the effect table's trigger writes (migrations/0008).
    """

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._records: dict[EffectKey, Effect] = {}

    def _check_fence(self, key: EffectKey, fence: int) -> None:
        """Raises LeaseLost (ABORTED) unless ``fence`` may act on the task now."""
        task = self._store.read(TaskKey(key.namespace, key.task_id))
        reason = fence_loss(task, fence)
        if reason is not None:
            raise LeaseLost(reason, task.fence if task is not None else 0)

    def _write(self, key: EffectKey, record: Effect) -> None:
        """Stores ``record``; a reservation or a first outcome goes to the task's history."""
        self._records[key] = record
        task = TaskKey(key.namespace, key.task_id)
        if record.state is EffectState.RESERVED:
            self._store.write_history(
                task,
                record.begin_time,
                kind="effect_reserved",
                fence=record.fence,
                attempt=record.attempts,
                effect_key=key.effect_key,
            )
        else:
            assert record.complete_time is not None and record.complete_fence is not None
            self._store.write_history(
                task,
                record.complete_time,
                kind="effect_completed",
                fence=record.complete_fence,
                attempt=record.attempts,
                effect_key=key.effect_key,
                effect_outcome=record.state.value,
                external_operation_id=record.external_operation_id,
            )

    async def begin(self, request: BeginRequest) -> tuple[BeginDecision, Effect]:
        """Reserves an effect (``protocol.EffectStore.begin``; ``ledger.EffectLedger.begin``)."""
        await asyncio.sleep(0)
        key = request.key
        self._check_fence(key, request.fence)
        now = self._store.now()
        record = self._records.get(key)
        if record is None:
            record = Effect(
                namespace=key.namespace,
                task_id=key.task_id,
                effect_key=key.effect_key,
                policy=request.policy,
                request_digest=request.request_digest,
                state=EffectState.RESERVED,
                fence=request.fence,
                complete_fence=None,
                retryable=False,
                result=b"",
                attempts=1,
                begin_time=now,
                complete_time=None,
            )
            self._write(key, record)
            return BeginDecision.PROCEED, record
        decision = decide_begin(record, request)
        if decision is not BeginDecision.PROCEED:
            return decision, record
        # SQL reserve_effect: a new attempt; the policy never changes. The
        # external operation id stays (SQL reserve_effect does not clear it).
        record = replace(
            record,
            state=EffectState.RESERVED,
            fence=request.fence,
            request_digest=request.request_digest,
            attempts=record.attempts + 1,
            begin_time=now,
            complete_fence=None,
            complete_time=None,
            retryable=False,
            result=b"",
        )
        self._write(key, record)
        return decision, record

    def _decide_complete(self, key: EffectKey, fence: int, outcome: Outcome) -> Effect | None:
        """The record SQL ``complete_effect`` would write, or None: the outcome is recorded already.

        Raises:
            LeaseLost: (ABORTED) the fence is not current and live.
            EffectNotBegun, EffectAlreadyCompleted: (FAILED_PRECONDITION)
                ``check_complete``'s refusals.
        """
        self._check_fence(key, fence)
        record = self._records.get(key)
        if not check_complete(record, outcome):
            return None
        assert record is not None
        return replace(
            record,
            state=outcome.state,
            retryable=outcome.retryable,
            result=outcome.result,
            complete_fence=fence,
            complete_time=self._store.now(),
            external_operation_id=outcome.external_operation_id,
        )

    async def complete(self, key: EffectKey, fence: int, outcome: Outcome) -> Effect:
        """Records an outcome (``protocol.EffectStore.complete``; ``EffectLedger.complete``)."""
        await asyncio.sleep(0)
        record = self._decide_complete(key, fence, outcome)
        if record is None:
            return self._records[key]
        self._write(key, record)
        return record

    async def complete_and_save(
        self,
        key: EffectKey,
        fence: int,
        outcome: Outcome,
        ref: LeaseRef,
        checkpoint: CheckpointWrite,
    ) -> tuple[Effect, Checkpoint]:
        """An outcome and a checkpoint, both or neither (``EffectLedger.complete_and_save``).

        Both decisions are taken before either is written, so a refusal of
        the checkpoint (LeaseLost, CheckpointNotNewer) records no outcome, as
        the PostgreSQL transaction rolls back; the outcome is written first
        (its history entry comes before the checkpoint's).
        """
        await asyncio.sleep(0)
        decided = self._decide_complete(key, fence, outcome)

        def record_outcome() -> None:
            if decided is not None:  # None: this outcome is recorded already
                self._write(key, decided)

        saved, _lease = self._store.save_checkpoint_after(ref, checkpoint, record_outcome)
        return (decided if decided is not None else self._records[key]), saved

    async def list(
        self, task: TaskKey, after_effect_key: str, limit: int, state: EffectState | None
    ) -> builtins.list[Effect]:
        """A page of a task's effects (``protocol.EffectStore.list``; SQL ``list_effects``)."""
        await asyncio.sleep(0)
        found = sorted(
            (
                record
                for key, record in self._records.items()
                if (key.namespace, key.task_id) == (task.namespace, task.task_id)
                and key.effect_key > after_effect_key
                and (state is None or record.state is state)
            ),
            key=lambda record: record.effect_key,
        )
        return found[:limit]


if TYPE_CHECKING:
    _store: type[LeaseStore] = MemoryStore
    _ledger: type[EffectStore] = MemoryLedger
    _events: type[ChangeFeed] = MemoryEvents


def _releasable_held(row: _Row, now: datetime) -> bool:
    """A held row whose lease a release or revoke may end: not one already QUARANTINED.

    An expired lease whose ending used up the last attempt is QUARANTINED
    (``Lease.state``), stored or not yet by the sweep (SQL ``release``, ``revoke``).
    """
    return row.state == "held" and row.lease(now).state is not TaskState.QUARANTINED
