"""Exponential backoff with full jitter (delay drawn uniformly in [0, cap])."""

from __future__ import annotations

import random


class Backoff:
    """Delays for retries: attempt n waits ``uniform(0, min(max_s, initial_s * 2**n))``.

    Full jitter spreads many workers retrying the same task over the whole
    interval instead of letting them collide in waves.
    """

    def __init__(
        self, initial_s: float = 0.05, max_s: float = 2.0, rng: random.Random | None = None
    ) -> None:
        """Create a backoff.

        Args:
            initial_s: Upper bound of the first delay in seconds; > 0.
            max_s: Upper bound of every delay in seconds; >= initial_s.
            rng: Source of randomness (seed one in tests).

        """
        self._initial_s = initial_s
        self._max_s = max_s
        self._rng = rng or random.Random()
        self._attempt = 0

    def next_delay_s(self, hint_s: float | None = None) -> float:
        """The next delay in seconds.

        Args:
            hint_s: When the wait can end early (e.g. a holder's remaining ttl in
                seconds), the delay never exceeds it by more than a few ms: no
                point sleeping past the moment the task frees up.

        Returns:
            Seconds to sleep before the next attempt.

        """
        cap = min(self._max_s, self._initial_s * (2.0 ** min(self._attempt, 62)))
        self._attempt += 1
        delay = self._rng.uniform(0.0, cap)
        if hint_s is not None:
            delay = min(delay, max(hint_s, 0.0) + 0.005)
        return delay

    def reset(self) -> None:
        """Start again from the first delay (after a success)."""
        self._attempt = 0
