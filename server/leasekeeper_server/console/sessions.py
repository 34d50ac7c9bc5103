"""Server-side sessions: a random id in a cookie, the viewer's token in this process's memory.

Every visitor gets a session on the first page (it holds the CSRF token of
the forms); signing in puts the viewer's token in a NEW session (a new id:
an id known before sign-in is worth nothing after it). The cookie carries
only the id: HttpOnly, SameSite=Strict, Path=/, Secure when the console
serves HTTPS. A session unused for ``idle_s`` seconds is gone; so are the
least recently used ones beyond ``max_sessions``, counted apart for visitors
and for signed-in viewers (a flood of new visitors never pushes out a
signed-in viewer). Tokens never leave this store: not in a URL, a page, or a
log line. A restart of the console ends every session.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import Any

COOKIE = "leasekeeper_console"
IDLE_S = 1800.0  # 30 minutes without a request ends a session
MAX_SESSIONS = 10_000
MAX_RESULTS = 16  # results of actions kept per session (the newest)


@dataclasses.dataclass(slots=True)
class Session:
    """One visitor's session.

    Attributes:
        id: The cookie's value (256 random bits).
        csrf: The CSRF token every form of this session carries (256 random bits).
        token: The viewer's bearer token once signed in; None: calls carry none.
        last_seen: When it was last used (the store's monotonic clock, seconds).
        notice: A short note for the next page that shows notes (e.g. "Signed
            out."); read once.
        results: The outcomes of this session's actions, by their one-time id
            (the result page's ``?r=``), newest last; at most ``MAX_RESULTS``.
    """

    id: str
    csrf: str
    token: str | None
    last_seen: float
    notice: str = ""
    results: collections.OrderedDict[str, dict[str, Any]] = dataclasses.field(
        default_factory=collections.OrderedDict
    )

    def keep_result(self, outcome: dict[str, Any]) -> str:
        """Keeps an action's outcome under a new random id, and returns the id."""
        result_id = secrets.token_urlsafe(12)
        self.results[result_id] = outcome
        while len(self.results) > MAX_RESULTS:
            self.results.popitem(last=False)
        return result_id

    def take_notice(self) -> str:
        """The notice for this page, cleared (it is shown once)."""
        notice, self.notice = self.notice, ""
        return notice

    @property
    def signed_in(self) -> bool:
        """Whether the viewer signed in with a token."""
        return self.token is not None

    def __repr__(self) -> str:  # never the token, never the ids
        return f"Session(signed_in={self.signed_in})"


class Sessions:
    """The sessions of one console process, by id."""

    def __init__(
        self,
        idle_s: float = IDLE_S,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """An empty store; sessions idle for ``idle_s`` seconds expire."""
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._clock = clock
        # Visitors and signed-in viewers, each in order of use (oldest first).
        self._visitors: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._signed_in: collections.OrderedDict[str, Session] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._visitors) + len(self._signed_in)

    def _pool(self, session: Session) -> collections.OrderedDict[str, Session]:
        return self._signed_in if session.signed_in else self._visitors

    def get(self, session_id: str | None) -> Session | None:
        """The live session with this id (now marked used), or None."""
        if not session_id:
            return None
        session = self._signed_in.get(session_id) or self._visitors.get(session_id)
        if session is None:
            return None
        pool = self._pool(session)
        now = self._clock()
        if now - session.last_seen > self.idle_s:
            del pool[session_id]
            return None
        session.last_seen = now
        pool.move_to_end(session_id)
        return session

    def new(self, token: str | None = None) -> Session:
        """A new session (signed in with ``token`` when given)."""
        session = Session(
            id=secrets.token_urlsafe(32),
            csrf=secrets.token_urlsafe(32),
            token=token,
            last_seen=self._clock(),
        )
        pool = self._pool(session)
        self._expire(pool)
        pool[session.id] = session
        while len(pool) > self.max_sessions:
            pool.popitem(last=False)
        return session

    def drop(self, session_id: str) -> None:
        """Ends a session (sign-out); unknown ids are ignored."""
        self._visitors.pop(session_id, None)
        self._signed_in.pop(session_id, None)

    def clear(self) -> None:
        """Ends every session (the console stops)."""
        self._visitors.clear()
        self._signed_in.clear()

    def _expire(self, pool: collections.OrderedDict[str, Session]) -> None:
        """Drops the idle sessions at the old end of ``pool`` (it is in order of use)."""
        now = self._clock()
        while pool:
            oldest = next(iter(pool.values()))
            if now - oldest.last_seen <= self.idle_s:
                return
            pool.popitem(last=False)


def cookie_header(session_id: str, *, secure: bool, max_age_s: float | None = None) -> str:
    """The Set-Cookie value carrying a session id (``max_age_s`` 0: delete it)."""
    parts = [f"{COOKIE}={session_id}", "Path=/", "HttpOnly", "SameSite=Strict"]
    if max_age_s is not None:
        parts.append(f"Max-Age={int(max_age_s)}")
    if secure:
        parts.append("Secure")
    return "; ".join(parts)
