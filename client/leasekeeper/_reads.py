"""LeaseClient's reads: what a task and a namespace hold now, their history, and Watch.

Every call here is read-only: a task's lease, checkpoint, history and effects; a namespace's
tasks and figures; the namespaces; the change feed. Each is one RPC.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from . import _checkpoint, _types, history
from ._checkpoint import Checkpoint
from ._connection import Connection, every_page
from ._types import EffectRecord, LeaseInfo, NamespaceInfo, NamespaceStats, TaskEvent
from .errors import from_rpc_error
from .history import HistoryEntry
from .v1 import lease_service_pb2 as pb


class Reads(Connection):
    """The read-only calls of :class:`~leasekeeper.LeaseClient`."""

    async def get_lease(self, task_id: str) -> LeaseInfo:
        """The task's current state, never a cached one.

        Raises:
            TaskNotFound: NOT_FOUND, the task was never claimed.
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.GetLeaseRequest(namespace=self._namespace, task_id=task_id)
        response = await self._call(self.stub.GetLease, request, task_id=task_id)
        return _types.lease_info(response.lease)

    async def get_checkpoint(self, task_id: str) -> Checkpoint | None:
        """The task's stored checkpoint, with its data (GetLease). Read-only.

        For an operator or a reader; a worker receives it with its grant
        (``ClaimResult.checkpoint``, ``HeldLease.checkpoint``).

        Returns:
            The checkpoint, or None when none was ever saved.

        Raises:
            TaskNotFound: NOT_FOUND, the task was never claimed.
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.GetLeaseRequest(namespace=self._namespace, task_id=task_id)
        response = await self._call(self.stub.GetLease, request, task_id=task_id)
        return _checkpoint.optional_checkpoint(response, "checkpoint")

    async def list_task_history(
        self,
        task_id: str,
        page_size: int = 100,
        page_token: str = "",
        namespace: str | None = None,
    ) -> tuple[list[HistoryEntry], str]:
        """One page of a task's history, oldest first (see :mod:`leasekeeper.history`). Read-only.

        Args:
            task_id: The task.
            page_size: At most this many (server default 100, maximum 1000).
            page_token: From the previous page (bound to this task); empty for the first.
            namespace: The task's namespace; None for this client's.

        Returns:
            ``(entries, next_page_token)``; the token is empty on the last page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT (e.g. a token of another task).
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = history.list_request(
            self._namespace if namespace is None else namespace, task_id, page_size, page_token
        )
        response = await self._call(self.stub.ListTaskHistory, request, task_id=task_id)
        return history.page(response)

    async def iter_task_history(
        self, task_id: str, page_size: int = 100, namespace: str | None = None
    ) -> AsyncIterator[HistoryEntry]:
        """Every entry of a task's history, oldest first, page by page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE, on any page.

        """
        async for entry in every_page(
            lambda token: self.list_task_history(task_id, page_size, token, namespace)
        ):
            yield entry

    async def list_leases(
        self, state: str | None = None, page_size: int = 100, page_token: str = ""
    ) -> tuple[list[LeaseInfo], str]:
        """One page of this namespace's tasks, ordered by task_id byte for byte.

        Args:
            state: Only tasks in this state (``"FREE"``, ``"HELD"``, ``"EXPIRED"``,
                ``"COMPLETED"``); None for all.
            page_size: At most this many (server maximum 1000).
            page_token: From the previous page; empty for the first.

        Returns:
            ``(leases, next_page_token)``; the token is empty on the last page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT (or locally for an unknown state).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.ListLeasesRequest(
            namespace=self._namespace,
            state=_types.task_state(state),  # type: ignore[arg-type]
            page_size=page_size,
            page_token=page_token,
        )
        response = await self._call(self.stub.ListLeases, request)
        return [_types.lease_info(lease) for lease in response.leases], response.next_page_token

    async def iter_leases(
        self, state: str | None = None, page_size: int = 100
    ) -> AsyncIterator[LeaseInfo]:
        """Every task of this namespace (optionally in one state), page by page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE, on any page.

        """
        async for lease in every_page(lambda token: self.list_leases(state, page_size, token)):
            yield lease

    async def list_namespaces(
        self, page_size: int = 100, page_token: str = ""
    ) -> tuple[list[NamespaceInfo], str]:
        """One page of the namespaces that hold tasks, ordered by name byte for byte.

        Any namespace, not only this client's. A namespace is listed from its
        first claim on; limits or tokens alone do not make one. Each comes
        with its count of tasks (every state), counted up to 1000
        (``task_count_capped`` when there are more). An operator's call: it
        needs an admin token when the server requires tokens, and lists only
        the namespaces that token covers, so a page may hold fewer than
        ``page_size`` namespaces (even none) and still have a next page.

        Args:
            page_size: At most this many (server maximum 1000).
            page_token: From the previous page; empty for the first.

        Returns:
            ``(namespaces, next_page_token)``: :class:`~leasekeeper.NamespaceInfo`
            values; the token is empty on the last page.

        Raises:
            AccessDenied: UNAUTHENTICATED, or PERMISSION_DENIED (the token's
                role is not admin).
            InvalidArgument: INVALID_ARGUMENT (a page_size outside [0, 1000],
                a page_token of another listing).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.ListNamespacesRequest(page_size=page_size, page_token=page_token)
        response = await self._call(self.stub.ListNamespaces, request)
        namespaces = [_types.namespace_info(summary) for summary in response.namespaces]
        return namespaces, response.next_page_token

    async def iter_namespaces(self, page_size: int = 100) -> AsyncIterator[NamespaceInfo]:
        """Every namespace that holds tasks (that the token covers), page by page.

        Raises:
            AccessDenied: UNAUTHENTICATED, or PERMISSION_DENIED (the token's
                role is not admin).
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE, on any page.

        """
        async for namespace in every_page(lambda token: self.list_namespaces(page_size, token)):
            yield namespace

    async def namespace_stats(self, namespace: str | None = None) -> NamespaceStats:
        """A namespace's figures now (GetNamespaceStats): an operator's view. Read-only.

        Leases held and expired, tasks quarantined, leases granted, stale
        fences refused and leases lost in the last 60 seconds, effects in
        doubt: see :class:`~leasekeeper.NamespaceStats`. Counted by the server
        in one statement on the database clock (``as_of``); each count stops
        at 1000 rows (its ``*_capped`` flag set when there were more), so a
        call's cost never follows the namespace's size. A namespace that holds no tasks
        answers with every count 0. An operator's call: it needs an admin
        token covering the namespace when the server requires tokens (the
        role of :meth:`list_leases`).

        Args:
            namespace: The namespace; None for this client's.

        Returns:
            The figures: :class:`~leasekeeper.NamespaceStats` (counts as
            ``int``, ``as_of`` a UTC ``datetime``).

        Raises:
            AccessDenied: UNAUTHENTICATED, or PERMISSION_DENIED (the token's
                role is not admin, or it does not cover the namespace).
            InvalidArgument: INVALID_ARGUMENT, the namespace breaks the rules
                of ids (field ``namespace``).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.GetNamespaceStatsRequest(
            namespace=self._namespace if namespace is None else namespace
        )
        response = await self._call(self.stub.GetNamespaceStats, request)
        return _types.namespace_stats(response)

    async def watch(self, task_id: str | None = None) -> AsyncIterator[TaskEvent]:
        """The events of one task (or of this namespace), as the database commits them.

        Yields a ``SNAPSHOT`` first (for one task), then ``CLAIMED``,
        ``RELEASED``, ``EXPIRED``, ``COMPLETED`` and ``REVOKED`` events; a
        later ``SNAPSHOT`` means events may have been missed. Runs until the
        caller stops iterating (the stream is cancelled then). No call timeout
        applies.

        Raises:
            LeaseUnavailable: UNAVAILABLE (server shutting down): watch again.
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            InvalidArgument: INVALID_ARGUMENT.

        """
        request = pb.WatchRequest(namespace=self._namespace, task_id=task_id or "")
        call = self.stub.Watch(request, metadata=self._metadata)
        try:
            async for message in call:
                yield _types.task_event(message)
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error, task_id=task_id) from error
        finally:
            call.cancel()

    async def list_effects(
        self,
        task_id: str,
        state: str | None = None,
        page_size: int = 100,
        page_token: str = "",
        namespace: str | None = None,
    ) -> tuple[list[EffectRecord], str]:
        """One page of a task's effects, ordered by effect_key byte for byte. Read-only.

        For reconciliation and for a replacement worker: what was reserved, by
        which fence, in which state. A task without effects (or never claimed)
        has none.

        Args:
            task_id: The task.
            state: Only effects in this state (``"RESERVED"``, ``"SUCCEEDED"``,
                ``"FAILED"``); None for all.
            page_size: At most this many (server maximum 1000).
            page_token: From the previous page; empty for the first.
            namespace: The task's namespace; None for this client's.

        Returns:
            ``(effects, next_page_token)``; the token is empty on the last page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT (or locally for an unknown state).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.ListEffectsRequest(
            namespace=self._namespace if namespace is None else namespace,
            task_id=task_id,
            state=_types.effect_state(state),  # type: ignore[arg-type]
            page_size=page_size,
            page_token=page_token,
        )
        response = await self._call(self.stub.ListEffects, request, task_id=task_id)
        effects = [_types.effect_record(effect) for effect in response.effects]
        return effects, response.next_page_token

    async def iter_effects(
        self,
        task_id: str,
        state: str | None = None,
        page_size: int = 100,
        namespace: str | None = None,
    ) -> AsyncIterator[EffectRecord]:
        """Every effect of a task (optionally in one state), page by page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE, on any page.

        """
        async for effect in every_page(
            lambda token: self.list_effects(task_id, state, page_size, token, namespace)
        ):
            yield effect
