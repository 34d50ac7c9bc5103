"""The checks every POST passes before it may change anything.

Two independent checks, both required:

- the form's ``csrf`` field equals the session's CSRF token
  (``secrets.compare_digest``); a page of another site cannot read it;
- the request's ``Origin`` header (or, when a browser sent none, its
  ``Referer``) names this console's own scheme, host and port; neither
  present, or ``Origin: null``, is refused.

A POST that fails either is answered 403 and its form is not acted on.
"""

from __future__ import annotations

import secrets
from urllib.parse import urlsplit

from starlette.datastructures import FormData
from starlette.requests import Request

from leasekeeper_server.console.runtime import session_of
from leasekeeper_server.console.service import Refusal

FIELD = "csrf"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of a URL or origin; None when it has none."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname:
        return None
    scheme = parts.scheme.lower()
    return scheme, parts.hostname.lower(), port or _DEFAULT_PORTS.get(scheme, 0)


def origin_problem(origin: str | None, referer: str | None, scheme: str, host: str) -> str | None:
    """Why the request does not come from this console's own pages; None when it does.

    Args:
        origin: The request's Origin header, or None.
        referer: Its Referer header, or None (consulted only without Origin).
        scheme: The scheme the console was reached with (http or https).
        host: The Host header the request carried (host[:port]).
    """
    expected = _origin(f"{scheme}://{host}")
    if expected is None:
        return "the request names no host"
    sent = origin if origin is not None else referer
    if sent is None:
        return "the request carries neither Origin nor Referer"
    found = _origin(sent)
    if found is None:
        return "the request's Origin is not a web origin"
    if found != expected:
        return "the request comes from another site"
    return None


def token_problem(sent: object, expected: str) -> str | None:
    """Why the form's CSRF field is not the session's token; None when it is."""
    if not isinstance(sent, str) or not sent:
        return "the form carries no CSRF token (reload the page and try again)"
    if not secrets.compare_digest(sent.encode(), expected.encode()):
        return "the form's CSRF token is not this session's (reload the page and try again)"
    return None


MAX_FIELDS = 16


async def checked_form(request: Request) -> FormData:
    """The POSTed form, once both checks passed.

    Raises:
        Refusal: 403 naming the check that failed; the form is not acted on.
    """
    problem = origin_problem(
        request.headers.get("origin"),
        request.headers.get("referer"),
        request.url.scheme,
        request.headers.get("host", ""),
    )
    form = await request.form(max_files=0, max_fields=MAX_FIELDS)
    if problem is None:
        problem = token_problem(form.get(FIELD), session_of(request).csrf)
    if problem is not None:
        raise Refusal(
            403, "Refused: not sent from this console's page", f"Nothing was done: {problem}."
        )
    return form
