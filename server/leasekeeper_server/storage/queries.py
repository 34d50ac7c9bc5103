"""Loads the named SQL blocks of ``sql/*.sql`` files, each once."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    """Splits a file of ``-- name: NAME`` blocks into {name: statement}."""
    parts = _NAME.split(text)
    blocks: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in blocks:
            raise ValueError(f"query {name!r} is defined twice")
        blocks[name] = body.strip().rstrip(";")
    return blocks


@cache
def load(file: str = "queries.sql") -> dict[str, str]:
    """The statements of ``sql/<file>`` by name (default: the service's own)."""
    text = resources.files(__package__).joinpath(f"sql/{file}").read_text("utf-8")
    return parse(text)
