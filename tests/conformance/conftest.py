"""The storage under test: PostgreSQL, or the in-memory implementation, behind the seam's Protocols.

Every test of this folder takes the ``world`` fixture and runs twice, once per
implementation (ids ``memory`` and ``postgres``), with the same assertions:
the PostgreSQL store (``Store``, ``EffectLedger``, ``LeaseEvents``) and the
in-memory one (``storage/memory.py``) must take the same decisions.

Time passes by :meth:`World.advance`. For the memory store the manual clock
moves; for PostgreSQL every instant of the namespace's task rows and claim
bucket is moved that far into the past, which is what the
database clock moving on means for those rows (the technique of
``tests/integration/test_lease_model.py``): no test waits for real time, and
no answer depends on the machine's speed; with ``history=True`` the
namespace's history entries age as well (the windows of ``namespace_stats``
read their event times). :meth:`World.run_out` lets real
time pass instead, for a lease with a short ttl. The database clock still runs
between statements, so expectations about the clock hold within ``SLACK``;
durations are minutes, so that slack never changes a decision.
:meth:`World.sweep` does what the expiry sweeper does (SQL ``sweep_expired``;
the memory store's ``announce_expiries``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from leasekeeper_server.core.limits import NO_LIMITS, NamespaceLimits
from leasekeeper_server.core.model import (
    ClaimOutcome,
    HistoryEntry,
    Lease,
    LeaseRef,
    TaskKey,
    TaskState,
)
from leasekeeper_server.storage.events import LeaseEvents
from leasekeeper_server.storage.ledger import EffectLedger
from leasekeeper_server.storage.memory import ManualClock, MemoryLedger, MemoryStore
from leasekeeper_server.storage.protocol import ChangeFeed, EffectStore, LeaseStore
from leasekeeper_server.storage.store import Store
from leasekeeper_server.storage.sweeper import SWEEP_BATCH
from tests.conftest import make_settings
from tests.helpers import STEP_S, poll

# How far the database clock may run between two statements of one test.
SLACK = timedelta(seconds=STEP_S)
MINUTE = timedelta(minutes=1)
HOUR = timedelta(hours=1)


@dataclass
class World:
    """One implementation of the seam, in a namespace of its own.

    Attributes:
        name: 'memory' or 'postgres'.
        store, ledger, events: the seam's three parts.
        namespace: a namespace no other test uses.
    """

    name: str
    store: LeaseStore
    ledger: EffectStore
    events: ChangeFeed
    namespace: str
    _advance: Callable[[timedelta, bool], Awaitable[None]]
    _set_limits: Callable[[NamespaceLimits], Awaitable[None]]
    _sweep: Callable[[], Awaitable[None]]

    def key(self, task_id: str = "t") -> TaskKey:
        """A task of this world's namespace."""
        return TaskKey(self.namespace, task_id)

    def ref(self, lease: Lease, owner_id: str | None = None, fence: int | None = None) -> LeaseRef:
        """Names ``lease`` (or its task with another owner or fence)."""
        return LeaseRef(
            TaskKey(lease.namespace, lease.task_id),
            owner_id if owner_id is not None else lease.owner_id,
            fence if fence is not None else lease.fence,
        )

    async def advance(self, by: timedelta, history: bool = False) -> None:
        """Lets ``by`` pass on the storage's clock for this namespace.

        ``history``: for the namespace's history entries too (PostgreSQL
        moves their event times; the memory clock moves for everything).
        """
        await self._advance(by, history)

    async def run_out(self, task_id: str = "t") -> Lease:
        """Waits for the task's lease to expire as time really passes; returns it ended.

        The memory clock jumps to the expiry; PostgreSQL's clock is waited
        for, polling the task's state (give the lease a short ttl). The lease
        comes back EXPIRED, or QUARANTINED when its ending used up the task's
        last attempt.
        """
        if self.name == "memory":
            lease = await self.lease(task_id)
            await self.advance(max(lease.expire_time - lease.db_now, timedelta(0)))

        async def expired() -> Lease | None:
            lease = await self.lease(task_id)
            return lease if lease.state in (TaskState.EXPIRED, TaskState.QUARANTINED) else None

        result: Lease = await poll(expired, f"the lease of {task_id!r} expires")
        return result

    async def sweep(self) -> None:
        """Announces every expiry not yet announced, as the expiry sweeper does.

        An expiry that uses up its task's last attempt is stored as a quarantine.
        """
        await self._sweep()

    async def history(self, task_id: str = "t") -> list[HistoryEntry]:
        """The task's whole history, oldest first."""
        return await self.store.list_history(self.key(task_id), 0, 1000)

    async def set_limits(self, limits: NamespaceLimits) -> None:
        """Writes the namespace's limits row (what ``leasekeeper limits set`` does)."""
        await self._set_limits(limits)

    async def claim(
        self,
        task_id: str = "t",
        owner_id: str = "w1",
        ttl: timedelta = 10 * MINUTE,
        max_runtime: timedelta = 24 * HOUR,
        request_id: str | None = None,
        limits: NamespaceLimits = NO_LIMITS,
        take_token: bool = True,
        max_attempts: int | None = None,
    ) -> ClaimOutcome:
        """A claim with the test's usual values."""
        return await self.store.claim(
            self.key(task_id),
            owner_id,
            ttl,
            max_runtime,
            request_id,
            limits,
            take_token,
            max_attempts,
        )

    async def lease(self, task_id: str = "t") -> Lease:
        """The task's lease as read now; asserts it was claimed once."""
        read = await self.store.get_lease(self.key(task_id))
        assert read is not None, f"task {task_id!r} was never claimed"
        return read

    async def held(self, task_id: str = "t", owner_id: str = "w1", **kw: Any) -> Lease:
        """Claims and asserts the claim was granted; returns the lease."""
        outcome = await self.claim(task_id, owner_id, **kw)
        assert outcome.acquired, outcome
        return outcome.lease


