"""A Watch stream's subscription: the events of a task or a namespace, in commit order (pure).

Filled by a change feed (``events.LeaseEvents`` from PostgreSQL's
notifications, ``memory.MemoryEvents`` in tests) and read by ``rpc/watch.py``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

# Events a Watch subscription may hold unread; past that it is told of a gap.
MAX_PENDING_EVENTS = 1000


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
