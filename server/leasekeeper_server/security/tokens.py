"""Access tokens: their text, their digests, the database store and the token file.

A token is ``lk_<token_id>_<secret>``: ``token_id`` is 10 letters and digits,
the public part shown in lists and logs; ``secret`` is 256 random bits,
url-safe base64. Only the SHA-256 digest of the whole text is ever stored, in
the table ``leasekeeper_tokens`` (``leasekeeper tokens create``) or in a token
file (``LEASEKEEPER_TOKENS_FILE``). A 256-bit random secret needs no slow
password hash: a leaked digest does not give the token back.

A token file is TOML, one ``[[token]]`` table per token::

    [[token]]
    name = "billing-workers"          # shown in logs, never the token
    sha256 = "9f86d0...0f00a08"       # hex SHA-256 of the whole token text
    role = "worker"                   # worker, effect or admin
    namespaces = ["billing", "team-a/*"]

Make an entry with ``python -m leasekeeper_server.cli.tokens new --name N --role R
--namespace NS`` (prints a fresh token on stderr and its entry on stdout), or
for a token you already have, ``python -m leasekeeper_server.cli.tokens hash ...``
reading the token from stdin (``printf %s "$TOKEN" | sha256sum`` gives the
same digest).

A namespace pattern is an exact namespace, ``*`` for every namespace, or a
prefix ending in ``*`` (``team-a/*`` covers every namespace that starts with
``team-a/``).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import asyncpg

from leasekeeper.ids import refusal
from leasekeeper_server.core.errors import InvalidArgument
from leasekeeper_server.rpc import validate

ROLES = ("worker", "effect", "admin")
PREFIX = "lk"
TOKEN_ID_LENGTH = 10
_TOKEN_ID_ALPHABET = string.ascii_letters + string.digits
_TOKEN = re.compile(r"^lk_([A-Za-z0-9]{8,12})_([A-Za-z0-9_-]{43,})$")
MAX_NAME_CHARS = 200
MAX_NAMESPACE_PATTERN_BYTES = 1024  # above any id a server allows (settings.MAX_ID_BYTES_LIMIT)

_COLUMNS = "token_id, name, role, namespaces, create_time, expire_time, revoke_time"

_INSERT = f"""
INSERT INTO leasekeeper_tokens (token_id, token_sha256, name, role, namespaces, expire_time)
VALUES ($1::text, $2::bytea, $3::text, $4::text, $5::text[], $6::timestamptz)
RETURNING {_COLUMNS}
"""
_LIST = f"SELECT {_COLUMNS} FROM leasekeeper_tokens ORDER BY create_time, token_id"
_REVOKE = """
UPDATE leasekeeper_tokens SET revoke_time = clock_timestamp()
WHERE token_id = $1::text AND revoke_time IS NULL
RETURNING token_id
"""
# The database clock decides whether a token has expired; the remaining
# seconds bound how long a server may trust its cached answer.
_FIND = """
SELECT token_id, name, role, namespaces,
       extract(epoch FROM expire_time - clock_timestamp())::float8 AS remaining_s
FROM leasekeeper_tokens
WHERE token_sha256 = $1::bytea
  AND revoke_time IS NULL
  AND (expire_time IS NULL OR expire_time > clock_timestamp())
