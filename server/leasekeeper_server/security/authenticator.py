"""A presented token to a principal: the token file first, then the database.

Database answers are cached by digest (found and not found, at most
``CACHE_TTL_S``, and never past a token's expiry), and the cache is flushed
when the database announces a change on channel ``leasekeeper_config``
(payload ``tokens``, through ``LeaseEvents.on_config``); while that channel
is not listened to the cache is bypassed, so a revoked token is refused
within about a second of the revoke committing. Errors name the token's
public id, never the token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import asyncpg
import cachetools

from leasekeeper_server.core.errors import Unauthenticated
from leasekeeper_server.security import tokens
from leasekeeper_server.security.roles import Principal
from leasekeeper_server.security.token_file import TokenFile

CACHE_TTL_S = 5.0
CACHE_MAX_ENTRIES = 10_000
_NOT_CACHED = object()

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
        (:func:`leasekeeper_server.security.caller.until_credentials_lost`).
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
