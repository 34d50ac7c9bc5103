"""Checkpoint: a task's saved progress, and its conversion from and to protos.

A leaf module (like ``_effect_record``): ``_types`` and ``checkpoints`` both
use it, and it imports nothing of the package but the stubs.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from .v1 import lease_service_pb2 as pb


@dataclasses.dataclass(frozen=True, slots=True)
class Checkpoint:
    """A task's saved progress: what a replacement worker resumes from.

    One per task, the latest; it survives release, expiry, revoke, quarantine
    and the task's end. Only the owner of the task's live current fence writes
    it, and only with a higher version.

    Attributes:
        version: Chosen by the worker; each write carries a higher one (>= 1).
        data: Opaque to the server; at most its ``max_checkpoint_bytes`` (256 KiB by default).
        content_type: What ``data`` is (e.g. ``"application/json"``); may be empty.
        fence: The fence that wrote it (0 in a checkpoint not yet saved).
        write_time: When it was written (UTC, database clock); None when not
            known (not yet saved, or saved on the heartbeat stream, whose
            answer does not carry it).
    """

    version: int
    data: bytes
    content_type: str = ""
    fence: int = 0
    write_time: datetime | None = None


CheckpointLike = Checkpoint | tuple[int, bytes] | tuple[int, bytes, str]
"""A checkpoint to save: a :class:`Checkpoint` (its ``fence`` and ``write_time`` are
ignored), or ``(version, data)`` or ``(version, data, content_type)``."""


def checkpoint_of(message: pb.Checkpoint) -> Checkpoint:
    """Convert a ``Checkpoint`` proto."""
    return Checkpoint(
        version=message.version,
        data=message.data,
        content_type=message.content_type,
        fence=message.fence,
        write_time=(
            message.write_time.ToDatetime(tzinfo=UTC) if message.HasField("write_time") else None
        ),
    )


def optional_checkpoint(parent: object, field: str) -> Checkpoint | None:
    """The ``Checkpoint`` field ``field`` of a proto converted; None when unset."""
    if not parent.HasField(field):  # type: ignore[attr-defined]
        return None
    message: pb.Checkpoint = getattr(parent, field)
    return checkpoint_of(message)


def saved(sent: pb.Checkpoint, stored: pb.Checkpoint | None, fence: int) -> Checkpoint:
    """The checkpoint as saved: what was ``sent``, with the server's fence and write time.

    The server's answers leave the data out (the caller has it); ``stored`` is
    the answer's checkpoint, or None when the answer carried none (a beat).
    """
    write_time = None
    if stored is not None and stored.HasField("write_time"):
        write_time = stored.write_time.ToDatetime(tzinfo=UTC)
    return Checkpoint(
        version=stored.version if stored is not None and stored.version else sent.version,
        data=sent.data,
        content_type=sent.content_type,
        fence=stored.fence if stored is not None and stored.fence else fence,
        write_time=write_time,
    )