"""


@dataclass(frozen=True)
class TokenRecord:
    """A token kept in the database, without its secret.

    Attributes:
        token_id: The public part of the token (``lk_<token_id>_...``).
        name: Who or what the token is for; shown in logs.
        role: ``worker``, ``effect`` or ``admin``.
        namespaces: Namespace patterns the token covers.
        create_time: When it was created (database clock).
        expire_time: When it stops being accepted (database clock); None: never.
        revoke_time: When it was revoked (database clock); None: not revoked.
    """

    token_id: str
    name: str
    role: str
    namespaces: tuple[str, ...]
    create_time: datetime
    expire_time: datetime | None
    revoke_time: datetime | None


@dataclass(frozen=True)
class TokenGrant:
    """What a presented token is allowed: a live database token or a token file entry.

    Attributes:
        name: The token's name, for logs.
        role: ``worker``, ``effect`` or ``admin``.
        namespaces: Namespace patterns the token covers.
        remaining_s: Seconds until the token expires (database clock); None: never.
    """

    name: str
    role: str
    namespaces: tuple[str, ...]
    remaining_s: float | None = None


def new_token() -> tuple[str, str]:
    """A fresh token: ``(token_id, token text)``, the text being ``lk_<token_id>_<secret>``."""
    token_id = "".join(secrets.choice(_TOKEN_ID_ALPHABET) for _ in range(TOKEN_ID_LENGTH))
    return token_id, f"{PREFIX}_{token_id}_{secrets.token_urlsafe(32)}"


def digest(token: str) -> bytes:
    """The SHA-256 digest of the whole token text (UTF-8), as stored."""
    return hashlib.sha256(token.encode("utf-8")).digest()


def token_id_of(token: str) -> str | None:
    """The public token id of a ``lk_<token_id>_<secret>`` token; None for another shape."""
    match = _TOKEN.match(token)
    return match.group(1) if match else None


def check_role(role: str) -> str:
    """Returns ``role``; ValueError naming the field unless it is worker, effect or admin."""
    if role not in ROLES:
        raise ValueError(f"role: must be one of {', '.join(ROLES)}, not {role!r}")
    return role


def check_namespaces(namespaces: Sequence[str]) -> tuple[str, ...]:
    """Returns the patterns as a tuple; ValueError naming the field when one is malformed.

    A pattern is an exact namespace, ``*``, or a prefix ending in ``*``; no
    other ``*``; otherwise the rules of every id (validate.identifier: 1 to
    1024 bytes of UTF-8, no control, bidirectional or line-separator
    characters, a visible one); at least one.
    """
    if isinstance(namespaces, str):
        raise ValueError("namespaces: must be a list of patterns, not one string")
    patterns = tuple(namespaces)
    if not patterns:
        raise ValueError("namespaces: at least one namespace pattern is needed ('*' for all)")
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"namespaces: {pattern!r} is not a string")
        try:
            validate.identifier("namespaces", pattern, MAX_NAMESPACE_PATTERN_BYTES)
        except InvalidArgument as exc:
            raise ValueError(f"namespaces: {pattern!r} {exc.description}") from exc
        if "*" in pattern[:-1]:
            raise ValueError(f"namespaces: {pattern!r} may have '*' only at its end")
    return patterns


def _check_name(name: str) -> str:
    """A token's name is shown in logs: 1..200 characters, the character rule of ids."""
    if not isinstance(name, str) or not name:
        raise ValueError("name: must be a non-empty string")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"name: at most {MAX_NAME_CHARS} characters")
    reason = refusal(name)
    if reason is not None:
        raise ValueError(f"name: {name!r} {reason}")
    return name


def _record(row: asyncpg.Record) -> TokenRecord:
    return TokenRecord(
        token_id=row["token_id"],
        name=row["name"],
        role=row["role"],
        namespaces=tuple(row["namespaces"]),
        create_time=row["create_time"],
        expire_time=row["expire_time"],
        revoke_time=row["revoke_time"],
    )


async def create_token(
    conn: asyncpg.Connection,
    name: str,
    role: str,
    namespaces: Sequence[str],
    expire_time: datetime | None = None,
) -> tuple[TokenRecord, str]:
    """Creates a database token; every server accepts it at once (NOTIFY ``leasekeeper_config``).

    Args:
        conn: A connection to the service's database (migrated).
        name: Who or what the token is for (1-200 characters), shown in logs.
        role: ``worker``, ``effect`` or ``admin``.
        namespaces: Namespace patterns (see the module docstring).
        expire_time: When the token stops being accepted (timezone-aware,
            judged on the database clock); None: never.

    Returns:
        The stored record and the token text. The text is shown this once:
        only its digest is stored.

    Raises:
        ValueError: a malformed argument; the message starts with its name.
    """
    _check_name(name)
    check_role(role)
    patterns = check_namespaces(namespaces)
    if expire_time is not None and expire_time.utcoffset() is None:
        raise ValueError("expire_time: must be timezone-aware")
    token_id, token = new_token()
    row = await conn.fetchrow(
        _INSERT, token_id, digest(token), name, role, list(patterns), expire_time
    )
    assert row is not None
    return _record(row), token


