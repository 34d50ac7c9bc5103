"""The effect side: carry a fence to every side-effect boundary and check it there.

A worker passes ``(namespace, task_id, fence)`` with every call that has an
effect, as gRPC metadata (:meth:`HeldLease.metadata`). The effect service reads
them back (:func:`fence_from_metadata`) and checks the fence immediately before
the effect (:class:`FenceChecker`, or :class:`FenceInterceptor` for whole
methods).

A check made *before* the effect leaves a window: the lease can be lost between
the check and the effect. For no window at all, reserve the effect atomically
with the fence in the effect's own store (keyed by an idempotency key, refusing
any fence lower than the highest accepted for the task).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from ._ports import FenceValidator
from ._types import FenceCheck
from .errors import (
    DOMAIN,
    FENCE_MISSING,
    InvalidArgument,
    LeaseError,
    MissingFence,
    StaleFence,
)

METADATA_NAMESPACE = "leasekeeper-namespace"
METADATA_TASK_ID = "leasekeeper-task-id"
METADATA_FENCE = "leasekeeper-fence"

FENCE_CHECK_FAILED = "FENCE_CHECK_FAILED"
"""Reason of the UNAVAILABLE status FenceInterceptor sends when it cannot check a fence."""

Metadata = Mapping[str, Any] | Iterable[tuple[str, Any]]
"""gRPC metadata: ``context.invocation_metadata()``, a tuple of pairs or a dict."""


@dataclasses.dataclass(frozen=True, slots=True)
class FenceRef:
    """The lease an effect is made under.

    Attributes:
        namespace: The task's namespace.
        task_id: The task.
        fence: The fence (>= 1).
    """

    namespace: str
    task_id: str
    fence: int

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The three gRPC metadata pairs that carry this reference."""
        return (
            (METADATA_NAMESPACE, self.namespace),
            (METADATA_TASK_ID, self.task_id),
            (METADATA_FENCE, str(self.fence)),
        )


def _pairs(metadata: Metadata | None) -> Iterable[tuple[str, Any]]:
    if metadata is None:
        return ()
    if isinstance(metadata, Mapping):
        return metadata.items()
    return ((item[0], item[1]) for item in metadata)


def fence_from_metadata(metadata: Metadata | None) -> FenceRef:
    """Read ``(namespace, task_id, fence)`` from gRPC metadata.

    Args:
        metadata: ``context.invocation_metadata()``, pairs, or a dict.

    Returns:
        The reference.

    Raises:
        MissingFence: A key is absent, empty, repeated with different values, or
            the fence is not an integer >= 1 (the error names the key).

    """
    wanted = {METADATA_NAMESPACE: None, METADATA_TASK_ID: None, METADATA_FENCE: None}
    values: dict[str, str | None] = dict(wanted)
    for key, raw in _pairs(metadata):
        key = key.lower()
        if key not in wanted:
            continue
        value = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        if values[key] is not None and values[key] != value:
            raise MissingFence(key, "repeated with different values")
        values[key] = value
    for name, text in values.items():
        if not text:
            raise MissingFence(name)
    fence_text = str(values[METADATA_FENCE]).strip()
    if not fence_text.isascii() or not fence_text.isdigit() or int(fence_text) < 1:
        raise MissingFence(METADATA_FENCE, f"not an integer >= 1: {fence_text[:32]!r}")
    return FenceRef(str(values[METADATA_NAMESPACE]), str(values[METADATA_TASK_ID]), int(fence_text))


class FenceChecker:
    """Checks fences with ValidateFence, right before an effect.

    The checks go through ``client.validate_fence``: with a ``LeaseClient``,
    on its one ValidateFences stream (concurrent checks share it; the answers
    are decided on the database clock after each check arrives, as a unary
    call's), or one unary call each with ``validate_stream=False``.

    Args:
        client: A client of the lease service (its namespace is not used: each
            check names its own).
    """

    def __init__(self, client: FenceValidator) -> None:
        self._client = client

    async def check(self, namespace: str, task_id: str, fence: int) -> FenceCheck:
        """Check that ``fence`` may act now (database clock). Changes no lease.

        Args:
            namespace: The task's namespace.
            task_id: The task.
            fence: The fence presented by the caller; >= 1.

        Returns:
            The (valid) answer, with the lease's remaining ttl in seconds.

        Raises:
            StaleFence: The fence is not current and live; ``reason`` says why.
            InvalidArgument: INVALID_ARGUMENT from the server.
            LeaseUnavailable: UNAVAILABLE: the fence could not be checked; treat
                the effect as refused (fail closed) and let the caller retry.

        """
        answer = await self._client.validate_fence(task_id, fence, namespace=namespace)
        if not answer.valid:
            raise StaleFence(
                answer.reason or "FENCE_UNKNOWN", answer.current_fence, namespace, task_id, fence
            )
        return answer

    async def check_ref(self, ref: FenceRef) -> FenceCheck:
        """:meth:`check` for a :class:`FenceRef` (same errors)."""
        return await self.check(ref.namespace, ref.task_id, ref.fence)

    async def check_metadata(self, metadata: Metadata | None) -> FenceCheck:
        """Read the fence from gRPC metadata and :meth:`check` it.

        Raises:
            MissingFence: Fence metadata absent or malformed.
            StaleFence: As :meth:`check`.
            LeaseUnavailable: As :meth:`check`.

        """
        return await self.check_ref(fence_from_metadata(metadata))


