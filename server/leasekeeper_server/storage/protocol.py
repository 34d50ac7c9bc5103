"""The storage seam: what the RPC layer needs from storage, as ``typing.Protocol``s.

``rpc/`` (the servicer, the heartbeat streams, the Watch streams) is written
against these three shapes, not against PostgreSQL:

* :class:`LeaseStore` — the lease decisions (claim, renew, release, revoke)
  and the reads (one task, a page of a namespace, a page of namespaces, a
  namespace's figures);
* :class:`EffectStore` — the effect ledger (BeginEffect, CompleteEffect,
  ListEffects);
* :class:`ChangeFeed` — the doorbell rung on every committed change of a
  task's ownership, and the events themselves for Watch.

Two implementations exist: PostgreSQL (``store.Store``, ``ledger.EffectLedger``,
``events.LeaseEvents``), the one a server runs, where every decision is one
SQL statement on the database clock (``sql/queries.sql``); and an in-memory
one for tests (``memory.py``), with a clock the test moves by hand. One
behaviour suite, ``tests/conformance/``, runs against both: a rule changed in
one and not the other fails it.

Every decision a method describes is the rule of ``core/model.py`` (the state
model, ``fence_loss``, ``owner_loss``) and ``core/effect_rules.py``; the
docstrings below say where each comes from. Durations are ``timedelta``;
instants are timezone-aware ``datetime``s of the storage's own clock (the
database's, for PostgreSQL): an implementation never uses the caller's clock
to decide. Domain errors are those of ``core/errors.py``; their gRPC status
(``rpc/status.py``) is given in parentheses. Every method may also raise
``DatabaseUnavailable`` (UNAVAILABLE) when its storage cannot be reached: the
call may then have been applied or not, and retrying it is safe (claims carry
request ids, the other decisions are idempotent per fence).

The implementations' conformance is checked by mypy at the bottom of this
module (under ``TYPE_CHECKING``, so nothing is imported at run time). The
implementations must therefore not import this module: that would be an
import circle (tests/unit/test_import_graph.py).
"""

from __future__ import annotations

import asyncio
import builtins
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from leasekeeper_server.core.effect_rules import (
    BeginDecision,
    BeginRequest,
    Effect,
    EffectKey,
    EffectState,
    Outcome,
)
from leasekeeper_server.core.limits import NO_LIMITS, NamespaceLimits
from leasekeeper_server.core.model import (
    STATS_COUNT_LIMIT,
    Checkpoint,
    CheckpointWrite,
    ClaimOutcome,
    HistoryEntry,
    Lease,
    LeaseRef,
    LossReason,
    NamespaceCount,
    NamespaceStats,
    TaskKey,
    TaskState,
)
from leasekeeper_server.storage.subscription import Doorbell


