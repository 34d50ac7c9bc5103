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
  max_runtime)``, ``runtime_deadline = now + max_runtime``;
* renew never revives and never reaches past the runtime deadline;
* release and complete are idempotent per fence; revoke by any or one fence;
* list_leases: state and owner filters, keyset paging, the same scan budget;
* the effect ledger: ``core/effect_rules.py``'s pure rules (reused, not
  rewritten), behind ``core/model.fence_loss``;
* the change feed: every committed change of a task rings its watchers and
  pushes the event the task table's trigger would send
  (``migrations/0005_operations.sql``, ``0006_announce_every_expiry.sql``),
  expiries included when a change ends an unannounced expired lease;
  :meth:`MemoryStore.announce_expiries` plays the sweeper.

Every decision runs without an ``await`` between its read and its write, so
it is atomic on the event loop, as the single SQL statement is in the
database. Each call yields to the loop once before deciding (a call is never
instantaneous for its caller).

Namespace limits: the lock delay passed with a claim applies as in SQL;
``max_leases`` and ``claims_per_second`` are judged, as in SQL, on the
storage's own copy set with :meth:`MemoryStore.set_limits` (the table
``leasekeeper_namespace_limits``), and only when the claim's ``limits`` ask
for it (``needs_lock``).
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
    ClaimRateLimit,
    LeaseLimit,
    LeaseLost,
    TaskCompleted,
    TaskNotFound,
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
    ClaimOutcome,
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
    """One task, as a row of ``leasekeeper_tasks`` (migrations/0001, 0004, 0005)."""

    namespace: str
    task_id: str
    owner_id: str
    fence: int
    state: str  # 'held', 'released', 'revoked' or 'completed'
    expire_time: datetime
    runtime_deadline: datetime
    claim_time: datetime
    update_time: datetime
    end_reason: str | None = None
    claim_request_id: str | None = None
    revoke_reason: str | None = None
    expiry_announced_fence: int | None = None

    def live(self, now: datetime) -> bool:
        """Whether the row holds a live lease at ``now``: core.model's rule (``Lease.state``)."""
        return self.lease(now).state is TaskState.HELD

    def lease(self, now: datetime) -> Lease:
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
        )

    def payload(self, event: str, event_time: datetime) -> dict[str, Any]:
        """The trigger's notification for this row (leasekeeper_notify_row), as parsed JSON."""
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
        }


