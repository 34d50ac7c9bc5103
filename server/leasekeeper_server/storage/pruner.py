"""The history pruner: keeps the task history within its age and per-task count.

Every ``history_prune_interval_s`` seconds a pass deletes, in batches of at
most ``PRUNE_BATCH`` entries per statement:

* by age: entries whose ``event_time`` is older than ``history_max_age_s``
  (statement ``prune_history_age``, through the ``event_time`` index);
* by count: for the tasks named by entries written since the pruner's
  watermark, each task's entries beyond the newest ``history_max_per_task``
  (statement ``prune_history_count``, which moves the watermark).

Either statement's cost follows the entries it reads and deletes, never the
table's size. Every replica runs a pruner; the count pass locks its
watermark row ``SKIP LOCKED``, so replicas take turns, and age deletions by
two replicas at once only find fewer rows. A pass that meets an unreachable
database logs it and waits for the next interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import timedelta

from leasekeeper_server.core.errors import DatabaseUnavailable
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage.store import Store

log = logging.getLogger(__name__)

# Most entries one statement reads (count pass) or deletes (age pass).
PRUNE_BATCH = 5000
# Most statements of each kind per pass: a pass's work is bounded; the rest waits.
MAX_BATCHES_PER_PASS = 20


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What one pass deleted: entries past their age, and entries past their task's count."""

    by_age: int
    by_count: int


class HistoryPruner:
    """Runs :meth:`prune_once` every ``history_prune_interval_s`` seconds in the background."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self._store = store
        self._settings = settings
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts the background passes."""
        self._task = asyncio.create_task(self._run(), name="leasekeeper-history-pruner")

    async def stop(self) -> None:
        """Stops after the statement in flight is cancelled."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def prune_once(self) -> PruneResult:
        """One pass: by age, then by count; at most ``MAX_BATCHES_PER_PASS`` statements each.

        Raises:
            DatabaseUnavailable: the database cannot be reached (UNAVAILABLE).
        """
        s = self._settings
        max_age = timedelta(seconds=s.history_max_age_s)
        by_age = 0
        for _ in range(MAX_BATCHES_PER_PASS):
            deleted = await self._store.execute_count("prune_history_age", max_age, PRUNE_BATCH)
            by_age += deleted
            if deleted < PRUNE_BATCH:
                break
        by_count = 0
        for _ in range(MAX_BATCHES_PER_PASS):
            rows = await self._store.fetch(
                "prune_history_count", s.history_max_per_task, PRUNE_BATCH
            )
            by_count += rows[0]["pruned"]
            if rows[0]["checked"] < PRUNE_BATCH:
                break
        if by_age or by_count:
            log.info("task history pruned: %d entries by age, %d by count", by_age, by_count)
        return PruneResult(by_age, by_count)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.history_prune_interval_s)
            try:
                await self.prune_once()
            except DatabaseUnavailable as exc:
                log.warning("task history pruning skipped: %s", exc)
