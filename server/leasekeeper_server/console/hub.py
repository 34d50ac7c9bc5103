"""One shared Watch stream per namespace, fanned out to every viewer of it.

The first subscriber of a namespace opens its Watch stream; every later one
shares it; ``linger_s`` seconds after the last one leaves, it is closed.
Fifty open pages of a namespace cost one stream (``streams_open``).

The stream is opened with the console's own token when it has one, else with
the token of a subscriber (each viewer's access to the namespace is checked
with the viewer's own token before subscribing, and again every minute: see
``events.py``). That token stays in use for the stream until the stream
ends, also after its viewer left (the stream serves the others); ``leasekeeper
console --token`` gives the console a token of its own for the streams. When the
service refuses that token (UNAUTHENTICATED, PERMISSION_DENIED: revoked, or
never allowed to watch), the subscribers with that token are ended and the
stream is opened again with another subscriber's token. Any other end of the
stream (the server restarting: UNAVAILABLE) is told to every subscriber as a
gap (events may have been missed: re-read), and the stream is opened again
after a backoff (``retry_initial_s``, doubling to ``retry_max_s``).

A subscriber that reads too slowly (its queue of ``queue_size`` updates is
full) loses updates: it is told of a gap instead, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

from leasekeeper import AccessDenied, LeaseError, TaskEvent

log = logging.getLogger(__name__)

LINGER_S = 5.0
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 10.0
QUEUE_SIZE = 256

OpenWatch = Callable[[str, str | None], AsyncIterator[TaskEvent]]
"""Opens a namespace's Watch stream with a token: ``LeaseClient(...).watch()``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Update:
    """What a subscriber receives.

    Attributes:
        event: A task's event; None for a gap (events may have been missed).
        ended: Set on the last update: why the subscription ends (the
            service refused the token, the console stops).
    """

    event: TaskEvent | None
    ended: str = ""


class Subscription:
    """One viewer's share of a namespace's stream: iterate it for updates."""

    def __init__(self, namespace: str, token: str | None, queue_size: int) -> None:
        self.namespace = namespace
        self.token = token
        self._queue: asyncio.Queue[Update] = asyncio.Queue(queue_size)
        self._lagging = False
        self._finished = False
        self.ended = False

    def offer(self, update: Update) -> None:
        """Queues an update; a full queue drops it and queues a gap once room returns."""
        if self.ended:
            return
        if update.ended:
            self.ended = True
            self._force(update)
            return
        if self._lagging:
            if self._queue.full():
                return
            self._lagging = False
            self._queue.put_nowait(Update(None))
        if self._queue.full():
            self._lagging = True
            return
        self._queue.put_nowait(update)

    def _force(self, update: Update) -> None:
        """Puts the last update in, dropping queued ones if there is no room."""
        while self._queue.full():
            self._queue.get_nowait()
        self._queue.put_nowait(update)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Update:
        if self._finished:
            raise StopAsyncIteration
        update = await self._queue.get()
        if update.ended:
            self._finished = True  # delivered once; the next call ends the iteration
        return update


