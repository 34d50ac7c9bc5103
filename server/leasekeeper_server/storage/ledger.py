"""The effect ledger on PostgreSQL: BeginEffect and CompleteEffect as short transactions.

Each call is one transaction on one connection borrowed from the
:class:`~leasekeeper_server.storage.store.Store`:

1. ``lock_lease`` share-locks the task's row and reads it with the database
   clock; :func:`~leasekeeper_server.core.model.fence_loss` must find the caller's
   fence current and its lease HELD, else the call fails with LeaseLost
   (ABORTED) and nothing is written. A claim, renewal or release of the task
   waits for the lock, so the fence stays current until the ledger write
   commits.
2. The effect's record is inserted or locked (``FOR UPDATE``): concurrent
   calls for one key are decided one after another, so of many concurrent
   BeginEffect calls for a new key exactly one inserts it and gets PROCEED.
3. The rules of :mod:`~leasekeeper_server.core.effect_rules` decide; at most one more
   statement writes the outcome.
4. Waiting for the effect's row lock can outlast the lease, so each of those
   statements also reads whether the lease is still live on the clock after
   its own lock or write (``lease_live``); the answer of the last one decides,
   and a lease that ran out meanwhile rolls everything back as LeaseLost.

An UNAVAILABLE answer does not prove that nothing was written: a commit that
was slower than the driver's timeout (a synchronous replica that lags) may
still land. Retrying is safe: a reservation that did commit answers IN_DOUBT,
a completion that did commit answers the same record again.

Driver errors leave as DatabaseUnavailable (UNAVAILABLE), as in the store.
"""

from __future__ import annotations

import asyncpg

from leasekeeper_server.core.effect_rules import (
    BeginDecision,
    BeginRequest,
    Effect,
    EffectKey,
    EffectPolicy,
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
    LossReason,
    TaskKey,
    fence_loss,
    lease_from_row,
)
from leasekeeper_server.storage.store import Store


def effect_from_row(row: asyncpg.Record) -> Effect:
    """A ledger row as an Effect."""
    return Effect(
        namespace=row["namespace"],
        task_id=row["task_id"],
        effect_key=row["effect_key"],
        policy=EffectPolicy(row["policy"]),
        request_digest=bytes(row["request_digest"]),
        state=EffectState(row["state"]),
        fence=row["fence"],
        complete_fence=row["complete_fence"],
        retryable=row["retryable"],
        result=bytes(row["result"]),
        attempts=row["attempts"],
        begin_time=row["begin_time"],
        complete_time=row["complete_time"],
        external_operation_id=row["external_operation_id"],
    )


