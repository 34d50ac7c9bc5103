"""LeaseClient's operator calls: cancel, retry and revoke a task (admin role when auth is on)."""

from __future__ import annotations

from . import _types
from ._connection import Connection
from ._types import LeaseInfo
from .v1 import lease_service_pb2 as pb


class OperatorCalls(Connection):
    """The operator calls of :class:`~leasekeeper.LeaseClient`."""

    async def cancel(self, task_id: str, reason: str) -> LeaseInfo:
        """Cancel a task (an operator's call; needs an admin token when auth is on).

        The task becomes CANCELLED, terminal: its holder's heartbeat ends at
        once (``hold()`` raises ``LeaseLost`` with reason ``TASK_CANCELLED``),
        every fence is refused from then on and claims raise
        :class:`~leasekeeper.TaskCancelled`. The checkpoint is kept.
        Cancelling a cancelled task answers OK and changes nothing.

        Args:
            task_id: The task.
            reason: Why (``LeaseInfo.cancel_reason``, recorded, audited); 1-1024 bytes.

        Returns:
            The task after the call.

        Raises:
            TaskNotFound: NOT_FOUND, the task was never claimed.
            TaskCompleted: FAILED_PRECONDITION TASK_COMPLETED: already ended.
            TaskFailed: FAILED_PRECONDITION TASK_FAILED: already ended.
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.CancelRequest(namespace=self._namespace, task_id=task_id, reason=reason)
        response = await self._call(self.stub.Cancel, request, task_id=task_id)
        return _types.lease_info(response.lease)

    async def retry(self, task_id: str, reason: str) -> LeaseInfo:
        """Put a QUARANTINED task back (an operator's call; needs an admin token when auth is on).

        The task becomes FREE with attempts 0; the next claim is granted with a
        higher fence and receives the kept checkpoint.

        Args:
            task_id: The task.
            reason: Why (recorded in its history and the audit log); 1-1024 bytes.

        Returns:
            The task after the call (FREE, attempts 0).

        Raises:
            TaskNotFound: NOT_FOUND, the task was never claimed.
            TaskNotQuarantined: FAILED_PRECONDITION TASK_NOT_QUARANTINED (its
                ``state`` says what the task is); nothing changed.
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.RetryRequest(namespace=self._namespace, task_id=task_id, reason=reason)
        response = await self._call(self.stub.Retry, request, task_id=task_id)
        return _types.lease_info(response.lease)

    async def revoke(self, task_id: str, reason: str, fence: int = 0) -> tuple[bool, LeaseInfo]:
        """End the task's lease now (an operator's call; needs an admin token when auth is on).

        The fence stops validating at once, the holder's heartbeat ends ABORTED
        ``LEASE_REVOKED`` and the next claim gets a new fence.

        Args:
            task_id: The task.
            reason: Why (recorded, audited, shown to watchers); 1-1024 bytes.
            fence: Revoke only this fence; 0 for whatever lease is current.

        Returns:
            ``(revoked, lease)``: revoked is False when the task had no such
            lease (FREE, or superseded); lease is the task after the call.

        Raises:
            TaskNotFound: NOT_FOUND, the task was never claimed.
            TaskCompleted: FAILED_PRECONDITION, the task is terminal.
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.RevokeRequest(
            namespace=self._namespace, task_id=task_id, reason=reason, fence=fence
        )
        response = await self._call(self.stub.Revoke, request, task_id=task_id)
        return response.revoked, _types.lease_info(response.lease)