async def list_tokens(conn: asyncpg.Connection) -> list[TokenRecord]:
    """Every database token (revoked and expired ones too), oldest first."""
    return [_record(row) for row in await conn.fetch(_LIST)]


async def revoke_token(conn: asyncpg.Connection, token_id: str) -> bool:
    """Revokes a database token; servers refuse it within about a second.

    Returns:
        True if this call revoked it; False if no such token or already revoked.
    """
    return await conn.fetchval(_REVOKE, token_id) is not None


async def find_token(conn: asyncpg.Connection, token_digest: bytes) -> TokenGrant | None:
    """The live database token with this digest; None if unknown, revoked or expired.

    Expiry is judged on the database clock.
    """
    row = await conn.fetchrow(_FIND, token_digest)
    if row is None:
        return None
    return TokenGrant(row["name"], row["role"], tuple(row["namespaces"]), row["remaining_s"])


def parse_token_file(text: str) -> dict[bytes, TokenGrant]:
    """Parses a token file (see the module docstring) into ``{digest: grant}``.

    Raises:
        ValueError: the file is not valid TOML, or an entry is malformed
            (the message names the entry and the field).
    """
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not valid TOML: {exc}") from exc
    unknown = set(document) - {"token"}
    if unknown:
        raise ValueError(f"unknown top-level keys {sorted(unknown)}; expected [[token]] tables")
    entries = document.get("token", [])
    if not isinstance(entries, list):
        raise ValueError("'token' must be an array of tables ([[token]])")
    grants: dict[bytes, TokenGrant] = {}
    for index, entry in enumerate(entries, 1):
        try:
            grant_digest, grant = _file_entry(entry)
        except ValueError as exc:
            raise ValueError(f"token entry {index}: {exc}") from exc
        if grant_digest in grants:
            raise ValueError(f"token entry {index}: sha256: the same digest is listed twice")
        grants[grant_digest] = grant
    return grants


def _file_entry(entry: object) -> tuple[bytes, TokenGrant]:
    if not isinstance(entry, dict):
        raise ValueError("must be a table")
    unknown = set(entry) - {"name", "sha256", "role", "namespaces"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    for key in ("name", "sha256", "role", "namespaces"):
        if key not in entry:
            raise ValueError(f"{key}: missing")
    sha256 = entry["sha256"]
    if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
        raise ValueError("sha256: must be 64 hex digits (the SHA-256 of the token text)")
    grant = TokenGrant(
        name=_check_name(entry["name"]),
        role=check_role(entry["role"]),
        namespaces=check_namespaces(entry["namespaces"]),
    )
    return bytes.fromhex(sha256), grant


def load_token_file(path: Path) -> dict[bytes, TokenGrant]:
    """Reads and parses a token file.

    Raises:
        ValueError: it cannot be read or is malformed (the message names the path).
    """
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"token file {path}: cannot be read: {exc}") from exc
    try:
        return parse_token_file(text)
    except ValueError as exc:
        raise ValueError(f"token file {path}: {exc}") from exc


def file_entry(token: str, name: str, role: str, namespaces: Sequence[str]) -> str:
    """The token file entry (TOML) for ``token``.

    Raises:
        ValueError: a malformed argument, named.
    """
    _check_name(name)
    check_role(role)
    patterns = check_namespaces(namespaces)

    def quoted(value: str) -> str:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return (
        "[[token]]\n"
        f"name = {quoted(name)}\n"
        f'sha256 = "{digest(token).hex()}"\n'
        f'role = "{role}"\n'
        f"namespaces = [{', '.join(quoted(p) for p in patterns)}]\n"
    )
