"""Sign-in and sign-out: a token in a POST body, kept in a server-side session.

``GET /signin`` shows the form, or, when the service asks for no token
(a call without one is answered), says so and offers the form only to check
a token anyway. ``POST /signin`` checks the form (CSRF, Origin), then asks
the service about the token with a real call made with it (ListNamespaces:
answered or PERMISSION_DENIED, the service knows it; UNAUTHENTICATED, it
does not). A known token, when the service asks for tokens, starts a new
session holding it, then goes back to the page the viewer came from
(``next``, a path of this console only). When the service asks for none,
the token is not kept: the page says it was not needed (or that the service
refused it). ``POST /signout`` ends the session and goes to ``/signin``,
which says "Signed out.". The token is never put in a URL, a page or a log
line.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from leasekeeper_server.console.csrf import checked_form
from leasekeeper_server.console.render import page
from leasekeeper_server.console.runtime import console_of, replace_session, session_of
from leasekeeper_server.console.service import Refusal

MAX_TOKEN_CHARS = 4096


def next_path(value: object) -> str:
    """Where to go after signing in: a path of this console, else ``/``."""
    if isinstance(value, str) and value.startswith("/") and not value.startswith(("//", "/\\")):
        return value
    return "/"


async def _tokens_needed(request: Request) -> bool | None:
    """Whether the service asks for tokens (None: it could not be asked)."""
    try:
        return not await console_of(request).service.probe(None)
    except Refusal:
        return None


async def form(request: Request) -> Response:
    """``GET /signin``: the sign-in form (and the note of a sign-out just done)."""
    return page(
        request,
        "signin.html",
        next=next_path(request.query_params.get("next")),
        needed=await _tokens_needed(request),
        problem="",
        notice=session_of(request).take_notice(),
    )


NOT_NEEDED = (
    "The service asks for no token, so this one was not needed: the console did not keep it. "
    "You are not signed in, and need not be: every call the console makes carries no token."
)


async def sign_in(request: Request) -> Response:
    """``POST /signin``: keep the token in a new session when the service knows it."""
    posted = await checked_form(request)
    token = str(posted.get("token", "")).strip()
    back = next_path(posted.get("next"))
    needed = await _tokens_needed(request)
    problem, status, notice = "", 200, ""
    if not token:
        problem, status = "Enter a token.", 400
    elif len(token) > MAX_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        problem, status = "That is not a token: a token is one line, without spaces.", 400
    elif not await console_of(request).service.probe(token):
        problem, status = (
            "The service refused this token (UNAUTHENTICATED): it is unknown, expired or revoked.",
            401,
        )
    elif needed is False:
        notice = NOT_NEEDED
    if problem or notice:
        return page(
            request,
            "signin.html",
            status=status,
            next=back,
            needed=needed,
            problem=problem,
            notice=notice,
        )
    sessions = console_of(request).sessions
    sessions.drop(session_of(request).id)
    replace_session(request, sessions.new(token))
    return RedirectResponse(back, status_code=303)


async def sign_out(request: Request) -> Response:
    """``POST /signout``: end the session; the sign-in page says "Signed out."."""
    await checked_form(request)
    sessions = console_of(request).sessions
    sessions.drop(session_of(request).id)
    fresh = sessions.new()
    fresh.notice = "Signed out. The console no longer holds your token."
    replace_session(request, fresh)
    return RedirectResponse("/signin", status_code=303)
