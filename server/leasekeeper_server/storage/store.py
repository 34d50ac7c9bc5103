"""The lease statements on PostgreSQL (with ``ledger.py``, whose statements it batches too).

Each method runs one named statement from ``sql/queries.sql`` (and, to
classify a statement that changed no row, at most one read). Every decision
is taken by the statement itself on the database clock; this module adds no
clock of its own. Claims, renewals and reads arriving together share one
statement (``statements.BatchedStatement``); a Claim reaches its SQL in four
frames below its handler (``Store.claim`` -> ``Coalescer.submit`` ->
``Coalescer._drain`` -> ``BatchedStatement._run_batch``), a renewal the same.

Driver errors leave as :class:`~leasekeeper_server.core.errors.DatabaseUnavailable`
(UNAVAILABLE) or ``DatabaseRefused``, classified in ``driver_errors``. The
same edge tells ``outcomes`` how each request's use of the database ended:
the health check decides from it (``observability/health.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import asyncpg

from leasekeeper_server.core.errors import (
    CheckpointNotNewer,
    ClaimRateLimit,
    DatabaseUnavailable,
    LeaseLimit,
    LeaseLost,
    LeaseServiceError,
    StatementsRefused,
    TaskNotClaimable,
    TaskNotFound,
    TaskNotQuarantined,
)
from leasekeeper_server.core.limits import NO_LIMITS, NamespaceLimits, refill, wait_for_token_s
from leasekeeper_server.core.model import (
    LIST_SCAN_BUDGET,
    NAMESPACE_COUNT_LIMIT,
    STATS_COUNT_LIMIT,
    STATS_WINDOW,
    ZERO,
    Checkpoint,
    CheckpointWrite,
    ClaimOutcome,
    HistoryEntry,
    Lease,
    LeaseRef,
    LossReason,
    NamespaceCount,
    NamespaceStats,
    StatsScans,
    TaskKey,
    TaskState,
    checkpoint_from_row,
    history_from_row,
    lease_from_row,
    namespace_stats,
    owner_loss,
    release_refusal,
)
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage import driver_errors, queries
from leasekeeper_server.storage.driver_errors import translate_errors
from leasekeeper_server.storage.outcomes import StatementOutcomes
from leasekeeper_server.storage.pooling import Pooling
from leasekeeper_server.storage.statements import (
    NOT_SENT,
    RUN_ALONE,
    BatchedStatement,
    ClaimParams,
    RenewParams,
    Unsent,
)

APPLICATION_NAME = "leasekeeper"

# The longest a batched statement may run, seconds (see Store.open).
BATCH_TIMEOUT_S = 1.5

__all__ = ["APPLICATION_NAME", "Store", "connection_settings", "translate_errors"]


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


class Store:
    """Lease operations on PostgreSQL, one statement per decision."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        settings: Settings,
        batch_pool: asyncpg.Pool,
        pooling: Pooling | None = None,
        batch_pooling: Pooling | None = None,
    ) -> None:
        self._pool = pool
        self._batch_pool = batch_pool
        self._settings = settings
        # How each pool's statements get their timeouts in the pool mode (pooling.py).
        self._pooling = pooling or Pooling()
        self._sql = queries.load()
        self.outcomes = StatementOutcomes()
        # Calls arriving together share one statement (statements.py, batch.py).
        # A claim of a task already in the batch is answered NOT_SENT once the
        # first has run (see claim()): contention for one task costs one
        # statement per batch. Each keeps a connection of the batch pool while
        # it works (one batch of a kind is in flight at a time).
        batched = {
            "pool": batch_pool,
            "connect_timeout_s": settings.connect_timeout_s,
            "outcomes": self.outcomes,
            "tick_s": settings.batch_tick_s,
            "pooling": batch_pooling or Pooling(),
        }
        self._claims = BatchedStatement("claim", self._sql, ClaimParams, not_sent=True, **batched)
        self._renewals = BatchedStatement("renew", self._sql, RenewParams, **batched)
        self._reads = BatchedStatement(
            "get_leases", self._sql, TaskKey, distinct=False, alone_on_lock=False, **batched
        )
        # The effect ledger's (ledger.py: batched()), closed with these.
        self._batched = batched
        self._more: list[BatchedStatement[Any]] = []

    @classmethod
    async def open(
        cls, dsn: str, settings: Settings, on_statement: Callable[[], object] | None = None
    ) -> Store:
        """Opens the connection pools (the request pool and the batch pool).

        Args:
            dsn: The PostgreSQL URL (``database_url``; a pooler in
                ``settings.database_pool_mode``).
            settings: The service's settings (pool sizes, timeouts, pool mode).
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
        mode, rollback_s = settings.database_pool_mode, settings.connect_timeout_s
        pooling = Pooling(mode, connection_settings(settings), rollback_s)
        with translate_errors(connecting=True):
            pool = await asyncpg.create_pool(
                dsn,
                min_size=settings.pool_min_size,
                max_size=settings.pool_max_size,
                server_settings=pooling.server_settings,
                **pooling.connect_options,
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
            batch_pooling = Pooling(mode, batch_settings, rollback_s)
            try:
                batch_pool = await asyncpg.create_pool(
                    dsn,
                    min_size=1,
                    # One connection per kind of batched statement: claims,
                    # renewals, reads, and the effect ledger's two.
                    max_size=5,
                    server_settings=batch_pooling.server_settings,
                    **batch_pooling.connect_options,
                    **batch_options,
                )
            except BaseException:
                pool.terminate()
                raise
        return cls(pool, settings, batch_pool, pooling, batch_pooling)

    async def close(self) -> None:
        """Closes the pools, waiting for connections in use (bounded by the statement timeout)."""
        statements: list[BatchedStatement[Any]] = [self._claims, self._renewals, self._reads]
        for statement in statements + self._more:
            await statement.close()
        for pool in (self._pool, self._batch_pool):
            try:
                await asyncio.wait_for(pool.close(), self._settings.statement_timeout_s + 1.0)
            except driver_errors.UNAVAILABLE:  # includes TimeoutError
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
            if not driver_errors.is_lock_timeout(exc):
                self.outcomes.failure(exc)
            raise
        except LeaseServiceError:
            self.outcomes.success()
            raise
        self.outcomes.success()

    @contextlib.asynccontextmanager
    async def _connection(self, transaction: bool = False) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection for a request; how its use ended goes to ``outcomes``."""
        with self._outcome():
            async with self._pooled(transaction) as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def _pooled(self, transaction: bool = False) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection; driver errors leave translated (translate_errors).

        ``transaction``: the block is one transaction; else it sends one
        statement, in a transaction of its own in transaction mode (pooling.py).
        """
        with translate_errors():
            async with self._pool.acquire(timeout=self._settings.connect_timeout_s) as conn:
                around = self._pooling.transaction if transaction else self._pooling.statement
                try:
                    async with around(conn):
                        yield conn
                except driver_errors.DROP_CONNECTION:
                    conn.terminate()
                    raise

    def batched(self, name: str, params: type[Any]) -> BatchedStatement[Any]:
        """Statement ``name`` of ``queries.sql``, batched on the batch pool as claims are.

        For the effect ledger (``ledger.py``); closed with the store. ``params``:
        its parameter dataclass (``statements.BatchedStatement``).
        """
        statement: BatchedStatement[Any] = BatchedStatement(
            name, self._sql, params, **self._batched
        )
        self._more.append(statement)
        return statement

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
        when it raises; driver errors leave as DatabaseUnavailable. In
        transaction mode it begins by setting the timeouts (pooling.py).
        """
        async with self._connection(transaction=True) as conn:
            yield conn

    async def _fetchrow(self, name: str, *args: Any) -> asyncpg.Record | None:
        async with self._connection() as conn:
            return await conn.fetchrow(self._sql[name], *args)

    async def fetch(self, name: str, *args: Any) -> list[asyncpg.Record]:
        """Runs a named read statement and returns its rows."""
        async with self._connection() as conn:
            return list(await conn.fetch(self._sql[name], *args))

    async def execute_count(self, name: str, *args: Any) -> int:
        """Runs a named statement that returns no rows; the number of rows it wrote."""
        async with self._connection() as conn:
            status = await conn.execute(self._sql[name], *args)
        return int(status.rsplit(" ", 1)[-1])

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
                if isinstance(exc, driver_errors.NOT_A_REFUSAL):
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
        assert not isinstance(row, Unsent)  # reads are never left unsent nor sent alone
        return lease_from_row(row) if row is not None else None

    async def alone(self, statement: BatchedStatement[Any], params: Any) -> asyncpg.Record | None:
        """``params``' row from ``statement``, sent alone (a batch of one) on a request connection.

        For a call its batch answered RUN_ALONE: it waits for a row lock as
        long as a single call may (the request pool's lock timeout).
        """
        async with self._connection() as conn:
            rows = await conn.fetch(statement.sql, *statement.arrays([params]))
        return rows[0] if rows else None

    async def claim(
        self,
        key: TaskKey,
        owner_id: str,
        ttl: timedelta,
        max_runtime: timedelta,
        request_id: str | None = None,
        limits: NamespaceLimits = NO_LIMITS,
        take_token: bool = True,
        max_attempts: int | None = None,
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
            max_attempts: the grant's attempt limit (None: none); the task is
                QUARANTINED when a lease of this grant ends without a release
                and that uses up the limit.

        Returns:
            acquired=True with a new lease (fence + 1) for a new, FREE or
            EXPIRED task (past its lock delay), or for a task this owner holds
            under another request id (a new incarnation; the earlier fence is
            superseded); acquired=True with the caller's own live lease
            unchanged for a retry (the same request id, or none);
            acquired=False with the holder's lease and ``retry_after`` when
            another owner (or another incarnation of this one, granted after
            this claim was decided) holds it, or it is in its lock delay.
            When acquired, the outcome carries the task's checkpoint.

        Raises:
            TaskNotClaimable: the task is COMPLETED, CANCELLED, FAILED or
                QUARANTINED (FAILED_PRECONDITION, the reason names which).
            LeaseLimit: the namespace holds max_leases live leases
                (RESOURCE_EXHAUSTED; nothing changed).
            ClaimRateLimit: the namespace's claim bucket is empty
                (RESOURCE_EXHAUSTED; nothing changed).
            DatabaseUnavailable: UNAVAILABLE.
        """
        delay = limits.lock_delay
        params = ClaimParams(
            key.namespace, key.task_id, owner_id, ttl, max_runtime, request_id, delay, max_attempts
        )
        # Claims in namespaces without a lease or rate limit arriving together
        # share one statement (``claim``, batched); limited ones run in a transaction each.
        # A read after a failed claim can find the task freed in between; the
        # claim is then simply tried again (bounded: each retry follows a
        # commit by some other call). A claim that was not sent because its
        # task was already in the batch (NOT_SENT) is decided by the read that
        # follows that batch, as if it had come after it: held by another
        # owner, it is refused; otherwise it is sent with the next batch.
        tries = 0
        while tries < 8:
            if limits.needs_lock:
                row = await self._limited_claim(params, take_token)
                take_token = False  # one token per Claim call, however often it is tried
            else:
                row = await self._claims.submit(params)
                if row is RUN_ALONE:
                    row = await self.alone(self._claims, params)
            sent = row is not NOT_SENT
            tries += sent
            if row is not None and sent:
                return ClaimOutcome(True, lease_from_row(row), checkpoint=checkpoint_from_row(row))
            lease = await self.get_lease(key)
            if lease is None:
                continue
            state = lease.state
            if lease.unclaimable is not None:
                raise TaskNotClaimable.of(lease)
            if state is TaskState.HELD:
                if lease.is_claim_of(owner_id, request_id):  # a retry: its lease, its checkpoint
                    return ClaimOutcome(True, lease, checkpoint=await self.get_checkpoint(key))
                if not sent and lease.owner_id == owner_id:
                    continue  # another incarnation of this owner: this claim supersedes it
                return ClaimOutcome(False, lease, lease.remaining_ttl + delay)
            if state is TaskState.EXPIRED and lease.expire_time + delay > lease.db_now:
                return ClaimOutcome(False, lease, lease.expire_time + delay - lease.db_now)
        raise DatabaseUnavailable("claim did not settle; try again")

    async def _limited_claim(self, params: ClaimParams, take_token: bool) -> asyncpg.Record | None:
        """The claim statement inside one transaction holding the namespace's limits row.

        Claims of one limited namespace take turns on that row, so the live
        lease count cannot be raced past; the bucket's tokens and the count
        are judged on the database's clock and values. Any refusal rolls the
        whole transaction back: nothing changes.
        """
        async with self.transaction() as conn:
            limit = await conn.fetchrow(self._sql["lock_limits"], params.namespace)
            if limit is None:  # the limits were removed since the cache was loaded
                return await conn.fetchrow(self._claims.sql, *self._claims.arrays([params]))
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
                        params.namespace,
                        wait_for_token_s(bucket, rate),
                        f"namespace {params.namespace!r} is limited to {rate:g} claims per second",
                    )
                await conn.execute(
                    self._sql["take_claim_token"], params.namespace, bucket.tokens - 1.0, bucket.at
                )
            row = await conn.fetchrow(self._claims.sql, *self._claims.arrays([params]))
            max_leases = limit["max_leases"]
            if row is not None and max_leases is not None:
                live = await conn.fetchrow(
                    self._sql["count_live_leases"], params.namespace, params.task_id, max_leases
                )
                if live["live"] >= max_leases:
                    first = live["first_expiry"]
                    wait = (first - live["db_now"]).total_seconds() if first else 0.0
                    raise LeaseLimit(
                        params.namespace,
                        max(0.0, wait),
                        f"namespace {params.namespace!r} holds its maximum of "
                        f"{max_leases} live leases",
                    )
            return row

    async def renew(self, ref: LeaseRef, ttl: timedelta) -> Lease:
        """Extends a live lease to least(db clock + ttl, runtime deadline).

        Atomic; never revives an expired lease. Renewals arriving together
        (heartbeat beats, Renew calls, checkpoint writes) share one statement
        (``renew``, batched).

        Raises:
            LeaseLost: (ABORTED) with the reason the lease is not live.
            DatabaseUnavailable: UNAVAILABLE.
        """
        params = RenewParams(ref.key.namespace, ref.key.task_id, ref.owner_id, ref.fence, ttl)
        row = await self._renewals.submit(params)  # inline: four frames from here to SQL
        if row is RUN_ALONE:
            row = await self.alone(self._renewals, params)
        assert not isinstance(row, Unsent)  # only claims are left unsent
        if row is not None:
            return lease_from_row(row)
        raise await self._loss(ref)

    async def _renew_row(
        self,
        ref: LeaseRef,
        ttl: timedelta | None,
        checkpoint: CheckpointWrite | None,
        conn: asyncpg.Connection | None = None,
    ) -> asyncpg.Record | None:
        """The row statement ``renew`` returned for one renewal (None: no live lease).

        Batched with the renewals arriving together, or on ``conn`` (a
        transaction's connection) alone.
        """
        params = RenewParams(ref.key.namespace, ref.key.task_id, ref.owner_id, ref.fence, ttl)
        if checkpoint is not None:
            params = dataclasses.replace(
                params,
                checkpoint_version=checkpoint.version,
                checkpoint_data=checkpoint.data,
                checkpoint_content_type=checkpoint.content_type,
            )
        if conn is not None:
            rows = await conn.fetch(self._renewals.sql, *self._renewals.arrays([params]))
            return rows[0] if rows else None
        row = await self._renewals.submit(params)
        if row is RUN_ALONE:
            row = await self.alone(self._renewals, params)
        assert not isinstance(row, Unsent)  # only claims are left unsent
        return row

    async def write_checkpoint(
        self,
        ref: LeaseRef,
        checkpoint: CheckpointWrite,
        ttl: timedelta | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> tuple[Lease, Checkpoint | None]:
        """Stores the task's checkpoint under a live lease, renewing it too when ``ttl`` is given.

        One statement (``renew``), decided on the database clock: stored only
        for the owner of the live current fence, and only with a version
        higher than the stored one. ``conn``: within that transaction
        (``EffectLedger.complete_and_save``).

        Returns:
            The lease after the statement, and the stored checkpoint when it is
            this write's: saved now, or the same version, data and content type
            already stored by this fence (a retry); None when the version did
            not move forward (nothing stored; the renewal, if any, happened).

        Raises:
            LeaseLost: (ABORTED) the lease is not live; nothing stored.
            DatabaseUnavailable: UNAVAILABLE.
        """
        row = await self._renew_row(ref, ttl, checkpoint, conn)
        if row is None:
            raise await self._loss(ref)
        lease = lease_from_row(row)
        if row["checkpoint_saved"]:
            written = Checkpoint(
                checkpoint.version,
                checkpoint.data,
                checkpoint.content_type,
                ref.fence,
                row["checkpoint_time"],
            )
            return lease, written
        if lease.checkpoint_version == checkpoint.version:  # a retry of this very write?
            stored = await self.get_checkpoint(ref.key, conn)
            if stored is not None and (stored.fence, stored.data, stored.content_type) == (
                ref.fence,
                checkpoint.data,
                checkpoint.content_type,
            ):
                return lease, stored
        return lease, None

    async def save_checkpoint(
        self, ref: LeaseRef, checkpoint: CheckpointWrite, conn: asyncpg.Connection | None = None
    ) -> tuple[Checkpoint, Lease]:
        """Stores the task's checkpoint under a live lease, without renewing it (SaveCheckpoint).

        :meth:`write_checkpoint`, refusing a checkpoint that is not stored.

        Returns:
            The stored checkpoint and the task after the write.

        Raises:
            LeaseLost: (ABORTED) the lease is not live; nothing stored.
            CheckpointNotNewer: (FAILED_PRECONDITION) the version does not move
                forward; nothing stored.
            DatabaseUnavailable: UNAVAILABLE.
        """
        lease, stored = await self.write_checkpoint(ref, checkpoint, None, conn)
        if stored is None:
            raise CheckpointNotNewer(checkpoint.version, lease.checkpoint_version or 0)
        return stored, lease

    async def get_checkpoint(
        self, key: TaskKey, conn: asyncpg.Connection | None = None
    ) -> Checkpoint | None:
        """The task's checkpoint with its data; None when none was saved (or never claimed).

        ``conn``: read in that transaction (never a second pooled connection
        while it holds one: a pool of waiting holders would deadlock).
        """
        if conn is not None:
            row = await conn.fetchrow(self._sql["get_checkpoint"], key.namespace, key.task_id)
        else:
            row = await self._fetchrow("get_checkpoint", key.namespace, key.task_id)
        return checkpoint_from_row(row) if row is not None else None

    async def release(
        self, ref: LeaseRef, complete: bool, fail: bool = False, fail_reason: str = ""
    ) -> Lease:
        """Releases the lease (FREE), or ends the task COMPLETED or FAILED; keeps the fence.

        Args:
            ref: the lease: its task, owner and fence.
            complete: the task becomes COMPLETED (terminal).
            fail: the run ended as failed: FAILED (terminal). Not together
                with ``complete``.
            fail_reason: why it failed (recorded; may be empty).

        Idempotent: a release (completion, failure) already made by this owner
        with this fence answers with the task as it is.

        Raises:
            LeaseLost: (ABORTED) LEASE_SUPERSEDED, NOT_OWNER, LEASE_REVOKED,
                FENCE_UNKNOWN, TASK_CANCELLED, and TASK_COMPLETED or
                TASK_FAILED when the task ended otherwise.
            DatabaseUnavailable: UNAVAILABLE.
        """
        row = await self._fetchrow(
            "release",
            ref.key.namespace,
            ref.key.task_id,
            ref.owner_id,
            ref.fence,
            complete,
            fail,
            fail_reason,
        )
        if row is not None:
            return lease_from_row(row)
        lease = await self.get_lease(ref.key)
        refused = release_refusal(lease, ref, complete, fail)
        if refused is None:
            assert lease is not None  # a release already made names its lease
            return lease
        raise LeaseLost.of(lease, refused)

    async def _loss(self, ref: LeaseRef) -> LeaseLost:
        lease = await self.get_lease(ref.key)
        # The renewal found no live lease; a read an instant later can only
        # confirm a loss, except for a lease that expired exactly in between.
        return LeaseLost.of(
            lease, owner_loss(lease, ref.owner_id, ref.fence) or LossReason.LEASE_EXPIRED
        )

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
        leases = [lease_from_row(r) for r in rows if r["matches"]]
        if len(leases) < limit and rows and rows[-1]["scanned"] >= budget:
            return leases, rows[-1]["task_id"]
        return leases, None

    async def list_namespaces(self, after_namespace: str, limit: int) -> list[NamespaceCount]:
        """Up to ``limit`` namespaces holding tasks after ``after_namespace``, by name (keyset).

        Each with its tasks counted up to ``NAMESPACE_COUNT_LIMIT`` (SQL
        ``list_namespaces``, a loose index scan: its cost never follows the
        table's size).
        """
        rows = await self.fetch(
            "list_namespaces", after_namespace, limit, NAMESPACE_COUNT_LIMIT + 1
        )
        return [
            NamespaceCount(
                r["namespace"],
                min(r["tasks"], NAMESPACE_COUNT_LIMIT),
                r["tasks"] > NAMESPACE_COUNT_LIMIT,
            )
            for r in rows
        ]

    async def namespace_stats(
        self, namespace: str, limit: int = STATS_COUNT_LIMIT
    ) -> NamespaceStats:
        """A namespace's figures at one instant (GetNamespaceStats), each counted up to ``limit``.

        One read-only statement (``namespace_stats``): each of its scans reads
        at most ``limit + 1`` rows of an index kept for it, so its cost never
        follows the namespace's size (``core.model.namespace_stats`` caps the
        figures).

        Raises:
            DatabaseUnavailable: UNAVAILABLE.
        """
        row = await self._fetchrow("namespace_stats", namespace, limit + 1, STATS_WINDOW)
        assert row is not None  # an aggregate over one-row subqueries: always one row
        scans = StatsScans(**{name: row[name] for name in StatsScans.__dataclass_fields__})
        return namespace_stats(namespace, scans, limit)

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
        lease = await self.get_lease(key)
        if lease is None:
            raise TaskNotFound(
                f"task {key.task_id!r} in namespace {key.namespace!r} was never claimed"
            )
        if lease.state in (TaskState.COMPLETED, TaskState.CANCELLED, TaskState.FAILED):
            raise TaskNotClaimable.of(lease)
        return False, lease

    async def cancel(self, key: TaskKey, reason: str) -> tuple[bool, Lease]:
        """Cancels the task (an operator's call): CANCELLED, terminal; its lease ends now.

        Idempotent: a cancelled task answers as it is, its first reason kept.

        Returns:
            (True, the task) when this call cancelled it; (False, the task as
            it is) when it was already CANCELLED (nothing written).

        Raises:
            TaskNotFound: the task was never claimed (NOT_FOUND).
            TaskNotClaimable: the task is COMPLETED or FAILED (FAILED_PRECONDITION).
            DatabaseUnavailable: UNAVAILABLE.
        """
        row = await self._fetchrow("cancel", key.namespace, key.task_id, reason)
        if row is not None:
            return True, lease_from_row(row)
        lease = await self._existing(key)
        if lease.state is not TaskState.CANCELLED:
            raise TaskNotClaimable.of(lease)
        return False, lease

    async def retry(self, key: TaskKey, reason: str) -> Lease:
        """Puts a QUARANTINED task back (an operator's call): FREE, attempts 0.

        Raises:
            TaskNotFound: the task was never claimed (NOT_FOUND).
            TaskNotQuarantined: the task is not QUARANTINED (FAILED_PRECONDITION).
            DatabaseUnavailable: UNAVAILABLE.
        """
        row = await self._fetchrow("retry", key.namespace, key.task_id, reason)
        if row is not None:
            return lease_from_row(row)
        raise TaskNotQuarantined((await self._existing(key)).state.value)

    async def _existing(self, key: TaskKey) -> Lease:
        lease = await self.get_lease(key)
        if lease is None:
            raise TaskNotFound(
                f"task {key.task_id!r} in namespace {key.namespace!r} was never claimed"
            )
        return lease

    async def record_refusal(self, key: TaskKey, fence: int, loss: LossReason, method: str) -> None:
        """Writes a FENCE_REFUSED entry to the task's history (nothing for a task never claimed).

        Raises:
            DatabaseUnavailable: UNAVAILABLE.
        """
        await self.execute_count(
            "record_refusal", key.namespace, key.task_id, fence, loss.value, method
        )

    async def list_history(
        self, key: TaskKey, after_sequence: int, limit: int
    ) -> list[HistoryEntry]:
        """Up to ``limit`` entries of the task's history after ``after_sequence``, oldest first."""
        rows = await self.fetch("list_history", key.namespace, key.task_id, after_sequence, limit)
        return [history_from_row(r) for r in rows]

    async def load_limits(self) -> dict[str, NamespaceLimits]:
        """Every namespace's limits (see limits.py)."""
        rows = await self.fetch("load_limits")
        return {
            r["namespace"]: NamespaceLimits(
                max_leases=r["max_leases"],
                claims_per_second=r["claims_per_second"],
                burst=r["burst"],
                lock_delay=r["lock_delay"] or ZERO,
                max_attempts=r["max_attempts"],
            )
            for r in rows
        }
