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
from its own sweeps: every expiry once, whoever announced it. From the same
notifications it counts the other task events of ``observability/metrics.py``
(leases lost by reason, time in recovery, quarantines, cancellations), each
once. (While the leader's notification connection is down, counts can be
missed; the events and the state in the database cannot.)

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
from datetime import datetime
from typing import Any

import asyncpg

from leasekeeper_server.core.model import LossReason
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
_ENDS_BY = {"revoked": LossReason.LEASE_REVOKED, "cancelled": LossReason.TASK_CANCELLED}

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
        # The last event counted: (event, namespace, task_id, fence), or None.
        self.is_leader = False

    def start(self) -> None:
        """Starts running for leadership, and counting task events, in the background."""
        self._task = asyncio.create_task(self._run(), name="leasekeeper-sweeper")
        self._counter = asyncio.create_task(self._count_events(), name="leasekeeper-task-events")

    async def stop(self) -> None:
        """Stops; the lock goes with the connection."""
        for task in (self._task, self._counter):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._set_leader(False)

    async def _count_events(self) -> None:
        """While leader: the task-event metrics, and one audit record per announced expiry."""
        with self._events.subscribe(None, None) as every_event:
            while True:
                await every_event.ready.wait()
                _gap, events = every_event.take()
                if self.is_leader:
                    try:
                        self._record(events)
                    except Exception:  # a payload it cannot read: counting goes on
                        log.exception("counting task events failed")

    def _record(self, events: list[dict[str, Any]]) -> None:
        """Counts one batch of notifications (payloads of migrations/0008), in commit order.

        expired: ``leases_expired`` and ``leases_lost`` (RUNTIME_EXCEEDED when
        the expiry was the runtime budget's end, else LEASE_EXPIRED), and its
        audit record. revoked, cancelled: ``leases_lost`` (LEASE_REVOKED,
        TASK_CANCELLED) when they ended a live lease (the payload's
        ``ended_live``, judged by the trigger at the change's instant); a
        lease that had expired was lost to its expiry, and a cancelled task
        without a lease lost none.
        claimed after an ended lease (``previous_end``): ``recovery_seconds``.
        quarantined, cancelled: ``tasks_quarantined``, ``tasks_cancelled``.
        """
        expired: Counter[str] = Counter()
        lost: Counter[tuple[str, LossReason]] = Counter()
        quarantined: Counter[str] = Counter()
        cancelled: Counter[str] = Counter()
        for data in events:
            event = data.get("event")
            namespace = str(data.get("namespace"))
            if event == "expired":
                expired[namespace] += 1
                lost[namespace, _expiry_reason(data)] += 1
                self._audit.expired(
                    namespace,
                    str(data["task_id"]),
                    str(data["owner_id"]),
                    int(str(data["fence"])),
                    str(data["expire_time"]),
                )
            elif event in _ENDS_BY and data.get("ended_live"):
                lost[namespace, _ENDS_BY[event]] += 1
            elif event == "claimed" and data.get("previous_end"):
                ended = _instant(data["previous_end"])
                granted = _instant(data["claim_time"])
                self._metrics.recovered(namespace, (granted - ended).total_seconds())
            if event == "quarantined":
                quarantined[namespace] += 1
            elif event == "cancelled":
                cancelled[namespace] += 1
        for namespace, count in expired.items():
            self._metrics.expired(namespace, count)
        for (namespace, reason), count in lost.items():
            self._metrics.lost(namespace, reason, count)
        for namespace, count in quarantined.items():
            self._metrics.quarantined(namespace, count)
        for namespace, count in cancelled.items():
            self._metrics.cancelled(namespace, count)

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


def _instant(value: object) -> datetime:
    """A notification's timestamp (PostgreSQL's JSON text of a timestamptz)."""
    return datetime.fromisoformat(str(value))


def _expiry_reason(data: dict[str, Any]) -> LossReason:
    """RUNTIME_EXCEEDED when an expiry was the runtime budget's end, else LEASE_EXPIRED."""
    deadline = data.get("runtime_deadline")
    if deadline and _instant(data["expire_time"]) >= _instant(deadline):
        return LossReason.RUNTIME_EXCEEDED
    return LossReason.LEASE_EXPIRED
