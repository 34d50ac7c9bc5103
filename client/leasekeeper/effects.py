"""Fenced, idempotent side effects: ``lease.effect(effect_key, policy=...)``.

An effect is something done to an outside system (send an email, charge a
card, write a draft) that a retried or replaced worker must not repeat
blindly. The effect ledger in the lease service records each effect of a task
under the caller's idempotency key (``effect_key``), checked in the same
transaction as the lease's fence. :class:`EffectRunner` walks its protocol:

1. Refuse to start when the lease is already lost (:class:`~leasekeeper.LeaseLost`).
2. BeginEffect with the lease's fence. The ledger answers:

   * PROCEED: the effect is reserved for this fence. The function runs once;
     its return value is recorded as SUCCEEDED. If it raises
     :class:`~leasekeeper.EffectFailed` (the outside system definitively
     refused), FAILED is recorded and the error is raised on. Any other
     exception (a timeout, a crash, the cancellation of a lost lease) records
     nothing: the outside system may have accepted the effect, so the
     reservation stays in doubt and the exception propagates.
   * ALREADY_APPLIED: a confirmed outcome exists. The function does not run;
     the recorded result is returned (or ``EffectFailed`` raised for a
     FAILED outcome that may not be retried).
   * IN_DOUBT: an earlier attempt was never confirmed. Without ``reconcile``
     :class:`~leasekeeper.EffectInDoubt` is raised. With it, the outside
     system is asked: a result it knows is recorded as SUCCEEDED and
     returned; None (it never happened) is recorded as a retryable FAILED,
     and the effect is begun once more -- at most one more attempt, never a
     loop.

Choosing a policy (required; there is no default):

* ``"ONCE"`` -- the effect cannot be taken back: an email sent, a card
  charged. The first confirmed outcome stands for ever; a replacement worker
  with a newer fence gets the recorded result instead of a second send.
* ``"LATEST"`` -- the effect replaces what was there: a draft written, a
  status set. A newer fence does it again, and the completion of an older
  fence (a paused worker coming back) is refused, so the newest owner's
  version is the one that stays.

A completion that the server refuses because the lease is gone raises
``LeaseLost`` (ABORTED); the effect then stays in doubt for the next owner to
reconcile.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ParamSpec

from . import _types
from ._checkpoint import CheckpointLike
from ._ports import EffectLease
from ._types import BeginResult, EffectRecord
from .checkpoints import checkpoint_message
from .errors import CheckpointNotNewer, EffectFailed, EffectInDoubt, LeaseError

P = ParamSpec("P")


@dataclasses.dataclass(frozen=True, slots=True)
class Performed:
    """An effect function's answer that also names the outside system's operation.

    Attributes:
        result: The outside system's answer, recorded as the effect's result
            (bytes as they are, text as UTF-8, None as empty bytes).
        external_operation_id: The outside system's id for the operation (a
            payment id, a message id), recorded with the outcome and in the
            task's history (CompleteEffectRequest.external_operation_id).
    """

    result: bytes | str | None
    external_operation_id: str = ""


EffectValue = bytes | str | None | Performed
"""What an effect function (or ``reconcile``) returns: the outside system's answer.

Bytes are recorded as they are, text as UTF-8, None as empty bytes.
"""

Reconcile = Callable[[EffectRecord], Awaitable[EffectValue]]
"""Asks the outside system about an unconfirmed attempt (given as its EffectRecord).

