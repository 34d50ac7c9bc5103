"""The caller of the call being handled, and the re-check that ends long calls.

The interceptor records the caller's principal and token with :func:`bind`
before the handler runs (grpc.aio runs both in one task, so the handler and
what it spawns see them). Handlers then ask :func:`authorize_namespace` for a
namespace named inside a stream, and streams and waiting claims run
:func:`guard_credentials` beside their work so a token revoked or expired
while they run ends them. With authentication off nothing is recorded and
every check allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Collection
from typing import Any

from leasekeeper_server.core.errors import DatabaseUnavailable, PermissionDenied
from leasekeeper_server.security.authenticator import Authenticator
from leasekeeper_server.security.roles import Principal

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


def bind(principal: Principal, authenticator: Authenticator, token: str) -> None:
    """Records the caller of the current call and the token to re-check it with."""
    _PRINCIPAL.set(principal)
    _CREDENTIALS.set((authenticator, token))


async def until_credentials_lost(namespace: str | Collection[str]) -> None:
    """Returns never while the current call's token stays valid for ``namespace``; else raises.

    Streams (Heartbeat, Watch, ValidateFences) and waiting claims run it beside
    their work: a token revoked in the database ends them within about a
    second (the change notification wakes this at once), one that expired or
    left a token file within ``RECHECK_S``. With authentication off it simply
    waits forever. ``namespace`` may be a collection the caller adds to while
    this runs (the namespaces a ValidateFences stream has named so far): each
    re-check covers every namespace in it then.

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
        for name in (namespace,) if isinstance(namespace, str) else tuple(namespace):
            if not principal.covers(name):
                raise PermissionDenied(
                    f"token {principal.name!r} no longer covers namespace {name!r}"
                )


def guard_credentials(namespace: str | Collection[str]) -> asyncio.Future[Any]:
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


def covers(namespace: str) -> bool:
    """Whether the current caller's token covers ``namespace``; True when auth is off.

    For a call that names no namespace (ListNamespaces): its answer leaves out
    what the token does not cover.
    """
    principal = _PRINCIPAL.get()
    return principal is None or principal.covers(namespace)


def authorize_method(method: str, part: str) -> None:
    """Checks the current caller's role may call ``method``; allows all when auth is off.

    For a part of a call that another method's role guards: CompleteEffect's
    ``next_checkpoint`` writes what SaveCheckpoint writes, so it needs a role
    that may call SaveCheckpoint (worker or admin; the effect role may not).

    Raises:
        PermissionDenied: the role does not include ``method`` (PERMISSION_DENIED).
    """
    principal = _PRINCIPAL.get()
    if principal is not None and not principal.may_call(method):
        raise PermissionDenied(
            f"token {principal.name!r} (role {principal.role}) may not send {part}: "
            f"it writes what {method} writes"
        )
