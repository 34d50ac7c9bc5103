"""The batched statements, typed: one parameter type each, one SQL text for one call or many.

``claim``, ``renew`` and ``get_leases`` (``sql/queries.sql``) take arrays, one
element per call, named by the statement's ``unnest(...) AS p(names)``. A
single call is a batch of one, so each decision is written once in SQL. The
parameters of a statement are a frozen dataclass whose fields are those names
in that order (:class:`ClaimParams`, :class:`RenewParams`, and
:class:`~leasekeeper_server.core.model.TaskKey` for reads):
:meth:`BatchedStatement.arrays` turns a batch into the statement's arguments
by field, and
:class:`BatchedStatement` refuses at start a dataclass whose fields do not
match the SQL's names, so no argument is placed by position by hand.

:class:`BatchedStatement` runs the calls arriving together as one statement
(``batch.Coalescer``: at most one in flight, one per tick while busy), on a
connection of the batch pool it keeps between batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, Protocol, TypeAlias, TypeVar, cast

import asyncpg

from leasekeeper_server.core.errors import DatabaseUnavailable
from leasekeeper_server.storage import driver_errors
from leasekeeper_server.storage.batch import Coalescer
from leasekeeper_server.storage.outcomes import StatementOutcomes
from leasekeeper_server.storage.pooling import Pooling


@dataclass(frozen=True, slots=True)
class ClaimParams:
    """One claim: the parameters of statement ``claim``, in its order.

    Attributes:
        ttl: the lease's length (clamped to ``max_runtime`` by the statement).
        max_runtime: the runtime budget from the grant.
        request_id: the claim's request id (AIP-155), or None for none.
        lock_delay: the namespace's lock delay after an expiry (zero for none).
        max_attempts: the grant's attempt limit (None for none).
    """

    namespace: str
    task_id: str
    owner_id: str
    ttl: timedelta
    max_runtime: timedelta
    request_id: str | None
    lock_delay: timedelta
    max_attempts: int | None


@dataclass(frozen=True, slots=True)
class RenewParams:
    """One renewal: the parameters of statement ``renew``, in its order.

    Attributes:
        fence: the lease's fence; only that fence's live lease is extended.
        ttl: the new remaining time (never past the runtime deadline); None:
            not renewed (a checkpoint written on its own).
        checkpoint_version: a checkpoint to store with the renewal when higher
            than the stored version; None: no checkpoint. Its data and
            content type follow.
    """

    namespace: str
    task_id: str
    owner_id: str
    fence: int
    ttl: timedelta | None
    checkpoint_version: int | None = None
    checkpoint_data: bytes | None = None
    checkpoint_content_type: str | None = None


class Unsent(enum.Enum):
    """A batched call's answer when its statement did not decide it."""

    # A claim left out of a batch that already claimed its task: decided by
    # a read after that batch (Store.claim).
    NOT_SENT = "not sent"
    # The batch met a row lock, or the database refused it as a whole (one
    # bad item): the caller runs its call alone (Store.alone).
    RUN_ALONE = "run alone"


NOT_SENT = Unsent.NOT_SENT
RUN_ALONE = Unsent.RUN_ALONE

Row: TypeAlias = asyncpg.Record
Answer: TypeAlias = asyncpg.Record | Unsent | None


class Params(Hashable, Protocol):
    """A statement's parameter dataclass: it names its task."""

    @property
    def namespace(self) -> str:
        """The task's namespace."""
        ...

    @property
    def task_id(self) -> str:
        """The task's id within its namespace."""
        ...


P = TypeVar("P", bound=Params)

_UNNEST_NAMES = re.compile(r"\)\s+AS\s+\w+\(([\w\s,]+)\)")


def unnest_names(sql: str) -> tuple[str, ...]:
    """The names a batched statement gives its arrays (``unnest(...) AS p(a, b)``).

    Raises:
        ValueError: the statement names no arrays.
    """
    match = _UNNEST_NAMES.search(sql)
    if match is None:
        raise ValueError("the statement has no unnest(...) AS alias(names)")
    return tuple(name.strip() for name in match.group(1).split(","))


def field_names(params: type[object]) -> tuple[str, ...]:
    """A parameter dataclass's field names, in order."""
    return tuple(f.name for f in dataclasses.fields(cast(Any, params)))


def task_of(item: Params) -> tuple[str, str]:
    """(namespace, task_id): what a batch holds at most once (a row changes once per statement)."""
    return item.namespace, item.task_id


