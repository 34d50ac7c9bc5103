"""RPC plumbing shared by every handler: parsing, and errors as rich statuses.

Domain errors become rich gRPC statuses through ``status.py``; anything else
is a bug, logged with an error id and answered INTERNAL with that id.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from . import status
from .errors import InvalidArgument, LeaseServiceError

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class MalformedRequest:
    """Stands in for a request body that did not parse as its message."""

    def __init__(self, error: str) -> None:
        self.error = error


def parse_or_malformed(message_type: Any) -> Callable[[bytes], Any]:
    """A request deserializer that yields MalformedRequest instead of raising.

    grpcio answers a deserializer's exception with a bare INTERNAL; the
    contract wants INVALID_ARGUMENT naming the request.
    """

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception as exc:  # DecodeError, or invalid UTF-8 in a string field
            return MalformedRequest(str(exc) or type(exc).__name__)

    return parse


def check_parsed(request: object) -> None:
    """Raises InvalidArgument for a body that was not a valid message."""
    if isinstance(request, MalformedRequest):
        raise InvalidArgument("request", f"is not a valid message: {request.error}")


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """Ends the call with the status for ``error`` (INTERNAL with an error id for a bug)."""
    if isinstance(error, LeaseServiceError):
        st = status.status_of(error)
    else:
        error_id = uuid.uuid4().hex[:12]
        log.error("internal error %s", error_id, exc_info=error)
        st = status.internal_status(error_id)
    await context.abort(st.code, st.details, st.trailing_metadata)


def unary(
    handler: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    """Wraps a unary handler: malformed bodies and errors become rich statuses."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            check_parsed(request)
            return await handler(self, request, context)
        except Exception as exc:  # every failure leaves as a status
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await abort_with(context, exc)
            raise AssertionError("unreachable") from exc  # abort raises

    return wrapper
