"""The in-memory effect ledger: ``MemoryLedger``, the rows of ``leasekeeper_effects``.

It takes the decisions of ``ledger.EffectLedger``'s statements
(``begin_effect``, ``complete_effect``) with ``core/effect_rules.py``'s pure
rules (reused, not rewritten), behind ``core/model.fence_loss`` on the task
read at the same instant; an outcome and a checkpoint saved together are
both kept or neither, the outcome first. The tasks are the
in-memory store's (``memory.MemoryStore``), reached through
:class:`LedgerTasks`; like the store's, every decision runs without an
``await`` between its read and its write, after one yield to the loop.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any, Protocol

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
from leasekeeper_server.core.errors import LeaseLost
from leasekeeper_server.core.model import (
    Checkpoint,
    CheckpointWrite,
    Lease,
    LeaseRef,
    TaskKey,
    fence_loss,
)


class LedgerTasks(Protocol):
    """What the ledger needs of the store that holds the tasks (``memory.MemoryStore``)."""

    # The rows of leasekeeper_effects, kept by the store as the database keeps
    # both tables: the ledger writes them, the store's namespace_stats reads them.
    effects: dict[EffectKey, Effect]

    def now(self) -> datetime:
        """The storage's clock (timezone-aware)."""
        ...

    def read(self, key: TaskKey) -> Lease | None:
        """The task's lease now, without yielding."""
        ...

    def write_history(self, key: TaskKey, event_time: datetime, **fields: Any) -> None:
        """Appends one entry to the task's history."""
        ...

    def save_checkpoint_after(
        self, ref: LeaseRef, checkpoint: CheckpointWrite, first: Callable[[], None]
    ) -> tuple[Checkpoint, Lease]:
        """Decides a checkpoint write; if it stands, runs ``first``, then stores it."""
        ...


class MemoryLedger:
    """The effect ledger in memory (``protocol.EffectStore``), over a ``MemoryStore``'s tasks.

    The decisions are ``core/effect_rules.py``'s (``decide_begin``,
    ``check_complete``), behind the fence check ``ledger.EffectLedger`` makes
    (``core/model.fence_loss`` on the task read at the same instant). Each
    reservation and each outcome recorded is a history entry of the task, as
    the effect table's trigger writes (migrations/0008).
    """

    def __init__(self, store: LedgerTasks) -> None:
        self._store = store
        self._records = store.effects

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
        # SQL begin_effect's new attempt: the policy never changes. The
        # external operation id stays (begin_effect does not clear it).
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
        checkpoint: CheckpointWrite,
    ) -> tuple[Effect, Checkpoint]:
        """An outcome and a checkpoint, both or neither (``EffectLedger.complete_and_save``).

        Both decisions are taken before either is written, so a refusal of
        the checkpoint (LeaseLost, CheckpointNotNewer) records no outcome, as
        SQL ``complete_effect`` writes neither; the outcome is written first
        (its history entry comes before the checkpoint's).
        """
        await asyncio.sleep(0)
        decided = self._decide_complete(key, fence, outcome)  # the fence may act: its task exists
        task = TaskKey(key.namespace, key.task_id)
        lease = self._store.read(task)
        assert lease is not None
        ref = LeaseRef(task, lease.owner_id, fence)

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
