"""Domain errors of the lease service.

::

    LeaseServiceError
    ├── InvalidArgument       bad input; nothing changed         -> INVALID_ARGUMENT
    ├── LeaseLost             the caller's lease is not live      -> ABORTED (reason)
    ├── TaskNotClaimable      claim of an ended or quarantined task -> FAILED_PRECONDITION
    │   └── TaskCompleted           the task is COMPLETED
    ├── TaskNotQuarantined    Retry of a task that is not QUARANTINED -> FAILED_PRECONDITION
    ├── CheckpointNotNewer    a checkpoint version that does not move forward
    │                                                             -> FAILED_PRECONDITION
    ├── EffectConflict        the effect ledger refuses the call  -> FAILED_PRECONDITION
    │   ├── EffectKeyReused         same key, another policy or request digest
    │   ├── EffectNotBegun          completion of an effect never reserved
    │   └── EffectAlreadyCompleted  another outcome is already recorded
    ├── TaskNotFound          inspection of an unknown task       -> NOT_FOUND
    ├── Unauthenticated       no valid token                      -> UNAUTHENTICATED
    ├── PermissionDenied      the token does not cover the call   -> PERMISSION_DENIED
    ├── LimitExceeded         a namespace limit (retry later)     -> RESOURCE_EXHAUSTED
    │   ├── LeaseLimit              the namespace's live leases are at their maximum
    │   └── ClaimRateLimit          the namespace's claims per second are spent
    └── ServiceUnavailable    retry the call                      -> UNAVAILABLE
        ├── DatabaseUnavailable   the database cannot be reached
        │   ├── DatabaseRefused       it refuses us for good: no retry helps
        │   └── StatementsRefused     it answers but refuses our statements
        └── ShuttingDown          the server is draining

The mapping to gRPC lives in one table, in ``status.py``. These errors never
mention asyncpg, SQLSTATEs or tables: ``storage/driver_errors.py`` translates driver errors.
"""

from __future__ import annotations

from leasekeeper_server.core.model import Lease, LossReason


class LeaseServiceError(Exception):
    """Base of every error the service reports to a caller."""

    reason: str = "INTERNAL"

    def metadata(self) -> dict[str, str]:
        """Dynamic values repeated in the ErrorInfo metadata."""
        return {}


class InvalidArgument(LeaseServiceError):
    """A request field is malformed; the request changed nothing."""

    reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description

    def metadata(self) -> dict[str, str]:  # noqa: D102
        return {"field": self.field}


class LeaseLost(LeaseServiceError):
    """The caller's owner id and fence do not hold a live lease."""

    def __init__(self, loss: LossReason, current_fence: int, message: str | None = None) -> None:
        super().__init__(message or f"lease lost: {loss.value} (current fence {current_fence})")
        self.loss = loss
        self.reason = loss.value
        self.current_fence = current_fence

    def metadata(self) -> dict[str, str]:  # noqa: D102
        return {"current_fence": str(self.current_fence)}

    @classmethod
    def of(cls, lease: Lease | None, loss: LossReason) -> LeaseLost:
        """The loss of a lease read as ``lease`` (None: never claimed, current fence 0)."""
        return cls(loss, lease.fence if lease is not None else 0)


_NOT_CLAIMABLE = {
    LossReason.TASK_COMPLETED: "task is completed",
    LossReason.TASK_CANCELLED: "task is cancelled",
    LossReason.TASK_FAILED: "task ended as failed",
    LossReason.TASK_QUARANTINED: "task used up its attempts and is quarantined "
    "(an operator may Retry or Cancel it)",
}


class TaskNotClaimable(LeaseServiceError):
    """A claim of a task that is ended (COMPLETED, CANCELLED, FAILED) or QUARANTINED.

    The ErrorInfo reason is the LossReason name: TASK_COMPLETED,
    TASK_CANCELLED, TASK_FAILED or TASK_QUARANTINED.
    """

    def __init__(self, loss: LossReason, fence: int) -> None:
        super().__init__(f"{_NOT_CLAIMABLE[loss]} (last fence {fence})")
        self.loss = loss
        self.reason = loss.value
        self.fence = fence

    def metadata(self) -> dict[str, str]:  # noqa: D102
        return {"current_fence": str(self.fence)}

    @classmethod
    def of(cls, lease: Lease) -> TaskNotClaimable:
        """The refusal of a claim of ``lease``'s task, which ``lease.unclaimable`` names."""
        loss = lease.unclaimable
        assert loss is not None
        if loss is LossReason.TASK_COMPLETED:
            return TaskCompleted(lease.fence)
        return cls(loss, lease.fence)


class TaskCompleted(TaskNotClaimable):
    """The task is COMPLETED: no claim is ever granted again."""

    def __init__(self, fence: int) -> None:
        super().__init__(LossReason.TASK_COMPLETED, fence)


