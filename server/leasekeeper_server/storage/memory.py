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
  list_namespaces: keyset paging, task counts up to the same limit;
  namespace_stats: the same scans, each stopped at the same limit, in the
  same order, their figures capped by the same rule;
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

This module is the lease store (:class:`MemoryStore`) and the names the rest
of the code imports; its parts each have a module: ``memory_clock`` (the
injected clock, ``ManualClock``), ``memory_rows`` (a task's row and how it
reads), ``memory_events`` (the trigger's events and the change feed,
``MemoryEvents``), ``memory_history`` (the task history), ``memory_limits``
(the namespace limits rows and claim buckets) and ``memory_ledger`` (the
effect ledger, ``MemoryLedger``).
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from leasekeeper_server.core.effect_rules import Effect, EffectKey, EffectState
from leasekeeper_server.core.errors import (
    CheckpointNotNewer,
    LeaseLost,
    TaskNotClaimable,
    TaskNotFound,
    TaskNotQuarantined,
)
from leasekeeper_server.core.limits import NO_LIMITS, NamespaceLimits
from leasekeeper_server.core.model import (
    LIST_SCAN_BUDGET,
    NAMESPACE_COUNT_LIMIT,
    STATS_COUNT_LIMIT,
    STATS_WINDOW,
    Checkpoint,
    CheckpointWrite,
    ClaimOutcome,
    HistoryEntry,
    Lease,
    LeaseRef,
    LossReason,
    NamespaceCount,
    NamespaceStats,
    StatsScans,
    TaskKey,
    TaskState,
    namespace_stats,
    owner_loss,
    release_refusal,
)
from leasekeeper_server.storage.memory_clock import Clock, ManualClock, check_aware, utc_now
from leasekeeper_server.storage.memory_events import MemoryEvents, trigger_events
from leasekeeper_server.storage.memory_history import MemoryHistory
from leasekeeper_server.storage.memory_ledger import LedgerTasks, MemoryLedger
from leasekeeper_server.storage.memory_limits import MemoryLimits, check_lease_limit
from leasekeeper_server.storage.memory_rows import TaskRow

if TYPE_CHECKING:
    from leasekeeper_server.storage.protocol import ChangeFeed, EffectStore, LeaseStore

__all__ = [
    "FIRST_FENCE",
    "Clock",
    "ManualClock",
    "MemoryEvents",
    "MemoryLedger",
    "MemoryStore",
    "utc_now",
]

# The first fence of a task: leasekeeper_fence_floor() on timeline 1.
FIRST_FENCE = 1

# Task states no transition leaves (no fence valid, no claim granted).
_ENDED = (TaskState.COMPLETED, TaskState.CANCELLED, TaskState.FAILED)