Returns the outside system's record of the effect (bytes or text) when it
happened, or None when it never did.
"""

RECONCILED_ABSENT = b"reconciled: the outside system has no record of the effect"
"""The result recorded with the retryable FAILED outcome when ``reconcile`` returns None."""


@dataclasses.dataclass(frozen=True, slots=True)
class EffectOutcome:
    """The settled outcome of one run of an effect.

    Attributes:
        result: The recorded result (what the outside system answered).
        fresh: True when this call performed the effect; False when the result
            was already recorded, or was found by ``reconcile``.
        effect: The ledger's record of the effect.
    """

    result: bytes
    fresh: bool
    effect: EffectRecord


def request_digest(value: bytes | str | Mapping[str, Any] | Sequence[Any]) -> bytes:
    """SHA-256 of what an effect will do, for ``request_digest``.

    The same key begun with another digest is refused (EFFECT_KEY_REUSED), so
    two different effects cannot share one key by mistake.

    Args:
        value: Bytes (digested as they are), text (as UTF-8), or a JSON-like
            mapping or sequence (as canonical JSON: sorted keys, no spaces,
            UTF-8), so equal values give equal digests whatever their key order.

    Returns:
        The 32-byte digest.

    Raises:
        TypeError: ``value`` holds something JSON cannot encode.
        ValueError: ``value`` holds NaN or infinity.

    """
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
    elif isinstance(value, str):
        data = value.encode()
    else:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
        data = text.encode()
    return hashlib.sha256(data).digest()


class EffectRunner:
    """Runs one effect of a held lease through the effect ledger.

    Made by :meth:`HeldLease.effect <leasekeeper.HeldLease.effect>`; see the
    module docstring for the protocol. Use it as a decorator::

        @lease.effect("email:welcome", policy="ONCE")
        async def send() -> str:
            return await mailer.send(to, body)  # the vendor's message id

        outcome = await send()

    or call :meth:`run`: ``await lease.effect(key, policy="ONCE").run(send, to)``.
    Each call runs the whole protocol again, so a second call with the same
    key returns the recorded result without running the function.
    """

    def __init__(
        self,
        lease: EffectLease,
        effect_key: str,
        *,
        policy: str,
        request_digest: bytes = b"",
        reconcile: Reconcile | None = None,
        next_checkpoint: CheckpointLike | None = None,
    ) -> None:
        """Prepare an effect; nothing is sent until it runs.

        Args:
            lease: The held lease whose fence the effect uses.
            effect_key: The effect's idempotency key, unique within the task.
            policy: ``"ONCE"`` (irreversible) or ``"LATEST"`` (replaceable).
            request_digest: Digest of what the effect will do (see
                :func:`request_digest`); at most 64 bytes.
            reconcile: Asks the outside system about an unconfirmed earlier
                attempt; None raises ``EffectInDoubt`` instead.
            next_checkpoint: The task's checkpoint after this effect, saved in
                the same transaction as its SUCCEEDED outcome (both or neither;
                CompleteEffectRequest.next_checkpoint); None: none.

        Raises:
            InvalidArgument: ``policy`` is not ONCE or LATEST (raised locally).

        """
        _types.effect_policy(policy)
        self._lease = lease
        self._effect_key = effect_key
        self._policy = policy
        self._request_digest = request_digest
        self._reconcile = reconcile
        self._next_checkpoint = next_checkpoint

    @property
    def effect_key(self) -> str:
        """The effect's idempotency key."""
        return self._effect_key

    def __call__(
        self, fn: Callable[P, Awaitable[EffectValue]]
    ) -> Callable[P, Awaitable[EffectOutcome]]:
        """Decorate ``fn``: calling the result runs the effect protocol around it."""

        @functools.wraps(fn)
        async def run_effect(*args: P.args, **kwargs: P.kwargs) -> EffectOutcome:
            return await self.run(fn, *args, **kwargs)

        return run_effect

    async def run(
        self, fn: Callable[P, Awaitable[EffectValue]], /, *args: P.args, **kwargs: P.kwargs
    ) -> EffectOutcome:
        """Begin the effect, run ``fn(*args, **kwargs)`` only when the ledger says PROCEED.

        Args:
            fn: Performs the effect and returns the outside system's answer
                (bytes, text, or None). Raises ``EffectFailed`` when the
                outside system definitively refused.
            *args: Passed to ``fn``.
            **kwargs: Passed to ``fn``.

        Returns:
            The recorded outcome; ``fresh`` when this call performed the effect.

        Raises:
            LeaseLost: The lease was lost before the start (nothing is sent), or
                the server refused BeginEffect or CompleteEffect with ABORTED.
            EffectInDoubt: An earlier attempt was never confirmed and there is no
                ``reconcile`` (or the ledger is still in doubt after it).
            EffectFailed: ``fn`` raised it (recorded as FAILED first), or the
                ledger holds a FAILED outcome that may not be retried.
            EffectKeyReused: FAILED_PRECONDITION: the key was begun with another
                policy or request_digest.
            LeaseUnavailable: UNAVAILABLE from either call.
            Exception: Whatever else ``fn`` raised; nothing was recorded, the
                effect stays in doubt.

        """
        self._lease.check()
        self._check_checkpoint_newer()
        begun = await self._begin()
        if begun.decision == "IN_DOUBT":
            if self._reconcile is None:
                raise EffectInDoubt(begun.effect)
            found = await self._reconcile(begun.effect)
            if found is not None:
                effect = await self._succeeded(found)
                return EffectOutcome(effect.result, fresh=False, effect=effect)
            await self._complete("FAILED", retryable=True, result=RECONCILED_ABSENT)
            begun = await self._begin()
            if begun.decision == "IN_DOUBT":  # another worker's attempt since: never loop
                raise EffectInDoubt(begun.effect)
        if begun.decision == "ALREADY_APPLIED":
            return _recorded(begun.effect)
        if begun.decision != "PROCEED":
            raise LeaseError(f"BeginEffect answered an unknown decision {begun.decision!r}")
        return await self._perform(fn, *args, **kwargs)

    async def _perform(
        self, fn: Callable[P, Awaitable[EffectValue]], /, *args: P.args, **kwargs: P.kwargs
    ) -> EffectOutcome:
        try:
            value = await fn(*args, **kwargs)
        except EffectFailed as failure:
            failure.effect = await self._complete(
                "FAILED", retryable=failure.retryable, result=failure.result
            )
            raise
        effect = await self._succeeded(value)
        return EffectOutcome(effect.result, fresh=True, effect=effect)

    def _check_checkpoint_newer(self) -> None:
        """Refuses, before anything runs, a next checkpoint the lease knows is not newer.

        Raises:
            CheckpointNotNewer: its version is at most the stored version this
                lease has heard of (raised locally; nothing is begun or run).
        """
        if self._next_checkpoint is None:
            return
        version = checkpoint_message(self._next_checkpoint, "next_checkpoint").version
        known = self._lease.checkpoint_version
        if version <= known:
            lease = self._lease
            raise CheckpointNotNewer.of(version, known, lease.task_id, lease.fence)

    async def _succeeded(self, value: EffectValue) -> EffectRecord:
        """Records SUCCEEDED with the answer, its operation id and the next checkpoint.

        Raises:
            CheckpointNotNewer: the next checkpoint was refused (another write of
                this lease stored a version as high meanwhile). The effect did
                happen, so its outcome is then recorded on its own, never left
                in doubt, before this is raised.
        """
        operation_id = value.external_operation_id if isinstance(value, Performed) else ""
        result = _as_bytes(value)
        try:
            return await self._complete(
                "SUCCEEDED",
                result=result,
                external_operation_id=operation_id,
                next_checkpoint=self._next_checkpoint,
            )
        except CheckpointNotNewer:
            await self._complete("SUCCEEDED", result=result, external_operation_id=operation_id)
            raise

    async def _begin(self) -> BeginResult:
        lease = self._lease
        return await lease.client.begin_effect(
            lease.task_id,
            lease.fence,
            self._effect_key,
            policy=self._policy,
            request_digest=self._request_digest,
            namespace=lease.namespace,
        )

    async def _complete(
        self,
        outcome: str,
        *,
        retryable: bool = False,
        result: bytes = b"",
        external_operation_id: str = "",
        next_checkpoint: CheckpointLike | None = None,
    ) -> EffectRecord:
        lease = self._lease
        return await lease.client.complete_effect(
            lease.task_id,
            lease.fence,
            self._effect_key,
            outcome=outcome,
            retryable=retryable,
            result=result,
            namespace=lease.namespace,
            external_operation_id=external_operation_id,
            next_checkpoint=next_checkpoint,
        )


def _recorded(effect: EffectRecord) -> EffectOutcome:
    """The outcome of an ALREADY_APPLIED answer: its result, or its failure raised."""
    if effect.state == "FAILED":
        raise EffectFailed(
            f"effect {effect.effect_key!r} of {effect.namespace}/{effect.task_id} is recorded "
            f"as FAILED by fence {effect.complete_fence}",
            retryable=effect.retryable,
            result=effect.result,
            effect=effect,
        )
    return EffectOutcome(effect.result, fresh=False, effect=effect)


def _as_bytes(value: EffectValue) -> bytes:
    """An effect's answer as the bytes to record.

    Raises:
        TypeError: Not bytes, text, None or :class:`Performed`; nothing is
            recorded (the effect stays in doubt).

    """
    if isinstance(value, Performed):
        value = value.result
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"an effect must return bytes, str or None, got {type(value).__name__}")
