"""One ValidateFences stream per client, shared by its ``validate_fence`` calls.

An effect service validates a fence before every effect (``FenceChecker``,
``FenceInterceptor``). On a stream each check costs the server a fraction of
a unary ValidateFence, and every answer is still decided on the database
clock after the server received the check (the proto's ValidateFences).

:class:`FenceStream` opens the stream on the first check and keeps it open.
Each check gets an id; checks made in one turn of the event loop (concurrent
calls) go out in one message, and more gather while a message is being
written (group commit). A reader task hands each answer to the call waiting
for its id: its response, or its error translated as a unary call's would be
(``errors.from_rpc_error``).

When the stream ends (the server stopped, the connection broke, the token
was revoked), every check still waiting fails: ``LeaseUnavailable``
(UNAVAILABLE, safe to retry), or ``AccessDenied`` for a token refused, never
an answer of another check. The next check opens a new stream. A server
without ValidateFences (UNIMPLEMENTED: an older version) is asked with the
unary ValidateFence from then on.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.rpc import status_pb2

from .errors import LeaseError, LeaseUnavailable, from_rpc_error
from .v1 import lease_service_pb2 as pb

# The most checks in one message (the server's limit, the proto's ValidateFencesRequest).
MAX_CHECKS_PER_MESSAGE = 1000
_STATUS_DETAILS_KEY = "grpc-status-details-bin"

OpenStream = Callable[[], Any]
"""Opens a ValidateFences call (``stub.ValidateFences(metadata=...)``)."""
Unary = Callable[[pb.ValidateFenceRequest], Awaitable[pb.ValidateFenceResponse]]
"""The unary ValidateFence, for a server that has no ValidateFences; raises LeaseError."""


class _StatusError(grpc.RpcError):  # type: ignore[misc]  # grpc ships no type stubs
    """A status decoded from bytes, shaped as the failed call ``from_rpc_error`` reads."""

    def __init__(self, code: grpc.StatusCode, details: str, status: bytes | None) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self._trailing = ((_STATUS_DETAILS_KEY, status),) if status is not None else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailing


def _code(number: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code
    return grpc.StatusCode.UNKNOWN


def check_error(status: bytes, task_id: str, fence: int) -> LeaseError:
    """The client error for a check answered with ``status`` (a serialized google.rpc.Status)."""
    try:
        decoded = status_pb2.Status.FromString(status)
    except Exception:  # undecodable: an error all the same, never an answer
        return from_rpc_error(_StatusError(grpc.StatusCode.UNKNOWN, "undecodable status", None))
    error = _StatusError(_code(decoded.code), decoded.message, status)
    return from_rpc_error(error, task_id=task_id, fence=fence)


class _Unimplemented(Exception):
    """The server has no ValidateFences: ask with the unary call."""


def _stream_ended(error: BaseException | None) -> Exception:
    """What the checks still waiting when a stream ended fail with."""
    if isinstance(error, grpc.aio.AioRpcError):
        code = error.code()
        if code is grpc.StatusCode.UNIMPLEMENTED:
            return _Unimplemented()
        translated = from_rpc_error(error)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return translated  # AccessDenied: the token, not the network
        cause = f"{code.name}: {error.details()}"
        reason = translated.reason
    elif error is None:
        cause, reason = "the server ended it", None
    else:
        cause, reason = f"{type(error).__name__}: {error}", None
    return LeaseUnavailable(
        f"the ValidateFences stream ended ({cause}) before this check was answered: "
        "it was not validated",
        code=grpc.StatusCode.UNAVAILABLE,
        reason=reason,
    )


class _Stream:
    """One open ValidateFences call: its checks waiting for answers, its reader and writer."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.ended = False
        self._waiting: dict[int, asyncio.Future[pb.ValidateFenceResponse]] = {}
        self._outbox: list[pb.ValidateFencesRequest.Check] = []
        self._writer: asyncio.Task[None] | None = None
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def send(self, check_id: int, request: pb.ValidateFenceRequest) -> asyncio.Future[Any]:
        """Queues a check; the future gets its response, or fails with the check's error."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[check_id] = future
        self._outbox.append(pb.ValidateFencesRequest.Check(id=check_id, request=request))
        if self._writer is None:
            # A task's first step runs on the next turn: the checks of this turn join it.
            self._writer = asyncio.get_running_loop().create_task(self._write())
        return future

    def forget(self, check_id: int) -> None:
        """Drops a check whose caller stopped waiting (timed out or cancelled)."""
        self._waiting.pop(check_id, None)

    async def _write(self) -> None:
        try:
            while self._outbox and not self.ended:
                checks = self._outbox[:MAX_CHECKS_PER_MESSAGE]
                del self._outbox[:MAX_CHECKS_PER_MESSAGE]
                await self._call.write(pb.ValidateFencesRequest(checks=checks))
        except Exception as exc:  # the call ended: the reader says how
            self._end(exc)
        finally:
            self._writer = None

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    break
                for answer in message.answers:
                    future = self._waiting.pop(answer.id, None)
                    if future is None or future.done():
                        continue  # its caller stopped waiting
                    if answer.HasField("response"):
                        future.set_result(answer.response)
                    else:
                        future.set_exception(_AnswerError(answer.error))
        except asyncio.CancelledError:
            error = LeaseError("the client closed its ValidateFences stream")
            raise
        except Exception as exc:  # AioRpcError: the stream ended with this status
            error = exc
        finally:
            self._end(error)

    def _end(self, error: BaseException | None) -> None:
        """Marks the stream ended; every check still waiting fails (never answered by another)."""
        if self.ended:
            return
        self.ended = True
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(_stream_ended(error))  # one error per caller
        self._outbox.clear()
        self._call.cancel()

    async def close(self) -> None:
        """Ends the call; checks still waiting fail."""
        self._end(LeaseError("the client closed its ValidateFences stream"))
        tasks = [task for task in (self._reader, self._writer) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _AnswerError(Exception):
    """A check answered with an error status (serialized); the caller translates it."""

    def __init__(self, status: bytes) -> None:
        super().__init__("check answered with an error")
        self.status = status


class FenceStream:
    """ValidateFence checks over one ValidateFences stream, opened on first use.

    Args:
        open_stream: Opens the call, with the client's metadata (its token).
        unary: The unary ValidateFence, used when the server has no
            ValidateFences (UNIMPLEMENTED).
        timeout_s: How long a check waits for its answer, seconds; None: no
            limit (the stream itself has no deadline).
    """

    def __init__(self, open_stream: OpenStream, unary: Unary, timeout_s: float | None) -> None:
        self._open_stream = open_stream
        self._unary = unary
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._stream: _Stream | None = None
        self._unsupported = False

    async def validate(
        self, request: pb.ValidateFenceRequest, *, task_id: str, fence: int
    ) -> pb.ValidateFenceResponse:
        """The answer to one check (a ValidateFenceResponse).

        Raises:
            InvalidArgument, AccessDenied, LeaseUnavailable, LeaseError: the
                check's own error, as the unary call would raise it.
            LeaseUnavailable: the stream ended before the answer came (not
                validated; safe to retry: the next check opens a new stream).
            LeaseError: DEADLINE_EXCEEDED, no answer within ``timeout_s``.
        """
        if self._unsupported:
            return await self._unary(request)
        stream = self._stream
        if stream is None or stream.ended:
            stream = self._stream = _Stream(self._open_stream())
        check_id = next(self._ids)
        future = stream.send(check_id, request)
        try:
            async with asyncio.timeout(self._timeout_s):
                return await future  # type: ignore[no-any-return]
        except TimeoutError:
            raise LeaseError(
                f"no answer to the fence check within {self._timeout_s} s",
                code=grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from None
        except _AnswerError as answered:
            raise check_error(answered.status, task_id, fence) from None
        except _Unimplemented:
            self._unsupported = True  # an older server: the unary call from now on
            return await self._unary(request)
        finally:
            stream.forget(check_id)

    async def close(self) -> None:
        """Closes the open stream, if any; checks still waiting fail LeaseUnavailable."""
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close()
