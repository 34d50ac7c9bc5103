"""The client's connection: the channel, the stub, one unary call, the client's background work.

:class:`Connection` is the base of :class:`~leasekeeper.LeaseClient` and of its groups of
calls (:mod:`._reads`, :mod:`._operator`, :mod:`._effect_calls`): what every call needs, and
nothing of any RPC. ``LeaseClient.__init__`` sets every attribute declared here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Self, TypeVar

import grpc

from . import lease as _lease
from ._owner import OwnerIdentity
from ._session import SessionKeeper
from ._trust import Clock
from ._validate_stream import FenceStream
from .channel import CHANNEL_OPTIONS
from .errors import from_rpc_error
from .v1 import lease_service_pb2_grpc as pb_grpc

_Response = TypeVar("_Response")
_Item = TypeVar("_Item")


async def every_page(
    fetch: Callable[[str], Awaitable[tuple[list[_Item], str]]],
) -> AsyncIterator[_Item]:
    """Every item of a paged listing: ``fetch(page_token)`` until the token comes back empty."""
    token = ""
    while True:
        items, token = await fetch(token)
        for item in items:
            yield item
        if not token:
            return


class Connection:
    """The connection every call of a client goes through; see :class:`~leasekeeper.LeaseClient`."""

    _target: str
    _namespace: str
    _owner: OwnerIdentity
    _channel: grpc.aio.Channel | None
    _owns_channel: bool
    _stub: pb_grpc.LeaseServiceStub | None
    _call_timeout_s: float | None
    _clock: Clock
    _credentials: grpc.ChannelCredentials | None
    _metadata: tuple[tuple[str, str], ...] | None
    _background: set[asyncio.Task[None]]
    _closing: bool
    _closed: bool
    _sessions: SessionKeeper | None
    _fences: FenceStream | None

    @property
    def target(self) -> str:
        """The server address given at construction."""
        return self._target

    @property
    def namespace(self) -> str:
        """The namespace of every task named by this client."""
        return self._namespace

    @property
    def owner_id(self) -> str:
        """This client's owner id (changes in a forked child when generated)."""
        return self._owner.value

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The metadata every call of this client carries (the bearer token), or None."""
        return self._metadata

    @property
    def clock(self) -> Clock:
        """The monotonic clock used for send times and trust deadlines."""
        return self._clock

    @property
    def stub(self) -> pb_grpc.LeaseServiceStub:
        """The generated stub (opens the channel on first use).

        Raises:
            RuntimeError: The client is closed.

        """
        if self._closed:
            raise RuntimeError("LeaseClient is closed")
        if self._stub is None:
            if self._channel is None:
                if self._credentials is not None:
                    self._channel = grpc.aio.secure_channel(
                        self._target, self._credentials, options=CHANNEL_OPTIONS
                    )
                else:
                    self._channel = grpc.aio.insecure_channel(self._target, options=CHANNEL_OPTIONS)
            # The generated stub module has no annotations (grpcio-tools writes none).
            self._stub = pb_grpc.LeaseServiceStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    async def close(self) -> None:
        """Close the channel if the client opened it; later calls fail. Idempotent.

        First lets the client's background work end: the best-effort release
        of a lost lease (see :meth:`hold`), waited for at most
        ``RELEASE_AFTER_LOSS_TIMEOUT_S`` (2 s), then cancelled; a lease it had no
        time to release ends by its ttl.
        """
        self._closing = True  # no new background work; what runs may still call
        background = list(self._background)
        try:
            if background:
                await asyncio.wait(background, timeout=_lease.RELEASE_AFTER_LOSS_TIMEOUT_S)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self._closed = True
        if self._fences is not None:
            await self._fences.close()
        if self._sessions is not None:
            await self._sessions.close()
        channel, self._stub = self._channel, None
        if channel is not None and self._owns_channel:
            self._channel = None
            await channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _call(
        self,
        rpc: Callable[..., Awaitable[_Response]],
        request: Any,
        *,
        task_id: str | None = None,
        fence: int | None = None,
        timeout_s: float | None = None,
        server_wait_s: float = 0.0,
    ) -> _Response:
        """One unary call within the call timeout, or ``timeout_s`` seconds if that is shorter.

        ``server_wait_s``: seconds the server may wait before it decides (a Claim's
        wait); the call timeout then counts from the end of that wait.
        """
        if timeout_s is None or (
            self._call_timeout_s is not None and self._call_timeout_s < timeout_s
        ):
            timeout_s = self._call_timeout_s
        if timeout_s is not None:
            timeout_s += server_wait_s
        try:
            return await rpc(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error, task_id=task_id, fence=fence) from error

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` as a task the client owns: referenced until done, cancelled by close().

        ``work`` handles its own errors (a task's exception would be logged as
        never retrieved). On a closing or closed client it is not started.
        """
        if self._closing:
            work.close()
            return
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
