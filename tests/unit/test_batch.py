"""The coalescer: calls arriving together share one run, each gets its own answer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from leasekeeper_server.storage.batch import Coalescer


class Recorder:
    """A batch runner that records its batches and answers item * 10."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.batches: list[list[tuple[str, int]]] = []
        self.fail = fail
        self.release = asyncio.Event()
        self.release.set()
        self.started = asyncio.Event()  # set when a batch starts

    async def run(self, items: Sequence[tuple[str, int]]) -> list[int]:
        self.batches.append(list(items))
        self.started.set()
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return [value * 10 for _, value in items]


async def held_run() -> tuple[Recorder, Coalescer[tuple[str, int], int], asyncio.Future[int]]:
    """A coalescer whose first call, ("a", 1), is in flight until ``r.release`` is set."""
    r = Recorder()
    r.release.clear()
    c = Coalescer(r.run, key=lambda item: item[0])
    first = asyncio.ensure_future(c.submit(("a", 1)))
    await r.started.wait()
    return r, c, first


async def test_calls_of_one_turn_share_a_batch_and_get_their_own_answers() -> None:
    r = Recorder()
    c = Coalescer(r.run, key=lambda item: item[0])
    answers = await asyncio.gather(*(c.submit((f"k{i}", i)) for i in range(50)))
    assert answers == [i * 10 for i in range(50)]
    assert len(r.batches) == 1 and len(r.batches[0]) == 50


async def test_calls_arriving_during_a_run_go_together_in_the_next() -> None:
    r, c, first = await held_run()
    assert len(r.batches) == 1  # in flight
    later = [asyncio.ensure_future(c.submit((f"b{i}", i))) for i in range(10)]
    await asyncio.sleep(0)  # one turn of the loop: the ten calls are submitted
    assert len(r.batches) == 1  # at most one run in flight
    r.release.set()
    assert await first == 10
    assert await asyncio.gather(*later) == [i * 10 for i in range(10)]
    assert [len(b) for b in r.batches] == [1, 10]


async def test_equal_keys_never_share_a_batch() -> None:
    r = Recorder()
    c = Coalescer(r.run, key=lambda item: item[0])
    answers = await asyncio.gather(c.submit(("a", 1)), c.submit(("a", 2)), c.submit(("b", 3)))
    assert answers == [10, 20, 30]
    assert r.batches == [[("a", 1), ("b", 3)], [("a", 2)]]


async def test_duplicates_are_answered_after_the_batch_of_the_first() -> None:
    r = Recorder()
    r.release.clear()
    c = Coalescer(r.run, key=lambda item: item[0], duplicate=lambda item: -1)
    first = asyncio.ensure_future(c.submit(("a", 1)))
    dup = asyncio.ensure_future(c.submit(("a", 2)))
    await r.started.wait()
    assert not dup.done()  # not before the first's run returned
    r.release.set()
    assert (await first, await dup) == (10, -1)
    assert r.batches == [[("a", 1)]]


async def test_max_batch_splits_a_crowd() -> None:
    r = Recorder()
    c = Coalescer(r.run, key=lambda item: item[0], max_batch=4)
    answers = await asyncio.gather(*(c.submit((f"k{i}", i)) for i in range(10)))
    assert answers == [i * 10 for i in range(10)]
    assert [len(b) for b in r.batches] == [4, 4, 2]


async def test_a_failed_run_fails_each_of_its_callers_and_the_next_batch_runs() -> None:
    r = Recorder(fail=RuntimeError("database down"))
    c = Coalescer(r.run, key=lambda item: item[0])
    results = await asyncio.gather(
        *(c.submit((f"k{i}", i)) for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(e, RuntimeError) and str(e) == "database down" for e in results)
    r.fail = None
    assert await c.submit(("k", 7)) == 70


async def test_a_cancelled_caller_is_left_out_of_the_batch() -> None:
    r, c, first = await held_run()
    gone = asyncio.ensure_future(c.submit(("b", 2)))
    kept = asyncio.ensure_future(c.submit(("c", 3)))
    await asyncio.sleep(0)  # one turn of the loop: both calls are submitted
    gone.cancel()
    r.release.set()
    assert (await first, await kept) == (10, 30)
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert r.batches == [[("a", 1)], [("c", 3)]]


async def test_close_cancels_the_run_in_flight() -> None:
    _, c, waiting = await held_run()
    await c.close()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_close_also_cancels_the_calls_waiting_for_the_next_run() -> None:
    r, c, in_flight = await held_run()
    queued = asyncio.ensure_future(c.submit(("b", 2)))
    await asyncio.sleep(0)  # one turn of the loop: the call is submitted
    await c.close()
    for call in (in_flight, queued):
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 1)
    assert r.batches == [[("a", 1)]]
