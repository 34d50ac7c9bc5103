"""Driver errors leave the store as DatabaseUnavailable; a broken connection is dropped.

asyncpg raises ``InternalClientError`` ("cannot switch to state 12; another
operation (2) is in progress") when PostgreSQL ends a session in the middle
of an operation; tests/fault/test_postgres_restart.py met it a few times in
fifty runs, answered INTERNAL. It cannot be provoked on demand, so here the
driver's method raises it once, on a real pool and a real database.
"""

from __future__ import annotations

import asyncpg
import pytest

from leasekeeper_server.core.errors import DatabaseUnavailable
from leasekeeper_server.rpc.validate import TaskKey
from leasekeeper_server.storage.store import Store
from tests.conftest import make_settings


async def test_internal_client_error_is_unavailable_and_connection_dropped(
    database_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await Store.open(database_url, make_settings(database_url))
    try:
        broken: list[asyncpg.Connection] = []
        # get_lease reads through the batched get_leases statement (Connection.fetch).
        real_fetch = asyncpg.connection.Connection.fetch

        async def fetch_once_broken(self: asyncpg.Connection, *args: object, **kw: object):
            if not broken:
                broken.append(self)
                raise asyncpg.exceptions.InternalClientError(
                    "cannot switch to state 12; another operation (2) is in progress"
                )
            return await real_fetch(self, *args, **kw)

        monkeypatch.setattr(asyncpg.connection.Connection, "fetch", fetch_once_broken)
        key = TaskKey(namespace, "t")
        with pytest.raises(DatabaseUnavailable, match="InternalClientError"):
            await store.get_lease(key)
        assert broken[0].is_closed()  # terminated, not handed back to the pool
        assert await store.get_lease(key) is None  # the next call gets a sound connection
    finally:
        await store.close()


async def test_ping_fails_where_writes_cannot_run(database_url: str) -> None:
    """The health ping takes the write path: a read-only session fails it, a writable one not."""
    separator = "&" if "?" in database_url else "?"
    read_only_url = f"{database_url}{separator}default_transaction_read_only=on"
    for url, writable in ((database_url, True), (read_only_url, False)):
        store = await Store.open(url, make_settings(url))
        try:
            if writable:
                await store.ping()
            else:
                with pytest.raises(DatabaseUnavailable, match="ReadOnlySQLTransactionError"):
                    await store.ping()
            # Not a call's statement: the health check judges the ping on its own.
            assert store.outcomes.ended == 0
        finally:
            await store.close()
