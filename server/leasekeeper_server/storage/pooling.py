"""At start: refuses a database connection through a pooler in transaction or statement mode.

The service needs each of its connections to keep one PostgreSQL session:
asyncpg names the statements it prepares on a connection and runs them again
later, the notification listener LISTENs, the migration holds a session
lock. A pooler in transaction mode, such as PgBouncer with
``pool_mode=transaction``, hands a session to whichever client starts a
transaction, so those statements land on another session (``prepared
statement "__asyncpg_stmt_…" does not exist``); one in statement mode
(``pool_mode=statement``) closes the connection of a client that opens a
transaction block. That can never work (support for transaction pooling is a
later change), so the server refuses to start (status 2, in one line, as for
any setting that can never work: cli/main.py) rather than serve calls it cannot
decide, or retry for ``startup_wait_s`` a connection that is closed each time.

The probe uses two connections, A and B, with no statement cache, each
statement in a transaction of its own, which works through any pooler but a
statement-mode one. A reads its session's
backend pid; B opens a transaction and reads its own; A reads its pid again
while B's transaction holds B's session. Directly or through a session-mode
pooler, a connection keeps one session for its life: A reads the same pid
twice, and B another one. Through a transaction-mode pooler, B's transaction
is handed the session A has just given back (PgBouncer reuses the most
recently used session first, and with one session in the pool there is no
other), or A's second read gets another session: either way it shows.
Through a statement-mode pooler A's first transaction ends its connection
with PgBouncer's error (``transaction blocks not allowed in statement pooling
mode``; asyncpg 0.32 keeps the server's error as the lost connection's cause).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import asyncpg

from leasekeeper_server.core.errors import DatabaseRefused
from leasekeeper_server.storage.driver_errors import translate_errors

PROBE_APPLICATION_NAME = "leasekeeper-pool-probe"


# What PgBouncer says before closing a client that opens a transaction block in
# statement mode ("... statement pooling mode" in 1.18, "... statement pool mode" before).
STATEMENT_POOLING_ERROR = "transaction blocks not allowed in statement pool"

_NEEDED = (
    "leasekeeper needs a session per connection; "
    "use PgBouncer pool_mode=session, or connect to PostgreSQL directly"
)


class TransactionPooling(DatabaseRefused):
    """The database URL leads to a pooler in transaction mode: no retry helps (exit 2 at start)."""


class StatementPooling(TransactionPooling):
    """The database URL leads to a pooler in statement mode: a transaction closes the connection."""


async def check_session_pooling(dsn: str, timeout_s: float) -> None:
    """Checks that each connection to ``dsn`` keeps one PostgreSQL session (see module docstring).

    Args:
        dsn: The PostgreSQL URL.
        timeout_s: The longest to wait for a connection, and for each statement, seconds.

    Raises:
        TransactionPooling: two connections shared a session, or (StatementPooling)
            a transaction closed the connection; its message is the one line to log.
        DatabaseUnavailable: the database cannot be reached.
    """
    with translate_errors():
        try:
            a_first, b_pid, a_second = await _probe(dsn, timeout_s)
        except asyncpg.ConnectionDoesNotExistError as exc:
            if _closed_by_statement_pooling(exc):
                raise StatementPooling(
                    f"the database connection goes through a pooler in statement mode "
                    f"({exc.__cause__}), e.g. PgBouncer pool_mode=statement: {_NEEDED}"
                ) from exc
            raise
    if a_second == a_first != b_pid:
        return
    seen = (
        f"two connections were given one session, backend pid {a_first}"
        if b_pid == a_first
        else f"a connection moved from backend pid {a_first} to {a_second}"
    )
    raise TransactionPooling(
        f"the database connection goes through a pooler in transaction mode ({seen}), e.g. "
        f"PgBouncer pool_mode=transaction: {_NEEDED}"
    )


async def _probe(dsn: str, timeout_s: float) -> tuple[int, int, int]:
    """The backend pids A reads first, B reads in its transaction, A reads then (docstring)."""
    async with _connected(dsn, timeout_s) as a, _connected(dsn, timeout_s) as b:
        a_first = await _backend_pid(a, timeout_s)
        async with b.transaction():
            b_pid: int = await b.fetchval("SELECT pg_backend_pid()", timeout=timeout_s)
            # Only when B has a session of its own may A need one meanwhile.
            a_second = a_first if b_pid == a_first else await _backend_pid(a, timeout_s)
    return a_first, b_pid, a_second


def _closed_by_statement_pooling(exc: asyncpg.ConnectionDoesNotExistError) -> bool:
    """Whether the server's last word before closing the connection was PgBouncer's refusal."""
    cause = exc.__cause__
    return isinstance(cause, asyncpg.PostgresError) and STATEMENT_POOLING_ERROR in str(cause)


async def _backend_pid(conn: asyncpg.Connection, timeout_s: float) -> int:
    """The pid of the session serving ``conn``, read in a transaction of its own.

    The transaction keeps the statement's steps (parse, then bind and run) on
    one session even through a transaction pooler.
    """
    async with conn.transaction():
        pid: int = await conn.fetchval("SELECT pg_backend_pid()", timeout=timeout_s)
    return pid


@contextlib.asynccontextmanager
async def _connected(dsn: str, timeout_s: float) -> AsyncIterator[asyncpg.Connection]:
    with translate_errors(connecting=True):
        conn = await asyncpg.connect(
            dsn,
            timeout=timeout_s,
            statement_cache_size=0,
            server_settings={"application_name": PROBE_APPLICATION_NAME},
        )
    try:
        yield conn
    finally:
        try:
            await conn.close(timeout=timeout_s)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
            conn.terminate()
