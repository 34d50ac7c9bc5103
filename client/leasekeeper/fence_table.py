"""The effect service's own fence table: refuse lower fences in the effect's transaction.

The lease contract asks every side-effect boundary to *reject any fence lower
than the highest it has accepted for that task*. An effect service with its own
database does that without a round trip to leasekeeper per write: it keeps the
highest fence it accepted per task in one table, ``leasekeeper_accepted_fences``,
and raises it with one conditional upsert (:data:`ACCEPT_FENCE_SQLITE`,
:data:`ACCEPT_FENCE_POSTGRES`) in the same transaction as the effect's own
write. Check and effect then commit together or not at all: there is no window
between them, and a fence refused here leaves nothing behind once the caller
rolls back. An equal fence passes, so one lease can make several effects.

The pattern, on SQLite (on PostgreSQL: ``async with conn.transaction():`` and
:func:`accept_fence_asyncpg`)::

    db = sqlite3.connect(path, isolation_level=None)  # explicit transactions
    ensure_schema_sqlite(db)
    db.execute("BEGIN IMMEDIATE")  # take the write lock before the check
    try:
        accept_fence_sqlite(db, ref)  # raises FenceRefused: nothing may be written
        db.execute("INSERT INTO sends ...")  # the effect, in the same transaction
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise

Concurrent writers of one task are serialized by the upsert itself: on
PostgreSQL the second waits for the first's row lock (or unique-index entry)
and then judges against the committed fence; on SQLite ``BEGIN IMMEDIATE``
serializes whole write transactions. Under REPEATABLE READ or SERIALIZABLE,
PostgreSQL may answer a concurrent update with a serialization failure
instead: retry the transaction as for any other. Never delete a row of a task
whose workers may still call: the row is what refuses their old fences.

A read that a worker uses to decide whether to act (the reconciliation
question "did my predecessor's attempt happen?") must accept the asker's fence
the same way, in the same transaction, before it reads: otherwise the older
attempt can still land after the answer "no", and the effect happens twice.

Other drivers run the same statements (constants below) with their own
placeholders. The table name is fixed; on PostgreSQL choose its schema with
``search_path``. SQLite needs version 3.35 or later (``RETURNING``).
"""

from __future__ import annotations

from typing import Any, Protocol

from .errors import StaleFence
from .fencing import FenceRef

FENCE_BELOW_ACCEPTED = "FENCE_BELOW_ACCEPTED"
"""Reason of :class:`FenceRefused`: the effect service accepted a higher fence for the task."""

MAX_FENCE = 2**63 - 1
"""Fences are int64 (proto, table)."""

SCHEMA_SQL = """\
CREATE TABLE IF NOT EXISTS leasekeeper_accepted_fences (
    namespace   TEXT NOT NULL,
    task_id     TEXT NOT NULL,
    fence       BIGINT NOT NULL CHECK (fence >= 1),
    accept_time TIMESTAMPTZ NOT NULL DEFAULT CURRENT_TIMESTAMP,
    PRIMARY KEY (namespace, task_id)
)"""
"""The table, on PostgreSQL and SQLite alike (idempotent).

``fence`` is the highest fence accepted for ``(namespace, task_id)``;
``accept_time`` is when a transaction last accepted a fence for the task (its
database's transaction time; informational, it decides nothing).
"""

# Raises the task's fence, or changes no row and returns none when the fence is
# lower: the check and the write are one statement, so two writers can never both
# pass a read-then-write check.
ACCEPT_FENCE_SQLITE = """\
INSERT INTO leasekeeper_accepted_fences (namespace, task_id, fence) VALUES (?, ?, ?)
ON CONFLICT (namespace, task_id) DO UPDATE
SET fence = excluded.fence, accept_time = CURRENT_TIMESTAMP
WHERE excluded.fence >= leasekeeper_accepted_fences.fence
RETURNING fence"""
"""Accept ``(namespace, task_id, fence)``: one row back when accepted, none when refused.

``?`` placeholders (SQLite, and DB-API drivers of paramstyle ``qmark``).
"""

