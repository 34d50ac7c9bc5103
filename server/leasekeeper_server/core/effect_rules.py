"""The effect ledger's rules (pure): what BeginEffect and CompleteEffect decide.

An effect is one side effect of a task (send this email, charge this card),
named by the caller's idempotency key: ``(namespace, task_id, effect_key)``.
The ledger remembers, per effect, the latest attempt's fence and whether its
outcome was confirmed. Both RPCs first check, in the same transaction and on
the database clock, that the caller's fence is the task's current fence and
its lease HELD (``model.fence_loss``); only then do the rules below apply.

BeginEffect, by the record found (``f`` is the caller's fence):

==========================================  ========  =====================================
record                                      ONCE      LATEST
==========================================  ========  =====================================
none                                        PROCEED   PROCEED
FAILED, retryable                           PROCEED   PROCEED
SUCCEEDED, or FAILED and not retryable      APPLIED   APPLIED if f wrote it, else PROCEED
RESERVED (never confirmed)                  IN_DOUBT  IN_DOUBT if f reserved it, else PROCEED
==========================================  ========  =====================================

"f wrote it": ``f`` is the newest fence that touched the record, the one that
reserved it or the one that recorded its outcome (a replacement that
reconciled an earlier attempt). Under LATEST only a fence newer than both
supersedes.

A record's policy never changes, and its request_digest changes only when a
newer fence supersedes a LATEST record: any other mismatch is
EFFECT_KEY_REUSED (the same key named two different effects).

RESERVED answers IN_DOUBT even to the fence that reserved it: a caller that
asks again does not know whether its first attempt reached the outside
system (a timeout, a lost reply), so it must reconcile before trying again.

CompleteEffect records SUCCEEDED (with the outside system's result) or FAILED
(retryable or not) over a RESERVED record whose fence is at most the
caller's: a replacement worker records what it learned when it reconciled an
earlier attempt. Recording the same outcome again answers with the record
(idempotent); another outcome over a confirmed one is
EFFECT_ALREADY_COMPLETED. An older fence can never complete: the lease check
refuses it first, so a step that outlived its lease leaves its effect in
doubt for the replacement to reconcile.

This module is pure: no grpc, no asyncpg, no clock of its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from leasekeeper_server.core.errors import EffectAlreadyCompleted, EffectKeyReused, EffectNotBegun


class EffectPolicy(enum.StrEnum):
    """How an effect may be repeated (the value is the stored one)."""

    ONCE = "once"
    LATEST = "latest"


class EffectState(enum.StrEnum):
    """An effect record's state (the value is the stored one)."""

    RESERVED = "reserved"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class BeginDecision(enum.StrEnum):
    """BeginEffect's answer."""

    PROCEED = "PROCEED"
    ALREADY_APPLIED = "ALREADY_APPLIED"
    IN_DOUBT = "IN_DOUBT"


@dataclass(frozen=True, slots=True)
class EffectKey:
    """Names one effect."""

    namespace: str
    task_id: str
    effect_key: str


@dataclass(frozen=True, slots=True)
class Effect:
    """One row of the effect ledger.

    Attributes:
        fence: the fence of the latest reservation.
        complete_fence: the fence that recorded the outcome; None while RESERVED.
        attempts: how many reservations were made (1 for the first).
        external_operation_id: the outside system's id for the operation,
            recorded with the outcome ("" when none).
    """

    namespace: str
    task_id: str
    effect_key: str
    policy: EffectPolicy
    request_digest: bytes
    state: EffectState
    fence: int
    complete_fence: int | None
    retryable: bool
    result: bytes
    attempts: int
    begin_time: datetime
    complete_time: datetime | None
    external_operation_id: str = ""

    @property
    def confirmed(self) -> bool:
        """A final outcome: SUCCEEDED, or FAILED and not retryable."""
        return self.state is EffectState.SUCCEEDED or (
            self.state is EffectState.FAILED and not self.retryable
        )


@dataclass(frozen=True, slots=True)
class BeginRequest:
    """A checked BeginEffect request."""

    key: EffectKey
    fence: int
    policy: EffectPolicy
    request_digest: bytes


@dataclass(frozen=True, slots=True)
class Outcome:
    """A checked CompleteEffect outcome: SUCCEEDED or FAILED.

    ``external_operation_id`` is recorded with the first outcome; a repeat of
    the same outcome is not compared on it.
    """

    state: EffectState
    retryable: bool
    result: bytes
    external_operation_id: str = ""


def decide_begin(record: Effect, request: BeginRequest) -> BeginDecision:
    """What BeginEffect answers for an existing record (see the module's table).

    The caller's fence has already been checked: it is the task's current,
    live fence, so it is at least ``record.fence``.

    Raises:
        EffectKeyReused: the key was reserved with another policy or digest
            (FAILED_PRECONDITION).
    """
    newer = request.fence > max(record.fence, record.complete_fence or 0)
    if request.policy is not record.policy:
        raise EffectKeyReused(
            record.effect_key, record.policy.value.upper(), record.fence, "policy"
        )
    superseding = record.policy is EffectPolicy.LATEST and newer
    if request.request_digest != record.request_digest and not superseding:
        raise EffectKeyReused(
            record.effect_key, record.policy.value.upper(), record.fence, "request_digest"
        )
    if record.state is EffectState.FAILED and record.retryable:
        return BeginDecision.PROCEED
    if superseding:
        return BeginDecision.PROCEED
    if record.state is EffectState.RESERVED:
        return BeginDecision.IN_DOUBT
    return BeginDecision.ALREADY_APPLIED


def check_complete(record: Effect | None, outcome: Outcome) -> bool:
    """Says whether CompleteEffect writes ``outcome`` (True) or answers the record as is (False).

    The caller's fence has already been checked: current and live, so at
    least the fence of any reservation.

    Raises:
        EffectNotBegun: no record for the key (FAILED_PRECONDITION).
        EffectAlreadyCompleted: another outcome is recorded (FAILED_PRECONDITION).
    """
    if record is None:
        raise EffectNotBegun()
    if record.state is EffectState.RESERVED:
        return True
    same = (record.state, record.retryable, record.result) == (
        outcome.state,
        outcome.retryable,
        outcome.result,
    )
    if not same:
        raise EffectAlreadyCompleted(record.state.value.upper(), record.complete_fence or 0)
    return False
