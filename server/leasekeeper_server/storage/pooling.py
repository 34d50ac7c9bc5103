"""The pool mode: how the service's statements reach PostgreSQL through a pooler, checked at start.

``LEASEKEEPER_DATABASE_POOL_MODE`` says what ``database_url`` leads to:

``session`` (the default): each connection keeps one PostgreSQL session
(PostgreSQL itself, or PgBouncer ``pool_mode=session``). asyncpg prepares each
statement once per connection and keeps it (its statement cache), and the
timeouts are session settings sent when the connection opens.

``transaction``: a pooler hands a session to a client for one transaction at
a time (PgBouncer ``pool_mode=transaction``), so nothing the service relies
on may outlive a transaction (:class:`Pooling`):

- no named prepared statement: asyncpg's statement cache is off
  (``statement_cache_size=0``), so a statement is described on one session
  and then parsed again with its parameters in the same message group that
  runs it (asyncpg re-parses an unnamed statement when its cache is off):
  one more round trip per statement;
- no session setting: PgBouncer 1.18 passes ``application_name`` (and the
  encoding, date style and time zone) from the startup packet and refuses the
  others (or ignores them, when listed in ``ignore_startup_parameters``), so
  every statement sent through the pooler runs in a transaction of its own
  that begins by setting its timeouts: ``BEGIN; SET LOCAL statement_timeout
  ...; SET LOCAL lock_timeout ...`` in one message, the statement, ``COMMIT``
  (a transaction of several statements sets them once). Four round trips
  for a single statement where session mode takes one;
- ``LISTEN`` (storage/events.py), the migration's session advisory lock
  (storage/migrate.py) and the expiry sweeper's election (a session advisory
  lock, storage/sweeper.py) need a session: they connect to
  ``direct_database_url`` instead, PostgreSQL itself (required in this mode).

A pooler in statement mode (PgBouncer ``pool_mode=statement``) allows no
transaction block: the service cannot work through it.

At start, :func:`check_pool_mode` probes ``database_url`` and refuses (status 2,
in one line, as for any setting that can never work: cli/main.py) a pooler in
statement mode, and a pooler in transaction mode while the pool mode is
``session`` (its prepared statements would land on other sessions:
``prepared statement "__asyncpg_stmt_…" does not exist``), rather than serve
calls it cannot decide; :func:`check_direct` refuses a direct URL that does
not keep its session. Transaction mode on a URL that keeps its session works
(every connection simply keeps one), and is only logged.

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
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import asyncpg

from leasekeeper_server.core.errors import DatabaseRefused, DatabaseUnavailable
from leasekeeper_server.storage import driver_errors
from leasekeeper_server.storage.driver_errors import translate_errors

log = logging.getLogger(__name__)

PoolMode = Literal["session", "transaction"]
SESSION: PoolMode = "session"
TRANSACTION: PoolMode = "transaction"

PROBE_APPLICATION_NAME = "leasekeeper-pool-probe"

# The session settings PgBouncer 1.18 passes from a client's startup packet to
# the sessions it hands out (it tracks them per client); of the service's, only this.
PASSED_BY_POOLERS = frozenset({"application_name"})

# What PgBouncer says before closing a client that opens a transaction block in
# statement mode ("... statement pooling mode" in 1.18, "... statement pool mode" before).
STATEMENT_POOLING_ERROR = "transaction blocks not allowed in statement pool"

_SESSION_MODE_SETTINGS = (
    "set LEASEKEEPER_DATABASE_POOL_MODE=transaction and LEASEKEEPER_DIRECT_DATABASE_URL "
    "(PostgreSQL itself, for notifications, migrations and the sweeper's election), "
    "or use PgBouncer pool_mode=session"
)
_MODES_SUPPORTED = (
    "use PgBouncer pool_mode=session, or pool_mode=transaction with "
    "LEASEKEEPER_DATABASE_POOL_MODE=transaction and LEASEKEEPER_DIRECT_DATABASE_URL, "
    "or connect to PostgreSQL directly"
)


class TransactionPooling(DatabaseRefused):
    """The database URL leads to a pooler in transaction mode the settings do not expect.

    No retry helps (exit 2 at start).
    """


class StatementPooling(TransactionPooling):
    """The database URL leads to a pooler in statement mode: a transaction closes the connection."""


class DirectDatabaseRefused(DatabaseRefused):
    """``direct_database_url`` is refused for good (a role, a database, a pooler): exit 2 at start.

    ``setting`` names the setting to fix (cli/main.py says it first).
    """

    setting = "direct_database_url"


@dataclass(frozen=True, slots=True)
class Pooling:
    """How one connection pool's sessions get their settings, in a pool mode.

    Attributes:
        mode: session or transaction (module docstring).
        session_settings: the PostgreSQL settings each statement runs under
            (``application_name``, ``statement_timeout`` and ``lock_timeout``
            in milliseconds, ...).
        rollback_timeout_s: the longest a transaction-mode statement that
            failed waits for its ROLLBACK before its connection is dropped,
            seconds.
    """

    mode: PoolMode = SESSION
    session_settings: Mapping[str, str] = field(default_factory=dict)
    rollback_timeout_s: float = 1.0

    @property
    def server_settings(self) -> dict[str, str]:
        """The settings to send when a connection opens: all in session mode, else those passed."""
        if self.mode == SESSION:
            return dict(self.session_settings)
        return {k: v for k, v in self.session_settings.items() if k in PASSED_BY_POOLERS}

    @property
    def connect_options(self) -> dict[str, Any]:
        """The driver's connection options for the mode: no statement cache in transaction mode."""
        return {"statement_cache_size": 0} if self.mode == TRANSACTION else {}

    @property
    def begin(self) -> str:
        """Transaction mode's first message: BEGIN, then the settings not sent at connect."""
        local = [
            f"SET LOCAL {name} = {_quoted(value)}"
            for name, value in self.session_settings.items()
            if name not in PASSED_BY_POOLERS
        ]
        return "; ".join(["BEGIN", *local])

    @contextlib.asynccontextmanager
    async def transaction(self, conn: asyncpg.Connection) -> AsyncIterator[None]:
        """One transaction on ``conn``: committed when the block ends, rolled back when it raises.

        Transaction mode: it begins by setting the session settings
        (``begin``), and a ROLLBACK that fails or waits past
        ``rollback_timeout_s`` drops the connection.
        """
        if self.mode == SESSION:
            async with conn.transaction():
                yield
            return
        await conn.execute(self.begin)
        try:
            yield
        except BaseException as exc:
            await self._roll_back(conn, exc)
            raise
        await conn.execute("COMMIT")

    @contextlib.asynccontextmanager
    async def statement(self, conn: asyncpg.Connection) -> AsyncIterator[None]:
        """Around one statement sent alone: nothing in session mode, a transaction otherwise."""
        if self.mode == SESSION:
            yield
            return
        async with self.transaction(conn):
            yield

    async def _roll_back(self, conn: asyncpg.Connection, exc: BaseException) -> None:
        """Ends the failed transaction, or drops a connection that cannot be trusted to.

        After ``_DEAD`` nothing is sent: the connection is gone, or its caller
        drops it (driver_errors.DROP_CONNECTION; a black-holed one would hold
        the ROLLBACK too).
        """
        if isinstance(exc, _DEAD) or conn.is_closed():
            return
        try:
            await conn.execute("ROLLBACK", timeout=self.rollback_timeout_s)
        except (*driver_errors.UNAVAILABLE, asyncpg.PostgresError):
            conn.terminate()


