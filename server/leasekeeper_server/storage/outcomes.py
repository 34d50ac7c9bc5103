"""How the request path's database statements ended, tallied for the health check.

``store.py`` tells a :class:`StatementOutcomes` how each use of the database
on the request path ended, at its one edge (see ``Store._outcome``);
``health.py`` takes the tally at every check and decides from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tally:
    """Statements that succeeded and failed over one period, and the last failure's text."""

    succeeded: int = 0
    failed: int = 0
    last_failure: str = ""


class StatementOutcomes:
    """Counts successes and failures until the next ``take``."""

    def __init__(self) -> None:
        self._succeeded = 0
        self._failed = 0
        self._last_failure = ""

    @property
    def ended(self) -> int:
        """Statements that ended (either way) since the last ``take``."""
        return self._succeeded + self._failed

    def success(self) -> None:
        """One statement succeeded (or ended in a decision, such as a lost lease)."""
        self._succeeded += 1

    def failure(self, error: BaseException) -> None:
        """One statement failed without deciding; ``error`` says why (its cause's, if any)."""
        self._failed += 1
        self._last_failure = describe(error)

    def take(self) -> Tally:
        """The tally since the last ``take``; starts a new one."""
        tally = Tally(self._succeeded, self._failed, self._last_failure)
        self._succeeded = self._failed = 0
        self._last_failure = ""
        return tally


def describe(error: BaseException) -> str:
    """``Type: first line of the message`` of the error's cause (the driver's), else of itself."""
    cause = error.__cause__ or error
    message = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {message[0]}" if message else type(cause).__name__
