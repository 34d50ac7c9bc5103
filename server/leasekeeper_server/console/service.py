"""The console's calls to the leasekeeper service: the Python client, with the viewer's token.

Every call goes through :class:`leasekeeper.LeaseClient` on one shared gRPC
channel, carrying the token of the viewer's session (none when the viewer has
not signed in). The service decides every role and namespace: a refusal
comes back as a :class:`Refusal`, which the pages show with its HTTP status
(UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404, ...), never as
a stack trace.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta

import grpc

from leasekeeper import (
    AccessDenied,
    Checkpoint,
    EffectRecord,
    HistoryEntry,
    LeaseClient,
    LeaseError,
    LeaseInfo,
    NamespaceInfo,
    NamespaceStats,
)
from leasekeeper._types import lease_info
from leasekeeper.errors import from_rpc_error
from leasekeeper.v1 import lease_service_pb2 as pb

CALL_TIMEOUT_S = 10.0
CHART_PAGE_SIZE = 1000  # the server's most per page
CHART_PAGES = 2  # the chart draws at most the first 2000 entries of a task's history
STATS_CONCURRENCY = 8  # GetNamespaceStats calls at once for one page of namespaces

# gRPC status -> (HTTP status, the page's title)
_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.UNAUTHENTICATED: (401, "Sign in needed"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "Not allowed"),
    grpc.StatusCode.NOT_FOUND: (404, "Not found"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "Not a valid request"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "Refused in the task's state"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "Limit reached"),
    grpc.StatusCode.UNAVAILABLE: (503, "Service unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "No answer in time"),
}


# What an UNAUTHENTICATED refusal says, instead of the service's "this call needs a token:
# authorization: Bearer <token>" (which speaks of gRPC metadata, not of the console).
SIGN_IN_NEEDED = (
    "This service needs a token. Sign in with one; an admin creates tokens with "
    "`leasekeeper tokens create` (see the docs' Tokens and roles page)."
)


class Refusal(Exception):
    """A request the console cannot answer as asked; shown as an error page.

    Attributes:
        status: The HTTP status of the page.
        title: The page's headline.
        message: What happened, in one or two sentences (the service's own
            message for a refused call; ``SIGN_IN_NEEDED`` for UNAUTHENTICATED).
        code: The gRPC status name when the service refused, else "".
        back: (path, label) of the page to go back to (the task an action
            was about), or None: the error page links to the namespaces only.
        detail: The service's own message when ``message`` says it otherwise
            (UNAUTHENTICATED), else "".
    """

    def __init__(
        self,
        status: int,
        title: str,
        message: str,
        code: str = "",
        back: tuple[str, str] | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.title = title
        self.message = message
        self.code = code
        self.back = back
        self.detail = detail


def refusal_of(error: LeaseError, token: str | None = None) -> Refusal:
    """The page a failed call becomes: its HTTP status, and the service's message.

    UNAUTHENTICATED says what to do instead: without a token, ``SIGN_IN_NEEDED``;
    with one (``token``), that the service refused it, and why.
    """
    code = error.code or grpc.StatusCode.UNKNOWN
    status, title = _HTTP.get(code, (502, "The service refused"))
    message, detail = str(error), ""
    if code is grpc.StatusCode.UNAUTHENTICATED:
        message, detail = SIGN_IN_NEEDED, str(error)
        if token:
            message = (
                f"The service refused your token ({error}). Sign in with a valid one; an admin "
                "creates tokens with `leasekeeper tokens create` (see the docs' Tokens and "
                "roles page)."
            )
    return Refusal(status, title, message, code.name, detail=detail)


@contextlib.contextmanager
def answered(token: str | None = None) -> Iterator[None]:
    """Turns a failed call (LeaseError) made with ``token`` into a :class:`Refusal`."""
    try:
        yield
    except LeaseError as error:
        raise refusal_of(error, token) from error


def database_now(lease: LeaseInfo) -> datetime | None:
    """The database time the lease was read at, when the answer shows it (a live lease)."""
    if lease.state == "HELD" and lease.expire_time is not None and lease.remaining_ttl > 0:
        return lease.expire_time - timedelta(seconds=lease.remaining_ttl)
    return None


class Service:
    """The service as the console calls it: one channel, a client per call with the token."""

    def __init__(self, channel: grpc.aio.Channel, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        """A gateway on ``channel`` (owned by the caller)."""
        self.channel = channel
        self._call_timeout_s = call_timeout_s

    def client(self, namespace: str, token: str | None) -> LeaseClient:
        """A client of ``namespace`` on the shared channel, sending ``token`` (None: no token).

        Never the ``LEASEKEEPER_TOKEN`` of the console's own environment: a
        viewer without a token sends none.
        """
        return LeaseClient(
            namespace=namespace,
            channel=self.channel,
            token=token or "",
            call_timeout=self._call_timeout_s,
        )

    async def probe(self, token: str | None) -> bool:
        """Whether the service accepts ``token``; True also when it asks for none.

        Asks for one namespace (ListNamespaces): answered, or refused
        PERMISSION_DENIED (a token without the admin role), the token is
        known; refused UNAUTHENTICATED, it is not.

        Raises:
            Refusal: the service could not be asked (UNAVAILABLE, ...).
        """
        try:
            await self.client("default", token).list_namespaces(page_size=1)
        except AccessDenied as error:
            if error.code is grpc.StatusCode.UNAUTHENTICATED:
                return False
            return True
        except LeaseError as error:
            raise refusal_of(error) from error
        return True

    async def may_list_namespaces(self, token: str | None) -> bool:
        """Whether ``token`` may list namespaces (False: PERMISSION_DENIED).

        Raises:
            Refusal: any other failure (UNAUTHENTICATED: 401).
        """
        try:
            await self.client("default", token).list_namespaces(page_size=1)
        except AccessDenied as error:
            if error.code is grpc.StatusCode.PERMISSION_DENIED:
                return False
            raise refusal_of(error, token) from error
        except LeaseError as error:
            raise refusal_of(error, token) from error
        return True

    async def namespaces(
        self, token: str | None, page_token: str, page_size: int
    ) -> tuple[list[NamespaceInfo], str]:
        """One page of namespaces (ListNamespaces).

        Raises:
            Refusal: the call failed.
        """
        with answered(token):
            return await self.client("default", token).list_namespaces(page_size, page_token)

    async def stats(self, namespace: str, token: str | None) -> NamespaceStats:
        """The namespace's figures (GetNamespaceStats).

        Raises:
            Refusal: the call failed.
        """
        with answered(token):
            return await self.client(namespace, token).namespace_stats(namespace)

    async def stats_of(
        self, namespaces: Sequence[str], token: str | None
    ) -> dict[str, NamespaceStats | Refusal]:
        """The figures of each namespace, at most ``STATS_CONCURRENCY`` calls at once."""
        limit = asyncio.Semaphore(STATS_CONCURRENCY)

        async def one(namespace: str) -> NamespaceStats | Refusal:
            async with limit:
                try:
                    return await self.stats(namespace, token)
                except Refusal as refusal:
                    return refusal

        found = await asyncio.gather(*(one(namespace) for namespace in namespaces))
        return dict(zip(namespaces, found, strict=True))

    async def leases(
        self,
        namespace: str,
        token: str | None,
        *,
        state: str | None,
        owner: str,
        page_token: str,
        page_size: int,
    ) -> tuple[list[LeaseInfo], str]:
        """One page of the namespace's tasks (ListLeases), of one state and owner when given.

        Through the client's stub: ``LeaseClient.list_leases`` has no owner
        filter; the request carries the client's metadata (the token) and
        its errors are the client's.

        Raises:
            Refusal: the call failed.
        """
        client = self.client(namespace, token)
        request = pb.ListLeasesRequest(
            namespace=namespace,
            state=f"TASK_STATE_{state}" if state else None,
            page_size=page_size,
            page_token=page_token,
            owner_id=owner,
        )
        try:
            response = await client.stub.ListLeases(
                request, timeout=self._call_timeout_s, metadata=client.call_metadata
            )
        except grpc.aio.AioRpcError as error:
            raise refusal_of(from_rpc_error(error), token) from error
        return [lease_info(lease) for lease in response.leases], response.next_page_token

    async def task(
        self, namespace: str, task_id: str, token: str | None
    ) -> tuple[LeaseInfo, Checkpoint | None]:
        """The task's lease and its checkpoint (two GetLease calls, at once).

        Raises:
            Refusal: a call failed (NOT_FOUND: a task never claimed).
        """
        client = self.client(namespace, token)
        with answered(token):
            lease, checkpoint = await asyncio.gather(
                client.get_lease(task_id), client.get_checkpoint(task_id)
            )
        return lease, checkpoint

    async def lease(self, namespace: str, task_id: str, token: str | None) -> LeaseInfo:
        """The task's lease (GetLease).

        Raises:
            Refusal: the call failed.
        """
        with answered(token):
            return await self.client(namespace, token).get_lease(task_id)

    async def history(
        self, namespace: str, task_id: str, token: str | None, page_token: str, page_size: int
    ) -> tuple[list[HistoryEntry], str]:
        """One page of the task's history, oldest first (ListTaskHistory).

        Raises:
            Refusal: the call failed.
        """
        with answered(token):
            return await self.client(namespace, token).list_task_history(
                task_id, page_size, page_token
            )

    async def chart_entries(
        self, namespace: str, task_id: str, token: str | None
    ) -> tuple[list[HistoryEntry], bool]:
        """The task's history for the chart: at most ``CHART_PAGES`` pages; True when cut short.

        Raises:
            Refusal: a call failed.
        """
        entries: list[HistoryEntry] = []
        page_token = ""
        for _ in range(CHART_PAGES):
            page, page_token = await self.history(
                namespace, task_id, token, page_token, CHART_PAGE_SIZE
            )
            entries += page
            if not page_token:
                return entries, False
        return entries, True

    async def effects(
        self, namespace: str, task_id: str, token: str | None, page_token: str, page_size: int
    ) -> tuple[list[EffectRecord], str]:
        """One page of the task's effects (ListEffects).

        Raises:
            Refusal: the call failed.
        """
        with answered(token):
            return await self.client(namespace, token).list_effects(
                task_id, page_size=page_size, page_token=page_token
            )

    async def revoke(
        self, namespace: str, task_id: str, token: str | None, reason: str, fence: int
    ) -> tuple[bool, LeaseInfo]:
        """Revoke the task's lease of ``fence`` (0: the current one).

        Raises:
            Refusal: the call failed.
        """
        with answered(token):
            return await self.client(namespace, token).revoke(task_id, reason, fence)

    async def cancel(
        self, namespace: str, task_id: str, token: str | None, reason: str
    ) -> LeaseInfo:
        """Cancel the task.

        Raises:
            Refusal: the call failed.
        """
        with answered(token):
            return await self.client(namespace, token).cancel(task_id, reason)

    async def retry(
        self, namespace: str, task_id: str, token: str | None, reason: str
    ) -> LeaseInfo:
        """Put the quarantined task back.

        Raises:
            Refusal: the call failed.
        """
        with answered(token):
            return await self.client(namespace, token).retry(task_id, reason)
