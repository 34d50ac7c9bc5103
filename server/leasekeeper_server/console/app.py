"""The console's web app: routes, the session middleware, security headers, error pages.

URL map (ids only in query parameters, never a token in a URL):

======================  ======  ==================================================
``/``                   GET     namespaces (ListNamespaces), or a form to open one
``/namespace?ns=``      GET     a namespace's tasks (ListLeases; ``state``, ``owner``,
                                ``page``)
``/task?ns=&id=``       GET     one task: checkpoint, chart, timeline (``h``),
                                effects (``e``), actions
``/action``             POST    revoke, cancel, retry: the confirmation; confirmed, the
                                action, then a 303 to its result
``/result?r=``          GET     an action's result (kept in the session, by a one-time id)
``/leases.json?ns=``    GET     the shown tasks' state and remaining ttl (``id`` for
                                one task; else ``state``, ``owner``, ``page``), polled
``/events?ns=[&id=]``   GET     live updates (Server-Sent Events)
``/signin``             GET     the sign-in form
``/signin``             POST    sign in with a token (form body)
``/signout``            POST    sign out
``/static/...``         GET     console.css, console.js, favicon.svg
``/favicon.ico``        GET     the same icon (for clients that ask for it by that name)
======================  ======  ==================================================

Every response carries a Content-Security-Policy allowing only this
console's own scripts, styles and connections, and no framing. A request
the console cannot answer is an error page with its status (a refusal of
the service keeps the service's message); an unexpected failure is a 500
page, its traceback only in the log.
"""

from __future__ import annotations

import logging
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leasekeeper_server.console import actions, events, pages, signin
from leasekeeper_server.console.render import page
from leasekeeper_server.console.runtime import SESSION_KEY, Console
from leasekeeper_server.console.service import Refusal
from leasekeeper_server.console.sessions import COOKIE, cookie_header

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
MAX_BODY_BYTES = 64 * 1024
FAVICON = STATIC / "favicon.svg"
SESSIONLESS = ("/static/", "/favicon.ico")  # paths that neither read a session nor make one
SECURITY_HEADERS = (
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
)


def _cookie(scope: Scope) -> str | None:
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for name, value in headers:
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                key, _, found = part.strip().partition("=")
                if key == COOKIE:
                    return found
    return None


class SessionMiddleware:
    """Gives every HTTP request a session, and sets its cookie when it is new or replaced.

    Static files (and the icon) need none: they neither read a session nor
    make one. Every response gets the security headers.
    """

    def __init__(self, app: ASGIApp, console: Console) -> None:
        self.app = app
        self.console = console

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serves one request with its session (made here when it has none)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sessions = self.console.sessions
        sent_id = _cookie(scope)
        if not str(scope.get("path", "")).startswith(SESSIONLESS):
            scope[SESSION_KEY] = sessions.get(sent_id) or sessions.new()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                headers += SECURITY_HEADERS
                session = scope.get(SESSION_KEY)
                if session is not None and session.id != sent_id:
                    value = cookie_header(session.id, secure=self.console.secure)
                    headers.append((b"set-cookie", value.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _favicon(request: Request) -> Response:
    return FileResponse(
        FAVICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"}
    )


async def _refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refusal)
    return page(
        request,
        "error.html",
        status=exc.status,
        title=exc.title,
        message=exc.message,
        code=exc.code,
        status_code=exc.status,
        back=exc.back,
        detail=exc.detail,
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if SESSION_KEY not in request.scope:  # a static file
        return PlainTextResponse(str(exc.detail), status_code=exc.status_code)
    title = "Page not found" if exc.status_code == 404 else "Not a valid request"
    return page(
        request,
        "error.html",
        status=exc.status_code,
        title=title,
        message=str(exc.detail),
        code="",
        status_code=exc.status_code,
    )


async def _failed(request: Request, exc: Exception) -> Response:
    log.error("console: %s %s failed", request.method, request.url.path, exc_info=exc)
    if SESSION_KEY not in request.scope:
        return PlainTextResponse("The console failed; its log says why.", status_code=500)
    return page(
        request,
        "error.html",
        status=500,
        title="The console failed",
        message="This page could not be made; the console's log says why.",
        code="",
        status_code=500,
    )


def create_app(console: Console) -> Starlette:
    """The console's ASGI app, serving ``console`` (see the URL map above)."""
    app = Starlette(
        routes=[
            Route("/", pages.namespaces, methods=["GET"]),
            Route("/namespace", pages.namespace, methods=["GET"]),
            Route("/task", pages.task, methods=["GET"]),
            Route("/action", actions.act, methods=["POST"]),
            Route("/result", actions.result, methods=["GET"]),
            Route("/leases.json", pages.leases_json, methods=["GET"]),
            Route("/events", events.events, methods=["GET"]),
            Route("/signin", signin.form, methods=["GET"]),
            Route("/signin", signin.sign_in, methods=["POST"]),
            Route("/signout", signin.sign_out, methods=["POST"]),
            Route("/favicon.ico", _favicon, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        exception_handlers={
            Refusal: _refused,
            HTTPException: _http_error,
            Exception: _failed,
        },
        max_body_size=MAX_BODY_BYTES,
    )
    app.state.console = console
    app.add_middleware(SessionMiddleware, console=console)
    return app
