"""The expiry sweeper, elected among the replicas, and the live-lease gauge.

Expiry needs no write: a lease is EXPIRED the moment the database clock
passes its expire_time. But nobody is told, so one replica at a time
*announces* expiries: it marks each expired lease's fence in
``expiry_announced_fence``, and the task table's trigger turns the mark into
an ``expired`` event (Watch streams, waiting claims, the audit log, the
``leases_expired`` metric).

A lease claimed again, released, completed or revoked before the sweeper
came by is announced by that change instead (the trigger sends its
``expired`` just before the change's own event; migrations/0006), so the
leader counts and audits expiries from the notifications themselves, not
from its own sweeps: every expiry once, whoever announced it. (While the
leader's notification connection is down, counts can be missed; the events
and the state in the database cannot.)

Election: the replica whose dedicated connection holds the session advisory
lock ``SWEEPER_LOCK_ID`` sweeps; the others try to take the lock every sweep
interval. When the leader's connection ends (its process dies, PostgreSQL
restarts), PostgreSQL releases the lock and another replica takes over
within a sweep interval. Two sweepers at once (a leader whose connection is
black-holed but not yet dead) would only do the same idempotent work: the
mark is written with ``SKIP LOCKED`` and only while it differs from the
fence, so an expiry is announced once.

The leader also counts the live leases per namespace every
``HELD_EVERY_SWEEPS`` sweeps for the ``leases_held`` gauge (only the leader
exports it, so summing over replicas is right).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

import asyncpg

from leasekeeper_server.observability.audit import Audit
from leasekeeper_server.observability.metrics import Metrics
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage import driver_errors
from leasekeeper_server.storage.driver_errors import translate_errors
from leasekeeper_server.storage.events import LeaseEvents
from leasekeeper_server.storage.store import APPLICATION_NAME, Store, connection_settings

log = logging.getLogger(__name__)

# A constant shared by every leasekeeper replica; names the sweeper's lock.
SWEEPER_LOCK_ID = 0x1EA5E_5EE9
# Most leases announced per statement; a full batch is followed at once by another.
SWEEP_BATCH = 1000
HELD_EVERY_SWEEPS = 5

_ERRORS = driver_errors.BACKGROUND


class ExpirySweeper:
    """Runs for leadership and, while leader, announces expired leases."""

    def __init__(
        self,
        dsn: str,
        store: Store,
        metrics: Metrics,
        settings: Settings,
        events: LeaseEvents,
    ) -> None:
        self._dsn = dsn
        self._store = store
        self._metrics = metrics
        self._settings = settings
        self._events = events
        self._task: asyncio.Task[None] | None = None
        self._counter: asyncio.Task[None] | None = None
        self._audit = Audit()
        self.is_leader = False

    def start(self) -> None:
        """Starts running for leadership, and counting expiries, in the background."""
        self._task = asyncio.create_task(self._run(), name="leasekeeper-sweeper")
        self._counter = asyncio.create_task(self._count_expiries(), name="leasekeeper-expiries")

    async def stop(self) -> None:
        """Stops; the lock goes with the connection."""
        for task in (self._task, self._counter):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._set_leader(False)

    async def _count_expiries(self) -> None:
        """While leader: one count and one audit record per announced expiry."""
        with self._events.subscribe(None, None) as every_event:
            while True:
                await every_event.ready.wait()
                _gap, events = every_event.take()
                if self.is_leader:
                    self._record(events)

    def _record(self, events: list[dict[str, object]]) -> None:
        per_namespace: Counter[str] = Counter()
        for data in events:
            if data.get("event") != "expired":
                continue
            namespace = str(data["namespace"])
            per_namespace[namespace] += 1
            self._audit.expired(
                namespace,
                str(data["task_id"]),
                str(data["owner_id"]),
                int(str(data["fence"])),
                str(data["expire_time"]),
            )
        for namespace, count in per_namespace.items():
            self._metrics.expired(namespace, count)

    def _set_leader(self, leader: bool) -> None:
        if leader != self.is_leader:
            log.info("expiry sweeper: %s", "elected" if leader else "not the leader")
        self.is_leader = leader
        self._metrics.set_sweeper_leader(leader)
        if not leader:
            self._metrics.set_held({})

    async def _run(self) -> None:
        interval_s = self._settings.sweep_interval_s
        while True:
            try:
                await self._serve_one_connection(interval_s)
            except asyncio.CancelledError:
                raise
            except _ERRORS as exc:
                log.warning("expiry sweeper interrupted: %s", exc)
            self._set_leader(False)
            await asyncio.sleep(interval_s)

    async def _serve_one_connection(self, interval_s: float) -> None:
        s = self._settings
        with translate_errors():
            conn = await asyncpg.connect(
                self._dsn,
                timeout=s.connect_timeout_s,
                command_timeout=s.statement_timeout_s + 1.0,
                server_settings={
                    **connection_settings(s),
                    "application_name": f"{APPLICATION_NAME}-sweeper",
                },
            )
        try:
            sweeps = 0
            while True:
                with translate_errors():
                    if not self.is_leader:
                        got = await conn.fetchval(
                            "SELECT pg_try_advisory_lock($1)", SWEEPER_LOCK_ID
                        )
                        self._set_leader(bool(got))
                    if self.is_leader:
                        full = await self._sweep(conn)
                        if sweeps % HELD_EVERY_SWEEPS == 0:
                            await self._count_held(conn)
                        sweeps += 1
                        if full:
                            continue  # more expired leases are waiting
                await asyncio.sleep(interval_s)
        finally:
            conn.terminate()

    async def _sweep(self, conn: asyncpg.Connection) -> bool:
        """Announces one batch of expiries; True when the batch was full."""
        rows = await conn.fetch(self._store.sql["sweep_expired"], SWEEP_BATCH)
        return len(rows) >= SWEEP_BATCH

    async def _count_held(self, conn: asyncpg.Connection) -> None:
        rows = await conn.fetch(self._store.sql["held_by_namespace"])
        self._metrics.set_held({r["namespace"]: r["held"] for r in rows})
