"""One running console: the service it calls, its sessions, its hub and its shared answers.

Handlers reach it through the request (``console_of``), and the viewer's
session through ``session_of`` (put in the request's scope by the app's
session middleware, ``app.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

import grpc
from starlette.requests import Request

from leasekeeper import TaskEvent
from leasekeeper_server.console.hub import LINGER_S, Hub
from leasekeeper_server.console.refresh import FRESH_S, Snapshots
from leasekeeper_server.console.service import CALL_TIMEOUT_S, Service
from leasekeeper_server.console.sessions import Session, Sessions

SESSION_KEY = "leasekeeper.session"
PAGE_SIZE = 100  # tasks per page of a namespace (ListLeases)
RECHECK_S = 60.0  # a live-update stream checks its viewer's session and access this often


class Console:
    """The state of one console process."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        target: str,
        token: str | None = None,
        secure: bool = False,
        page_size: int = PAGE_SIZE,
        linger_s: float = LINGER_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
        sessions: Sessions | None = None,
        recheck_s: float = RECHECK_S,
        fresh_s: float = FRESH_S,
    ) -> None:
        """A console calling the service on ``channel`` (the caller closes it).

        Args:
            channel: The gRPC channel to the service.
            target: The service's address, as shown in the pages.
            token: The console's own token, for the shared Watch streams
                only; None: each stream uses a viewer's token.
            secure: The console serves HTTPS (session cookies are Secure).
            page_size: Tasks per page of a namespace.
            linger_s: Seconds a namespace's stream stays open after its last viewer.
            call_timeout_s: Deadline of each call, in seconds.
            sessions: The session store; None: a new one.
            recheck_s: Seconds between two checks of a live-update viewer's
                session and access; also how long a viewer's checked access
                to a namespace lets it share the answers of ``/leases.json``.
            fresh_s: Seconds an answer of ``/leases.json`` is shared.
        """
        self.service = Service(channel, call_timeout_s)
        self.sessions = sessions or Sessions()
        self.hub = Hub(self._open_watch, token=token, linger_s=linger_s)
        self.target = target
        self.secure = secure
        self.page_size = page_size
        self.recheck_s = recheck_s
        self.snapshots = Snapshots(fresh_s=fresh_s, access_s=recheck_s)

    def _open_watch(self, namespace: str, token: str | None) -> AsyncIterator[TaskEvent]:
        return self.service.client(namespace, token).watch()

    async def close(self) -> None:
        """Ends every live-update stream and every session."""
        await self.hub.close()
        self.sessions.clear()


def console_of(request: Request) -> Console:
    """The console serving ``request``."""
    return cast(Console, request.app.state.console)


def session_of(request: Request) -> Session:
    """The viewer's session (every request has one: see the session middleware)."""
    return cast(Session, request.scope[SESSION_KEY])


def replace_session(request: Request, session: Session) -> None:
    """Makes ``session`` the viewer's from this response on (its cookie is set)."""
    request.scope[SESSION_KEY] = session
