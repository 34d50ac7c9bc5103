"""EffectRecord: one effect as the ledger recorded it (its own module: errors carry it).

``errors.EffectFailed`` and ``errors.EffectInDoubt`` hold a record, and
``_types`` converts it from its proto while raising ``errors`` types: this
module needs neither, so neither imports the other back.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module imports nothing of the package
    from ._checkpoint import Checkpoint


@dataclasses.dataclass(frozen=True, slots=True)
class EffectRecord:
    """One effect of a task as the effect ledger recorded it.

    Attributes:
        namespace: The task's namespace.
        task_id: The task.
        effect_key: The caller's idempotency key for the effect, unique within the task.
        policy: ``"ONCE"`` or ``"LATEST"``, fixed by the key's first reservation.
        request_digest: The digest the effect was reserved with (opaque to the server).
        state: ``"RESERVED"`` (outcome never confirmed: it may or may not have
            happened), ``"SUCCEEDED"`` or ``"FAILED"``.
        fence: The fence of the latest reservation.
        complete_fence: The fence that recorded the outcome; 0 while RESERVED,
            higher than ``fence`` when a replacement worker reconciled an earlier attempt.
        retryable: For FAILED: whether a new attempt may be reserved.
        result: The opaque result recorded with the outcome (e.g. the outside
            system's message id, or an error description for FAILED).
        attempts: How many times the effect was reserved (1 for the first attempt).
        begin_time: When the latest reservation was made (UTC, database clock).
        complete_time: When the outcome was recorded (UTC, database clock); None while RESERVED.
        external_operation_id: The outside system's id for the operation (e.g.
            the payment's id), as recorded with the outcome; "" when none.
        checkpoint: From ``LeaseClient.complete_effect`` only: the checkpoint
            saved in the same transaction as the outcome (its ``next_checkpoint``,
            with the data sent); None otherwise. Not compared: a record equals
            the same effect as listed.
    """

    namespace: str
    task_id: str
    effect_key: str
    policy: str
    request_digest: bytes
    state: str
    fence: int
    complete_fence: int
    retryable: bool
    result: bytes
    attempts: int
    begin_time: datetime
    complete_time: datetime | None
    external_operation_id: str = ""
    checkpoint: Checkpoint | None = dataclasses.field(default=None, compare=False)