@dataclass(slots=True)
class _Grant:
    """A claim's decision before it is committed (a limit may still refuse it)."""

    old: TaskRow | None
    new: TaskRow


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
        self._rows: dict[TaskKey, TaskRow] = {}
        self._limits = MemoryLimits()
        self._history = MemoryHistory()
        # The rows of leasekeeper_effects: a MemoryLedger over this store writes
        # them (memory_ledger.LedgerTasks), namespace_stats reads them.
        self.effects: dict[EffectKey, Effect] = {}

    def now(self) -> datetime:
        """The storage's clock (timezone-aware).

        Raises:
            ValueError: the injected clock returned a naive datetime.
        """
        return check_aware(self._clock())

    def set_limits(self, namespace: str, limits: NamespaceLimits | None) -> None:
        """Sets (or, with None, removes) a namespace's limits row: what ``limits set`` writes.

        Claims judge ``max_leases`` and ``claims_per_second`` on this copy,
        and only when the limits they are given ask for it (``needs_lock``),
        as the SQL path does; a new rate starts with a full bucket.
        """
        self._limits.write(namespace, limits)

    def read(self, key: TaskKey) -> Lease | None:
        """The task's lease now, without yielding (for the ledger and for tests)."""
        row = self._rows.get(key)
        return row.lease(self.now()) if row is not None else None

    def write_history(self, key: TaskKey, event_time: datetime, **fields: Any) -> None:
        """Appends one entry to the task's history (a row of ``leasekeeper_task_history``).

        ``fields`` are HistoryEntry's (``kind`` at least); those left out are
        0 or empty, as the table's defaults. The sequence is the store's next.
        """
        self._history.write(key, event_time, **fields)

    def _commit(self, key: TaskKey, old: TaskRow | None, new: TaskRow) -> None:
        """Stores ``new``; announces and records what the task trigger would (migrations/0008)."""
        self._rows[key] = new
        for event in trigger_events(old, new):
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
        stored = self._limits.stored(key.namespace) if limits.needs_lock else None
        bucket = None
        if stored is not None and stored.claims_per_second is not None and take_token:
            bucket = self._limits.take_token(key.namespace, stored, stored.claims_per_second, now)
        grant = self._decide_claim(
            key, owner_id, ttl, max_runtime, request_id, delay, max_attempts, now
        )
        if grant is not None and stored is not None and stored.max_leases is not None:
            # Raises before the bucket is stored: SQL rolls the token back with the claim.
            check_lease_limit(self._rows.values(), key, stored.max_leases, now)
        if bucket is not None:  # taken by a granted and by a refused claim alike
            self._limits.keep_token(key.namespace, bucket)
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
        granted = TaskRow(
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

    def _decide_renewal(
        self,
        ref: LeaseRef,
        ttl: timedelta | None,
        checkpoint: CheckpointWrite | None,
        now: datetime,
    ) -> TaskRow | None:
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

    async def renew(self, ref: LeaseRef, ttl: timedelta) -> Lease:
        """Extends a live lease (``LeaseStore.renew``; SQL ``renew``).

        Only the expiry and the update instant change: no event (not news to
        anyone).
        """
        await asyncio.sleep(0)
        now = self.now()
        new = self._decide_renewal(ref, ttl, None, now)
        if new is None:
            raise self._loss(ref, now)
        self._commit(ref.key, self._rows[ref.key], new)
        return new.lease(now)

    async def write_checkpoint(
        self, ref: LeaseRef, checkpoint: CheckpointWrite, ttl: timedelta | None = None
    ) -> tuple[Lease, Checkpoint | None]:
        """Stores a checkpoint, renewing when ``ttl`` is given (``LeaseStore.write_checkpoint``).

        A checkpoint stored is a history entry; one not newer is not stored
        (the renewal, if asked, still is).
        """
        await asyncio.sleep(0)
        now = self.now()
        new = self._decide_renewal(ref, ttl, checkpoint, now)
        if new is None:
            raise self._loss(ref, now)
        old = self._rows[ref.key]
        self._commit(ref.key, old, new)
        return new.lease(now), _this_write(old, new, ref, checkpoint)

    def _decide_save(
        self, ref: LeaseRef, checkpoint: CheckpointWrite, now: datetime
    ) -> tuple[TaskRow, Checkpoint]:
        """``Store.save_checkpoint``'s decision: the row to write and the checkpoint stored.

        Raises:
            LeaseLost: (ABORTED) ``ref`` holds no live lease.
            CheckpointNotNewer: (FAILED_PRECONDITION) the version does not move
                forward, and the stored one is not this very write.
        """
        new = self._decide_renewal(ref, None, checkpoint, now)
        if new is None:
            raise self._loss(ref, now)
        stored = _this_write(self._rows[ref.key], new, ref, checkpoint)
        if stored is None:
            current = new.checkpoint
            raise CheckpointNotNewer(checkpoint.version, current.version if current else 0)
        return new, stored

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
        outcome, so a refused checkpoint leaves both unwritten, as SQL
        ``complete_effect`` writes neither.

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
        refused = release_refusal(task, ref, complete, fail)
        if refused is None:
            assert task is not None  # a release already made names its lease
            return task
        raise LeaseLost.of(task, refused)

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

    async def list_namespaces(
        self, after_namespace: str, limit: int
    ) -> builtins.list[NamespaceCount]:
        """A page of namespaces (``protocol.LeaseStore.list_namespaces``; SQL list_namespaces)."""
        await asyncio.sleep(0)
        counts: dict[str, int] = {}
        for key in self._rows:
            if key.namespace > after_namespace:  # code point order: COLLATE "C"
                counts[key.namespace] = counts.get(key.namespace, 0) + 1
        return [
            NamespaceCount(
                namespace,
                min(counts[namespace], NAMESPACE_COUNT_LIMIT),
                counts[namespace] > NAMESPACE_COUNT_LIMIT,
            )
            for namespace in sorted(counts)[:limit]
        ]

    async def namespace_stats(
        self, namespace: str, limit: int = STATS_COUNT_LIMIT
    ) -> NamespaceStats:
        """A namespace's figures (``protocol.LeaseStore.namespace_stats``; SQL namespace_stats).

        The statement's scans, each in its index's order and stopped after
        ``limit + 1`` rows, judged at one reading of the clock.
        """
        await asyncio.sleep(0)
        now = self.now()
        read = limit + 1
        # Python orders str by code point, which is UTF-8 byte order: COLLATE "C".
        rows = sorted(
            (row for row in self._rows.values() if row.namespace == namespace),
            key=lambda row: row.task_id,
        )
        unswept = [
            row.lease(now).state
            for row in rows
            if row.state == "held" and row.expiry_announced_fence != row.fence
        ][:read]
        announced = [r for r in rows if r.state == "held" and r.expiry_announced_fence == r.fence]
        stored = [row for row in rows if row.state == "quarantined"]
        recent = [entry.kind for entry in self._history.since(namespace, now - STATS_WINDOW)]
        reserved = sorted(
            (
                effect
                for effect in self.effects.values()
                if effect.namespace == namespace and effect.state is EffectState.RESERVED
            ),
            key=lambda effect: (effect.task_id, effect.effect_key),
        )[:read]

        def live_fence(effect: Effect) -> bool:
            task = self.read(TaskKey(namespace, effect.task_id))
            return task is not None and task.fence == effect.fence and task.state is TaskState.HELD

        scans = StatsScans(
            unswept=len(unswept),
            unswept_live=unswept.count(TaskState.HELD),
            unswept_expired=unswept.count(TaskState.EXPIRED),
            unswept_quarantined=unswept.count(TaskState.QUARANTINED),
            announced_expired=min(len(announced), read),
            stored_quarantined=min(len(stored), read),
            granted=min(recent.count("granted"), read),
            refused=min(recent.count("fence_refused"), read),
            expired=min(recent.count("expired"), read),
            revoked=min(recent.count("revoked"), read),
            reserved=len(reserved),
            in_doubt=sum(not live_fence(effect) for effect in reserved),
            db_now=now,
        )
        return namespace_stats(namespace, scans, limit)

    def _existing(self, key: TaskKey) -> TaskRow:
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

    async def cancel(self, key: TaskKey, reason: str) -> tuple[bool, Lease]:
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
            return True, new.lease(now)
        if task.state is not TaskState.CANCELLED:
            raise TaskNotClaimable.of(task)
        return False, task  # cancelled already: nothing written

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

        Nothing for a task never claimed, for a fence it never issued, nor for
        a refusal already recorded with this fence, reason and method; the
        owner only when ``fence`` is the current one (SQL ``record_refusal``).
        """
        await asyncio.sleep(0)
        row = self._rows.get(key)
        if row is None or fence > row.fence:
            return
        seen = (fence, loss.value, method)
        recorded = self._history.of(key)
        if any(
            (e.fence, e.reason, e.method) == seen for e in recorded if e.kind == "fence_refused"
        ):
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
        return self._history.page(key, after_sequence, limit)

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


if TYPE_CHECKING:
    _store: type[LeaseStore] = MemoryStore
    _tasks: type[LedgerTasks] = MemoryStore
    _ledger: type[EffectStore] = MemoryLedger
    _events: type[ChangeFeed] = MemoryEvents


def _releasable_held(row: TaskRow, now: datetime) -> bool:
    """A held row whose lease a release or revoke may end: not one already QUARANTINED.

    An expired lease whose ending used up the last attempt is QUARANTINED
    (``Lease.state``), stored or not yet by the sweep (SQL ``release``, ``revoke``).
    """
    return row.state == "held" and row.lease(now).state is not TaskState.QUARANTINED


def _this_write(
    old: TaskRow, new: TaskRow, ref: LeaseRef, checkpoint: CheckpointWrite
) -> Checkpoint | None:
    """The stored checkpoint when it is ``checkpoint`` (``Store.write_checkpoint``), else None.

    Saved by this write (the row's checkpoint changed), or the same version,
    data and content type already stored by ``ref``'s fence (a retry).
    """
    stored = new.checkpoint
    if stored is None:
        return None
    if stored is not old.checkpoint:
        return stored
    this = (checkpoint.version, ref.fence, checkpoint.data, checkpoint.content_type)
    same = (stored.version, stored.fence, stored.data, stored.content_type) == this
    return stored if same else None
