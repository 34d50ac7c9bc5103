"""The in-memory storage's clock: an injected ``Clock``, moved by hand in tests (``ManualClock``).

The in-memory storage (``memory.py``) has no database clock: every decision
reads the instant its ``Clock`` returns. Tests pass a :class:`ManualClock`
and advance it, so no test waits for real time to pass.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    """The machine's wall clock in UTC (the default clock)."""
    return datetime.now(UTC)


def check_aware(instant: datetime) -> datetime:
    """Returns ``instant`` when it is timezone-aware.

    Raises:
        ValueError: ``instant`` is naive (no tzinfo or no UTC offset).
    """
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError(f"the storage clock must be timezone-aware, got {instant!r}")
    return instant


class ManualClock:
    """A clock that moves only when told to: ``clock()`` is the instant, ``advance`` moves it.

    Args:
        start: the first instant (timezone-aware); now, in UTC, by default.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start if start is not None else utc_now()
        check_aware(self._now)

    def __call__(self) -> datetime:
        """The current instant."""
        return self._now

    def advance(self, by: timedelta | float) -> None:
        """Moves the clock forward by ``by`` (a timedelta, or seconds); never backwards.

        Raises:
            ValueError: ``by`` is negative.
        """
        step = by if isinstance(by, timedelta) else timedelta(seconds=by)
        if step < timedelta(0):
            raise ValueError("a ManualClock never goes backwards")
        self._now += step
