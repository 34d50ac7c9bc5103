"""Who waits on a task's changes, and a Watch stream's subscription to them (pure).

A change feed (``events.LeaseEvents`` from PostgreSQL's notifications,
``memory.MemoryEvents`` in tests) hands each committed change to a
:class:`Fanout`, which rings the task's watchers (waiting claims, heartbeat
streams: a doorbell, then a fresh read) and pushes the event to the
subscriptions of the task, its namespace and everything (Watch streams, read
by ``rpc/watch.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any, Protocol

from leasekeeper_server.core.model import TaskKey

# Events a Watch subscription may hold unread; past that it is told of a gap.
MAX_PENDING_EVENTS = 1000


class Doorbell(Protocol):
    """What a watcher of a task is rung with: ``asyncio.Event``, or anything with ``set()``."""

    def set(self) -> None:
        """Rung on a change of the task (or when changes may have been missed)."""


class Subscription:
    """The events of a task (or a namespace) since subscribing, in commit order.

    Attributes:
        ready: set while ``pending`` holds events or ``gap`` is set.
        pending: the notification payloads (dicts), oldest first.
        gap: True when events may have been lost (the listening connection
            was interrupted, or too many events were left unread).
    """

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.pending: deque[dict[str, Any]] = deque()
        self.gap = False

    def push(self, payload: dict[str, Any]) -> None:
        """Adds one event; too many unread turns into a gap."""
        if len(self.pending) >= MAX_PENDING_EVENTS:
            self.mark_gap()
            return
        self.pending.append(payload)
        self.ready.set()

    def mark_gap(self) -> None:
        """Drops what is pending: the reader must re-read the state instead."""
        self.pending.clear()
        self.gap = True
        self.ready.set()

    def take(self) -> tuple[bool, list[dict[str, Any]]]:
        """(gap, events) since the last take; clears both."""
        gap, events = self.gap, list(self.pending)
        self.gap = False
        self.pending.clear()
        self.ready.clear()
        return gap, events


class Fanout:
    """The watchers and the subscriptions of a change feed, by task and by topic."""

    def __init__(self) -> None:
        self._watchers: defaultdict[TaskKey, set[Doorbell]] = defaultdict(set)
        # By (namespace, task_id): task_id None for a whole namespace, both None for all.
        self._subscribers: defaultdict[tuple[str | None, str | None], set[Subscription]] = (
            defaultdict(set)
        )

    @contextlib.contextmanager
    def watch(self, key: TaskKey) -> Iterator[asyncio.Event]:
        """An event set whenever ``key``'s ownership may have changed; clear it after checking."""
        event = asyncio.Event()
        with self.ring(key, event):
            yield event

    @contextlib.contextmanager
    def ring(self, key: TaskKey, bell: Doorbell) -> Iterator[None]:
        """Calls ``bell.set()`` whenever ``key``'s ownership may have changed, while the block runs.

        :meth:`watch` with a bell of the caller's: a Session stream rings one
        small object per lease instead of keeping an event and a task for each.
        """
        self._watchers[key].add(bell)
        try:
            yield
        finally:
            watchers = self._watchers.get(key)
            if watchers is not None:
                watchers.discard(bell)
                if not watchers:
                    del self._watchers[key]

    @contextlib.contextmanager
    def subscribe(self, namespace: str | None, task_id: str | None) -> Iterator[Subscription]:
        """The events of one task, of every task of a namespace (task_id None), or of all (both)."""
        sub = Subscription()
        topic = (namespace, task_id)
        self._subscribers[topic].add(sub)
        try:
            yield sub
        finally:
            subs = self._subscribers.get(topic)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subscribers[topic]

    def deliver(self, key: TaskKey, event: dict[str, Any] | None) -> None:
        """Rings ``key``'s watchers; pushes ``event``, if any, to its subscriptions."""
        for watcher in self._watchers.get(key, ()):
            watcher.set()
        if event is not None:
            for topic in ((key.namespace, key.task_id), (key.namespace, None), (None, None)):
                for sub in self._subscribers.get(topic, ()):
                    sub.push(event)

    def wake_all(self) -> None:
        """Rings every watcher, and tells every subscription of a gap (events may be lost)."""
        for events in self._watchers.values():
            for watcher in events:
                watcher.set()
        for subs in self._subscribers.values():
            for sub in subs:
                sub.mark_gap()

    @property
    def watched(self) -> list[TaskKey]:
        """The tasks someone watches now."""
        return list(self._watchers)
