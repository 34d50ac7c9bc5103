"""The trust window: how long the client may act on a lease without hearing back.

The database clock decides whether a lease is live, and the client never sees
it. What the client does see is ``remaining_ttl``: the time the lease had left
when the database answered. Since the answer was made *after* the request was
sent, the lease certainly lasts until ``send_time + remaining_ttl`` on the
client's monotonic clock (as long as the two clocks run at nearly the same
rate). The trust deadline subtracts a safety margin for rate differences and
scheduling delays::

    trust_deadline = send_time + remaining_ttl - safety_margin

Past it, and unless a renewal has been confirmed since, the lease counts as
lost: stop, cancel, commit nothing. The loss is ``RUNTIME_EXCEEDED`` when the
answer that set the deadline already ended the lease at its runtime budget
(``expire_time >= runtime_deadline``, the server's own rule: no renewal could
have moved it), else ``LEASE_EXPIRED``. This module is pure: the clock is injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime

Clock = Callable[[], float]
"""A monotonic clock returning seconds (``time.monotonic`` by default)."""

MAX_DEFAULT_SAFETY_MARGIN_S = 1.0


def default_safety_margin(ttl_s: float) -> float:
    """The default safety margin for a lease of ``ttl_s`` seconds: ``min(1 s, ttl / 10)``.

    One second covers scheduling hiccups and clock-rate differences on leases of
    10 s and more; a tenth of the ttl keeps short leases usable.
    """
    return min(MAX_DEFAULT_SAFETY_MARGIN_S, max(ttl_s, 0.0) / 10.0)


def trust_deadline(send_time: float, remaining_ttl_s: float, safety_margin_s: float) -> float:
    """``send_time + remaining_ttl_s - safety_margin_s``: past this clock reading, a lease is lost.

    Args:
        send_time: The client clock (seconds) when the answered request was sent.
        remaining_ttl_s: Seconds the lease had left, per the database's answer.
        safety_margin_s: Seconds kept in reserve for clock-rate differences and delays.

    """
    return send_time + remaining_ttl_s - safety_margin_s


class TrustWindow:
    """The client-side deadline of a lease, moved only by confirmed renewals.

    Not thread-safe; meant for one event loop.
    """

    def __init__(
        self,
        safety_margin_s: float,
        clock: Clock = time.monotonic,
        runtime_deadline: datetime | None = None,
    ) -> None:
        """Create a window that trusts nothing yet.

        Args:
            safety_margin_s: Seconds subtracted from every confirmed remaining ttl; >= 0.
            clock: Monotonic clock in seconds.
            runtime_deadline: The end of the lease's runtime budget (database
                clock, from the grant), or None when unknown.

        Raises:
            ValueError: Negative safety margin.

        """
        if safety_margin_s < 0:
            raise ValueError(f"safety_margin_s must be >= 0, got {safety_margin_s}")
        self._margin_s = safety_margin_s
        self._clock = clock
        self._runtime_deadline = runtime_deadline
        self._deadline: float | None = None
        self._confirmed_send_time: float | None = None
        self._at_budget = False

    @property
    def safety_margin_s(self) -> float:
        """The safety margin in seconds."""
        return self._margin_s

    @property
    def deadline(self) -> float | None:
        """The trust deadline on the clock, or None before the first confirmation."""
        return self._deadline

    def confirm(
        self,
        send_time: float,
        remaining_ttl_s: float,
        *,
        renewed: bool = True,
        expire_time: datetime | None = None,
    ) -> None:
        """Record an answer that says the lease had ``remaining_ttl_s`` left.

        The deadline becomes ``send_time + remaining_ttl_s - safety_margin`` (the
        latest answer is the truth, even when it shortens the lease, e.g. near the
        runtime budget). An answer to a request sent before the one that set the
        current deadline is stale and ignored. An answer with ``renewed=False``
        (the server answered from its last renewal without writing) may shorten
        the deadline but never extends it: its ``remaining_ttl`` was not freshly
        decided by the database.

        Args:
            send_time: The clock reading when the answered request was sent.
            remaining_ttl_s: Seconds the lease had left, per the database.
            renewed: False for an answer made without a database write.
            expire_time: The lease's expire_time in the answer (database clock),
                if sent: at or past the runtime deadline, the lease ends by its budget.

        """
        if self._confirmed_send_time is not None and send_time < self._confirmed_send_time:
            return
        candidate = trust_deadline(send_time, remaining_ttl_s, self._margin_s)
        if not renewed and self._deadline is not None and candidate > self._deadline:
            return
        self._deadline = candidate
        self._confirmed_send_time = send_time
        self._at_budget = (
            expire_time is not None
            and self._runtime_deadline is not None
            and expire_time >= self._runtime_deadline
        )

    @property
    def loss_reason(self) -> str:
        """Why the lease is lost once the deadline passes: RUNTIME_EXCEEDED or LEASE_EXPIRED."""
        return "RUNTIME_EXCEEDED" if self._at_budget else "LEASE_EXPIRED"

    def remaining_s(self) -> float:
        """Seconds until the trust deadline (<= 0 once passed or never confirmed)."""
        if self._deadline is None:
            return 0.0
        return self._deadline - self._clock()

    def expired(self) -> bool:
        """True once the trust deadline has passed (or was never set)."""
        return self.remaining_s() <= 0.0