# The driver gave up on an answer, or the connection is gone: no ROLLBACK is sent.
_DEAD: tuple[type[BaseException], ...] = (
    *driver_errors.DROP_CONNECTION,
    *driver_errors.CONNECTION_LOST,
)


def _quoted(value: str) -> str:
    """A setting's value as an SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


async def check_pool_mode(dsn: str, mode: PoolMode, timeout_s: float) -> None:
    """Checks that ``dsn`` can be used in pool mode ``mode`` (see the module docstring).

    Args:
        dsn: The PostgreSQL URL (``database_url``).
        mode: ``database_pool_mode``.
        timeout_s: The longest to wait for a connection, and for each statement, seconds.

    Raises:
        TransactionPooling: (a DatabaseRefused) a pooler in transaction mode
            while ``mode`` is session, or (StatementPooling) in statement mode;
            its message is the one line to log.
        DatabaseUnavailable: the database cannot be reached.
    """
    found = await _probe_mode(dsn, timeout_s, _MODES_SUPPORTED)
    if found is None:
        if mode == TRANSACTION:
            log.info(
                "LEASEKEEPER_DATABASE_POOL_MODE=transaction on a database URL whose connections "
                "keep their session: it works, with more round trips than session mode"
            )
        return
    if mode == SESSION:
        raise TransactionPooling(
            f"the database connection goes through a pooler in transaction mode ({found}), e.g. "
            f"PgBouncer pool_mode=transaction: {_SESSION_MODE_SETTINGS}"
        )


async def check_direct(dsn: str, timeout_s: float) -> None:
    """Checks that each connection to ``direct_database_url`` keeps one PostgreSQL session.

    Raises:
        DirectDatabaseRefused: it leads to a pooler in transaction or statement
            mode, or it is refused for good; the message is the one line to log.
        DatabaseUnavailable: it cannot be reached (the message says it is the
            direct connection).
    """
    with direct_connection():
        found = await _probe_mode(dsn, timeout_s, "connect it to PostgreSQL itself")
        if found is not None:
            raise DirectDatabaseRefused(
                f"the direct connection goes through a pooler in transaction mode ({found}): "
                "LISTEN and session advisory locks need a session of their own; "
                "connect it to PostgreSQL itself"
            )


@contextlib.contextmanager
def direct_connection() -> Iterator[None]:
    """Names the direct connection in the errors of the block (it uses ``direct_database_url``).

    Raises:
        DirectDatabaseRefused: for a DatabaseRefused.
        DatabaseUnavailable: for a DatabaseUnavailable, saying it is the direct connection.
    """
    try:
        yield
    except DirectDatabaseRefused:
        raise
    except DatabaseRefused as exc:
        raise DirectDatabaseRefused(f"the direct connection: {exc}") from exc
    except DatabaseUnavailable as exc:
        raise DatabaseUnavailable(
            f"the direct connection (LEASEKEEPER_DIRECT_DATABASE_URL): {exc}"
        ) from exc


async def _probe_mode(dsn: str, timeout_s: float, advice: str) -> str | None:
    """What shows a pooler in transaction mode before ``dsn`` (the docstring's probe), or None.

    Raises:
        StatementPooling: a pooler in statement mode (``advice`` ends the message).
        DatabaseUnavailable: the database cannot be reached.
    """
    with translate_errors():
        try:
            a_first, b_pid, a_second = await _probe(dsn, timeout_s)
        except asyncpg.ConnectionDoesNotExistError as exc:
            if _closed_by_statement_pooling(exc):
                raise StatementPooling(
                    f"the database connection goes through a pooler in statement mode "
                    f"({exc.__cause__}), e.g. PgBouncer pool_mode=statement, which leasekeeper "
                    f"cannot work through: {advice}"
                ) from exc
            raise
    if a_second == a_first != b_pid:
        return None
    if b_pid == a_first:
        return f"two connections were given one session, backend pid {a_first}"
    return f"a connection moved from backend pid {a_first} to {a_second}"


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
