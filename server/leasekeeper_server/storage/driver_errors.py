"""How the service treats each error the database driver raises: the one table.

Every module of ``storage/`` that talks to PostgreSQL classifies driver and
network errors through the groups below and :func:`translate_errors`, so a
driver error class is named in one place. Errors leave ``storage/`` as
:class:`~leasekeeper_server.core.errors.DatabaseUnavailable` (UNAVAILABLE:
retry) or :class:`~leasekeeper_server.core.errors.DatabaseRefused` (for good:
the server exits 2 at start); anything else is a bug (INTERNAL).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import asyncpg

from leasekeeper_server.core.errors import DatabaseRefused, DatabaseUnavailable

# "The database is out of reach or refused to work now": the call may be retried.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,  # class 08
    asyncpg.InterfaceError,  # connection closed underneath us
    asyncpg.exceptions.OperatorInterventionError,  # class 57: cancel, shutdown, cannot connect now
    asyncpg.exceptions.InsufficientResourcesError,  # class 53: too many connections, disk full
    asyncpg.exceptions.LockNotAvailableError,  # lock_timeout
    asyncpg.exceptions.ReadOnlySQLTransactionError,  # a standby while a failover settles
    # The driver lost track of the protocol ("cannot switch to state 12; another
    # operation is in progress"): seen when PostgreSQL ends a session in the
    # middle of an operation (a crash, a restart). The connection is dropped.
    asyncpg.exceptions.InternalClientError,
    # The database answers but cannot run the service's statements; no request
    # is at fault, and the call may succeed later or on another replica:
    asyncpg.exceptions.InsufficientPrivilegeError,  # 42501: the service's role lost a privilege
    # 26000 and 42P05: a pooler in transaction mode ran a prepared statement on
    # another session (pooling.py refuses one at start; a pool changed since).
    asyncpg.exceptions.InvalidSQLStatementNameError,
    asyncpg.exceptions.DuplicatePreparedStatementError,
)

# "The database refuses this connection for good": the role, password, client
# address or database name (SQLSTATE classes 28 and 3D), or parameters the
# driver cannot use. Checked before UNAVAILABLE (the driver's
# ClientConfigurationError is an InterfaceError): retrying cannot help.
REFUSED: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,  # class 28
    asyncpg.exceptions.InvalidCatalogNameError,  # 3D000: no such database
    asyncpg.exceptions.ClientConfigurationError,
)

# What PostgreSQL answers while a connection opens when the URL carries a
# setting it refuses (asyncpg sends the URL's unknown query parameters as
# settings, e.g. ``?foo=bar``, ``?statement_timeout=abc``): for good, like
# REFUSED. Refused only while connecting (translate_errors(connecting=True));
# raised by a statement later, the same errors are bugs (INTERNAL).
REFUSED_AT_CONNECT: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.UndefinedObjectError,  # 42704: unrecognized configuration parameter
    asyncpg.exceptions.InvalidParameterValueError,  # 22023: invalid value for parameter
    asyncpg.exceptions.CantChangeRuntimeParamError,  # 55P02: parameter cannot be changed
)

# The driver gave up on an answer (the connection may be black-holed) or lost
# the protocol's state: the connection is dropped, never handed back to a pool.
DROP_CONNECTION: tuple[type[BaseException], ...] = (
    TimeoutError,
    asyncpg.exceptions.InternalClientError,
)

# A connection that died underneath (seen only when next used): a statement
# that was never answered may be sent once more on a new connection.
CONNECTION_LOST: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
)

# Errors the database sends that say it is slow or going away, not that it
# refuses the service's statements (Store.ping, health).
NOT_A_REFUSAL: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.QueryCanceledError,  # statement_timeout
    asyncpg.exceptions.LockNotAvailableError,  # lock_timeout
    asyncpg.exceptions.OperatorInterventionError,  # 57P0x: shutting down, starting up
)

# Whatever a background loop (the LISTEN connection, the sweeper) survives by
# logging and trying again: any database or network failure, translated or not.
BACKGROUND: tuple[type[BaseException], ...] = (
    DatabaseUnavailable,
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)


def is_lock_timeout(exc: BaseException) -> bool:
    """True for a DatabaseUnavailable that only met another call's row lock (the database works)."""
    return isinstance(exc.__cause__, asyncpg.exceptions.LockNotAvailableError)


@contextlib.contextmanager
def translate_errors(*, connecting: bool = False) -> Iterator[None]:
    """Turns driver and network errors into DatabaseUnavailable (DatabaseRefused: for good).

    Args:
        connecting: the block only opens connections (``asyncpg.connect``,
            ``create_pool``): a setting of the URL PostgreSQL refuses is a
            DatabaseRefused too.

    Raises:
        DatabaseRefused: REFUSED (and REFUSED_AT_CONNECT when connecting).
        DatabaseUnavailable: UNAVAILABLE.
    """
    refused = REFUSED + REFUSED_AT_CONNECT if connecting else REFUSED
    try:
        yield
    except refused as exc:
        raise DatabaseRefused(f"cannot connect to the database: {exc}") from exc
    except UNAVAILABLE as exc:
        raise DatabaseUnavailable(f"database unavailable: {type(exc).__name__}") from exc