def _rejection(
    code: grpc.StatusCode, message: str, reason: str, metadata: Mapping[str, str]
) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=dict(metadata))
    packed = any_pb2.Any()
    packed.Pack(info)
    proto = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=[packed])
    return rpc_status.to_status(proto)


def _rejecting_handler(
    handler: grpc.RpcMethodHandler, status: grpc.Status
) -> grpc.RpcMethodHandler:
    async def reject(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort_with_status(status)

    async def reject_stream(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort_with_status(status)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(reject, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(reject_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(reject, **kwargs)
    return grpc.stream_stream_rpc_method_handler(reject_stream, **kwargs)


# grpc ships no type stubs: its classes are Any to mypy.
class FenceInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Rejects calls whose fence may not act, before their handler runs.

    For each protected method the interceptor reads ``leasekeeper-namespace``,
    ``leasekeeper-task-id`` and ``leasekeeper-fence`` from the invocation
    metadata and checks the fence with ValidateFence, through the checker's
    client (a ``LeaseClient`` sends every check on its one ValidateFences
    stream). Rejections (the handler never runs):

    * ABORTED, ErrorInfo reason ``FENCE_MISSING`` (metadata ``key``): a key is
      absent or malformed;
    * ABORTED, ErrorInfo reason the loss reason (``LEASE_SUPERSEDED``, ...),
      metadata ``current_fence``, ``fence``, ``namespace``, ``task_id``: stale fence;
    * INVALID_ARGUMENT, reason ``INVALID_ARGUMENT`` (metadata ``field``): the
      lease service refused the namespace or task id;
    * UNAVAILABLE, reason ``FENCE_CHECK_FAILED`` (metadata ``cause``): the lease
      service could not answer, or the stream the check was sent on broke
      before its answer came. The interceptor fails closed.

    This is the check-just-before pattern: the lease can still be lost between
    this check and the effect. A handler that wants no window re-checks the
    fence atomically in its own store when it makes the effect.

    Args:
        checker: The fence checker.
        methods: Full method names to protect (``"/demo.Gateway/Send"``); None
            protects every method of the server.
    """

    def __init__(self, checker: FenceChecker, methods: Collection[str] | None = None) -> None:
        self._checker = checker
        self._methods = None if methods is None else frozenset(methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Check the fence of a protected call; reject it or continue."""
        method: str = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or (self._methods is not None and method not in self._methods):
            return handler
        status = await self._verdict(handler_call_details.invocation_metadata)
        return handler if status is None else _rejecting_handler(handler, status)

    async def _verdict(self, metadata: Metadata | None) -> grpc.Status | None:
        try:
            await self._checker.check_metadata(metadata)
        except MissingFence as error:
            return _rejection(grpc.StatusCode.ABORTED, str(error), FENCE_MISSING, error.metadata)
        except StaleFence as error:
            return _rejection(
                grpc.StatusCode.ABORTED, str(error), error.reason or "FENCE_UNKNOWN", error.metadata
            )
        except InvalidArgument as error:
            field = error.field or ""
            return _rejection(
                grpc.StatusCode.INVALID_ARGUMENT, str(error), "INVALID_ARGUMENT", {"field": field}
            )
        except LeaseError as error:
            cause = error.reason or (error.code.name if error.code else "UNKNOWN")
            return _rejection(
                grpc.StatusCode.UNAVAILABLE,
                f"fence could not be checked: {cause}",
                FENCE_CHECK_FAILED,
                {"cause": cause},
            )
        return None
