"""Sign-in and sign-out: a token in a POST body, kept in a server-side session.

``GET /signin`` shows the form (and says so when the service asks for no
token). ``POST /signin`` checks the form (CSRF, Origin), asks the service
whether it knows the token (ListNamespaces: answered or PERMISSION_DENIED,
it does; UNAUTHENTICATED, it does not), and on success starts a new session
holding the token, then goes back to the page the viewer came from (``next``,
a path of this console only). ``POST /signout`` ends the session. The token
is never put in a URL, a page or a log line.
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
    """``GET /signin``: the sign-in form."""
    return page(
        request,
        "signin.html",
        next=next_path(request.query_params.get("next")),
        needed=await _tokens_needed(request),
        problem="",
    )


async def sign_in(request: Request) -> Response:
    """``POST /signin``: keep the token in a new session when the service knows it."""
    posted = await checked_form(request)
    token = str(posted.get("token", "")).strip()
    back = next_path(posted.get("next"))
    problem = ""
    if not token:
        problem = "Enter a token."
    elif len(token) > MAX_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        problem = "That is not a token: the service refused it."
    elif not await console_of(request).service.probe(token):
        problem = "The service does not know this token (UNAUTHENTICATED): it is unknown, "
        problem += "expired or revoked."
    if problem:
        return page(
            request,
            "signin.html",
            status=401 if token else 400,
            next=back,
            needed=await _tokens_needed(request),
            problem=problem,
        )
    sessions = console_of(request).sessions
    sessions.drop(session_of(request).id)
    replace_session(request, sessions.new(token))
    return RedirectResponse(back, status_code=303)


async def sign_out(request: Request) -> Response:
    """``POST /signout``: end the session; the viewer continues without a token."""
    await checked_form(request)
    sessions = console_of(request).sessions
    sessions.drop(session_of(request).id)
    replace_session(request, sessions.new())
    return RedirectResponse("/", status_code=303)