class LeaseStore(Protocol):
    """The lease decisions and reads (the tasks of ``core/model.py``'s state model)."""

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
        """Claims a task for ``owner_id``; atomic, decided on the storage's clock.

        The rule (``core/model.py`` "claim", SQL ``claim``): a new, FREE or
        EXPIRED task (past ``limits.lock_delay`` since its expiry) is granted
        with fence + 1 (the first fence of a task is 1 on a fresh database);
        a task HELD by this owner under another request id is granted again
        with fence + 1 (a new incarnation supersedes the earlier fence); a
        task HELD by this owner under the same request id, or with
        ``request_id`` None, is handed back unchanged (a retry; no renewal).

        Args:
            key: the task.
            owner_id: the claiming owner incarnation.
            ttl: lease length; the granted expiry is ``now + min(ttl, max_runtime)``.
            max_runtime: the runtime budget: no renewal reaches past
                ``now + max_runtime`` (the lease's ``runtime_deadline``).
            request_id: names this logical claim (AIP-155); None for none.
            limits: the namespace's limits (``core/limits.py``); the lock
                delay applies to every claim, a lease or rate limit is judged
                on the storage's own copy of the limits.
            take_token: False for a retry of a waiting Claim that already
                took its rate token.
            max_attempts: the grant's attempt limit (None: none). Taking over
                an EXPIRED lease counts it as an attempt; an EXPIRED lease whose
                ending used up its grant's limit is not taken over (the task is
                QUARANTINED: ``Lease.attempt_used_up``).

        Returns:
            ``acquired=True`` with the caller's lease (new or handed back) and
            the task's checkpoint, or
            ``acquired=False`` with the holder's lease and ``retry_after``:
            the holder's remaining ttl plus the lock delay, or, for an
            EXPIRED lease in its lock delay, ``expire_time + lock_delay - now``.

        Raises:
            TaskNotClaimable: the task is COMPLETED, CANCELLED, FAILED or
                QUARANTINED (FAILED_PRECONDITION; ``Lease.unclaimable``).
            LeaseLimit: the namespace holds ``max_leases`` live leases
                (RESOURCE_EXHAUSTED; nothing changed).
            ClaimRateLimit: the namespace's claim bucket is empty
                (RESOURCE_EXHAUSTED; nothing changed).
        """
        ...

    async def renew(self, ref: LeaseRef, ttl: timedelta) -> Lease:
        """Extends a live lease to ``min(now + ttl, runtime_deadline)``; atomic.

        The rule (``core/model.py`` "renew", SQL ``renew``): only the HELD
        lease of ``ref.owner_id`` with ``ref.fence``; an EXPIRED lease is never
        revived, even by its owner and fence.

        Returns:
            The renewed lease (``db_now`` the instant of the renewal).

        Raises:
            LeaseLost: (ABORTED) with ``owner_loss``'s reason: LEASE_EXPIRED,
                RUNTIME_EXCEEDED, LEASE_SUPERSEDED, LEASE_RELEASED,
                LEASE_REVOKED, TASK_COMPLETED, NOT_OWNER or FENCE_UNKNOWN; its
                ``current_fence`` is the task's fence (0 if never claimed).
        """
        ...

    async def write_checkpoint(
        self, ref: LeaseRef, checkpoint: CheckpointWrite, ttl: timedelta | None = None
    ) -> tuple[Lease, Checkpoint | None]:
        """Stores the checkpoint under ``ref``'s live lease, renewing it when ``ttl`` is given.

        The renewal's rule decides (SQL ``renew``): only the HELD lease of
        ``ref``, only a version higher than the stored one.

        Returns:
            The lease after the decision, and the stored checkpoint when it is
            this write's (saved now, or the same version, data and content type
            already stored by this fence); None when the version did not move
            forward (not stored; a renewal, if asked, happened).

        Raises:
            LeaseLost: (ABORTED) as :meth:`renew`; nothing stored.
        """
        ...

    async def save_checkpoint(
        self, ref: LeaseRef, checkpoint: CheckpointWrite
    ) -> tuple[Checkpoint, Lease]:
        """Stores the task's checkpoint under ``ref``'s live lease (``renew`` without ttl).

        Idempotent for the stored version rewritten by its fence with the
        same data and content type.

        Raises:
            LeaseLost: (ABORTED) as :meth:`renew`; nothing stored.
            CheckpointNotNewer: (FAILED_PRECONDITION) the version is not higher.
        """
        ...

    async def get_checkpoint(self, key: TaskKey) -> Checkpoint | None:
        """The task's checkpoint with its data; None when none was saved."""
        ...

    async def release(
        self, ref: LeaseRef, complete: bool, fail: bool = False, fail_reason: str = ""
    ) -> Lease:
        """Ends the lease of ``ref`` (live or expired): FREE, COMPLETED or FAILED.

        ``fail`` ends the run as failed (terminal; ``fail_reason`` recorded).

        The rule (``core/model.py`` "release", SQL ``release``): the fence
        matching proves no newer grant exists, so an expired lease may still
        be released or completed by its owner; the task keeps its fence and
        owner, and ``expire_time`` becomes ``min(expire_time, now)``. A lease
        already released by this owner and fence may still be completed.
        Idempotent per fence: a release (or completion) already made by this
        owner with this fence answers with the task as it is.

        Raises:
            LeaseLost: (ABORTED) LEASE_SUPERSEDED, NOT_OWNER, LEASE_REVOKED,
                FENCE_UNKNOWN (``owner_loss``).
        """
        ...

    async def get_lease(self, key: TaskKey) -> Lease | None:
        """The task's lease with the storage's clock (``db_now``), or None if never claimed.

        Read-only. Its ``state`` (``Lease.state``) is judged at ``db_now``;
        ValidateFence and the heartbeat's check apply ``fence_loss`` /
        ``owner_loss`` to it.
        """
        ...

    async def list_leases(
        self,
        namespace: str,
        after_task_id: str,
        limit: int,
        state: TaskState | None,
        owner_id: str | None = None,
    ) -> tuple[builtins.list[Lease], str | None]:
        """Up to ``limit`` tasks of ``namespace`` after ``after_task_id``, by task_id (keyset).

        Filters: derived ``state`` at one reading of the clock (None: any),
        ``owner_id`` (None: any). Task ids compare byte for byte (code point
        order; SQL ``COLLATE "C"``). One call reads at most
        ``max(1000, limit)`` tasks of the namespace however rare the
        filter's matches (SQL ``list_leases``).

        Returns:
            The matching tasks read, and the task_id of the last task read
            when the read stopped at that budget with fewer than ``limit``
            matches (the next page starts after it), else None.
        """
        ...

    async def list_namespaces(
        self, after_namespace: str, limit: int
    ) -> builtins.list[NamespaceCount]:
        """Up to ``limit`` namespaces that hold tasks after ``after_namespace``, by name (keyset).

        Names compare byte for byte (SQL ``COLLATE "C"``). Each comes with its
        tasks (every state) counted up to ``NAMESPACE_COUNT_LIMIT``, ``capped``
        when it holds more. Read-only; every namespace, whoever asks (the RPC
        layer leaves out those the caller's token does not cover). A call
        reads one index descent per namespace it passes and at most
        ``NAMESPACE_COUNT_LIMIT + 1`` tasks of each (SQL ``list_namespaces``).
        """
        ...

    async def namespace_stats(
        self, namespace: str, limit: int = STATS_COUNT_LIMIT
    ) -> NamespaceStats:
        """A namespace's figures at one instant of the storage's clock (GetNamespaceStats).

        Read-only, at one instant (``as_of``): the tasks HELD, EXPIRED and
        QUARANTINED (``Lease.state``); the GRANTED, FENCE_REFUSED, and
        EXPIRED plus REVOKED history entries whose event_time is within
        ``STATS_WINDOW`` before it; the RESERVED effects whose fence is not
        the task's live lease (the fence is not the task's current one, or its
        lease is not HELD). A namespace without tasks has every count 0.

        Each scan reads at most ``limit + 1`` rows, in its index's order:
        the unswept leases (row state 'held', expiry not announced) by
        task_id, the announced expiries and the stored quarantines by
        task_id, each kind of history entry by event_time, the reserved
        effects by (task_id, effect_key); ``core.model.namespace_stats``
        caps the figures from them (SQL ``namespace_stats``). The cost never
        follows the namespace's size.
        """
        ...

    async def revoke(self, key: TaskKey, reason: str, fence: int) -> tuple[bool, Lease]:
        """Ends the task's lease now (an operator's call); the task becomes FREE.

        The rule (SQL ``revoke``): a held lease, live or expired, of any fence
        (``fence`` 0) or of ``fence`` only, is revoked: row state 'revoked',
        claimable at once (no lock delay), fence kept (the next claim gets
        fence + 1), ``expire_time`` becomes ``min(expire_time, now)``,
        ``revoke_reason`` recorded.

        Returns:
            (True, the task) when a held lease was revoked; (False, the task
            as it is) when it had none (FREE) or another fence.

        Raises:
            TaskNotFound: never claimed (NOT_FOUND).
            TaskNotClaimable: the task is COMPLETED, CANCELLED or FAILED
                (FAILED_PRECONDITION).
        """
        ...

    async def cancel(self, key: TaskKey, reason: str) -> tuple[bool, Lease]:
        """Cancels the task: CANCELLED, terminal, its lease ended now; idempotent.

        Returns:
            (True, the task) when this call cancelled it; (False, the task as
            it is) when it was CANCELLED already: nothing written, its first
            reason kept.

        Raises:
            TaskNotFound: never claimed (NOT_FOUND).
            TaskNotClaimable: COMPLETED or FAILED (FAILED_PRECONDITION).
        """
        ...

    async def retry(self, key: TaskKey, reason: str) -> Lease:
        """Puts a QUARANTINED task back: FREE, attempts 0, fence kept.

        Raises:
            TaskNotFound: never claimed (NOT_FOUND).
            TaskNotQuarantined: not QUARANTINED (FAILED_PRECONDITION).
        """
        ...

    async def record_refusal(self, key: TaskKey, fence: int, loss: LossReason, method: str) -> None:
        """A FENCE_REFUSED history entry (none for a task never claimed)."""
        ...

    async def list_history(
        self, key: TaskKey, after_sequence: int, limit: int
    ) -> builtins.list[HistoryEntry]:
        """Up to ``limit`` history entries of the task after ``after_sequence``, oldest first."""
        ...


