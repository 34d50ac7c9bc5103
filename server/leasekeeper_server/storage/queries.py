"""Loads the named SQL blocks of ``sql/*.sql`` files, each once.

A file holds ``-- name: NAME`` blocks (statements) and ``-- fragment: NAME``
blocks (text written once and shared). A statement says ``{{NAME}}`` where a
fragment goes, or ``{{NAME:EXPR}}`` to put the expression EXPR where the
fragment says ``@now`` (``clock_timestamp()`` when not given): a decision
that several statements take, such as whether a lease is live, is written
once.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_BLOCK = re.compile(r"^-- (name|fragment): (\w+)\s*$", re.MULTILINE)
_USE = re.compile(r"\{\{(\w+)(?::([^}]+))?\}\}")
_COMMENT = re.compile(r"^--.*\n", re.MULTILINE)
DEFAULT_NOW = "clock_timestamp()"


def parse(text: str) -> dict[str, str]:
    """Splits a file of blocks into {statement name: statement}, fragments put in place.

    Raises:
        ValueError: a name defined twice, or a fragment used but not defined.
    """
    parts = _BLOCK.split(text)
    statements: dict[str, str] = {}
    fragments: dict[str, str] = {}
    for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        if name in statements or name in fragments:
            raise ValueError(f"query {name!r} is defined twice")
        if kind == "fragment":
            fragments[name] = " ".join(_COMMENT.sub("", body).split())
        else:
            statements[name] = body.strip().rstrip(";")

    def put(match: re.Match[str]) -> str:
        name, now = match.group(1), match.group(2)
        if name not in fragments:
            raise ValueError(f"fragment {name!r} is used but not defined")
        return fragments[name].replace("@now", now or DEFAULT_NOW)

    return {name: _USE.sub(put, sql) for name, sql in statements.items()}


@cache
def load(file: str = "queries.sql") -> dict[str, str]:
    """The statements of ``sql/<file>`` by name (default: the service's own)."""
    text = resources.files(__package__).joinpath(f"sql/{file}").read_text("utf-8")
    return parse(text)
