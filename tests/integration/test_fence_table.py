"""leasekeeper.fence_table on a real PostgreSQL (asyncpg) and a real SQLite file.

Every test of the rule runs on both databases through one small adapter: a
transaction that accepts the fence and writes an "effect" row (a stand-in for
the effect service's own write), committed together or rolled back together.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import asyncpg
import pytest

from leasekeeper import FenceRef, StaleFence
from leasekeeper.fence_table import (
    FENCE_BELOW_ACCEPTED,
    FenceRefused,
    accept_fence_asyncpg,
    accept_fence_sqlite,
    ensure_schema_asyncpg,
    ensure_schema_sqlite,
)
from tests.helpers import poll

pytestmark = pytest.mark.timeout(60)

POLL_INTERVAL_S = 0.01
WAIT_TIMEOUT_S = 10.0
EFFECTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    namespace TEXT NOT NULL, task_id TEXT NOT NULL, fence BIGINT NOT NULL, note TEXT NOT NULL
)"""
ROW_SQLITE = """
SELECT fence, accept_time FROM leasekeeper_accepted_fences WHERE namespace = ? AND task_id = ?"""
ROW_POSTGRES = """
SELECT fence, accept_time FROM leasekeeper_accepted_fences WHERE namespace = $1 AND task_id = $2"""
EFFECTS_SQLITE = "SELECT fence, note FROM effects WHERE namespace = ? AND task_id = ? ORDER BY note"
EFFECTS_POSTGRES = (
    "SELECT fence, note FROM effects WHERE namespace = $1 AND task_id = $2 ORDER BY note"
)


class Store(Protocol):
    """An effect service's database, as the tests drive it."""

    async def apply(self, ref: FenceRef, note: str, effect_first: bool = False) -> int:
        """One transaction: accept ``ref`` and write one effect row; raises FenceRefused."""
        ...

    async def row(self, namespace: str, task_id: str) -> tuple[int, Any] | None:
        """The task's (fence, accept_time), or None."""
        ...

    async def effects(self, namespace: str, task_id: str) -> list[tuple[int, str]]:
        """The task's committed effect rows: (fence, note), by note."""
        ...

    async def ensure_schema(self) -> None: ...


class PostgresStore:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def ensure_schema(self) -> None:
        await ensure_schema_asyncpg(self.conn)

    async def apply(self, ref: FenceRef, note: str, effect_first: bool = False) -> int:
        async with self.conn.transaction():
            if effect_first:
                await self._effect(ref, note)
            fence = await accept_fence_asyncpg(self.conn, ref)
            if not effect_first:
                await self._effect(ref, note)
            return fence

    async def _effect(self, ref: FenceRef, note: str) -> None:
        await self.conn.execute(
            "INSERT INTO effects VALUES ($1, $2, $3, $4)",
            ref.namespace,
            ref.task_id,
            ref.fence,
            note,
        )

    async def row(self, namespace: str, task_id: str) -> tuple[int, Any] | None:
        found = await self.conn.fetchrow(ROW_POSTGRES, namespace, task_id)
        return None if found is None else (found[0], found[1])

    async def effects(self, namespace: str, task_id: str) -> list[tuple[int, str]]:
        return [tuple(r) for r in await self.conn.fetch(EFFECTS_POSTGRES, namespace, task_id)]


class SqliteStore:
    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)

    async def ensure_schema(self) -> None:
        ensure_schema_sqlite(self.db)

    async def apply(self, ref: FenceRef, note: str, effect_first: bool = False) -> int:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            if effect_first:
                self._effect(ref, note)
            fence = accept_fence_sqlite(self.db, ref)
            if not effect_first:
                self._effect(ref, note)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return fence

    def _effect(self, ref: FenceRef, note: str) -> None:
        self.db.execute(
            "INSERT INTO effects VALUES (?, ?, ?, ?)", (ref.namespace, ref.task_id, ref.fence, note)
        )

    async def row(self, namespace: str, task_id: str) -> tuple[int, Any] | None:
        return self.db.execute(ROW_SQLITE, (namespace, task_id)).fetchone()

    async def effects(self, namespace: str, task_id: str) -> list[tuple[int, str]]:
        return self.db.execute(EFFECTS_SQLITE, (namespace, task_id)).fetchall()


Connect = Callable[[], Awaitable[asyncpg.Connection]]


@contextlib.asynccontextmanager
async def schema_of_its_own(database_url: str) -> AsyncIterator[Connect]:
    """Connections whose search_path is a fresh schema, dropped on the way out."""
    schema = f"fence_table_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(database_url)
    await admin.execute(f'CREATE SCHEMA "{schema}"')
    opened: list[asyncpg.Connection] = []

    async def connect() -> asyncpg.Connection:
        conn = await asyncpg.connect(database_url, server_settings={"search_path": schema})
        opened.append(conn)
        return conn

    try:
        yield connect
    finally:
        for conn in opened:
            await conn.close()
        await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await admin.close()


