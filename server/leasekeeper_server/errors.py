"""Domain errors of the lease service.

::

    LeaseServiceError
    ├── InvalidArgument       bad input; nothing changed         -> INVALID_ARGUMENT
    ├── LeaseLost             the caller's lease is not live      -> ABORTED (reason)
    ├── TaskCompleted         claim of a terminal task            -> FAILED_PRECONDITION
    ├── TaskNotFound          inspection of an unknown task       -> NOT_FOUND
    └── ServiceUnavailable    retry the call                      -> UNAVAILABLE
        ├── DatabaseUnavailable   the database cannot be reached
        └── ShuttingDown          the server is draining

The mapping to gRPC lives in one table, in ``status.py``. These errors never
mention asyncpg, SQLSTATEs or tables: ``store.py`` translates driver errors.
"""

from __future__ import annotations

from .model import LossReason


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


class TaskCompleted(LeaseServiceError):
    """The task is COMPLETED: no claim is ever granted again."""

    reason = LossReason.TASK_COMPLETED.value

    def __init__(self, fence: int) -> None:
        super().__init__(f"task is completed (last fence {fence})")
        self.fence = fence

    def metadata(self) -> dict[str, str]:  # noqa: D102
        return {"current_fence": str(self.fence)}


class TaskNotFound(LeaseServiceError):
    """No task of that name was ever claimed."""

    reason = "TASK_NOT_FOUND"


class ServiceUnavailable(LeaseServiceError):
    """The call can be retried, here or on another replica."""


class DatabaseUnavailable(ServiceUnavailable):
    """The database could not be reached or did not answer in time."""

    reason = "DATABASE_UNAVAILABLE"


class ShuttingDown(ServiceUnavailable):
    """The server is draining; the lease lives on in the database."""

    reason = "SHUTTING_DOWN"
