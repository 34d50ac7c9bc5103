"""Calls arriving together, run as one statement: a coalescer per kind of statement.

Workers renew constantly and effect services validate before every effect,
so most of the service's calls are small single-row statements. Run one by
one, each pays a pool checkout, a round trip and the database's per-statement
work. A :class:`Coalescer` instead collects the calls that arrive while its
previous statement runs and sends them together as one statement over arrays
(``unnest``); each caller still gets its own answer.

The rule (group commit, as in database logs): at most one statement of a
coalescer is in flight. A call arriving in a quiet moment starts one on the
next turn of the event loop, so it waits for nothing. Calls arriving while
one runs are sent together when it returns; and while calls keep coming so
(busy), at most one statement starts per tick (``tick_s``, 2 ms by default:
LEASEKEEPER_BATCH_TICK_S), the calls of the tick gathering into it. So a
busy process sends at most one statement of each kind per tick, and a batch
grows with the load instead of the number of statements.

Items with the same key never share a statement: a statement that would
change the same row twice is an error in PostgreSQL (``ON CONFLICT DO UPDATE
command cannot affect row a second time``), so the later item waits for the
next statement, or, where the caller says so (``duplicate``), is answered
without one once the statement carrying the first has returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")
_Entry = tuple[Item, "asyncio.Future[Result]"]


class Coalescer(Generic[Item, Result]):
    """Runs the items submitted together as one call of ``run``.

    Args:
        run: Runs a batch (1 to ``max_batch`` items with distinct keys) and
            returns one result per item, in the items' order. Whatever it
            raises is raised to every caller of the batch.
        key: An item's key; items with equal keys never share a batch. None:
            any items may share one.
        max_batch: The most items in one batch.
        tick_s: The least time, seconds, from one batch's start to the next's
            while calls keep coming: calls arriving meanwhile wait and go
            together. A call arriving when no batch is in flight is sent at
            once.
        duplicate: The result for an item whose key is already in the batch
            being taken, given once that batch's ``run`` has returned (or
            raised), instead of running the item in a later batch. None:
            such items wait for a later batch.
    """

    def __init__(
        self,
        run: Callable[[Sequence[Item]], Awaitable[Sequence[Result]]],
        key: Callable[[Item], Hashable] | None = None,
        max_batch: int = 1000,
        duplicate: Callable[[Item], Result] | None = None,
        tick_s: float = 0.0,
    ) -> None:
        self._run = run
        self._tick_s = tick_s
        self._key = key
        self._max_batch = max_batch
        self._duplicate = duplicate
        self._pending: list[_Entry[Item, Result]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def submit(self, item: Item) -> Result:
        """The result of ``item``, run in the next batch that has room for its key.

        Raises:
            Whatever ``run`` raised for the batch.
        """
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._drainer is None:
            # A task's first step runs on the next turn of the loop: the calls
            # arriving in this turn join the batch.
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def close(self) -> None:
        """Cancels the batch in flight and the calls waiting for the next; for shutdown.

        Their callers see CancelledError.
        """
        drainer = self._drainer
        if drainer is not None:
            drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drainer
        for _, future in self._pending:
            future.cancel()
        self._pending = []

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        last_start: float | None = None  # loop time this drainer sent its last batch
        try:
            while self._pending:
                # Busy (this drainer already sent a batch, and calls came while
                # it ran): at most one batch per tick, and the calls arriving
                # meanwhile gather. A drainer's first batch goes at once.
                if last_start is not None:
                    wait_s = last_start + self._tick_s - loop.time()
                    if wait_s > 0:
                        await asyncio.sleep(wait_s)
                batch, duplicates = self._take()
                if not batch:
                    continue
                last_start = loop.time()
                try:
                    results = await self._run([item for item, _ in batch])
                except Exception as exc:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                except BaseException:  # cancelled (shutdown): so are its callers
                    for _, future in batch:
                        future.cancel()
                    raise
                else:
                    for (_, future), result in zip(batch, results, strict=True):
                        if not future.done():
                            future.set_result(result)
                finally:
                    self._answer_duplicates(duplicates)
        finally:
            self._drainer = None

    def _take(self) -> tuple[list[_Entry[Item, Result]], list[_Entry[Item, Result]]]:
        """Up to max_batch live items with distinct keys, in arrival order, and their duplicates.

        Items left over stay pending for the next batch.
        """
        batch: list[_Entry[Item, Result]] = []
        duplicates: list[_Entry[Item, Result]] = []
        left: list[_Entry[Item, Result]] = []
        keys: set[Hashable] = set()
        for entry in self._pending:
            if entry[1].done():  # its caller was cancelled: drop it unsent
                continue
            if len(batch) >= self._max_batch:
                left.append(entry)
            elif self._key is None:
                batch.append(entry)
            elif (k := self._key(entry[0])) not in keys:
                keys.add(k)
                batch.append(entry)
            elif self._duplicate is not None:
                duplicates.append(entry)
            else:
                left.append(entry)
        self._pending = left
        return batch, duplicates

    def _answer_duplicates(self, duplicates: list[_Entry[Item, Result]]) -> None:
        if not duplicates:
            return
        duplicate = self._duplicate
        assert duplicate is not None  # _take keeps no duplicates without it
        for item, future in duplicates:
            if not future.done():
                future.set_result(duplicate(item))
