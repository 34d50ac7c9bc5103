"""Database URLs for fault tests: where a database listens, and the same URL through a proxy."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit


def database_address(database_url: str) -> tuple[str, int]:
    """Where the database listens: host and port, or a Unix socket folder (``?host=/dir``)."""
    parts = urlsplit(database_url)
    socket_dir = dict(parse_qsl(parts.query)).get("host", "")
    host = socket_dir if socket_dir.startswith("/") else parts.hostname or "127.0.0.1"
    return host, parts.port or 5432


def proxied(database_url: str, port: int) -> str:
    """``database_url`` with its host and port replaced by a proxy's on 127.0.0.1."""
    parts = urlsplit(database_url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "host"])
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def replaced(database_url: str, *, role: str | None = None, database: str | None = None) -> str:
    """``database_url`` with its role (user and password) or its database name replaced."""
    parts = urlsplit(database_url)
    if role is not None:
        parts = parts._replace(netloc=f"{role}@{parts.netloc.rpartition('@')[2]}")
    if database is not None:
        parts = parts._replace(path=f"/{database}")
    return urlunsplit(parts)
