"""The module that talks to PostgreSQL (with ``ledger.py``, which borrows its transactions).

Each method runs one named statement from ``sql/queries.sql`` (and, to
classify a statement that changed no row, at most one read). Every decision
is taken by the statement itself on the database clock; this module adds no
clock of its own. Driver errors are translated here, at one edge: a database
that cannot be reached, refuses connections, is shutting down, does not
answer within the statement timeout, or cannot run the service's statements
(a privilege taken from the service's role, prepared statements lost to a
pooler) becomes :class:`~leasekeeper_server.core.errors.DatabaseUnavailable`
(UNAVAILABLE). The same edge tells ``outcomes`` how each request's use of the
database ended: the health check decides from it (``health.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import asyncpg

from leasekeeper_server.core.errors import (
    ClaimRateLimit,
    DatabaseRefused,
    DatabaseUnavailable,
    LeaseLimit,
    LeaseLost,
    LeaseServiceError,
    StatementsRefused,
    TaskCompleted,
    TaskNotFound,
)
from leasekeeper_server.core.limits import NO_LIMITS, NamespaceLimits, refill, wait_for_token_s
from leasekeeper_server.core.model import (
    ZERO,
    ClaimOutcome,
    Lease,
    LossReason,
    TaskKey,
    TaskState,
    owner_loss,
)
from leasekeeper_server.rpc.validate import LeaseRef
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage import queries
from leasekeeper_server.storage.batch import Coalescer
from leasekeeper_server.storage.outcomes import StatementOutcomes

APPLICATION_NAME = "leasekeeper"

# The answer to a claim left out of a batch that already claimed its task.
NOT_SENT: Any = object()
# The answer to each item of a batch that met a row lock or failed as a whole
# (one bad item): run it on its own.
RUN_ALONE: Any = object()
# The longest a batched statement may run, seconds (see Store.open).
BATCH_TIMEOUT_S = 1.5

# Errors that mean "the database is out of reach or refused to work now";
# the call may be retried. Anything else is a bug and surfaces as INTERNAL.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
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


# Errors that mean "the database refuses this connection for good": the role,
# password, client address or database name (SQLSTATE classes 28 and 3D), or
# parameters the driver cannot use. Checked before _UNAVAILABLE (the driver's
# ClientConfigurationError is an InterfaceError): retrying cannot help.
_REFUSED: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,  # class 28
    asyncpg.exceptions.InvalidCatalogNameError,  # 3D000: no such database
    asyncpg.exceptions.ClientConfigurationError,
)


# What PostgreSQL answers while a connection opens when the URL carries a
# setting it refuses (asyncpg sends the URL's unknown query parameters as
# settings, e.g. ``?foo=bar``, ``?statement_timeout=abc``): for good, like
# _REFUSED. Refused only while connecting (translate_errors(connecting=True));
# raised by a statement later, the same errors are bugs (INTERNAL).
_REFUSED_AT_CONNECT: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.UndefinedObjectError,  # 42704: unrecognized configuration parameter
    asyncpg.exceptions.InvalidParameterValueError,  # 22023: invalid value for parameter
    asyncpg.exceptions.CantChangeRuntimeParamError,  # 55P02: parameter cannot be changed
)


# The driver gave up on an answer (the connection may be black-holed) or lost
# the protocol's state: the connection is dropped, never handed back to a pool.
_DROP_CONNECTION: tuple[type[BaseException], ...] = (
    TimeoutError,
    asyncpg.exceptions.InternalClientError,
)

# The most tasks one ListLeases call reads, however rare its filter's matches.
LIST_SCAN_BUDGET = 1000

# A connection that died underneath (seen only when next used).
_CONNECTION_LOST: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
)


# Errors the database sends that say it is slow or going away, not that it
# refuses the service's statements (Store.ping).
_NOT_A_REFUSAL: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.QueryCanceledError,  # statement_timeout
    asyncpg.exceptions.LockNotAvailableError,  # lock_timeout
    asyncpg.exceptions.OperatorInterventionError,  # 57P0x: shutting down, starting up
)


@contextlib.contextmanager
def translate_errors(*, connecting: bool = False) -> Iterator[None]:
    """Turns driver and network errors into DatabaseUnavailable (DatabaseRefused: for good).

    Args:
        connecting: the block only opens connections (``asyncpg.connect``,
            ``create_pool``): a setting of the URL PostgreSQL refuses is a
            DatabaseRefused too.
    """
    refused = _REFUSED + _REFUSED_AT_CONNECT if connecting else _REFUSED
    try:
        yield
    except refused as exc:
        raise DatabaseRefused(f"cannot connect to the database: {exc}") from exc
    except _UNAVAILABLE as exc:
        raise DatabaseUnavailable(f"database unavailable: {type(exc).__name__}") from exc


def connection_settings(settings: Settings) -> dict[str, str]:
    """Session settings for every connection the service opens."""
    return {
        "application_name": APPLICATION_NAME,
        "statement_timeout": str(int(settings.statement_timeout_s * 1000)),
        "lock_timeout": str(int(settings.lock_timeout_s * 1000)),
        "idle_in_transaction_session_timeout": str(int(settings.statement_timeout_s * 2000)),
    }


async def _reset_connection(conn: asyncpg.Connection) -> None:
    """Readies a connection for its next user without a round trip.

    asyncpg's default reset runs ``RESET ALL; UNLISTEN *; ...`` on every
    release, doubling the statements per RPC. The store runs single
    autocommit statements and changes no session state, so nothing needs
    undoing, unless a transaction was somehow left open.
    """
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


def _counting(
    on_statement: Callable[[], object],
) -> Callable[[asyncpg.Connection], Awaitable[None]]:
    """A pool ``init`` hook that reports each statement a new connection sends."""

    def logged(_query: object) -> None:
        on_statement()

    async def init(conn: asyncpg.Connection) -> None:
        conn.add_query_logger(logged)

    return init


def lease_from_row(row: Mapping[str, Any]) -> Lease:
    """A task row (with ``db_now``) as a Lease: an asyncpg record, or a dict of the same keys."""
    return Lease(
        namespace=row["namespace"],
        task_id=row["task_id"],
        owner_id=row["owner_id"],
        fence=row["fence"],
        row_state=row["state"],
        expire_time=row["expire_time"],
        runtime_deadline=row["runtime_deadline"],
        claim_time=row["claim_time"],
        end_reason=row["end_reason"],
        claim_request_id=row["claim_request_id"],
        db_now=row["db_now"],
        revoke_reason=row.get("revoke_reason"),
    )


class Store:
    """Lease operations on PostgreSQL, one statement per decision."""

    def __init__(self, pool: asyncpg.Pool, settings: Settings, batch_pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._batch_pool = batch_pool
        self._settings = settings
        self._sql = queries.load()
        # Calls arriving together share one statement (batch.py). A claim of a
        # task already in the batch is answered NOT_SENT once the first has run
        # (see claim()): contention for one task costs one statement per batch.
        tick = settings.batch_tick_s
        self._claims: Coalescer[tuple[Any, ...], Any] = Coalescer(
            self._claim_batch, key=_task_of, duplicate=lambda _: NOT_SENT, tick_s=tick
        )
        self._renewals: Coalescer[tuple[Any, ...], Any] = Coalescer(
            self._renew_batch, key=_task_of, tick_s=tick
        )
        self._reads: Coalescer[TaskKey, asyncpg.Record | None] = Coalescer(
            self._read_batch, tick_s=tick
        )
        # Each kind of batch keeps a connection of the batch pool while it works
        # (one batch of a kind is in flight at a time): no pool checkout per batch.
        self._batch_conns: dict[str, asyncpg.Connection] = {}
        self.outcomes = StatementOutcomes()

    @classmethod
    async def open(
        cls, dsn: str, settings: Settings, on_statement: Callable[[], object] | None = None
    ) -> Store:
        """Opens a connection pool.

        Args:
            dsn: The PostgreSQL URL.
            settings: The service's settings (pool sizes, timeouts).
            on_statement: Called once for every statement a pooled connection
                sends (the driver's query logger), e.g. a metric's ``inc``.

        Raises:
            DatabaseUnavailable: the database cannot be reached.
        """
        options: dict[str, Any] = {
            "timeout": settings.connect_timeout_s,
            # The driver's own timer: a black-holed connection would never
            # reach the server's statement_timeout.
            "command_timeout": settings.statement_timeout_s + 1.0,
            "reset": _reset_connection,
            "init": _counting(on_statement) if on_statement is not None else None,
        }
        with translate_errors(connecting=True):
            pool = await asyncpg.create_pool(
                dsn,
                min_size=settings.pool_min_size,
                max_size=settings.pool_max_size,
                server_settings=connection_settings(settings),
                **options,
            )
            # Batches (at most one in flight per kind) never wait long for a
            # row lock: one locked row must not hold up every other renewal.
            # A batch that meets one runs its items on their own (RUN_ALONE).
            batch_settings = connection_settings(settings)
            batch_settings["lock_timeout"] = str(max(1, int(settings.batch_lock_timeout_s * 1000)))
            # Every renewal of the process waits behind the batch in flight, so
            # a batch that hangs (a stalled backend, a black-holed link) gives up
            # sooner than a single statement: its callers get UNAVAILABLE (a
            # heartbeat resumes on a new stream) instead of all waiting out the
            # statement timeout.
            batch_timeout_s = min(settings.statement_timeout_s, BATCH_TIMEOUT_S)
            batch_settings["statement_timeout"] = str(int(batch_timeout_s * 1000))
            batch_options = dict(options, command_timeout=batch_timeout_s + 0.5)
            try:
                batch_pool = await asyncpg.create_pool(
                    dsn, min_size=1, max_size=3, server_settings=batch_settings, **batch_options
                )
            except BaseException:
                pool.terminate()
                raise
        return cls(pool, settings, batch_pool)

    async def close(self) -> None:
        """Closes the pools, waiting for connections in use (bounded by the statement timeout)."""
        for coalescer in (self._claims, self._renewals, self._reads):
            await coalescer.close()
        for conn in self._batch_conns.values():
            with contextlib.suppress(asyncpg.InterfaceError):  # released by the driver on close
                await self._batch_pool.release(conn)
        self._batch_conns.clear()
        for pool in (self._pool, self._batch_pool):
            try:
                await asyncio.wait_for(pool.close(), self._settings.statement_timeout_s + 1.0)
            except _UNAVAILABLE:  # includes TimeoutError
                pool.terminate()

    @contextlib.contextmanager
    def _outcome(self) -> Iterator[None]:
        """Tells ``outcomes`` how the request's use of the database in this block ended.

        A success, or a decision the block raised (a lost lease, a limit); a
        failure when it ends in DatabaseUnavailable, except a lock timeout (a
        row another call holds: the database works). Anything else (a bug, a
        cancelled call) tells nothing.
        """
        try:
            yield
        except DatabaseUnavailable as exc:
            if not isinstance(exc.__cause__, asyncpg.exceptions.LockNotAvailableError):
                self.outcomes.failure(exc)
            raise
        except LeaseServiceError:
            self.outcomes.success()
            raise
        self.outcomes.success()

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection for a request; how its use ended goes to ``outcomes``."""
        with self._outcome():
            async with self._pooled() as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def _pooled(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection; driver errors leave translated (translate_errors)."""
        with translate_errors():
            async with self._pool.acquire(timeout=self._settings.connect_timeout_s) as conn:
                try:
                    yield conn
                except _DROP_CONNECTION:
                    conn.terminate()
                    raise

    async def _batch_fetch(self, kind: str, *args: Any) -> list[asyncpg.Record]:
        """Runs batch statement ``kind`` on the connection kept for it.

        A kept connection may have died while idle (a database restart, a cut
        link) without the driver knowing yet: if it fails with a lost
        connection, the batch pool's connections are all replaced and the
        statement is sent once more on a new one. That is safe for every
        batch statement: a read; a renewal (renewing again only sets the same
        expiry); a claim (each carries its request id, so a claim that did
        commit finds its own lease the second time).

        Raises:
            DatabaseUnavailable: the database cannot be reached (or refused).
        """
        with self._outcome():
            return await self._fetch_kept(kind, self._sql[kind], *args)

    async def _fetch_kept(self, kind: str, sql: str, *args: Any) -> list[asyncpg.Record]:
        """``_batch_fetch`` without the outcome: one try, and one more on a new connection."""
        for attempt in (1, 2):
            kept = self._batch_conns.pop(kind, None)
            with translate_errors():
                conn = kept if kept is not None and _usable(kept) else None
                if conn is None:
                    conn = await self._batch_pool.acquire(timeout=self._settings.connect_timeout_s)
                try:
                    rows: list[asyncpg.Record] = await conn.fetch(sql, *args)
                except BaseException as exc:
                    if isinstance(exc, _DROP_CONNECTION):
                        conn.terminate()
                    with contextlib.suppress(asyncpg.InterfaceError):  # the driver did already
                        await self._batch_pool.release(conn)
                    if (
                        attempt == 1
                        and conn is kept
                        and isinstance(exc, _CONNECTION_LOST)
                        and not isinstance(exc, TimeoutError)  # sent, and no answer: unknown
                    ):
                        # Its siblings in the pool likely died with it: replace them all.
                        await self._batch_pool.expire_connections()
                        continue
                    raise
            self._batch_conns[kind] = conn
            return rows
        raise AssertionError("unreachable")

    @property
    def pool(self) -> asyncpg.Pool:
        """The connection pool (for its gauges: size, idle, maximum)."""
        return self._pool

    @property
    def sql(self) -> dict[str, str]:
        """The named statements of ``sql/queries.sql``."""
        return self._sql

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection inside one transaction (READ COMMITTED).

        The transaction commits when the block exits normally and rolls back
        when it raises; driver errors leave as DatabaseUnavailable.
        """
        async with self._connection() as conn, conn.transaction():
            yield conn

    async def _fetchrow(self, name: str, *args: Any) -> asyncpg.Record | None:
        async with self._connection() as conn:
            return await conn.fetchrow(self._sql[name], *args)

    async def fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        """Runs a named read statement and returns its rows."""
        async with self._connection() as conn:
            return list(await conn.fetch(self._sql[name], *args))

    async def ping(self) -> None:
        """Checks the database can run the statements that decide calls, writes included.

        Changes nothing (see ``ping`` in queries.sql); not told to ``outcomes``,
        which tallies the calls' statements only.

        Raises:
            StatementsRefused: (a DatabaseUnavailable) the database answered
                and refused the statement: a privilege taken from the
                service's role, a read-only session, a prepared statement lost.
            DatabaseUnavailable: no answer: the database out of reach, or
                too slow (a statement or lock timeout).
        """
        async with self._pooled() as conn:
            try:
                await conn.fetchrow(self._sql["ping"])
            except asyncpg.PostgresError as exc:
                if isinstance(exc, _NOT_A_REFUSAL):
                    raise
                raise StatementsRefused(
                    f"database refuses the service's statements: {type(exc).__name__}: {exc}"
                ) from exc

    async def page_token_key(self) -> bytes:
        """The key that signs page tokens, the same for every replica (read once, at start).

        Raises:
            DatabaseUnavailable: the database cannot be reached.
        """
        row = await self._fetchrow("page_token_key")
        if row is None:  # migration 0007 stores it, and nothing deletes it
            raise RuntimeError("leasekeeper_page_token_key holds no key")
        return bytes(row["key"])

    async def get_lease(self, key: TaskKey) -> Lease | None:
        """The task's current row with the database clock, or None if never claimed.

        Reads arriving together share one statement (``get_leases``).
        """
        row = await self._reads.submit(key)
        return lease_from_row(row) if row is not None else None

    async def _read_batch(self, keys: Sequence[TaskKey]) -> list[asyncpg.Record | None]:
        rows = await self._batch_fetch(
            "get_leases", [k.namespace for k in keys], [k.task_id for k in keys]
        )
        return _rows_by_task(rows, [(k.namespace, k.task_id) for k in keys])

    async def _claim_batch(self, claims: Sequence[tuple[Any, ...]]) -> list[asyncpg.Record | None]:
        return await self._batch("claim_many", claims)

    async def _renew_batch(
        self, renewals: Sequence[tuple[Any, ...]]
    ) -> list[asyncpg.Record | None]:
        return await self._batch("renew_many", renewals)

    async def _batched(
        self, coalescer: Coalescer[tuple[Any, ...], Any], single: str, args: tuple[Any, ...]
    ) -> Any:
        """The row for ``args``, sent with the calls of its batch.

        Sent alone, as statement ``single``, when the batch met a row lock or
        failed as a whole (RUN_ALONE); NOT_SENT passes through.
        """
        row = await coalescer.submit(args)
        if row is RUN_ALONE:
            row = await self._fetchrow(single, *args)
        return row

    async def _batch(
        self, name: str, items: Sequence[tuple[Any, ...]]
    ) -> list[asyncpg.Record | None]:
        """Runs statement ``name`` over argument tuples of distinct tasks (one array per position).

        Returns the row of each item's task, or None where the statement returned none;
        RUN_ALONE for every item when the statement waited too long for a row lock or
        the database refused the batch as a whole.
        """
        columns = [list(column) for column in zip(*items, strict=True)]
        try:
            rows = await self._batch_fetch(name, *columns)
        except DatabaseUnavailable as exc:
            if isinstance(exc.__cause__, asyncpg.exceptions.LockNotAvailableError):
                return [RUN_ALONE] * len(items)
            raise
        except asyncpg.PostgresError:
            # The statement refused one item (e.g. a value past a limit): each
            # runs alone, so only that item's caller sees the error.
            if len(items) == 1:
                raise
            return [RUN_ALONE] * len(items)
        return _rows_by_task(rows, [_task_of(item) for item in items])

    async def claim(
        self,
        key: TaskKey,
        owner_id: str,
        ttl: timedelta,
        max_runtime: timedelta,
        request_id: str | None = None,
        limits: NamespaceLimits = NO_LIMITS,
        take_token: bool = True,
    ) -> ClaimOutcome:
        """Claims a task; atomic, decided on the database clock.

        Args:
            key: the task.
            owner_id: the claiming owner incarnation.
            ttl: lease length (clamped to ``max_runtime``).
            max_runtime: runtime budget from the grant.
            request_id: names this logical claim (AIP-155); None for none.
            limits: the namespace's limits (see limits.py): its lock delay
                applies to every claim; a lease or rate limit makes the claim
                lock the namespace's limits row and decide in one transaction.
            take_token: False for a claim that already took its rate token
                (the retries of a waiting Claim).

        Returns:
            acquired=True with a new lease (fence + 1) for a new, FREE or
            EXPIRED task (past its lock delay), or for a task this owner holds
            under another request id (a new incarnation; the earlier fence is
            superseded); acquired=True with the caller's own live lease
            unchanged for a retry (the same request id, or none);
            acquired=False with the holder's lease and ``retry_after`` when
            another owner (or another incarnation of this one, granted after
            this claim was decided) holds it, or it is in its lock delay.

        Raises:
            TaskCompleted: the task is COMPLETED (FAILED_PRECONDITION).
            LeaseLimit: the namespace holds max_leases live leases
                (RESOURCE_EXHAUSTED; nothing changed).
            ClaimRateLimit: the namespace's claim bucket is empty
                (RESOURCE_EXHAUSTED; nothing changed).
            DatabaseUnavailable: UNAVAILABLE.
        """
        args = (key.namespace, key.task_id, owner_id, ttl, max_runtime, request_id)
        delay = limits.lock_delay
        # Claims in namespaces without a lease or rate limit arriving together
        # share one statement (claim_many); limited ones run in a transaction each.
        # A read after a failed claim can find the task freed in between; the
        # claim is then simply tried again (bounded: each retry follows a
        # commit by some other call). A claim that was not sent because its
        # task was already in the batch (NOT_SENT) is decided by the read that
        # follows that batch, as if it had come after it: held by another
        # owner, it is refused; otherwise it is sent with the next batch.
        tries = 0
        while tries < 8:
            if limits.needs_lock:
                row = await self._limited_claim(key, args, delay, take_token)
                take_token = False  # one token per Claim call, however often it is tried
            else:
                row = await self._batched(self._claims, "claim", (*args, delay))
            sent = row is not NOT_SENT
            tries += sent
            if row is not None and sent:
                return ClaimOutcome(True, lease_from_row(row))
            task = await self.get_lease(key)
            if task is None:
                continue
            state = task.state
            if state is TaskState.COMPLETED:
                raise TaskCompleted(task.fence)
            if state is TaskState.HELD:
                if task.is_claim_of(owner_id, request_id):
                    return ClaimOutcome(True, task)
                if not sent and task.owner_id == owner_id:
                    continue  # another incarnation of this owner: this claim supersedes it
                return ClaimOutcome(False, task, task.remaining_ttl + delay)
            if state is TaskState.EXPIRED and task.expire_time + delay > task.db_now:
                return ClaimOutcome(False, task, task.expire_time + delay - task.db_now)
        raise DatabaseUnavailable("claim did not settle; try again")

    async def _limited_claim(
        self, key: TaskKey, args: tuple[Any, ...], delay: timedelta, take_token: bool
    ) -> asyncpg.Record | None:
        """The claim statement inside one transaction holding the namespace's limits row.

        Claims of one limited namespace take turns on that row, so the live
        lease count cannot be raced past; the bucket's tokens and the count
        are judged on the database's clock and values. Any refusal rolls the
        whole transaction back: nothing changes.
        """
        async with self.transaction() as conn:
            limit = await conn.fetchrow(self._sql["lock_limits"], key.namespace)
            if limit is None:  # the limits were removed since the cache was loaded
                return await conn.fetchrow(self._sql["claim"], *args, delay)
            rate = limit["claims_per_second"]
            if rate is not None and take_token:
                bucket = refill(
                    limit["bucket_tokens"],
                    limit["bucket_time"],
                    limit["db_now"],
                    rate,
                    limit["burst"],
                )
                if bucket.tokens < 1.0:
                    raise ClaimRateLimit(
                        key.namespace,
                        wait_for_token_s(bucket, rate),
                        f"namespace {key.namespace!r} is limited to {rate:g} claims per second",
                    )
                await conn.execute(
                    self._sql["take_claim_token"], key.namespace, bucket.tokens - 1.0, bucket.at
                )
            row = await conn.fetchrow(self._sql["claim"], *args, delay)
            max_leases = limit["max_leases"]
            if row is not None and max_leases is not None:
                live = await conn.fetchrow(
                    self._sql["count_live_leases"], key.namespace, key.task_id, max_leases
                )
                if live["live"] >= max_leases:
                    first = live["first_expiry"]
                    wait = (first - live["db_now"]).total_seconds() if first else 0.0
                    raise LeaseLimit(
                        key.namespace,
                        max(0.0, wait),
                        f"namespace {key.namespace!r} holds its maximum of "
                        f"{max_leases} live leases",
                    )
            return row

    async def renew(self, ref: LeaseRef, ttl: timedelta) -> Lease:
        """Extends a live lease to least(db clock + ttl, runtime deadline).

        Atomic; never revives an expired lease. Renewals arriving together
        (heartbeat beats, Renew calls) share one statement (``renew_many``).

        Raises:
            LeaseLost: (ABORTED) with the reason the lease is not live.
            DatabaseUnavailable: UNAVAILABLE.
        """
        args = (ref.key.namespace, ref.key.task_id, ref.owner_id, ref.fence, ttl)
        row = await self._batched(self._renewals, "renew", args)
        if row is not None:
            return lease_from_row(row)
        raise await self._loss(ref)

    async def release(self, ref: LeaseRef, complete: bool) -> Lease:
        """Releases the lease (FREE), or completes the task; keeps the fence.

        Idempotent: a release already made by this owner with this fence
        answers with the task as it is.

        Raises:
            LeaseLost: (ABORTED) LEASE_SUPERSEDED, NOT_OWNER, LEASE_REVOKED,
                FENCE_UNKNOWN.
            DatabaseUnavailable: UNAVAILABLE.
        """
        row = await self._fetchrow(
            "release", ref.key.namespace, ref.key.task_id, ref.owner_id, ref.fence, complete
        )
        if row is not None:
            return lease_from_row(row)
        task = await self.get_lease(ref.key)
        reason = owner_loss(task, ref.owner_id, ref.fence)
        if task is not None and reason in (LossReason.LEASE_RELEASED, LossReason.TASK_COMPLETED):
            if task.fence == ref.fence and task.owner_id == ref.owner_id:
                return task
        raise _lost(task, reason or LossReason.LEASE_SUPERSEDED)

    async def _loss(self, ref: LeaseRef) -> LeaseLost:
        task = await self.get_lease(ref.key)
        # The renewal found no live lease; a read an instant later can only
        # confirm a loss, except for a lease that expired exactly in between.
        return _lost(task, owner_loss(task, ref.owner_id, ref.fence) or LossReason.LEASE_EXPIRED)

    async def list_leases(
        self,
        namespace: str,
        after_task_id: str,
        limit: int,
        state: TaskState | None,
        owner_id: str | None = None,
    ) -> tuple[list[Lease], str | None]:
        """Up to ``limit`` matching tasks of a namespace after ``after_task_id``, by task_id.

        One call reads at most ``max(LIST_SCAN_BUDGET, limit)`` tasks of the
        namespace, however rare the filter's matches (its cost never follows
        the namespace's size).

        Returns:
            The matching tasks read, and the task_id of the last task read
            when the read stopped at its budget with fewer than ``limit``
            matches (the next page starts after it), else None.
        """
        budget = max(LIST_SCAN_BUDGET, limit)
        rows = await self.fetch(
            "list_leases",
            namespace,
            after_task_id,
            limit,
            state.value if state else None,
            owner_id,
            budget,
        )
        tasks = [lease_from_row(r) for r in rows if r["matches"]]
        if len(tasks) < limit and rows and rows[-1]["scanned"] >= budget:
            return tasks, rows[-1]["task_id"]
        return tasks, None

    async def revoke(self, key: TaskKey, reason: str, fence: int) -> tuple[bool, Lease]:
        """Ends the task's lease now (an operator's call); the task becomes FREE.

        Args:
            key: the task.
            reason: why (recorded in the row and announced to watchers).
            fence: revoke only this fence; 0 for whatever lease is current.

        Returns:
            (True, the task) when a held lease (live or expired) was revoked;
            (False, the task as it is) when it had none (FREE) or another fence.

        Raises:
            TaskNotFound: the task was never claimed (NOT_FOUND).
            TaskCompleted: the task is COMPLETED (FAILED_PRECONDITION).
            DatabaseUnavailable: UNAVAILABLE.
        """
        row = await self._fetchrow("revoke", key.namespace, key.task_id, reason, fence)
        if row is not None:
            return True, lease_from_row(row)
        task = await self.get_lease(key)
        if task is None:
            raise TaskNotFound(
                f"task {key.task_id!r} in namespace {key.namespace!r} was never claimed"
            )
        if task.state is TaskState.COMPLETED:
            raise TaskCompleted(task.fence)
        return False, task

    async def load_limits(self) -> dict[str, NamespaceLimits]:
        """Every namespace's limits (see limits.py)."""
        rows = await self.fetch("load_limits")
        return {
            r["namespace"]: NamespaceLimits(
                max_leases=r["max_leases"],
                claims_per_second=r["claims_per_second"],
                burst=r["burst"],
                lock_delay=r["lock_delay"] or ZERO,
            )
            for r in rows
        }


def _usable(conn: asyncpg.Connection) -> bool:
    """False for a kept pool connection that closed while idle.

    The driver hands a pooled connection that closes back to its pool by
    itself; the kept proxy then refuses every call, ``is_closed`` included.
    """
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False


def _rows_by_task(
    rows: Sequence[asyncpg.Record], tasks: Sequence[tuple[str, str]]
) -> list[asyncpg.Record | None]:
    """For each (namespace, task_id), its row among ``rows`` (a batch's answer), or None."""
    found = {(r["namespace"], r["task_id"]): r for r in rows}
    return [found.get(task) for task in tasks]


def _task_of(args: tuple[Any, ...]) -> tuple[str, str]:
    """(namespace, task_id): the first two arguments of a claim or a renewal."""
    return args[0], args[1]


def _lost(task: Lease | None, reason: LossReason) -> LeaseLost:
    return LeaseLost(reason, task.fence if task is not None else 0)