class BatchedStatement(Generic[P]):
    """Statement ``name`` run for the calls arriving together, on a connection it keeps.

    Args:
        name: the statement in ``sql``.
        sql: the named statements (``queries.load()``).
        params: its parameter dataclass; its fields must be the statement's
            unnest names, in order (checked here: ValueError otherwise).
        pool: the batch pool (its short lock and statement timeouts:
            ``Store.open``).
        connect_timeout_s: the longest wait for a connection, seconds.
        outcomes: told how each batch's use of the database ended (health).
        tick_s: while busy, the least time between two batches' starts, seconds.
        distinct: items naming one task never share a batch (statements that
            change rows); False for reads.
        not_sent: a later item naming a task already in the batch is
            answered NOT_SENT (claims) instead of waiting for the next batch.
        alone_on_lock: a batch that meets a row lock, or that the database
            refuses as a whole, answers RUN_ALONE to each item (statements
            that change rows); False: the error reaches every caller.
        pooling: how the batch pool's statements get their timeouts in the
            pool mode (pooling.py: in transaction mode, a transaction each);
            None: session mode.
    """

    def __init__(
        self,
        name: str,
        sql: dict[str, str],
        params: type[P],
        pool: asyncpg.Pool,
        *,
        connect_timeout_s: float,
        outcomes: StatementOutcomes,
        tick_s: float,
        distinct: bool = True,
        not_sent: bool = False,
        alone_on_lock: bool = True,
        pooling: Pooling | None = None,
    ) -> None:
        self.name = name
        self.sql = sql[name]
        fields = self.fields = field_names(params)
        if unnest_names(self.sql) != fields:
            raise ValueError(
                f"{params.__name__} fields {fields} are not statement {name!r}'s "
                f"arrays {unnest_names(self.sql)}"
            )
        self.params = params
        self._pool = pool
        self._connect_timeout_s = connect_timeout_s
        self._outcomes = outcomes
        self._alone_on_lock = alone_on_lock
        self._pooling = pooling or Pooling()
        self._kept: asyncpg.Connection | None = None
        duplicate: Callable[[P], Answer] | None = (lambda _: NOT_SENT) if not_sent else None
        self._coalescer: Coalescer[P, Answer] = Coalescer(
            self._run_batch, key=task_of if distinct else None, duplicate=duplicate, tick_s=tick_s
        )
        # The one entry point: a call's answer, sent with the calls of its batch.
        self.submit: Callable[[P], Awaitable[Answer]] = self._coalescer.submit

    async def close(self) -> None:
        """Cancels the batch in flight and the calls waiting; hands the kept connection back."""
        await self._coalescer.close()
        kept, self._kept = self._kept, None
        if kept is not None:
            with contextlib.suppress(asyncpg.InterfaceError):  # released by the driver on close
                await self._pool.release(kept)

    def arrays(self, items: Sequence[P]) -> list[list[Any]]:
        """The statement's arguments for ``items``: one array per parameter field, in order."""
        return [[getattr(item, name) for item in items] for name in self.fields]

    async def _run_batch(self, items: Sequence[P]) -> list[Answer]:
        """Runs the statement over ``items``; each item's row, None, or RUN_ALONE.

        A kept connection may have died while idle (a database restart, a cut
        link) without the driver knowing yet: if it fails with a lost
        connection, the batch pool's connections are all replaced and the
        statement is sent once more on a new one. That is safe for every
        batched statement: a read; a renewal (renewing again only sets the
        same expiry); a claim (each carries its request id, so a claim that
        did commit finds its own lease the second time).

        Raises:
            DatabaseUnavailable: the database cannot be reached (or refused).
        """
        args = self.arrays(items)
        try:
            for attempt in (1, 2):
                kept, self._kept = self._kept, None
                with driver_errors.translate_errors():
                    conn = kept if kept is not None and _usable(kept) else None
                    if conn is None:
                        conn = await self._pool.acquire(timeout=self._connect_timeout_s)
                    try:
                        async with self._pooling.statement(conn):
                            rows: list[Row] = await conn.fetch(self.sql, *args)
                    except BaseException as exc:
                        if isinstance(exc, driver_errors.DROP_CONNECTION):
                            conn.terminate()
                        with contextlib.suppress(asyncpg.InterfaceError):  # the driver did
                            await self._pool.release(conn)
                        if (
                            attempt == 1
                            and conn is kept
                            and isinstance(exc, driver_errors.CONNECTION_LOST)
                            and not isinstance(exc, TimeoutError)  # sent, and no answer: unknown
                        ):
                            # Its siblings in the pool likely died with it: replace them all.
                            await self._pool.expire_connections()
                            continue
                        raise
                self._kept = conn
                break
        except DatabaseUnavailable as exc:
            if driver_errors.is_lock_timeout(exc):
                if self._alone_on_lock:
                    return [RUN_ALONE] * len(items)
            else:
                self._outcomes.failure(exc)
            raise
        except asyncpg.PostgresError:
            # The statement refused one item (e.g. a value past a limit): each
            # runs alone, so only that item's caller sees the error.
            if not self._alone_on_lock or len(items) == 1:
                raise
            return [RUN_ALONE] * len(items)
        self._outcomes.success()
        found = {(r["namespace"], r["task_id"]): r for r in rows}
        return [found.get(task_of(item)) for item in items]


def _usable(conn: asyncpg.Connection) -> bool:
    """False for a kept pool connection that closed while idle.

    The driver hands a pooled connection that closes back to its pool by
    itself; the kept proxy then refuses every call, ``is_closed`` included.
    """
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False