class EffectLedger:
    """BeginEffect, CompleteEffect and ListEffects on the store's database."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._sql = store.sql

    async def _check_fence(
        self, conn: asyncpg.Connection, key: EffectKey, fence: int, lock: str = "lock_lease"
    ) -> Lease:
        """Locks the task row (``lock``: share or exclusive) and returns its lease.

        Raises:
            LeaseLost: (ABORTED) ``fence`` may not act now.
        """
        row = await conn.fetchrow(self._sql[lock], key.namespace, key.task_id)
        task = lease_from_row(row) if row is not None else None
        reason = fence_loss(task, fence)
        if reason is not None:
            raise LeaseLost(reason, task.fence if task is not None else 0)
        assert task is not None  # a fence that may act names an existing task
        return task

    async def _settle(
        self, conn: asyncpg.Connection, key: EffectKey, fence: int, row: asyncpg.Record
    ) -> Effect:
        """The record of the transaction's last statement, if the lease was still live then.

        Raises:
            LeaseLost: the lease ran out while the transaction waited (ABORTED);
                the transaction rolls back.
        """
        if not row["lease_live"]:
            await self._check_fence(conn, key, fence)  # the clock moved on: raises the loss
            raise LeaseLost(LossReason.LEASE_EXPIRED, fence)  # pragma: no cover - unreachable
        return effect_from_row(row)

    async def begin(self, request: BeginRequest) -> tuple[BeginDecision, Effect]:
        """Reserves an effect for a live fence, or says why not to act.

        Atomic (one transaction, decided on the database clock); see
        :mod:`~leasekeeper_server.core.effect_rules` for the rules.

        Returns:
            PROCEED with the new reservation, ALREADY_APPLIED with the
            confirmed outcome, or IN_DOUBT with the unconfirmed earlier attempt.

        Raises:
            LeaseLost: the fence is not current and live (ABORTED); nothing reserved.
            EffectKeyReused: another policy or digest (FAILED_PRECONDITION).
            DatabaseUnavailable: UNAVAILABLE.
        """
        key, sql = request.key, self._sql
        args = (key.namespace, key.task_id, key.effect_key)
        async with self._store.transaction() as conn:
            await self._check_fence(conn, key, request.fence)
            row = await conn.fetchrow(
                sql["insert_effect"],
                *args,
                request.policy.value,
                request.request_digest,
                request.fence,
            )
            if row is not None:
                return BeginDecision.PROCEED, await self._settle(conn, key, request.fence, row)
            row = await conn.fetchrow(sql["lock_effect"], *args)
            assert row is not None, "effect rows are never deleted"
            record = await self._settle(conn, key, request.fence, row)
            decision = decide_begin(record, request)
            if decision is not BeginDecision.PROCEED:
                return decision, record
            row = await conn.fetchrow(
                sql["reserve_effect"], *args, request.request_digest, request.fence
            )
            return decision, await self._settle(conn, key, request.fence, row)

    async def complete(self, key: EffectKey, fence: int, outcome: Outcome) -> Effect:
        """Records an effect's outcome by a live fence. Atomic; idempotent for the same outcome.

        Raises:
            LeaseLost: the fence is not current and live (ABORTED); nothing recorded.
            EffectNotBegun: no reservation for the key (FAILED_PRECONDITION).
            EffectAlreadyCompleted: another outcome is recorded (FAILED_PRECONDITION).
            DatabaseUnavailable: UNAVAILABLE.
        """
        async with self._store.transaction() as conn:
            await self._check_fence(conn, key, fence)
            return await self._complete(conn, key, fence, outcome)

    async def complete_and_save(
        self,
        key: EffectKey,
        fence: int,
        outcome: Outcome,
        checkpoint: CheckpointWrite,
    ) -> tuple[Effect, Checkpoint]:
        """Records an effect's outcome and saves the checkpoint after it: both or neither.

        One transaction holding the task's row exclusively; the checkpoint is
        decided as ``Store.save_checkpoint`` decides it, for the owner of
        ``fence`` as the locked row names it. Idempotent like each part.

        Raises:
            LeaseLost, EffectNotBegun, EffectAlreadyCompleted: as :meth:`complete`.
            CheckpointNotNewer: (FAILED_PRECONDITION) nothing recorded.
            DatabaseUnavailable: UNAVAILABLE.
        """
        async with self._store.transaction() as conn:
            task = await self._check_fence(conn, key, fence, "lock_lease_exclusive")
            record = await self._complete(conn, key, fence, outcome)
            ref = LeaseRef(TaskKey(key.namespace, key.task_id), task.owner_id, fence)
            saved, _lease = await self._store.save_checkpoint(ref, checkpoint, conn)
            return record, saved

    async def _complete(
        self, conn: asyncpg.Connection, key: EffectKey, fence: int, outcome: Outcome
    ) -> Effect:
        args = (key.namespace, key.task_id, key.effect_key)
        row = await conn.fetchrow(self._sql["lock_effect"], *args)
        record = await self._settle(conn, key, fence, row) if row is not None else None
        if not check_complete(record, outcome):
            assert record is not None
            return record
        row = await conn.fetchrow(
            self._sql["complete_effect"],
            *args,
            fence,
            outcome.state.value,
            outcome.retryable,
            outcome.result,
            outcome.external_operation_id,
        )
        return await self._settle(conn, key, fence, row)

    async def list(
        self, task: TaskKey, after_effect_key: str, limit: int, state: EffectState | None
    ) -> list[Effect]:
        """Up to ``limit`` effects of a task after ``after_effect_key``, by key. Read-only."""
        rows = await self._store.fetch(
            "list_effects",
            task.namespace,
            task.task_id,
            after_effect_key,
            limit,
            state.value if state is not None else None,
        )
        return [effect_from_row(r) for r in rows]
