"""The console's hub: one Watch stream per namespace, shared, reopened, closed (no server)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from leasekeeper import AccessDenied, LeaseUnavailable, TaskEvent
from leasekeeper_server.console.hub import Hub, Update
from tests.helpers import poll


class FakeWatch:
    """Watch streams that yield what the test feeds them, or raise what it feeds them."""

    def __init__(self) -> None:
        self.opened: list[tuple[str, str | None]] = []
        self.open_now = 0
        self.feed: asyncio.Queue[TaskEvent | BaseException] = asyncio.Queue()

    def __call__(self, namespace: str, token: str | None) -> AsyncIterator[TaskEvent]:
        async def stream() -> AsyncIterator[TaskEvent]:
            self.opened.append((namespace, token))
            self.open_now += 1
            try:
                while True:
                    item = await self.feed.get()
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                self.open_now -= 1

        return stream()


def event(kind: str = "CLAIMED") -> TaskEvent:
    return TaskEvent(type=kind, lease=None, event_time=None)


async def next_update(subscription: AsyncIterator[Update]) -> Update:
    return await asyncio.wait_for(anext(subscription), 5)


async def test_viewers_share_one_stream_closed_a_little_after_the_last_leaves() -> None:
    watch = FakeWatch()
    hub = Hub(watch, linger_s=0.1, retry_initial_s=0.01)
    async with contextlib.AsyncExitStack() as stack:
        subs = [await stack.enter_async_context(hub.subscribe("ns", "t")) for _ in range(5)]
        await poll(lambda: watch.open_now == 1, "the stream to open")
        assert hub.streams_open == 1 and hub.subscribers("ns") == 5
        await watch.feed.put(event())
        updates = await asyncio.gather(*(next_update(sub) for sub in subs))
        assert {update.event.type for update in updates if update.event} == {"CLAIMED"}
    assert hub.subscribers("ns") == 0
    assert hub.streams_open == 1  # lingering
    await poll(lambda: hub.streams_open == 0 and watch.open_now == 0, "the stream to close")
    assert watch.opened == [("ns", "t")]
    await hub.close()


async def test_a_viewer_back_within_the_linger_keeps_the_stream() -> None:
    watch = FakeWatch()
    hub = Hub(watch, linger_s=0.3)
    async with hub.subscribe("ns", None):
        await poll(lambda: watch.open_now == 1, "the stream to open")
    async with hub.subscribe("ns", None):
        await asyncio.sleep(0.4)
        assert watch.open_now == 1
    assert watch.opened == [("ns", None)]
    await hub.close()
    assert watch.open_now == 0


async def test_a_failed_stream_is_a_gap_then_reopened() -> None:
    watch = FakeWatch()
    hub = Hub(watch, retry_initial_s=0.01)
    async with hub.subscribe("ns", "t") as subscription:
        await poll(lambda: watch.open_now == 1, "the stream to open")
        await watch.feed.put(LeaseUnavailable("server stopping", code=grpc.StatusCode.UNAVAILABLE))
        gap = await next_update(subscription)
        assert gap.event is None and not gap.ended
        await poll(lambda: len(watch.opened) == 2, "the stream to be opened again")
        await watch.feed.put(event("RELEASED"))
        update = await next_update(subscription)
        assert update.event is not None and update.event.type == "RELEASED"
    await hub.close()


async def test_a_refused_token_ends_its_viewers_and_another_token_watches() -> None:
    watch = FakeWatch()
    hub = Hub(watch, retry_initial_s=0.01)
    async with hub.subscribe("ns", "revoked") as first, hub.subscribe("ns", "good") as second:
        await poll(lambda: watch.open_now == 1, "the stream to open")
        assert watch.opened == [("ns", "revoked")]
        denied = AccessDenied("token revoked", code=grpc.StatusCode.UNAUTHENTICATED)
        await watch.feed.put(denied)
        ended = await next_update(first)
        assert ended.ended.startswith("the service refused")
        assert [u async for u in first] == []  # the subscription is over
        await poll(lambda: watch.opened[-1] == ("ns", "good"), "a stream with the other token")
        await watch.feed.put(event())
        update = await next_update(second)
        assert update.event is not None
    await hub.close()


async def test_close_ends_every_subscription() -> None:
    watch = FakeWatch()
    hub = Hub(watch)
    async with hub.subscribe("a", None) as one, hub.subscribe("b", None) as two:
        await poll(lambda: watch.open_now == 2, "two streams")
        await hub.close()
        for subscription in (one, two):
            assert (await next_update(subscription)).ended == "the console is stopping"
    assert watch.open_now == 0 and hub.streams_open == 0


async def test_a_slow_viewer_is_told_of_a_gap() -> None:
    watch = FakeWatch()
    hub = Hub(watch, queue_size=2)
    async with hub.subscribe("ns", None) as subscription:
        await poll(lambda: watch.open_now == 1, "the stream to open")
        for _ in range(5):
            await watch.feed.put(event())
        await poll(lambda: watch.feed.empty(), "the events to be taken")
        await asyncio.sleep(0.05)
        kinds = [await next_update(subscription) for _ in range(2)]
        assert all(update.event is not None for update in kinds)
        await watch.feed.put(event("EXPIRED"))
        gap = await next_update(subscription)
        assert gap.event is None  # what was dropped is said
        after = await next_update(subscription)
        assert after.event is not None and after.event.type == "EXPIRED"
    await hub.close()