class _Feed:
    """A namespace's stream and its subscribers."""

    def __init__(self, hub: Hub, namespace: str) -> None:
        self.hub = hub
        self.namespace = namespace
        self.subscribers: list[Subscription] = []
        self.task: asyncio.Task[None] | None = None
        self.closing: asyncio.Task[None] | None = None
        self.refused: set[str | None] = set()

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(
                self._run(), name=f"leasekeeper-console-watch {self.namespace!r}"
            )

    def broadcast(self, update: Update, token: object = ...) -> None:
        """Offers ``update`` to every subscriber (or only to those with ``token``)."""
        for subscriber in list(self.subscribers):
            if token is ... or subscriber.token == token:
                subscriber.offer(update)

    def _token(self) -> tuple[bool, str | None]:
        """(found, the token to open the stream with); found False: no token may be used."""
        if self.hub.token is not None:
            return True, self.hub.token
        for subscriber in self.subscribers:
            if not subscriber.ended and subscriber.token not in self.refused:
                return True, subscriber.token
        return False, None

    async def _run(self) -> None:
        delay_s = self.hub.retry_initial_s
        while True:
            found, token = self._token()
            if not found:
                return  # no subscriber left whose token may watch
            try:
                self.hub.opened += 1
                try:
                    async for event in self.hub.open_watch(self.namespace, token):
                        delay_s = self.hub.retry_initial_s
                        self.broadcast(Update(event))
                finally:
                    self.hub.opened -= 1
                why = "the stream ended"
            except AccessDenied as error:
                if self.hub.token is not None:
                    log.warning("console: watching %r refused: %s", self.namespace, error)
                    self.broadcast(Update(None, ended=f"the service refused to watch: {error}"))
                    return
                # This viewer's token may no longer watch: end its subscriptions, try another.
                self.refused.add(token)
                self.broadcast(Update(None, ended=f"the service refused: {error}"), token=token)
                self.subscribers = [s for s in self.subscribers if s.token != token]
                continue
            except LeaseError as error:
                why = str(error)
            log.info(
                "console: watch of %r ended (%s); again in %.1f s", self.namespace, why, delay_s
            )
            self.broadcast(Update(None))
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, self.hub.retry_max_s)


class Hub:
    """The console's Watch streams, one per namespace with viewers."""

    def __init__(
        self,
        open_watch: OpenWatch,
        *,
        token: str | None = None,
        linger_s: float = LINGER_S,
        retry_initial_s: float = RETRY_INITIAL_S,
        retry_max_s: float = RETRY_MAX_S,
        queue_size: int = QUEUE_SIZE,
    ) -> None:
        """A hub with no streams yet.

        Args:
            open_watch: Opens a namespace's Watch stream with a token.
            token: The console's own token for the streams; None: a subscriber's.
            linger_s: Seconds a stream stays open after its last subscriber left.
            retry_initial_s: First wait, in seconds, before a stream is opened again.
            retry_max_s: Longest wait, in seconds, between two openings.
            queue_size: Updates queued per subscriber before it is told of a gap.
        """
        self.open_watch = open_watch
        self.token = token
        self.linger_s = linger_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.queue_size = queue_size
        self.opened = 0
        self._feeds: dict[str, _Feed] = {}
        self._closed = False

    @property
    def streams_open(self) -> int:
        """Watch streams open now (one per namespace with viewers, while it lingers too)."""
        return self.opened

    def subscribers(self, namespace: str) -> int:
        """How many subscribers a namespace has now."""
        feed = self._feeds.get(namespace)
        return len(feed.subscribers) if feed is not None else 0

    @contextlib.asynccontextmanager
    async def subscribe(self, namespace: str, token: str | None) -> AsyncIterator[Subscription]:
        """Shares the namespace's stream (opening it if needed) for the ``async with`` block.

        Raises:
            RuntimeError: the hub is closed.
        """
        if self._closed:
            raise RuntimeError("the console is stopping")
        feed = self._feeds.get(namespace)
        if feed is None:
            feed = self._feeds[namespace] = _Feed(self, namespace)
        if feed.closing is not None:
            feed.closing.cancel()
            feed.closing = None
        subscription = Subscription(namespace, token, self.queue_size)
        feed.subscribers.append(subscription)
        feed.refused.discard(token)  # a token checked just now gets another chance
        feed.start()
        try:
            yield subscription
        finally:
            with contextlib.suppress(ValueError):
                feed.subscribers.remove(subscription)
            if not feed.subscribers and not self._closed and feed.closing is None:
                feed.closing = asyncio.create_task(self._close_later(feed))

    async def _close_later(self, feed: _Feed) -> None:
        await asyncio.sleep(self.linger_s)
        if feed.subscribers:
            return
        feed.closing = None
        if self._feeds.get(feed.namespace) is feed:
            del self._feeds[feed.namespace]
        await _cancel(feed.task)

    async def close(self) -> None:
        """Ends every subscription and closes every stream."""
        self._closed = True
        feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            feed.broadcast(Update(None, ended="the console is stopping"))
            await _cancel(feed.closing)
            await _cancel(feed.task)


async def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
