"""LeaseClient's effect ledger calls: BeginEffect and CompleteEffect.

A worker inside ``hold()`` uses :meth:`HeldLease.effect <leasekeeper.HeldLease.effect>`,
which runs the whole protocol on these two calls.
"""

from __future__ import annotations

from . import _types, checkpoints
from ._checkpoint import CheckpointLike
from ._connection import Connection
from ._types import BeginResult, EffectRecord
from .errors import InvalidArgument
from .v1 import lease_service_pb2 as pb


class EffectCalls(Connection):
    """The effect ledger calls of :class:`~leasekeeper.LeaseClient`."""

    async def begin_effect(
        self,
        task_id: str,
        fence: int,
        effect_key: str,
        *,
        policy: str,
        request_digest: bytes = b"",
        namespace: str | None = None,
    ) -> BeginResult:
        """Reserve an effect for ``fence`` in the effect ledger.

        One transaction on the database clock: the fence must be the task's
        current fence and its lease HELD; then ``(task, effect_key)`` is
        reserved. Of many concurrent calls for one new key, exactly one gets
        PROCEED. Prefer :meth:`HeldLease.effect <leasekeeper.HeldLease.effect>`,
        which runs the whole protocol.

        Not idempotent for the caller: if a reply is lost (DEADLINE_EXCEEDED),
        the retried call answers IN_DOUBT for the reservation it made itself.

        Args:
            task_id: The task.
            fence: The caller's fence; >= 1.
            effect_key: The effect's idempotency key, unique within the task
                (1-256 bytes UTF-8 by default, no control characters).
            policy: ``"ONCE"`` for an irreversible effect (send the email,
                charge the card): the first confirmed outcome stands for ever.
                ``"LATEST"`` for a replaceable one (write the draft, set the
                status): a newer fence does it again, and an older fence's
                completion is refused. Fixed for the key by its first reservation.
            request_digest: What the effect will do, digested (e.g.
                :func:`~leasekeeper.request_digest` of the request); at most 64
                bytes, may be empty.
            namespace: The task's namespace; None for this client's.

        Returns:
            ``decision`` PROCEED (do the effect now, then :meth:`complete_effect`),
            ALREADY_APPLIED (the confirmed outcome: do not repeat) or IN_DOUBT
            (the earlier, unconfirmed attempt: reconcile first), with the effect.

        Raises:
            LeaseLost: ABORTED: the fence may not act (LEASE_EXPIRED,
                LEASE_SUPERSEDED, ...); nothing is reserved.
            EffectKeyReused: FAILED_PRECONDITION EFFECT_KEY_REUSED: the key was
                reserved with another policy or request_digest.
            InvalidArgument: INVALID_ARGUMENT (or locally for an unknown policy).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.BeginEffectRequest(
            namespace=self._namespace if namespace is None else namespace,
            task_id=task_id,
            fence=fence,
            effect_key=effect_key,
            policy=_types.effect_policy(policy),  # type: ignore[arg-type]
            request_digest=request_digest,
        )
        response = await self._call(self.stub.BeginEffect, request, task_id=task_id, fence=fence)
        return _types.begin_result(response)

    async def complete_effect(
        self,
        task_id: str,
        fence: int,
        effect_key: str,
        *,
        outcome: str,
        retryable: bool = False,
        result: bytes = b"",
        namespace: str | None = None,
        external_operation_id: str = "",
        next_checkpoint: CheckpointLike | None = None,
    ) -> EffectRecord:
        """Record the outcome of a reserved effect (and the checkpoint after it).

        One transaction on the database clock: the fence must be the task's
        current fence, its lease HELD, and at least the reservation's fence (a
        replacement worker may record the outcome of an earlier attempt it
        reconciled). Idempotent: the same outcome, retryable flag and result
        recorded again answer OK. With ``next_checkpoint`` the checkpoint is
        saved in the same transaction, decided as :meth:`save_checkpoint`
        decides: both are stored or neither.

        Args:
            task_id: The task.
            fence: The caller's fence; >= 1.
            effect_key: The effect's idempotency key.
            outcome: ``"SUCCEEDED"`` (the effect happened) or ``"FAILED"`` (it
                did not).
            retryable: For FAILED: a new attempt may be reserved later. Must be
                False for SUCCEEDED.
            result: Opaque bytes kept with the outcome (e.g. the outside
                system's message id); at most the server's
                ``max_effect_result_bytes`` (64 KiB by default).
            namespace: The task's namespace; None for this client's.
            external_operation_id: The outside system's id for the operation
                (e.g. the payment's id), recorded with the outcome and in the
                task's history; at most 256 bytes, the rules of ids; may be empty.
            next_checkpoint: The checkpoint after this effect: a
                :class:`~leasekeeper.Checkpoint` or ``(version, data[,
                content_type])``; None: none.

        Returns:
            The effect as recorded; its ``checkpoint`` is the one saved with it
            (the data sent), None without ``next_checkpoint``.

        Raises:
            LeaseLost: ABORTED: the fence may not act; a step that outlived its
                lease cannot complete its effect (it stays RESERVED, in doubt).
            EffectNotBegun: FAILED_PRECONDITION EFFECT_NOT_BEGUN: no reservation
                for the key.
            EffectAlreadyCompleted: FAILED_PRECONDITION EFFECT_ALREADY_COMPLETED:
                another outcome is recorded.
            CheckpointNotNewer: FAILED_PRECONDITION CHECKPOINT_NOT_NEWER: the
                checkpoint does not move forward; the outcome is not recorded either.
            InvalidArgument: INVALID_ARGUMENT (or locally for an unknown outcome,
                ``retryable`` with SUCCEEDED, or a value that is not a checkpoint).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        outcome_value = _types.effect_outcome(outcome)
        if retryable and outcome_value == pb.EFFECT_STATE_SUCCEEDED:
            raise InvalidArgument(
                "retryable must be False for outcome SUCCEEDED",
                field_violations=[("retryable", "only a FAILED outcome is retryable")],
                code=None,
            )
        sent = (
            None
            if next_checkpoint is None
            else checkpoints.checkpoint_message(next_checkpoint, "next_checkpoint")
        )
        request = pb.CompleteEffectRequest(
            namespace=self._namespace if namespace is None else namespace,
            task_id=task_id,
            fence=fence,
            effect_key=effect_key,
            outcome=outcome_value,  # type: ignore[arg-type]
            retryable=retryable,
            result=result,
            external_operation_id=external_operation_id,
            next_checkpoint=sent,
        )
        response = await self._call(self.stub.CompleteEffect, request, task_id=task_id, fence=fence)
        return _types.completed_effect(response, sent, fence)
