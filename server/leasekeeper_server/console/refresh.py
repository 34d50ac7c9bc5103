"""Shared answers for ``GET /leases.json``: the state and remaining ttl of the tasks a page shows.

Renewals are not Watch events: a worker that renews every 10 s changes no
row the live updates (``events.py``) would touch, so an open page would
count its lease down to "expiry due" while it is fine. So every page that
shows remaining ttls polls this endpoint (``console.js``, every 2.5 s while
its tab is visible) and sets each shown task's state, owner, fence,
attempts, checkpoint version, remaining ttl and expiry from the answer.

- ``/leases.json?ns=[&state=][&owner=][&page=]``: the tasks of that page of
  the namespace (ListLeases, with the page's own filter and page token).
- ``/leases.json?ns=&id=``: one task (GetLease).

The answer: ``{"age_s": seconds, "tasks": [{"task_id", "state",
"owner_id", "fence", "attempts", "max_attempts", "checkpoint_version",
"remaining_ttl", "expire_time", "end_reason"}]}``. ``remaining_ttl`` is the
seconds left now on the database clock (the service's figure less the age
of the answer; null when the task holds no live lease); ``expire_time`` is
the expiry as the pages write it (UTC, database clock), or null. A refusal
of the service is answered with its status (401, 403, 404, ...) and
``{"error", "code"}``.

Answers are shared (:class:`Snapshots`): one answer per call, namespace,
filter and page (or task) is kept ``fresh_s`` seconds (2 by default) and
served to every viewer whose access to that namespace was checked, so fifty
open pages of a namespace cost about one ListLeases each ``fresh_s``, not
fifty. A viewer's access is checked with the viewer's own token: a page
rendered for it, or a call made with its token, records that the service
allowed that token that method in that namespace, for ``access_s`` seconds
(the live updates' ``recheck_s``: 60 by default). A viewer without such a
record makes the call with its own token (its answer then refreshes the
shared one); a refusal is its answer. The data of one viewer is never served
to a viewer the service did not allow the same read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import Awaitable, Callable

from leasekeeper import LeaseInfo
from leasekeeper_server.console.service import Refusal

FRESH_S = 2.0  # an answer is shared this long
MAX_KEPT = 4096  # answers kept at most (namespace pages and tasks)
MAX_ACCESS = 10_000  # access records kept at most (token, namespace, method)

Key = tuple[str, ...]


def identity(token: str | None) -> bytes:
    """Who a token is, for the access records: its SHA-256 (b"" for no token); never the token."""
    return hashlib.sha256(token.encode()).digest() if token else b""


@dataclasses.dataclass(frozen=True, slots=True)
class Kept:
    """An answer, and when (the console's monotonic clock) its call was sent."""

    at: float
    leases: list[LeaseInfo]


class Snapshots:
    """Answers of ListLeases and GetLease shared for ``fresh_s`` seconds among allowed viewers."""

    def __init__(
        self,
        *,
        fresh_s: float = FRESH_S,
        access_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_kept: int = MAX_KEPT,
        max_access: int = MAX_ACCESS,
    ) -> None:
        """An empty store.

        Args:
            fresh_s: Seconds an answer is served to other viewers.
            access_s: Seconds a viewer's checked access to a namespace is trusted.
            clock: The monotonic clock (seconds).
            max_kept: Answers kept at most (older ones are dropped first).
            max_access: Access records kept at most.
        """
        self.fresh_s = fresh_s
        self.access_s = access_s
        self.max_kept = max_kept
        self.max_access = max_access
        self.calls = 0  # calls made to the service through this store
        self._clock = clock
        self._kept: dict[Key, Kept] = {}
        self._pending: dict[Key, asyncio.Future[Kept | None]] = {}
        self._access: dict[tuple[bytes, str, str], float] = {}

    def allow(self, token: str | None, namespace: str, method: str) -> None:
        """Records that the service just allowed ``token`` to call ``method`` in ``namespace``."""
        key = (identity(token), namespace, method)
        self._access.pop(key, None)  # to the young end
        self._access[key] = self._clock() + self.access_s
        if len(self._access) > self.max_access:
            now = self._clock()
            for old in [k for k, until in self._access.items() if until <= now]:
                del self._access[old]
            while len(self._access) > self.max_access:
                del self._access[next(iter(self._access))]

    def allowed(self, token: str | None, namespace: str, method: str) -> bool:
        """Whether the service allowed ``token`` that read less than ``access_s`` seconds ago."""
        until = self._access.get((identity(token), namespace, method))
        return until is not None and self._clock() < until

    async def get(
        self,
        key: Key,
        token: str | None,
        namespace: str,
        method: str,
        call: Callable[[], Awaitable[list[LeaseInfo]]],
    ) -> tuple[list[LeaseInfo], float]:
        """The answer for ``key`` and its age in seconds: shared when fresh, else ``call()``.

        ``call`` makes the call with this viewer's token. A viewer whose
        access is not on record always makes its own call.

        Raises:
            Refusal: this viewer's own call was refused.
        """
        if self.allowed(token, namespace, method):
            kept = self._kept.get(key)
            if kept is not None and self._clock() - kept.at <= self.fresh_s:
                return kept.leases, max(self._clock() - kept.at, 0.0)
            pending = self._pending.get(key)
            if pending is not None:
                shared = await asyncio.shield(pending)
                if shared is not None:
                    return shared.leases, max(self._clock() - shared.at, 0.0)
                # That call failed (its viewer's refusal is not this viewer's): call anew.
        future: asyncio.Future[Kept | None] | None = None
        if key not in self._pending:
            future = asyncio.get_running_loop().create_future()
            self._pending[key] = future
        sent = self._clock()
        kept = None
        try:
            self.calls += 1
            leases = await call()
            kept = Kept(sent, leases)
            self._keep(key, kept)
            self.allow(token, namespace, method)
        except Refusal:
            self._access.pop((identity(token), namespace, method), None)
            raise
        finally:
            if future is not None:
                if not future.done():
                    future.set_result(kept)
                if self._pending.get(key) is future:
                    del self._pending[key]
        return leases, max(self._clock() - sent, 0.0)

    def _keep(self, key: Key, kept: Kept) -> None:
        self._kept.pop(key, None)
        self._kept[key] = kept
        if len(self._kept) > self.max_kept:
            now = self._clock()
            for old in [k for k, v in self._kept.items() if now - v.at > self.fresh_s]:
                del self._kept[old]
            while len(self._kept) > self.max_kept:
                del self._kept[next(iter(self._kept))]
