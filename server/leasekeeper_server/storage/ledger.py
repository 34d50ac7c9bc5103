"""The effect ledger on PostgreSQL: BeginEffect and CompleteEffect, one statement each.

BeginEffect is statement ``begin_effect``, CompleteEffect statement
``complete_effect`` (``sql/queries.sql``, where the rules and the argument
for at most once are written beside the SQL). One statement is one
transaction, so a pair costs two statements, and neither needs anything of
its session (no transaction block, no state left on the connection). Like
claims, the calls arriving together share one statement over arrays
(``statements.BatchedStatement``, made by ``Store.batched``: never two calls
of one task in a batch; a batch that meets a row lock, or fails, is sent
again call by call: ``RUN_ALONE``), so under load a pair costs a fraction of
a statement. A CompleteEffect that saves the next checkpoint is always sent
alone (it locks its task's row for writing). Each call's element holds its
task's row, then the effect's record, reads the database clock, decides and
writes; this module reads its answer row:

* no row: the task was never claimed, so the fence is unknown (LeaseLost,
  ABORTED);
* ``may_act`` false: the fence is not the task's current one or its lease is
  not live on that clock; :func:`~leasekeeper_server.core.model.fence_loss`
  of the lease in the row gives the reason (LeaseLost, ABORTED), nothing
  was written;
* otherwise the effect's record (``e_*``), as the statement wrote it
  (``e_written``), or as it found it when the rules wrote nothing, which
  :mod:`~leasekeeper_server.core.effect_rules` then answers (IN_DOUBT,
  ALREADY_APPLIED, or a refusal).

A BeginEffect whose statement began before another one's first reservation of
the same key committed finds no record and writes none (``e_written`` NULL);
it is sent once more, and then finds it. A BeginEffect whose lease ran out
while its first reservation waited fails in the database (SQLSTATE
``LK001``), which undoes the reservation (and the rest of its batch, sent
again call by call); it is answered LeaseLost.

An UNAVAILABLE answer does not prove that nothing was written: a commit that
was slower than the driver's timeout (a synchronous replica that lags) may
still land. Retrying is safe: a reservation that did commit answers IN_DOUBT,
a completion that did commit answers the same record again. For the same
reason a batch is safely sent once more when its kept connection turns out
dead (``BatchedStatement``).

Driver errors leave as DatabaseUnavailable (UNAVAILABLE), as in the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
from leasekeeper_server.core.errors import CheckpointNotNewer, EffectNotBegun, LeaseLost
from leasekeeper_server.core.model import (
    Checkpoint,
    CheckpointWrite,
    LossReason,
    TaskKey,
    fence_loss,
    lease_from_row,
)
from leasekeeper_server.storage.statements import RUN_ALONE, BatchedStatement, Unsent
from leasekeeper_server.storage.store import Store

# The SQLSTATE of leasekeeper_lease_ran_out (migrations/0010_effect_statements.sql).
LEASE_RAN_OUT = "LK001"
# A BeginEffect is sent at most twice: the second statement sees every record
# the first one's insert conflicted with (records are never deleted).
BEGIN_TRIES = 2


@dataclass(frozen=True, slots=True)
class BeginParams:
    """One BeginEffect: the parameters of statement ``begin_effect``, in its order.

    Attributes:
        policy: ``EffectPolicy``'s stored value ('once', 'latest').
    """

    namespace: str
    task_id: str
    effect_key: str
    policy: str
    request_digest: bytes
    fence: int


@dataclass(frozen=True, slots=True)
class CompleteParams:
    """One CompleteEffect: the parameters of statement ``complete_effect``, in its order.

    Attributes:
        state: the outcome, ``EffectState``'s stored value ('succeeded', 'failed').
        checkpoint_version: the task's next checkpoint, saved with the outcome
            (both or neither); None: none. Its data and content type follow.
    """

    namespace: str
    task_id: str
    effect_key: str
    fence: int
    state: str
    retryable: bool
    result: bytes
    external_operation_id: str
    checkpoint_version: int | None = None
    checkpoint_data: bytes | None = None
    checkpoint_content_type: str | None = None


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


def answered_effect(key: EffectKey, row: Mapping[str, Any]) -> Effect:
    """The record in an answer row of ``begin_effect`` or ``complete_effect`` (its ``e_*``)."""
    return Effect(
        namespace=key.namespace,
        task_id=key.task_id,
        effect_key=key.effect_key,
        policy=EffectPolicy(row["e_policy"]),
        request_digest=bytes(row["e_request_digest"]),
        state=EffectState(row["e_state"]),
        fence=row["e_fence"],
        complete_fence=row["e_complete_fence"],
        retryable=row["e_retryable"],
        result=bytes(row["e_result"]),
        attempts=row["e_attempts"],
        begin_time=row["e_begin_time"],
        complete_time=row["e_complete_time"],
        external_operation_id=row["e_external_operation_id"],
    )


def _lost(row: Mapping[str, Any] | None, fence: int) -> LeaseLost:
    """Why ``fence`` may not act, from an answer row's lease (None: the task was never claimed)."""
    lease = lease_from_row(row) if row is not None else None
    reason = fence_loss(lease, fence)
    assert reason is not None, "the statement refused a fence that may act"
    return LeaseLost(reason, lease.fence if lease is not None else 0)


