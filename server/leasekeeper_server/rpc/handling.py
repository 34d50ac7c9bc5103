"""RPC plumbing shared by every handler: parsing, and errors as rich statuses.

Domain errors become rich gRPC statuses through ``status.py``; anything else
is a bug, logged with an error id and answered INTERNAL with that id.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from leasekeeper_server.core.errors import InvalidArgument, LeaseServiceError
from leasekeeper_server.rpc import status

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class MalformedRequest:
    """Stands in for a request body that did not parse as its message.

    ``field`` names what is wrong: ``request`` for a body that is not a
    message at all, or the dotted path of a declared field that arrived with
    the wrong wire type (``ttl``, ``ttl.seconds``); ``error`` says what.
    """

    def __init__(self, error: str, field: str = "request") -> None:
        self.error = error
        self.field = field


def parse_or_malformed(message_type: Any) -> Callable[[bytes], Any]:
    """A request deserializer that yields MalformedRequest instead of raising.

    grpcio answers a deserializer's exception with a bare INTERNAL; the
    contract wants INVALID_ARGUMENT naming the request, or the field that was
    sent with the wrong wire type (protobuf keeps such a field as an unknown
    field and leaves the declared one unset: a ttl sent as a varint would
    silently become the default ttl). Unknown field numbers the message does
    not declare are accepted (a newer client may send them) and dropped.
    """

    def parse(data: bytes) -> Any:
        try:
            message = message_type.FromString(data)
        except Exception as exc:  # DecodeError, or invalid UTF-8 in a string field
            return MalformedRequest(f"is not a valid message: {str(exc) or type(exc).__name__}")
        # Cheap test first: dropping unknown fields (at every depth, in C)
        # shrinks the message only if it had some; the walk is for those rare
        # requests, on a fresh parse that still holds them.
        size = message.ByteSize()
        message.DiscardUnknownFields()
        if message.ByteSize() != size:
            mistyped = wire_type_mismatch(message_type.FromString(data))
            if mistyped is not None:
                path, error = mistyped
                return MalformedRequest(error, path)
        return message

    return parse


_WIRE_TYPES = {
    0: "varint",
    1: "64-bit",
    2: "length-delimited",
    3: "group start",
    4: "group end",
    5: "32-bit",
}
_FIELD_TYPES = {
    number: name.removeprefix("TYPE_").lower()
    for name, number in vars(FieldDescriptor).items()
    if name.startswith("TYPE_")
}


def wire_type_mismatch(message: Message) -> tuple[str, str] | None:
    """The first unknown field whose number ``message`` declares, at any depth.

    Singular, repeated and map sub-messages are searched.

    Returns:
        The field's dotted path (``ttl``, ``ttl.seconds``) and what is wrong
        with it, or None when every unknown field has an undeclared number.
    """
    fields = message.DESCRIPTOR.fields_by_number
    unknowns = UnknownFieldSet(message)
    for unknown in (unknowns[i] for i in range(len(unknowns))):  # the stubs know no __iter__
        declared = fields.get(unknown.field_number)
        if declared is not None:
            sent = _WIRE_TYPES.get(unknown.wire_type, "unknown")
            kind = (
                declared.message_type.full_name
                if declared.message_type is not None
                else _FIELD_TYPES.get(declared.type, "?")
            )
            return declared.name, (
                f"was sent with wire type {unknown.wire_type} ({sent}), "
                f"which a field of type {kind} cannot have"
            )
    for field, value in message.ListFields():
        for item in _sub_messages(field, value):
            inner = wire_type_mismatch(item)
            if inner is not None:
                return f"{field.name}.{inner[0]}", inner[1]
    return None


def _sub_messages(field: FieldDescriptor, value: Any) -> Iterable[Message]:
    """The messages a set field holds: itself, its items, or its map's values."""
    if field.message_type is None:
        return ()
    if field.message_type.GetOptions().map_entry:
        holds_messages = field.message_type.fields_by_name["value"].message_type is not None
        return value.values() if holds_messages else ()
    return value if field.is_repeated else (value,)


def check_parsed(request: object) -> None:
    """Raises InvalidArgument for a body that was not a valid message.

    Raises:
        InvalidArgument: (INVALID_ARGUMENT) naming ``request``, or the field
            that arrived with the wrong wire type.
    """
    if isinstance(request, MalformedRequest):
        raise InvalidArgument(request.field, request.error)


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """Ends the call with the status for ``error`` (INTERNAL with an error id for a bug).

    The one place a call is aborted: the handlers reach it through
    :func:`unary` and :func:`streaming`, the auth interceptor directly. Called
    while handling ``error``, the AbortError it raises keeps ``error`` as its
    ``__context__``, where ``observe.py`` finds the domain error.

    Raises:
        grpc.aio.AbortError: always (grpc's way of ending the call).
    """
    st = status_for(error)
    await context.abort(st.code, st.details, st.trailing_metadata)


def status_for(error: Exception) -> grpc.Status:
    """The status for ``error``: its rich status, or INTERNAL with an error id for a bug (logged).

    :func:`abort_with` ends a call with it; a ValidateFences stream answers a
    check with it and goes on.
    """
    if isinstance(error, LeaseServiceError):
        return status.status_of(error)
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s", error_id, exc_info=error)
    return status.internal_status(error_id)


# The trailer in which grpc carries a call's google.rpc.Status.
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


def error_bytes(error: Exception) -> bytes:
    """The serialized ``google.rpc.Status`` a unary call ending with ``error`` would carry.

    A stream that answers one item with an error and goes on (a ValidateFences check, a
    Session add) sends these bytes in that item's answer.
    """
    for key, value in status_for(error).trailing_metadata or ():
        if key == _STATUS_DETAILS_KEY:
            return bytes(value)
    raise AssertionError("every status of status.py carries its google.rpc.Status")


def _answering(
    handler: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    """``handler``, with a malformed request or any error ending the call as a rich status."""

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


def unary(
    handler: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    """Wraps a unary handler: malformed bodies and errors become rich statuses."""
    return _answering(handler)


def streaming(
    handler: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[None]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[None]]:
    """Wraps a streaming handler that writes its responses with ``context.write``.

    Its request is the message (Watch) or the request iterator (Heartbeat,
    whose messages the handler checks with :func:`check_parsed` as it reads
    them). A malformed request and every error end the stream with a rich
    status; the responses already written stay sent.
    """
    return _answering(handler)
