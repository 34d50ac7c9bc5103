"""leasekeeper: the Python client of the leasekeeper lease service.

Workers hold leases on tasks and pass fences to their side effects::

    from leasekeeper import LeaseClient

    async with LeaseClient("127.0.0.1:9457", namespace="billing") as client:
        async with client.hold("invoice-42", ttl=30.0, wait=60.0) as lease:
            await gateway.Send(request, metadata=lease.metadata())

Effects that must not be repeated go through the effect ledger, checked with
the lease's fence (``policy`` is required: see :mod:`leasekeeper.effects`)::

        @lease.effect("email:welcome", policy="ONCE")
        async def send() -> str:
            return await mailer.send(to, body)  # the vendor's message id

        outcome = await send()  # run again: the recorded result, nothing sent

A run survives its worker through checkpoints: the next owner's grant carries
the latest one (see :mod:`leasekeeper.checkpoints`)::

        step = int(lease.checkpoint.data) if lease.checkpoint else 0
        await lease.save_checkpoint(step + 1, str(step + 1).encode())

Effect services check those fences (:class:`FenceChecker`, :class:`FenceInterceptor`),
or, with a database of their own, refuse lower fences in the effect's own
transaction (:mod:`leasekeeper.fence_table`).
Durations are float seconds (or ``timedelta`` on input); instants are UTC
``datetime`` on the database clock.
"""

from ._checkpoint import Checkpoint, CheckpointLike
from ._owner import new_owner_id, new_request_id
from ._types import (
    BeginResult,
    ClaimResult,
    EffectRecord,
    FenceCheck,
    LeaseInfo,
    NamespaceInfo,
    NamespaceStats,
    RenewedLease,
    TaskEvent,
)
from .channel import CHANNEL_OPTIONS
from .client import LeaseClient
from .effects import EffectOutcome, EffectRunner, Performed, request_digest
from .errors import (
    AccessDenied,
    CheckpointNotNewer,
    ClaimTimeout,
    EffectAlreadyCompleted,
    EffectError,
    EffectFailed,
    EffectInDoubt,
    EffectKeyReused,
    EffectNotBegun,
    InvalidArgument,
    LeaseError,
    LeaseLost,
    LeaseUnavailable,
    LimitExceeded,
    MissingFence,
    NotAcquired,
    StaleFence,
    TaskCancelled,
    TaskCompleted,
    TaskEnded,
    TaskFailed,
    TaskNotFound,
    TaskNotQuarantined,
    TaskQuarantined,
)
from .fence_table import FENCE_BELOW_ACCEPTED, FenceRefused
from .fencing import (
    METADATA_FENCE,
    METADATA_NAMESPACE,
    METADATA_TASK_ID,
    FenceChecker,
    FenceInterceptor,
    FenceRef,
    fence_from_metadata,
)
from .history import HistoryEntry, HistoryKind
from .lease import HeldLease, LeaseHold

__all__ = [
    "CHANNEL_OPTIONS",
    "FENCE_BELOW_ACCEPTED",
    "METADATA_FENCE",
    "METADATA_NAMESPACE",
    "METADATA_TASK_ID",
    "AccessDenied",
    "BeginResult",
    "Checkpoint",
    "CheckpointLike",
    "CheckpointNotNewer",
    "ClaimResult",
    "ClaimTimeout",
    "EffectAlreadyCompleted",
    "EffectError",
    "EffectFailed",
    "EffectInDoubt",
    "EffectKeyReused",
    "EffectNotBegun",
    "EffectOutcome",
    "EffectRecord",
    "EffectRunner",
    "FenceCheck",
    "FenceChecker",
    "FenceInterceptor",
    "FenceRef",
    "FenceRefused",
    "HeldLease",
    "HistoryEntry",
    "HistoryKind",
    "InvalidArgument",
    "LeaseClient",
    "LeaseError",
    "LeaseHold",
    "LeaseInfo",
    "LeaseLost",
    "LeaseUnavailable",
    "LimitExceeded",
    "MissingFence",
    "NamespaceInfo",
    "NamespaceStats",
    "NotAcquired",
    "Performed",
    "RenewedLease",
    "StaleFence",
    "TaskCancelled",
    "TaskCompleted",
    "TaskEnded",
    "TaskEvent",
    "TaskFailed",
    "TaskNotFound",
    "TaskNotQuarantined",
    "TaskQuarantined",
    "fence_from_metadata",
    "new_owner_id",
    "new_request_id",
    "request_digest",
]
