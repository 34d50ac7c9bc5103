"""Who may call what: bearer tokens, roles and namespaces.

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
   calls :func:`authorize_namespace` right after validating that message.

Tokens come from a token file (reloaded when it changes, checked at most once
a second) and from the database table ``leasekeeper_tokens``. Database
answers are cached by digest (found and not found, at most
``CACHE_TTL_S``), and the cache is flushed when the database announces a
change on channel ``leasekeeper_config`` (payload ``tokens``, through
``LeaseEvents.on_config``); while that channel is not listened to the cache
is bypassed, so a revoked token is refused within about a second of the
revoke committing. Logs name the token's
name or public id, never the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import ipaddress
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import asyncpg
import cachetools
import grpc

from leasekeeper.v1 import lease_service_pb2 as pb

from . import tokens
from .errors import DatabaseUnavailable, PermissionDenied, Unauthenticated
from .rpc import MalformedRequest, abort_with
from .settings import Settings

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LeaseService"].full_name
CACHE_TTL_S = 5.0
CACHE_MAX_ENTRIES = 10_000
FILE_CHECK_INTERVAL_S = 1.0
_NOT_CACHED = object()

# The proto's "Access:" table. admin may call every RPC, including any not listed.
ROLE_METHODS: dict[str, frozenset[str]] = {
    "worker": frozenset(
        {
            "Claim",
            "Renew",
            "Release",
            "Heartbeat",
            "GetLease",
            "Watch",
            "BeginEffect",
            "CompleteEffect",
            "ListEffects",
        }
    ),
    "effect": frozenset(
        {"ValidateFence", "GetLease", "BeginEffect", "CompleteEffect", "ListEffects"}
    ),
}

Source = Literal["file", "database"]


@dataclass(frozen=True)
class Principal:
    """The caller a token stands for.

    Attributes:
        name: The token's name (never the token), for logs.
        role: ``worker``, ``effect`` or ``admin``.
        namespaces: Namespace patterns: exact, ``*``, or a prefix ending in ``*``.
        source: Where the token was found: ``file`` or ``database``.
    """

    name: str
    role: str
    namespaces: tuple[str, ...]
    source: Source

    def may_call(self, method: str) -> bool:
        """Whether the role includes the LeaseService method (its short name, e.g. ``Claim``)."""
        return self.role == "admin" or method in ROLE_METHODS.get(self.role, frozenset())

    def covers(self, namespace: str) -> bool:
        """Whether a namespace pattern covers ``namespace`` (byte for byte)."""
        for pattern in self.namespaces:
            if pattern.endswith("*"):
                if namespace.startswith(pattern[:-1]):
                    return True
            elif namespace == pattern:
                return True
        return False


_PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "leasekeeper_principal", default=None
)


# The current call's authenticator and token, for calls that outlive a check:
# streams and waiting claims re-check their token while they run.
_CREDENTIALS: contextvars.ContextVar[tuple[Authenticator, str] | None] = contextvars.ContextVar(
    "leasekeeper_credentials", default=None
)

# How often a long call re-checks its token without a change notification (a
# token file rotated, a database token that expired): the cache's lifetime.
RECHECK_S = 5.0


async def until_credentials_lost(namespace: str) -> None:
    """Returns never while the current call's token stays valid for ``namespace``; else raises.

    Streams (Heartbeat, Watch) and waiting claims run it beside their work: a
    token revoked in the database ends them within about a second (the change
    notification wakes this at once), one that expired or left a token file
    within ``RECHECK_S``. With authentication off it simply waits forever.

    Raises:
        Unauthenticated: the token is no longer accepted (UNAUTHENTICATED).
        PermissionDenied: it no longer covers ``namespace`` (PERMISSION_DENIED).
    """
    credentials = _CREDENTIALS.get()
    if credentials is None:
        await asyncio.Event().wait()  # nothing to lose
        return
    authenticator, token = credentials
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(authenticator.changed().wait(), RECHECK_S)
        try:
            principal = await authenticator.authenticate(token)
        except DatabaseUnavailable:
            continue  # a database blip is no reason to end a call; ask again later
        if not principal.covers(namespace):
            raise PermissionDenied(
                f"token {principal.name!r} no longer covers namespace {namespace!r}"
            )


def guard_credentials(namespace: str) -> asyncio.Future[Any]:
    """A future that fails when the call's token stops being valid (see until_credentials_lost).

    With authentication off it is a bare future that never completes: no task
    per stream or waiting claim.
    """
    if _CREDENTIALS.get() is None:
        return asyncio.get_running_loop().create_future()
    return asyncio.ensure_future(until_credentials_lost(namespace))


def current_principal() -> Principal | None:
    """The caller of the RPC being handled; None when authentication is off."""
    return _PRINCIPAL.get()


def authorize_namespace(namespace: str) -> None:
    """Checks the current caller's token covers ``namespace``; allows all when auth is off.

    Call it in a stream handler right after validating the message that names
    the namespace (Heartbeat's first message).

    Raises:
        PermissionDenied: the token does not cover it (PERMISSION_DENIED).
    """
    principal = _PRINCIPAL.get()
    if principal is not None and not principal.covers(namespace):
        raise PermissionDenied(f"token {principal.name!r} does not cover namespace {namespace!r}")


def is_loopback(listen: str) -> bool:
    """Whether a ``host:port`` listen address is loopback only (127.0.0.0/8, ::1, localhost)."""
    host = listen.rpartition(":")[0] if ":" in listen else listen
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auth_enabled(settings: Settings) -> bool:
    """Whether calls need a token: ``auth`` on, or ``auto`` on a non-loopback listen address."""
    if settings.auth == "auto":
        return not is_loopback(settings.listen)
    return settings.auth == "on"


def log_startup(settings: Settings, tls: bool) -> None:
    """Logs how calls are authenticated, warning when the port is open to anyone."""
    loopback = is_loopback(settings.listen)
    if not auth_enabled(settings):
        if loopback:
            log.info("authentication off (%s is loopback only)", settings.listen)
        else:
            log.warning(
                "authentication is OFF on %s: anyone who can reach the port can take and "
                "revoke leases; set LEASEKEEPER_AUTH=on (or auto) and create tokens",
                settings.listen,
            )
        return
    if settings.tokens_file:
        log.info(
            "authentication on: tokens from %s and from the database (leasekeeper tokens)",
            settings.tokens_file,
        )
    else:
        log.info("authentication on: tokens from the database (leasekeeper tokens create)")
    if not tls and not loopback:
        log.warning(
            "authentication on without TLS on %s: tokens travel in clear text; "
            "set LEASEKEEPER_TLS_CERT_FILE and LEASEKEEPER_TLS_KEY_FILE",
            settings.listen,
        )


class TokenFile:
    """A token file, reloaded when its size, mtime or inode changes.

    Args:
        path: The file (see :mod:`leasekeeper_server.tokens`).

    Raises:
        ValueError: the file cannot be read or is malformed (at start only;
            a bad file at a reload keeps the previous tokens and logs an error).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp = self._stat()
        self._grants = tokens.load_token_file(path)
        self._checked = time.monotonic()
        log.info("token file %s: %d token(s)", path, len(self._grants))

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def grants(self) -> dict[bytes, tokens.TokenGrant]:
        """The current tokens by digest, reloading first if the file changed."""
        now = time.monotonic()
        if now - self._checked >= FILE_CHECK_INTERVAL_S:
            self._checked = now
            stamp = self._stat()
            if stamp != self._stamp:
                self._reload(stamp)
        return self._grants

    def _reload(self, stamp: tuple[int, int, int] | None) -> None:
        self._stamp = stamp
        try:
            self._grants = tokens.load_token_file(self.path)
        except ValueError as exc:
            log.error("%s; keeping the %d token(s) loaded before", exc, len(self._grants))
            return
        log.info("token file %s reloaded: %d token(s)", self.path, len(self._grants))


ConnectionSource = Callable[[], AbstractAsyncContextManager[asyncpg.Connection]]


class Authenticator:
    """Turns a presented token into a Principal, from the token file and the database.

    Args:
        connection: Opens a database connection for a lookup (e.g. ``Store.transaction``);
            driver errors must leave it as DatabaseUnavailable.
        token_file: The token file, if one is configured.
        listening: Set while changes on ``leasekeeper_config`` reach
            :meth:`on_config_change` (``LeaseEvents.connected``); database
            answers are cached only then. None: never cached.
    """

    def __init__(
        self,
        connection: ConnectionSource,
        token_file: TokenFile | None = None,
        listening: asyncio.Event | None = None,
    ) -> None:
        self._connection = connection
        self._file = token_file
        self._listening = listening
        self._cache: cachetools.TLRUCache[bytes, tokens.TokenGrant | None] = cachetools.TLRUCache(
            CACHE_MAX_ENTRIES, ttu=_cache_until, timer=time.monotonic
        )
        self._generation = 0
        self._changed = asyncio.Event()

    def changed(self) -> asyncio.Event:
        """An event set at the next change of database tokens (a fresh one after each)."""
        return self._changed

    def on_config_change(self, payload: str) -> None:
        """Forgets cached database answers on ``tokens`` or ``*`` (anything may have changed).

        Also wakes the calls that re-check their token while they run
        (:func:`until_credentials_lost`).
        """
        if payload in ("tokens", "*"):
            self._generation += 1
            self._cache.clear()
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    def _caching(self) -> bool:
        return self._listening is not None and self._listening.is_set()

    async def authenticate(self, token: str | None) -> Principal:
        """The principal a token stands for.

        Args:
            token: The bearer token from the call's metadata; None when absent.

        Raises:
            Unauthenticated: no token, or one no source knows, or revoked or
                expired (UNAUTHENTICATED).
            DatabaseUnavailable: the database could not be asked (UNAVAILABLE).
        """
        if not token:
            raise Unauthenticated("this call needs a token: authorization: Bearer <token>")
        token_digest = tokens.digest(token)
        if self._file is not None:
            grant = self._file.grants().get(token_digest)
            if grant is not None:
                return Principal(grant.name, grant.role, grant.namespaces, "file")
        token_id = tokens.token_id_of(token)
        grant = await self._database_grant(token_digest) if token_id else None
        if grant is None:
            shown = f"token {token_id}" if token_id else "the token"
            raise Unauthenticated(f"{shown} is unknown, revoked or expired")
        return Principal(grant.name, grant.role, grant.namespaces, "database")

    async def _database_grant(self, token_digest: bytes) -> tokens.TokenGrant | None:
        if self._caching():
            cached = self._cache.get(token_digest, _NOT_CACHED)
            if cached is not _NOT_CACHED:
                return cached  # type: ignore[return-value]
        generation = self._generation
        async with self._connection() as conn:
            grant = await tokens.find_token(conn, token_digest)
        # A change announced while we asked may already make this answer stale.
        if self._caching() and generation == self._generation:
            self._cache[token_digest] = grant
        return grant


def _cache_until(_key: bytes, grant: tokens.TokenGrant | None, now: float) -> float:
    ttl_s = CACHE_TTL_S
    if grant is not None and grant.remaining_s is not None:
        ttl_s = min(ttl_s, grant.remaining_s)
    return now + ttl_s


def bearer_token(metadata: Any) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry; None if absent."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
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
        _PRINCIPAL.set(principal)
        _CREDENTIALS.set((self._auth, token or ""))
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
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