@pytest.fixture
async def pg_connect(database_url: str) -> AsyncIterator[Connect]:
    async with schema_of_its_own(database_url) as connect:
        yield connect


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    return tmp_path / "effects.sqlite3"


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """Which database; PostgreSQL's URL is resolved only for its own runs."""
    if request.param == "postgres":
        return "postgres", request.getfixturevalue("database_url")
    return "sqlite", None


@pytest.fixture
async def store(backend: tuple[str, str | None], sqlite_path: Path) -> AsyncIterator[Store]:
    """An effect service's database with the fence table and an effects table."""
    kind, database_url = backend
    if kind == "postgres":
        assert database_url is not None
        async with schema_of_its_own(database_url) as connect:
            conn = await connect()
            await conn.execute(EFFECTS_SCHEMA)
            pg_store = PostgresStore(conn)
            await pg_store.ensure_schema()
            yield pg_store
        return
    sqlite_store = SqliteStore(sqlite_path)
    try:
        sqlite_store.db.execute(EFFECTS_SCHEMA)
        await sqlite_store.ensure_schema()
        yield sqlite_store
    finally:
        sqlite_store.db.close()


async def test_accept_fence_first_fence_is_accepted_with_its_effect(store):
    assert await store.apply(FenceRef("ns", "t", 1), "one") == 1
    assert (await store.row("ns", "t"))[0] == 1
    assert await store.effects("ns", "t") == [(1, "one")]


@pytest.mark.parametrize(
    ("first", "second"), [(2, 2), (2, 3), (1, 7)], ids=["equal", "higher", "much-higher"]
)
async def test_accept_fence_equal_or_higher_is_accepted(store, first, second):
    await store.apply(FenceRef("ns", "t", first), "a")
    assert await store.apply(FenceRef("ns", "t", second), "b") == second
    assert (await store.row("ns", "t"))[0] == second
    assert await store.effects("ns", "t") == [(first, "a"), (second, "b")]


@pytest.mark.parametrize("effect_first", [False, True], ids=["effect-after", "effect-before"])
async def test_accept_fence_lower_is_refused_and_its_effect_rolled_back(store, effect_first):
    await store.apply(FenceRef("ns", "t", 3), "accepted")
    before = await store.row("ns", "t")

    with pytest.raises(FenceRefused) as refused:
        await store.apply(FenceRef("ns", "t", 2), "refused", effect_first=effect_first)

    error = refused.value
    assert isinstance(error, StaleFence)
    assert (error.reason, error.highest_fence, error.current_fence) == (FENCE_BELOW_ACCEPTED, 3, 3)
    assert (error.namespace, error.task_id, error.fence) == ("ns", "t", 2)
    assert error.metadata["highest_fence"] == "3"
    assert await store.row("ns", "t") == before  # fence and accept_time untouched
    assert await store.effects("ns", "t") == [(3, "accepted")]


async def test_accept_fence_tasks_are_independent(store):
    await store.apply(FenceRef("ns", "t1", 5), "high")
    assert await store.apply(FenceRef("ns", "t2", 1), "other task") == 1
    assert await store.apply(FenceRef("ns2", "t1", 1), "other namespace") == 1
    assert [
        (await store.row(ns, t))[0] for ns, t in [("ns", "t1"), ("ns", "t2"), ("ns2", "t1")]
    ] == [
        5,
        1,
        1,
    ]


async def test_ensure_schema_again_is_harmless_and_keeps_rows(store):
    await store.apply(FenceRef("ns", "t", 4), "kept")
    await store.ensure_schema()
    await store.ensure_schema()
    assert (await store.row("ns", "t"))[0] == 4
    with pytest.raises(FenceRefused):
        await store.apply(FenceRef("ns", "t", 3), "still refused")


@pytest.mark.parametrize("fence", [0, -1, 2**63])
async def test_accept_fence_out_of_range_raises_value_error(store, fence):
    with pytest.raises(ValueError, match="fence must be"):
        await store.apply(FenceRef("ns", "t", fence), "never")
    assert await store.row("ns", "t") is None
    assert await store.effects("ns", "t") == []


async def test_accept_fence_asyncpg_outside_a_transaction_raises(pg_connect):
    conn = await pg_connect()
    await ensure_schema_asyncpg(conn)
    with pytest.raises(RuntimeError, match="open transaction"):
        await accept_fence_asyncpg(conn, FenceRef("ns", "t", 1))
    assert await conn.fetchval("SELECT count(*) FROM leasekeeper_accepted_fences") == 0