def _trigger_events(old: _Row | None, new: _Row) -> list[dict[str, Any]]:
    """What the task table's trigger announces for a change from ``old`` to ``new``.

    ``leasekeeper_notify_lease`` (migrations/0006): an expired lease nobody
    announced is announced first when a change ends it (a new fence or a new
    state); then 'claimed' for a new row or fence, else the new state
    ('released', 'completed', 'revoked'), else an expiry the sweeper marks.
    """
    events = []
    if (
        old is not None
        and old.state == "held"
        and (new.fence != old.fence or new.state != old.state)
        and old.expire_time <= new.update_time
        and old.expiry_announced_fence != old.fence
    ):
        events.append(old.payload("expired", old.expire_time))
    if old is None or new.fence != old.fence:
        events.append(new.payload("claimed", new.claim_time))
    elif new.state != old.state:
        events.append(new.payload(new.state, new.update_time))
    elif new.owner_id != old.owner_id:
        events.append(new.payload("claimed", new.claim_time))
    elif (
        new.expiry_announced_fence != old.expiry_announced_fence
        and new.expiry_announced_fence == new.fence
    ):
        events.append(new.payload("expired", new.expire_time))
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

    def _commit(self, key: TaskKey, old: _Row | None, new: _Row) -> None:
        self._rows[key] = new
        for payload in _trigger_events(old, new):
            self.events.publish(payload)

    async def claim(
        self,
        key: TaskKey,
        owner_id: str,
        ttl: timedelta,
        max_runtime: timedelta,
        request_id: str | None = None,
        limits: NamespaceLimits = NO_LIMITS,
        take_token: bool = True,
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
        grant = self._decide_claim(key, owner_id, ttl, max_runtime, request_id, delay, now)
        if grant is not None and stored is not None and stored.max_leases is not None:
            # Raises before the bucket is stored: SQL rolls the token back with the claim.
            self._check_lease_limit(key, stored.max_leases, now)
        if bucket is not None:  # taken by a granted and by a refused claim alike
            self._buckets[key.namespace] = bucket
        if grant is not None:
            self._commit(key, grant.old, grant.new)
            return ClaimOutcome(True, grant.new.lease(now))
        # No grant: say why, as Store.claim does with its read after the statement.
        task = self.read(key)
        assert task is not None, "a claim of a task without a row always grants"
        state = task.state
        if state is TaskState.COMPLETED:
            raise TaskCompleted(task.fence)
        if state is TaskState.HELD:
            if task.is_claim_of(owner_id, request_id):
                return ClaimOutcome(True, task)
            return ClaimOutcome(False, task, task.remaining_ttl + delay)
        assert state is TaskState.EXPIRED and task.expire_time + delay > now
        return ClaimOutcome(False, task, task.expire_time + delay - now)

    def _decide_claim(
        self,
        key: TaskKey,
        owner_id: str,
        ttl: timedelta,
        max_runtime: timedelta,
        request_id: str | None,
        delay: timedelta,
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
        )
        if old is None:
            return _Grant(None, granted)
        free = old.state in ("released", "revoked")
        past_delay = old.state == "held" and old.expire_time + delay <= now
        new_incarnation = (
            old.state == "held"
            and old.owner_id == owner_id
            and request_id is not None
            and old.claim_request_id != request_id
        )
        if not (free or past_delay or new_incarnation):
            return None
        # The row keeps its expiry announcement (it names an older fence).
        return _Grant(
            old,
            replace(
                granted, fence=old.fence + 1, expiry_announced_fence=old.expiry_announced_fence
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

    async def renew(self, ref: LeaseRef, ttl: timedelta) -> Lease:
        """Extends a live lease (``protocol.LeaseStore.renew``; SQL ``renew``)."""
        await asyncio.sleep(0)
        now = self.now()
        row = self._rows.get(ref.key)
        if (
            row is not None
            and row.owner_id == ref.owner_id
            and row.fence == ref.fence
            and row.live(now)
            and row.runtime_deadline > now
        ):
            # Only expire_time and update_time change: no event (not news to anyone).
            row.expire_time = min(now + ttl, row.runtime_deadline)
            row.update_time = now
            return row.lease(now)
        task = self.read(ref.key)
        raise LeaseLost.of(
            task, owner_loss(task, ref.owner_id, ref.fence) or LossReason.LEASE_EXPIRED
        )

    async def release(self, ref: LeaseRef, complete: bool) -> Lease:
        """Releases or completes a lease (``protocol.LeaseStore.release``; SQL ``release``)."""
        await asyncio.sleep(0)
        now = self.now()
        old = self._rows.get(ref.key)
        if (
            old is not None
            and old.owner_id == ref.owner_id
            and old.fence == ref.fence
            and (old.state == "held" or (complete and old.state == "released"))
        ):
            new = replace(
                old,
                state="completed" if complete else "released",
                end_reason="TASK_COMPLETED" if complete else "LEASE_RELEASED",
                expire_time=min(old.expire_time, now),
                update_time=now,
            )
            self._commit(ref.key, old, new)
            return new.lease(now)
        task = self.read(ref.key)
        reason = owner_loss(task, ref.owner_id, ref.fence)
        if task is not None and reason in (LossReason.LEASE_RELEASED, LossReason.TASK_COMPLETED):
            if task.fence == ref.fence and task.owner_id == ref.owner_id:
                return task  # released (or completed) already by this owner and fence
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

    async def revoke(self, key: TaskKey, reason: str, fence: int) -> tuple[bool, Lease]:
        """Ends the task's lease now (``protocol.LeaseStore.revoke``; SQL ``revoke``)."""
        await asyncio.sleep(0)
        now = self.now()
        old = self._rows.get(key)
        if old is not None and old.state == "held" and fence in (0, old.fence):
            new = replace(
                old,
                state="revoked",
                end_reason="LEASE_REVOKED",
                revoke_reason=reason,
                expire_time=min(old.expire_time, now),
                update_time=now,
            )
            self._commit(key, old, new)
            return True, new.lease(now)
        if old is None:
            raise TaskNotFound(
                f"task {key.task_id!r} in namespace {key.namespace!r} was never claimed"
            )
        if old.state == "completed":
            raise TaskCompleted(old.fence)
        return False, old.lease(now)

    def announce_expiries(self) -> int:
        """Plays the expiry sweeper (SQL ``sweep_expired``): announces every unannounced expiry.

        Returns:
            How many expiries were announced (each sends an 'expired' event).
        """
        now = self.now()
        announced = 0
        for key, old in sorted(
            self._rows.items(), key=lambda item: (item[0].namespace, item[0].task_id)
        ):
            if old.state == "held" and old.expiry_announced_fence != old.fence:
                if not old.live(now):
                    self._commit(key, old, replace(old, expiry_announced_fence=old.fence))
                    announced += 1
        return announced


class MemoryLedger:
    """The effect ledger in memory (``protocol.EffectStore``), over a MemoryStore's tasks.

    The decisions are ``core/effect_rules.py``'s (``decide_begin``,
    ``check_complete``), behind the fence check ``ledger.EffectLedger`` makes
    (``core/model.fence_loss`` on the task read at the same instant).
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
            self._records[key] = record
            return BeginDecision.PROCEED, record
        decision = decide_begin(record, request)
        if decision is not BeginDecision.PROCEED:
            return decision, record
        # SQL reserve_effect: a new attempt; the policy never changes.
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
        self._records[key] = record
        return decision, record

    async def complete(self, key: EffectKey, fence: int, outcome: Outcome) -> Effect:
        """Records an outcome (``protocol.EffectStore.complete``; ``EffectLedger.complete``)."""
        await asyncio.sleep(0)
        self._check_fence(key, fence)
        record = self._records.get(key)
        if not check_complete(record, outcome):
            assert record is not None
            return record
        assert record is not None
        record = replace(
            record,
            state=outcome.state,
            retryable=outcome.retryable,
            result=outcome.result,
            complete_fence=fence,
            complete_time=self._store.now(),
        )
        self._records[key] = record
        return record

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