class EffectStore(Protocol):
    """The effect ledger: one record per ``(namespace, task_id, effect_key)``.

    Every call first checks, atomically with its write, that the caller's
    fence is the task's current fence and its lease HELD on the storage's
    clock (``core/model.fence_loss``); only then do the pure rules of
    ``core/effect_rules.py`` decide.
    """

    async def begin(self, request: BeginRequest) -> tuple[BeginDecision, Effect]:
        """Reserves an effect for a live fence, or says why not to act (BeginEffect).

        Returns:
            PROCEED with the new reservation (a new record, attempts 1, or a
            new attempt over a retryable failure or a superseded LATEST
            record, attempts + 1); ALREADY_APPLIED with the confirmed
            outcome; IN_DOUBT with the unconfirmed earlier attempt
            (``effect_rules.decide_begin``).

        Raises:
            LeaseLost: the fence is not current and live (ABORTED; reason
                from ``fence_loss``); nothing reserved.
            EffectKeyReused: another policy, or another request digest
                without superseding (FAILED_PRECONDITION).
        """
        ...

    async def complete(self, key: EffectKey, fence: int, outcome: Outcome) -> Effect:
        """Records an effect's outcome by a live fence (CompleteEffect).

        Idempotent for the same outcome (``effect_rules.check_complete``);
        ``complete_fence`` is the caller's fence.

        Raises:
            LeaseLost: the fence is not current and live (ABORTED); nothing recorded.
            EffectNotBegun: no record for the key (FAILED_PRECONDITION).
            EffectAlreadyCompleted: another outcome is recorded (FAILED_PRECONDITION).
        """
        ...

    async def complete_and_save(
        self,
        key: EffectKey,
        fence: int,
        outcome: Outcome,
        checkpoint: CheckpointWrite,
    ) -> tuple[Effect, Checkpoint]:
        """:meth:`complete` and ``LeaseStore.save_checkpoint`` (for ``fence``'s owner), atomically.

        Raises:
            As :meth:`complete`, and CheckpointNotNewer (FAILED_PRECONDITION).
        """
        ...

    async def list(
        self, task: TaskKey, after_effect_key: str, limit: int, state: EffectState | None
    ) -> builtins.list[Effect]:
        """Up to ``limit`` effects of a task after ``after_effect_key``, by key (keyset).

        Read-only; ``state`` None for any state. An unknown task has none.
        """
        ...


