"""Pages from templates: the Jinja2 environment (autoescape on), its filters, URLs.

Every value a template shows is escaped by Jinja2's autoescape; only the
chart's SVG (``chart.py``, escaped there) is passed as markup. URLs carry
ids in query parameters, percent-encoded (``url``); never a token.
"""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

from leasekeeper_server.console.runtime import console_of, session_of

TEMPLATES = Path(__file__).parent / "templates"
NO_STORE = {"Cache-Control": "no-store"}


def url(path: str, **params: object) -> str:
    """``path`` with its query parameters, percent-encoded; None and "" are left out."""
    kept = {name: str(value) for name, value in params.items() if value not in (None, "")}
    if not kept:
        return path
    return f"{path}?{urlencode(kept, quote_via=quote, safe='')}"


def when(value: datetime | None) -> str:
    """An instant as ``2025-01-02 03:04:05.678Z`` (UTC); "—" for none."""
    if value is None:
        return "—"
    return value.strftime("%Y-%m-%d %H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def seconds(value: float | None) -> str:
    """A duration in seconds, as ``12.3 s``; "—" for none."""
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.1f} s"


def size(value: int) -> str:
    """A size in bytes, as ``512 B``, ``1.5 KiB``, ``2.0 MiB``."""
    if value < 1024:
        return f"{value} B"
    if value < 1024 * 1024:
        return f"{value / 1024:.1f} KiB"
    return f"{value / (1024 * 1024):.1f} MiB"


def expire(value: float) -> str:
    """A remaining ttl for ``data-expire``: seconds with millisecond precision."""
    return f"{max(value, 0.0):.3f}"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=when, seconds=seconds, size=size, expire=expire)
    env.globals["url"] = url
    return env


ENVIRONMENT = _environment()


def page(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    """A page rendered for the viewer of ``request``.

    Every template gets ``session`` facts (``signed_in``, ``csrf``), the
    service's address (``target``), ``url`` and ``here`` (the path and query
    of this request, for a sign-in's way back).
    """
    console = console_of(request)
    session = session_of(request)
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    html = ENVIRONMENT.get_template(template).render(
        signed_in=session.signed_in,
        csrf=session.csrf,
        target=console.target,
        here=here,
        **context,
    )
    return HTMLResponse(html, status_code=status, headers=NO_STORE)
