"""Checkpoints: a run that survives its worker (``lease.checkpoint``, ``lease.save_checkpoint``).

A worker saves its progress as it goes; when it dies, the next owner's claim
receives the latest checkpoint with the grant and resumes from it::

    async with client.hold("import-7", ttl=30.0, max_attempts=5) as lease:
        start = int(lease.checkpoint.data) if lease.checkpoint else 0
        for row in range(start, total):
            await import_row(row)
            await lease.save_checkpoint(row + 1, str(row + 1).encode())

The server stores a checkpoint only from the owner of the task's live current
fence, and only with a higher version than the stored one, in one statement
on the database clock: a paused worker that lost its lease can never
overwrite its replacement's progress.

:class:`CheckpointWriter` saves a held lease's checkpoints. While the lease's
heartbeat stream is open it carries each one on a beat (no extra call: the
beat's renewal writes it); otherwise (a lease kept by the client's Session
stream too: a session carries no checkpoints, see ``_session.py``), and
whenever the stream cannot say whether it was stored, it asks
SaveCheckpoint, which decides (the same version written again with the same
data answers OK). Saves of one lease go one at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ._checkpoint import Checkpoint, CheckpointLike
from ._heartbeat import CheckpointNotCarried, HeartbeatKeeper
from ._ports import CheckpointCalls
from .errors import CheckpointNotNewer, InvalidArgument
from .v1 import lease_service_pb2 as pb

__all__ = ["Checkpoint", "CheckpointWriter", "checkpoint_message"]


class CheckpointWriter:
    """Saves the checkpoints of one held lease (``HeldLease.save_checkpoint``).

    Args:
        client: Sends SaveCheckpoint.
        task_id: The lease's task.
        fence: The lease's fence.
        granted: The checkpoint received with the grant, or None.
    """

    def __init__(
        self, client: CheckpointCalls, task_id: str, fence: int, granted: Checkpoint | None
    ) -> None:
        self._client = client
        self._task_id = task_id
        self._fence = fence
        self._known_version = granted.version if granted is not None else 0
        self._lock = asyncio.Lock()
        # A carried save that ended without its answer (cancelled) may still be
        # stored: until SaveCheckpoint has decided one, the stream is not trusted
        # to tell this lease's save from that one.
        self._unsure = False
        # Data this long was refused (INVALID_ARGUMENT checkpoint.data): no longer
        # is carried, for a refused beat ends its stream (the lease lives on).
        self._refused_bytes: int | None = None

    def known_version(self, stream: HeartbeatKeeper | None) -> int:
        """The stored version as this holder last heard it (0: none)."""
        heard = stream.stored_checkpoint_version if stream is not None else 0
        return max(self._known_version, heard)

    async def save(
        self,
        version: int,
        data: bytes,
        content_type: str,
        *,
        stream: HeartbeatKeeper | None,
        check: Callable[[], None],
    ) -> Checkpoint:
        """Save one checkpoint, on ``stream`` when it can carry it, else by SaveCheckpoint.

        Args:
            version: Higher than the stored version; >= 1.
            data: The progress, opaque to the server.
            content_type: What ``data`` is; may be empty.
            stream: The lease's heartbeat, or None.
            check: Raises ``LeaseLost`` when the lease may not be acted on.

        Returns:
            The checkpoint as stored (``write_time`` None when the stream carried it).

        Raises:
            CheckpointNotNewer: The version does not move forward.
            LeaseLost: The lease is lost (raised by ``check`` or the server).
            InvalidArgument: INVALID_ARGUMENT, or locally for values of the wrong type.
            LeaseUnavailable: UNAVAILABLE; safe to call again.

        """
        message = checkpoint_message((version, data, content_type))
        async with self._lock:
            check()
            if (
                stream is not None
                and not self._unsure
                and version > self.known_version(stream)
                and _well_formed(message)
                and (self._refused_bytes is None or len(message.data) < self._refused_bytes)
            ):
                carried = await self._carry(stream, message, version)
                if carried is not None:
                    return carried
                check()
            try:
                saved = await self._client.save_checkpoint(
                    self._task_id, self._fence, version, message.data, message.content_type
                )
            except CheckpointNotNewer as error:
                self._heard(error.current_version)
                self._unsure = False
                raise
            except InvalidArgument as error:
                self._unsure = False  # a checkpoint no beat could have stored either
                if error.field == "checkpoint.data":
                    self._refused_bytes = min(
                        len(message.data), self._refused_bytes or len(message.data)
                    )
                raise
            self._heard(saved.version)
            self._unsure = False
            return saved

    async def _carry(
        self, stream: HeartbeatKeeper, message: pb.Checkpoint, version: int
    ) -> Checkpoint | None:
        """Carry the checkpoint on ``stream``; None when SaveCheckpoint must decide.

        Raises:
            CheckpointNotNewer: The answer says another checkpoint of this
                version or a higher one is stored.

        """
        self._unsure = True
        try:
            stored, saved = await stream.carry_checkpoint(message)
        except CheckpointNotCarried:
            return None
        self._unsure = False
        self._heard(stored)
        if saved:  # this very checkpoint is the stored one (the version alone cannot tell)
            return Checkpoint(version, message.data, message.content_type, self._fence)
        if stored >= version:
            raise CheckpointNotNewer.of(version, stored, self._task_id, self._fence)
        return None  # not stored, and nothing as high: a server that ignores beats' checkpoints

    def _heard(self, version: int) -> None:
        self._known_version = max(self._known_version, version)


CONTENT_TYPE_MAX_BYTES = 128
"""The longest content type the server accepts (printable ASCII)."""


def _well_formed(message: pb.Checkpoint) -> bool:
    """Whether the server's checks of a checkpoint could pass (its data size aside).

    One that cannot is sent as SaveCheckpoint, whose INVALID_ARGUMENT names the field.
    """
    content_type = message.content_type
    return (
        message.version >= 1
        and len(content_type) <= CONTENT_TYPE_MAX_BYTES
        and all(" " <= ch <= "~" for ch in content_type)
    )


def checkpoint_message(checkpoint: CheckpointLike, name: str = "checkpoint") -> pb.Checkpoint:
    """A checkpoint to save as a ``Checkpoint`` proto (version, data and content type only).

    The server checks the values (INVALID_ARGUMENT); only their types are checked here.

    Args:
        checkpoint: A :class:`Checkpoint`, or ``(version, data[, content_type])``.
        name: The argument's name, for the error.

    Raises:
        InvalidArgument: Not a checkpoint: a version that is not an int, data
            that is not bytes, a content type that is not text (raised locally).

    """
    if isinstance(checkpoint, Checkpoint):
        version, data, content_type = (
            checkpoint.version,
            checkpoint.data,
            checkpoint.content_type,
        )
    elif isinstance(checkpoint, tuple) and len(checkpoint) in (2, 3):
        version, data = checkpoint[0], checkpoint[1]
        content_type = checkpoint[2] if len(checkpoint) == 3 else ""
    else:
        raise _not_a_checkpoint(name, checkpoint)
    if (
        isinstance(version, bool)
        or not isinstance(version, int)
        or not isinstance(data, bytes | bytearray | memoryview)
        or not isinstance(content_type, str)
    ):
        raise _not_a_checkpoint(name, checkpoint)
    return pb.Checkpoint(version=version, data=bytes(data), content_type=content_type)


def _not_a_checkpoint(name: str, value: object) -> InvalidArgument:
    return InvalidArgument(
        f"{name} must be a Checkpoint or (version: int, data: bytes[, content_type: str]), "
        f"got {_shape(value)}",
        field_violations=[(name, "not a checkpoint")],
        code=None,
    )


def _shape(value: object) -> str:
    """The types in ``value``, not its data (which may be large)."""
    if isinstance(value, tuple):
        return "(" + ", ".join(type(item).__name__ for item in value) + ")"
    return type(value).__name__
