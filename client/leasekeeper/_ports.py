"""What a held lease, its effects and a fence checker need from the client, as Protocols.

``LeaseClient`` makes each ``LeaseHold`` and ``HeldLease`` (``client`` imports
``lease``); these name the client's side structurally, so ``lease``,
``effects`` and ``fencing`` never import ``client`` back (no import circle).
``LeaseClient`` satisfies each; mypy checks it where a client is passed.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from ._checkpoint import Checkpoint, CheckpointLike
from ._effect_record import EffectRecord
from ._trust import Clock
from ._types import BeginResult, ClaimResult, FenceCheck, LeaseInfo, Seconds

if TYPE_CHECKING:
    from ._session import SessionKeeper


class FenceValidator(Protocol):
    """Answers ValidateFence (``LeaseClient.validate_fence``)."""

    async def validate_fence(
        self, task_id: str, fence: int, namespace: str | None = None
    ) -> FenceCheck: ...


class EffectCalls(Protocol):
    """BeginEffect and CompleteEffect (``LeaseClient.begin_effect``, ``complete_effect``)."""

    async def begin_effect(
        self,
        task_id: str,
        fence: int,
        effect_key: str,
        *,
        policy: str,
        request_digest: bytes = b"",
        namespace: str | None = None,
    ) -> BeginResult: ...

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
    ) -> EffectRecord: ...


class CheckpointCalls(Protocol):
    """SaveCheckpoint (``LeaseClient.save_checkpoint``)."""

    async def save_checkpoint(
        self, task_id: str, fence: int, version: int, data: bytes, content_type: str = ""
    ) -> Checkpoint: ...


class HoldingClient(EffectCalls, CheckpointCalls, Protocol):
    """The client as ``LeaseHold`` and ``HeldLease`` use it (its private surface included)."""

    _call_timeout_s: float | None

    @property
    def clock(self) -> Clock: ...

    async def _claim(
        self,
        task_id: str,
        ttl: Seconds | None,
        max_runtime: Seconds | None,
        *,
        request_id: str,
        wait: Seconds | None,
        deadline_past_wait: bool = False,
        max_attempts: int = 0,
    ) -> ClaimResult: ...

    async def _release(
        self,
        task_id: str,
        fence: int,
        complete: bool,
        timeout_s: float | None = None,
        *,
        fail: bool = False,
        fail_reason: str = "",
    ) -> LeaseInfo: ...

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None: ...

    def _open_heartbeat(self) -> Any: ...

    def _session_keeper(self) -> SessionKeeper | None: ...

    def _mark_held(self, task_id: str) -> bool: ...

    def _unmark_held(self, task_id: str) -> None: ...


class EffectLease(Protocol):
    """A held lease as an effect uses it (``HeldLease``)."""

    @property
    def task_id(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def fence(self) -> int: ...

    @property
    def client(self) -> EffectCalls: ...

    @property
    def checkpoint_version(self) -> int: ...

    def check(self) -> None: ...