ACCEPT_FENCE_POSTGRES = """\
INSERT INTO leasekeeper_accepted_fences (namespace, task_id, fence)
VALUES ($1::text, $2::text, $3::bigint)
ON CONFLICT (namespace, task_id) DO UPDATE
SET fence = excluded.fence, accept_time = CURRENT_TIMESTAMP
WHERE excluded.fence >= leasekeeper_accepted_fences.fence
RETURNING fence"""
""":data:`ACCEPT_FENCE_SQLITE` with PostgreSQL's ``$n`` placeholders (asyncpg)."""

HIGHEST_FENCE_SQLITE = """\
SELECT fence FROM leasekeeper_accepted_fences
WHERE namespace = ? AND task_id = ?"""
"""The highest fence accepted for ``(namespace, task_id)``; no row for a task never seen."""

HIGHEST_FENCE_POSTGRES = """\
SELECT fence FROM leasekeeper_accepted_fences
WHERE namespace = $1::text AND task_id = $2::text"""
""":data:`HIGHEST_FENCE_SQLITE` with PostgreSQL's ``$n`` placeholders (asyncpg)."""

# Two services starting at once could both run CREATE TABLE IF NOT EXISTS and one
# fail on PostgreSQL's catalog (a known race): the first takes this lock, the
# second then finds the table. Transaction-scoped: gone at the implicit commit.
_SCHEMA_LOCK_POSTGRES = "SELECT pg_advisory_xact_lock(hashtext('leasekeeper_accepted_fences'))"


class FenceRefused(StaleFence):
    """The effect service accepted a higher fence for this task: refuse the effect.

    The caller rolls its transaction back (nothing of the effect may commit)
    and answers ABORTED with ``reason`` ``FENCE_BELOW_ACCEPTED``; the worker's
    client then raises ``LeaseLost``.

    Attributes:
        highest_fence: The highest fence accepted for the task (also
            ``current_fence``, and ``highest_fence`` in ``metadata``).
    """

    def __init__(self, namespace: str, task_id: str, fence: int, highest_fence: int) -> None:
        super().__init__(FENCE_BELOW_ACCEPTED, highest_fence, namespace, task_id, fence)
        self.args = (
            f"fence {fence} for {namespace}/{task_id} is below fence {highest_fence} "
            f"already accepted: {FENCE_BELOW_ACCEPTED}",
        )
        self.highest_fence = highest_fence
        self.metadata["highest_fence"] = str(highest_fence)


class AsyncConnection(Protocol):
    """What :func:`accept_fence_asyncpg` needs of a connection (an ``asyncpg.Connection``)."""

    async def fetchrow(self, query: str, *args: Any) -> Any:
        """Run ``query``; its first row or None."""

    async def execute(self, query: str, *args: Any) -> Any:
        """Run ``query`` (several statements when there are no ``args``)."""


def _params(ref: FenceRef) -> tuple[str, str, int]:
    if not 1 <= ref.fence <= MAX_FENCE:
        raise ValueError(f"fence must be an integer in [1, 2**63 - 1], got {ref.fence}")
    return ref.namespace, ref.task_id, ref.fence


def _refused(ref: FenceRef, row: Any) -> FenceRefused:
    if row is None:  # the upsert found the row and kept it locked: it cannot vanish
        raise RuntimeError(f"no accepted fence for {ref.namespace}/{ref.task_id} after a refusal")
    return FenceRefused(ref.namespace, ref.task_id, ref.fence, int(row[0]))


def ensure_schema_sqlite(conn: Any) -> None:
    """Create ``leasekeeper_accepted_fences`` unless it exists. Idempotent.

    Args:
        conn: A ``sqlite3.Connection`` (or a DB-API connection of a database
            that accepts :data:`SCHEMA_SQL`).

    """
    cursor = conn.cursor()
    try:
        cursor.execute(SCHEMA_SQL)
    finally:
        cursor.close()