@contextlib.asynccontextmanager
async def memory_world(namespace: str) -> AsyncIterator[World]:
    """The in-memory implementation, with a manual clock."""
    clock = ManualClock()
    store = MemoryStore(clock)

    async def advance(by: timedelta, history: bool) -> None:
        clock.advance(by)

    async def set_limits(limits: NamespaceLimits) -> None:
        store.set_limits(namespace, limits)

    async def sweep() -> None:
        store.announce_expiries()

    yield World(
        "memory", store, MemoryLedger(store), store.events, namespace, advance, set_limits, sweep
    )


@contextlib.asynccontextmanager
async def postgres_world(database_url: str, namespace: str) -> AsyncIterator[World]:
    """The PostgreSQL implementation on the test database, as a server opens it."""
    settings = make_settings(database_url)
    store = await Store.open(database_url, settings)
    events = LeaseEvents(database_url, settings.health_interval_s, settings.connect_timeout_s)
    await events.start()
    admin = await asyncpg.connect(database_url)
    try:

        async def advance(by: timedelta, history: bool) -> None:
            # Moving every instant back by `by` is the clock moving on by `by`
            # for these rows. The trigger announces nothing and writes no
            # history: no fence, state, owner or checkpoint version changes.
            # The effects' begin and complete times decide nothing and stay
            # (as the memory store's do); so do the history's event times,
            # unless asked: only namespace_stats' windows read them.
            async with admin.transaction():
                if history:
                    await admin.execute(
                        "UPDATE leasekeeper_task_history"
                        " SET event_time = event_time - $2::interval WHERE namespace = $1",
                        namespace,
                        by,
                    )
                await admin.execute(
                    "UPDATE leasekeeper_tasks SET claim_time = claim_time - $2::interval,"
                    " expire_time = expire_time - $2::interval,"
                    " runtime_deadline = runtime_deadline - $2::interval,"
                    " checkpoint_time = checkpoint_time - $2::interval,"
                    " update_time = update_time - $2::interval WHERE namespace = $1",
                    namespace,
                    by,
                )
                await admin.execute(
                    "UPDATE leasekeeper_namespace_limits"
                    " SET bucket_time = bucket_time - $2::interval WHERE namespace = $1",
                    namespace,
                    by,
                )

        async def set_limits(limits: NamespaceLimits) -> None:
            await admin.execute(
                "INSERT INTO leasekeeper_namespace_limits"
                " (namespace, max_leases, claims_per_second, claim_burst, lock_delay)"
                " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (namespace) DO UPDATE SET"
                " (max_leases, claims_per_second, claim_burst, lock_delay, bucket_tokens,"
                "  bucket_time) = ($2, $3, $4, $5, NULL, NULL)",
                namespace,
                limits.max_leases,
                limits.claims_per_second,
                limits.burst,
                limits.lock_delay,
            )

        async def sweep() -> None:
            # The sweeper's statement, in batches as the sweeper sends it
            # (it marks every namespace's expiries: any sweeper would).
            while len(await store.fetch("sweep_expired", SWEEP_BATCH)) == SWEEP_BATCH:
                pass

        yield World(
            "postgres",
            store,
            EffectLedger(store),
            events,
            namespace,
            advance,
            set_limits,
            sweep,
        )
    finally:
        await admin.close()
        await events.stop()
        await store.close()


@pytest.fixture(params=["memory", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    """Which implementation: 'memory' or 'postgres'."""
    return str(request.param)


@pytest.fixture
def backend_url(backend: str, request: pytest.FixtureRequest) -> str | None:
    """The test database's URL for PostgreSQL (made here, outside the event loop), else None."""
    return str(request.getfixturevalue("database_url")) if backend == "postgres" else None


@pytest.fixture
async def world(backend_url: str | None, namespace: str) -> AsyncIterator[World]:
    """The seam's implementation under test, in a fresh namespace."""
    made = (
        memory_world(namespace) if backend_url is None else postgres_world(backend_url, namespace)
    )
    async with made as opened:
        yield opened


def close_to(actual: timedelta, expected: timedelta) -> bool:
    """``actual`` is ``expected`` less at most SLACK (the database clock ran on meanwhile)."""
    return expected - SLACK <= actual <= expected