class TaskNotQuarantined(LeaseServiceError):
    """Retry of a task that is not QUARANTINED; nothing changed."""

    reason = "TASK_NOT_QUARANTINED"

    def __init__(self, state: str) -> None:
        super().__init__(f"task is {state}, not QUARANTINED: only a quarantined task is retried")
        self.state = state

    def metadata(self) -> dict[str, str]:  # noqa: D102
        return {"state": self.state}


class CheckpointNotNewer(LeaseServiceError):
    """A checkpoint whose version does not move forward; nothing was stored."""

    reason = "CHECKPOINT_NOT_NEWER"

    def __init__(self, version: int, current_version: int) -> None:
        super().__init__(
            f"checkpoint.version {version} does not move forward: the stored version is "
            f"{current_version}; send a higher one"
        )
        self.version = version
        self.current_version = current_version

    def metadata(self) -> dict[str, str]:  # noqa: D102
        return {"current_version": str(self.current_version)}


class EffectConflict(LeaseServiceError):
    """The effect ledger refuses a call whatever the lease (FAILED_PRECONDITION)."""


class EffectKeyReused(EffectConflict):
    """The effect key was reserved with another policy or request digest."""

    reason = "EFFECT_KEY_REUSED"

    def __init__(self, effect_key: str, policy: str, fence: int, field: str) -> None:
        """``policy`` and ``fence`` are the record's; ``field`` the request's field that differs."""
        super().__init__(
            f"effect_key {effect_key!r} was reserved with another {field} "
            f"(policy {policy}, fence {fence}): one key names one effect"
        )
        self.field = field
        self.fence = fence

    def metadata(self) -> dict[str, str]:  # noqa: D102
        return {"field": self.field, "recorded_fence": str(self.fence)}


class EffectNotBegun(EffectConflict):
    """CompleteEffect for an effect key that was never reserved."""

    reason = "EFFECT_NOT_BEGUN"

    def __init__(self) -> None:
        super().__init__("no effect with this effect_key was begun: call BeginEffect first")


class EffectAlreadyCompleted(EffectConflict):
    """CompleteEffect with another outcome than the one recorded."""

    reason = "EFFECT_ALREADY_COMPLETED"

    def __init__(self, state: str, complete_fence: int) -> None:
        super().__init__(
            f"the effect already has another outcome ({state}, recorded by fence "
            f"{complete_fence}); the first confirmed outcome stands"
        )
        self.state = state
        self.complete_fence = complete_fence

    def metadata(self) -> dict[str, str]:  # noqa: D102
        return {"state": self.state, "complete_fence": str(self.complete_fence)}


class TaskNotFound(LeaseServiceError):
    """No task of that name was ever claimed."""

    reason = "TASK_NOT_FOUND"


class Unauthenticated(LeaseServiceError):
    """The call carries no token, or one the server does not accept."""

    reason = "UNAUTHENTICATED"


class PermissionDenied(LeaseServiceError):
    """The caller's token does not cover this RPC or this namespace."""

    reason = "PERMISSION_DENIED"


class LimitExceeded(LeaseServiceError):
    """A namespace limit refuses the call for now; nothing was changed.

    Args:
        namespace: The limited namespace.
        retry_after_s: When a retry may succeed, in seconds (google.rpc.RetryInfo).
        message: What was exceeded.
    """

    def __init__(self, namespace: str, retry_after_s: float, message: str) -> None:
        super().__init__(message)
        self.namespace = namespace
        self.retry_after_s = retry_after_s

    def metadata(self) -> dict[str, str]:  # noqa: D102
        return {"namespace": self.namespace, "retry_after_s": f"{self.retry_after_s:.3f}"}


class LeaseLimit(LimitExceeded):
    """The namespace holds its maximum number of live leases."""

    reason = "LEASE_LIMIT"


class ClaimRateLimit(LimitExceeded):
    """The namespace's claims per second are spent."""

    reason = "CLAIM_RATE_LIMIT"


class ServiceUnavailable(LeaseServiceError):
    """The call can be retried, here or on another replica."""


class DatabaseUnavailable(ServiceUnavailable):
    """The database could not be reached or did not answer in time."""

    reason = "DATABASE_UNAVAILABLE"


class StatementsRefused(DatabaseUnavailable):
    """The database answers but refuses the service's statements (Store.ping).

    A privilege taken from the service's role, a read-only session, a
    prepared statement lost to a pooler: calls cannot be decided however fast
    the database answers, so health is NOT_SERVING (health.py). Callers get
    UNAVAILABLE, as for any DatabaseUnavailable.
    """


class DatabaseRefused(DatabaseUnavailable):
    """The database refuses the connection for a reason no retry fixes.

    An unknown role, a wrong password, a client address it does not admit, a
    database that does not exist, or connection parameters the driver cannot
    use: the configuration must change. A caller of a serving server still
    gets UNAVAILABLE (another replica may be configured right); at start the
    commands exit at once (cli/main.py) instead of retrying.
    """


class ShuttingDown(ServiceUnavailable):
    """The server is draining; the lease lives on in the database."""

    reason = "SHUTTING_DOWN"