def accept_fence_sqlite(conn: Any, ref: FenceRef) -> int:
    """Accept ``ref.fence`` for its task, in the caller's open transaction, or refuse it.

    One statement (:data:`ACCEPT_FENCE_SQLITE`): the task's highest accepted
    fence becomes ``ref.fence`` when it is equal or higher; a lower fence
    changes nothing. Idempotent for the same fence. Make the effect's write in
    the same transaction, after this call; begin it with ``BEGIN IMMEDIATE``
    so that concurrent writers queue for the write lock instead of failing
    with ``database is locked`` halfway.

    Args:
        conn: A ``sqlite3.Connection`` (or DB-API ``qmark`` connection) with a
            transaction open. The table must exist (:func:`ensure_schema_sqlite`).
        ref: The lease the effect is made under; fence in [1, 2**63 - 1].

    Returns:
        ``ref.fence``, now the task's highest accepted fence.

    Raises:
        FenceRefused: A higher fence was accepted for the task (``highest_fence``).
            Nothing was written: roll back and answer ABORTED.
        ValueError: ``ref.fence`` is out of range.
        RuntimeError: ``conn`` is in autocommit mode with no transaction open:
            the check would commit apart from the effect.

    """
    params = _params(ref)
    if not getattr(conn, "in_transaction", True) and (
        getattr(conn, "autocommit", None) is True or getattr(conn, "isolation_level", "") is None
    ):
        raise RuntimeError("accept_fence_sqlite needs an open transaction (BEGIN IMMEDIATE)")
    cursor = conn.cursor()
    try:
        cursor.execute(ACCEPT_FENCE_SQLITE, params)
        row = cursor.fetchone()
        if row is None:
            cursor.execute(HIGHEST_FENCE_SQLITE, params[:2])
            raise _refused(ref, cursor.fetchone())
    finally:
        cursor.close()
    return int(row[0])


async def ensure_schema_asyncpg(conn: AsyncConnection) -> None:
    """Create ``leasekeeper_accepted_fences`` unless it exists, on PostgreSQL.

    Idempotent, also when several services run it at once (an advisory lock
    held for the statement's transaction serializes them).

    Args:
        conn: An ``asyncpg.Connection`` (any object with its ``execute``).

    """
    await conn.execute(f"{_SCHEMA_LOCK_POSTGRES};\n{SCHEMA_SQL}")


async def accept_fence_asyncpg(conn: AsyncConnection, ref: FenceRef) -> int:
    """Accept ``ref.fence`` for its task, in the caller's open transaction, or refuse it.

    One statement (:data:`ACCEPT_FENCE_POSTGRES`), as :func:`accept_fence_sqlite`.
    The upsert locks the task's row until the transaction ends, so a
    concurrent writer of the same task waits and is judged against this
    transaction's outcome: after a commit of fence 3, fence 2 is refused.

    Args:
        conn: An ``asyncpg.Connection`` inside ``conn.transaction()`` (any
            object with ``fetchrow``; ``is_in_transaction`` is checked when present).
            The table must exist (:func:`ensure_schema_asyncpg`).
        ref: The lease the effect is made under; fence in [1, 2**63 - 1].

    Returns:
        ``ref.fence``, now the task's highest accepted fence.

    Raises:
        FenceRefused: A higher fence was accepted for the task (``highest_fence``).
            Nothing was written: roll back and answer ABORTED.
        ValueError: ``ref.fence`` is out of range.
        RuntimeError: ``conn`` has no transaction open: the check would commit
            apart from the effect.

    """
    params = _params(ref)
    in_transaction = getattr(conn, "is_in_transaction", None)
    if in_transaction is not None and not in_transaction():
        raise RuntimeError("accept_fence_asyncpg needs an open transaction (conn.transaction())")
    row = await conn.fetchrow(ACCEPT_FENCE_POSTGRES, *params)
    if row is None:
        raise _refused(ref, await conn.fetchrow(HIGHEST_FENCE_POSTGRES, *params[:2]))
    return int(row[0])