class EventSubscription(Protocol):
    """The events of a subscription since it began, in commit order (``events.Subscription``)."""

    @property
    def ready(self) -> asyncio.Event:
        """Set while events are pending or a gap was marked."""
        ...

    def take(self) -> tuple[bool, builtins.list[dict[str, Any]]]:
        """(gap, events) since the last take; clears both and ``ready``.

        Each event is a dict shaped as the task trigger's payload
        (``migrations/0005_operations.sql``): ``event`` ('claimed',
        'released', 'completed', 'revoked', 'expired'), ``event_time`` and the
        row's instants as ISO 8601 text, and the row's ``namespace``,
        ``task_id``, ``owner_id``, ``fence``, ``state``, ``end_reason``,
        ``claim_request_id``, ``revoke_reason``. ``gap`` True: events may have
        been lost; re-read the state.
        """
        ...


class ChangeFeed(Protocol):
    """Committed changes of task ownership: a grant, release, completion, revoke, announced expiry.

    A renewal is not a change (nothing is announced). A notification is a
    doorbell: whoever wakes decides again on a fresh read.
    """

    def watch(self, key: TaskKey) -> AbstractContextManager[asyncio.Event]:
        """An event set on every committed change of ``key`` while the block runs.

        Also set when changes may have been missed (the PostgreSQL listener
        reconnected). The watcher clears it after checking.
        """
        ...

    def ring(self, key: TaskKey, bell: Doorbell) -> AbstractContextManager[None]:
        """Calls ``bell.set()`` on every committed change of ``key`` while the block runs.

        What :meth:`watch` does with its event, with a bell of the caller's
        (any object with ``set()``): a Session stream watches each of its
        leases with one small object rather than an event and a task each.
        """
        ...

    def subscribe(
        self, namespace: str | None, task_id: str | None
    ) -> AbstractContextManager[EventSubscription]:
        """The events of one task, of every task of a namespace (task_id None), or of all (both)."""
        ...


if TYPE_CHECKING:
    # mypy checks the PostgreSQL implementations against the seam here; the
    # in-memory ones are checked in memory.py.
    from leasekeeper_server.storage.events import LeaseEvents
    from leasekeeper_server.storage.ledger import EffectLedger
    from leasekeeper_server.storage.store import Store

    _store: type[LeaseStore] = Store
    _ledger: type[EffectStore] = EffectLedger
    _events: type[ChangeFeed] = LeaseEvents