def test_accept_fence_sqlite_autocommit_without_transaction_raises(sqlite_path):
    db = sqlite3.connect(sqlite_path, isolation_level=None)
    try:
        ensure_schema_sqlite(db)
        with pytest.raises(RuntimeError, match="open transaction"):
            accept_fence_sqlite(db, FenceRef("ns", "t", 1))
        assert db.execute("SELECT count(*) FROM leasekeeper_accepted_fences").fetchone() == (0,)
    finally:
        db.close()


def test_accept_fence_sqlite_default_connection_opens_its_transaction(sqlite_path):
    """Python's default (deferred, implicit BEGIN) mode: the upsert opens the transaction."""
    db = sqlite3.connect(sqlite_path)
    try:
        ensure_schema_sqlite(db)
        assert accept_fence_sqlite(db, FenceRef("ns", "t", 2)) == 2
        assert db.in_transaction
        db.rollback()
        assert db.execute("SELECT count(*) FROM leasekeeper_accepted_fences").fetchone() == (0,)
    finally:
        db.close()


def test_accept_fence_sqlite_second_connection_sees_committed_higher_fence(sqlite_path):
    first, second = (sqlite3.connect(sqlite_path, isolation_level=None) for _ in range(2))
    try:
        ensure_schema_sqlite(first)
        first.execute("BEGIN IMMEDIATE")
        accept_fence_sqlite(first, FenceRef("ns", "t", 3))
        second.execute("PRAGMA busy_timeout = 0")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            second.execute("BEGIN IMMEDIATE")  # one writer at a time: check and effect as one
        first.execute("COMMIT")

        second.execute("BEGIN IMMEDIATE")
        with pytest.raises(FenceRefused) as refused:
            accept_fence_sqlite(second, FenceRef("ns", "t", 2))
        second.execute("ROLLBACK")
        assert refused.value.highest_fence == 3
    finally:
        first.close()
        second.close()


async def _wait_until_blocked(observer: asyncpg.Connection, pid: int) -> None:
    """Poll until backend ``pid`` waits for a lock held by another backend."""

    async def blocked() -> bool:
        return bool(await observer.fetchval("SELECT cardinality(pg_blocking_pids($1)) > 0", pid))

    await poll(blocked, f"backend {pid} waiting for a lock", WAIT_TIMEOUT_S, POLL_INTERVAL_S)


@pytest.mark.parametrize("existing", [False, True], ids=["new-task", "task-seen-before"])
@pytest.mark.parametrize(
    ("first", "second", "first_ends", "second_accepted"),
    [
        (3, 2, "commit", False),
        (2, 3, "commit", True),
        (3, 2, "rollback", True),
        (2, 2, "commit", True),
    ],
    ids=["3-commits-then-2", "2-commits-then-3", "3-rolls-back-then-2", "2-and-2"],
)
async def test_accept_fence_asyncpg_concurrent_writer_waits_and_is_judged_after_commit(
    pg_connect, existing, first, second, first_ends, second_accepted
):
    observer, a, b = await pg_connect(), await pg_connect(), await pg_connect()
    await ensure_schema_asyncpg(observer)
    await observer.execute(EFFECTS_SCHEMA)
    ns = "ns"
    if existing:
        async with observer.transaction():
            await accept_fence_asyncpg(observer, FenceRef(ns, "t", 1))
    a_store, b_store = PostgresStore(a), PostgresStore(b)

    tx_a = a.transaction()
    await tx_a.start()
    await accept_fence_asyncpg(a, FenceRef(ns, "t", first))
    await a_store._effect(FenceRef(ns, "t", first), "a")

    b_done = asyncio.ensure_future(b_store.apply(FenceRef(ns, "t", second), "b"))
    try:
        await _wait_until_blocked(observer, b.get_server_pid())
        assert not b_done.done()
        await (tx_a.commit() if first_ends == "commit" else tx_a.rollback())
        if second_accepted:
            assert await b_done == second
        else:
            with pytest.raises(FenceRefused) as refused:
                await b_done
            assert refused.value.highest_fence == first
    finally:
        if not b_done.done():
            b_done.cancel()

    committed = [(first, "a")] if first_ends == "commit" else []
    committed += [(second, "b")] if second_accepted else []
    expected_fence = max(fence for fence, _ in committed)
    observed = PostgresStore(observer)
    assert (await observed.row(ns, "t"))[0] == expected_fence
    assert sorted(await observed.effects(ns, "t")) == sorted(committed)


async def test_ensure_schema_asyncpg_concurrent_first_runs_all_succeed(pg_connect):
    """Without the advisory lock, concurrent CREATE TABLE IF NOT EXISTS can hit a catalog race."""
    conns = [await pg_connect() for _ in range(8)]
    await asyncio.gather(*(ensure_schema_asyncpg(conn) for conn in conns))
    async with conns[0].transaction():
        assert await accept_fence_asyncpg(conns[0], FenceRef("ns", "t", 1)) == 1


def test_fence_table_import_does_not_load_asyncpg():
    code = "import sys, leasekeeper.fence_table; sys.exit('asyncpg' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