class EffectLedger:
    """BeginEffect, CompleteEffect and ListEffects on the store's database."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._begins = store.batched("begin_effect", BeginParams)
        self._completes = store.batched("complete_effect", CompleteParams)

    async def _row(
        self, statement: BatchedStatement[Any], params: Any, alone: bool = False
    ) -> asyncpg.Record | None:
        """``params``' answer row from ``statement``: batched, or ``alone`` (a batch of one).

        Raises:
            asyncpg.PostgresError: the statement failed for this call itself
                (``LEASE_RAN_OUT``).
            DatabaseUnavailable: UNAVAILABLE.
        """
        if not alone:
            row = await statement.submit(params)
            if row is not RUN_ALONE:
                assert not isinstance(row, Unsent)  # only claims are left unsent
                return row
        return await self._store.alone(statement, params)

    async def begin(self, request: BeginRequest) -> tuple[BeginDecision, Effect]:
        """Reserves an effect for a live fence, or says why not to act.

        One statement (``begin_effect``), decided on the database clock; see
        :mod:`~leasekeeper_server.core.effect_rules` for the rules.

        Returns:
            PROCEED with the new reservation, ALREADY_APPLIED with the
            confirmed outcome, or IN_DOUBT with the unconfirmed earlier attempt.

        Raises:
            LeaseLost: the fence is not current and live (ABORTED); nothing reserved.
            EffectKeyReused: another policy or digest (FAILED_PRECONDITION).
            DatabaseUnavailable: UNAVAILABLE.
        """
        key = request.key
        params = BeginParams(
            key.namespace,
            key.task_id,
            key.effect_key,
            request.policy.value,
            request.request_digest,
            request.fence,
        )
        for _ in range(BEGIN_TRIES):
            try:
                row = await self._row(self._begins, params)
            except asyncpg.PostgresError as exc:
                if exc.sqlstate != LEASE_RAN_OUT:
                    raise
                raise await self._ran_out(key, request.fence) from exc
            if row is None or not row["may_act"]:
                raise _lost(row, request.fence)
            written = row["e_written"]
            if written is None:  # a first reservation committed after this statement began
                continue
            record = answered_effect(key, row)
            if written:
                return BeginDecision.PROCEED, record
            decision = decide_begin(record, request)
            assert decision is not BeginDecision.PROCEED, "begin_effect left a PROCEED unwritten"
            return decision, record
        raise AssertionError(f"begin_effect found no record of {key} after {BEGIN_TRIES} tries")

    async def _ran_out(self, key: EffectKey, fence: int) -> LeaseLost:
        """The LeaseLost of a BeginEffect whose lease ran out while it waited to write."""
        lease = await self._store.get_lease(TaskKey(key.namespace, key.task_id))
        reason = fence_loss(lease, fence) or LossReason.LEASE_EXPIRED
        return LeaseLost(reason, lease.fence if lease is not None else fence)

    async def _complete(
        self, key: EffectKey, fence: int, outcome: Outcome, checkpoint: CheckpointWrite | None
    ) -> tuple[Effect, asyncpg.Record]:
        """Statement ``complete_effect``: the record after it, and its answer row.

        Raises:
            As :meth:`complete_and_save`.
        """
        saved: tuple[int | None, bytes | None, str | None] = (None, None, None)
        if checkpoint is not None:
            saved = (checkpoint.version, checkpoint.data, checkpoint.content_type)
        params = CompleteParams(
            key.namespace,
            key.task_id,
            key.effect_key,
            fence,
            outcome.state.value,
            outcome.retryable,
            outcome.result,
            outcome.external_operation_id,
            *saved,
        )
        row = await self._row(self._completes, params, alone=checkpoint is not None)
        if row is None or not row["may_act"]:
            raise _lost(row, fence)
        written = row["e_written"]
        if written is None:
            raise EffectNotBegun()
        record = answered_effect(key, row)
        # Over a confirmed record: the same outcome answers it, another is refused.
        writes = not written and check_complete(record, outcome)
        if checkpoint is not None and not row["checkpoint_stands"]:
            raise CheckpointNotNewer(checkpoint.version, row["checkpoint_version"] or 0)
        assert not writes, "complete_effect left an outcome unwritten"
        return record, row

    async def complete(self, key: EffectKey, fence: int, outcome: Outcome) -> Effect:
        """Records an effect's outcome by a live fence (one statement). Idempotent for the same one.

        Raises:
            LeaseLost: the fence is not current and live (ABORTED); nothing recorded.
            EffectNotBegun: no reservation for the key (FAILED_PRECONDITION).
            EffectAlreadyCompleted: another outcome is recorded (FAILED_PRECONDITION).
            DatabaseUnavailable: UNAVAILABLE.
        """
        record, _row = await self._complete(key, fence, outcome, None)
        return record

    async def complete_and_save(
        self,
        key: EffectKey,
        fence: int,
        outcome: Outcome,
        checkpoint: CheckpointWrite,
    ) -> tuple[Effect, Checkpoint]:
        """Records an effect's outcome and saves the checkpoint after it: both or neither.

        The same one statement as :meth:`complete`, sent alone: it holds the
        task's row for writing and decides the checkpoint as
        ``Store.save_checkpoint`` decides it, for the owner of ``fence``.
        Idempotent like each part: the same version, data and content type
        stored by this fence answer the stored checkpoint.

        Raises:
            LeaseLost, EffectNotBegun, EffectAlreadyCompleted: as :meth:`complete`.
            CheckpointNotNewer: (FAILED_PRECONDITION) nothing recorded.
            DatabaseUnavailable: UNAVAILABLE.
        """
        record, row = await self._complete(key, fence, outcome, checkpoint)
        version, data, content_type = checkpoint.version, checkpoint.data, checkpoint.content_type
        return record, Checkpoint(version, data, content_type, fence, row["checkpoint_time"])

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
