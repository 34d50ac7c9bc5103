"""leasekeeper: the Python client of the leasekeeper lease service.

Workers hold leases on tasks and pass fences to their side effects::

    from leasekeeper import LeaseClient

    async with LeaseClient("127.0.0.1:9457", namespace="billing") as client:
        async with client.hold("invoice-42", ttl=30.0, wait=60.0) as lease:
            await gateway.Send(request, metadata=lease.metadata())

Effect services check those fences (:class:`FenceChecker`, :class:`FenceInterceptor`).
Durations are float seconds (or ``timedelta`` on input); instants are UTC
``datetime`` on the database clock.
"""

from ._owner import new_owner_id
from ._types import ClaimResult, FenceCheck, LeaseInfo
from .client import LeaseClient
from .errors import (
    ClaimTimeout,
    InvalidArgument,
    LeaseError,
    LeaseLost,
    LeaseUnavailable,
    MissingFence,
    NotAcquired,
    StaleFence,
    TaskCompleted,
    TaskNotFound,
)
from .fencing import (
    METADATA_FENCE,
    METADATA_NAMESPACE,
    METADATA_TASK_ID,
    FenceChecker,
    FenceInterceptor,
    FenceRef,
    fence_from_metadata,
)
from .lease import HeldLease, LeaseHold

__all__ = [
    "METADATA_FENCE",
    "METADATA_NAMESPACE",
    "METADATA_TASK_ID",
    "ClaimResult",
    "ClaimTimeout",
    "FenceCheck",
    "FenceChecker",
    "FenceInterceptor",
    "FenceRef",
    "HeldLease",
    "InvalidArgument",
    "LeaseClient",
    "LeaseError",
    "LeaseHold",
    "LeaseInfo",
    "LeaseLost",
    "LeaseUnavailable",
    "MissingFence",
    "NotAcquired",
    "StaleFence",
    "TaskCompleted",
    "TaskNotFound",
    "fence_from_metadata",
    "new_owner_id",
]
