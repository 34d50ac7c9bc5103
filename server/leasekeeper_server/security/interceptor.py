"""The gRPC interceptor that decides who may call what, before any handler runs.

Every ``leasekeeper.v1.LeaseService`` call carries ``authorization: Bearer
<token>`` in its metadata when authentication is on (the health and
reflection services stay open: Kubernetes probes carry no token). The
interceptor decides before any handler runs and before anything is read:

1. no token, or one that no token source knows (or revoked, or expired)
   -> UNAUTHENTICATED;
2. the token's role does not include the method (``ROLE_METHODS``)
   -> PERMISSION_DENIED;
3. the request's ``namespace`` is not covered by the token's patterns
   -> PERMISSION_DENIED. Unary requests (and Watch's) are checked here; the
   Heartbeat stream names its namespace in its first message, so its handler
   calls :func:`leasekeeper_server.security.caller.authorize_namespace` right
   after validating that message (a Session stream, after validating each
   lease it adds: an add outside the token's namespaces is refused alone). A
   method whose request names no namespace (``UNSCOPED_METHODS``:
   ListNamespaces) is not refused here: its handler leaves out of the answer
   what the token does not cover
   (:func:`leasekeeper_server.security.caller.covers`).

Logs name the token's name or public id, never the token.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from leasekeeper_server.core.errors import PermissionDenied
from leasekeeper_server.rpc.handling import MalformedRequest, abort_with
from leasekeeper_server.rpc.service import SERVICE_NAME
from leasekeeper_server.security.access_log import log
from leasekeeper_server.security.authenticator import Authenticator
from leasekeeper_server.security.caller import bind
from leasekeeper_server.security.roles import UNSCOPED_METHODS, Principal


def bearer_token(metadata: Any) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry; None if absent."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


# grpc ships no type stubs, so its ServerInterceptor is Any.
class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates and authorizes every LeaseService call before its handler runs.

    Args:
        authenticator: Where tokens are looked up.
    """

    def __init__(self, authenticator: Authenticator) -> None:
        self._auth = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Refuses the call (UNAUTHENTICATED, PERMISSION_DENIED) or hands it on, checked."""
        full_method = handler_call_details.method
        service, _, method = full_method.lstrip("/").partition("/")
        if service != SERVICE_NAME:
            return await continuation(handler_call_details)
        token = bearer_token(handler_call_details.invocation_metadata)
        try:
            principal = await self._auth.authenticate(token)
            if not principal.may_call(method):
                raise PermissionDenied(
                    f"token {principal.name!r} (role {principal.role}) may not call {method}"
                )
        except Exception as exc:  # every refusal leaves as a status, a bug as INTERNAL
            log.info("refused %s: %s", method, exc)
            handler = await continuation(handler_call_details)
            return _refusing(handler, exc) if handler is not None else handler
        log.debug("%s called by %s (%s token)", method, principal.name, principal.source)
        # grpc.aio runs the interceptor and the handler in one task: the
        # handler (and what it spawns) sees this principal.
        bind(principal, self._auth, token or "")
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or method in UNSCOPED_METHODS:
            return handler
        return _checking_namespace(handler, principal, method)


def _namespace_error(principal: Principal, request: Any, method: str) -> PermissionDenied | None:
    if isinstance(request, MalformedRequest):
        return None  # the handler answers INVALID_ARGUMENT; nothing is read
    namespace = getattr(request, "namespace", None)
    if isinstance(namespace, str) and principal.covers(namespace):
        return None
    return PermissionDenied(
        f"token {principal.name!r} does not cover namespace {namespace!r} ({method})"
    )


def _checking_namespace(
    handler: grpc.RpcMethodHandler, principal: Principal, method: str
) -> grpc.RpcMethodHandler:
    """The handler, refusing a request whose namespace the principal does not cover."""
    if handler.unary_unary is not None:
        behavior = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            error = _namespace_error(principal, request, method)
            if error is not None:
                log.info("refused %s by %s: %s", method, principal.name, error)
                await abort_with(context, error)
            return await behavior(request, context)

        return handler._replace(unary_unary=unary_unary)
    stream_behavior = handler.unary_stream
    assert stream_behavior is not None

    async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
        error = _namespace_error(principal, request, method)
        if error is not None:
            log.info("refused %s by %s: %s", method, principal.name, error)
            await abort_with(context, error)

    if inspect.isasyncgenfunction(stream_behavior):

        async def unary_stream_gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(request, context)
            async for response in stream_behavior(request, context):
                yield response

        return handler._replace(unary_stream=unary_stream_gen)

    async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(request, context)
        return await stream_behavior(request, context)

    return handler._replace(unary_stream=unary_stream)


def _refusing(handler: grpc.RpcMethodHandler, error: Exception) -> grpc.RpcMethodHandler:
    """A handler of the same shape that ends the call with ``error``'s status."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await abort_with(context, error)

    if handler.request_streaming and handler.response_streaming:
        return handler._replace(stream_stream=refuse)
    if handler.request_streaming:
        return handler._replace(stream_unary=refuse)
    if handler.response_streaming:
        return handler._replace(unary_stream=refuse)
    return handler._replace(unary_unary=refuse)
