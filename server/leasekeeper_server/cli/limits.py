"""Operators' side of per-namespace limits: set, clear and list the rows.

The servers enforce the limits (see :mod:`leasekeeper_server.core.limits`); this
module only writes table ``leasekeeper_namespace_limits`` through one
connection, with the statements of ``sql/limits_admin.sql``. Each change is
announced on channel ``leasekeeper_config`` by the table's trigger, so every
server reloads its cache at once. The claim bucket's state (``bucket_tokens``,
``bucket_time``) is left to the claims, except that a change of the rate or
the burst resets it to a full bucket.

A namespace without a row has no limits, no lock delay and no default
attempt limit; a row left with nothing set is removed. A change that would
leave every value as it is writes nothing (and announces nothing): set and
clear say whether they changed the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from leasekeeper_server.core.errors import InvalidArgument
from leasekeeper_server.rpc import validate
from leasekeeper_server.storage import queries

MAX_NAMESPACE_BYTES = 1024  # above any id a server allows (settings.MAX_ID_BYTES_LIMIT)
MAX_LEASES_CAP = 2**31 - 1  # the column is a PostgreSQL integer
MAX_CLAIMS_PER_SECOND = 1e9
MAX_LOCK_DELAY_S = 86400.0 * 365
MAX_ATTEMPTS_CAP = 1_000_000  # ClaimRequest.max_attempts's bound


class LimitsError(ValueError):
    """A limit value the table cannot take.

    Attributes:
        field: the limit's name (``namespace``, ``max_leases``,
            ``claims_per_second``, ``burst``, ``lock_delay_s``,
            ``max_attempts``).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class LimitsRow:
    """One namespace's limits, as stored.

    Attributes:
        namespace: the namespace.
        max_leases: most live leases at once; None for no limit.
        claims_per_second: the claim bucket's refill rate; None for no limit.
        burst: the bucket's size in claims; None for the default
            ``max(1, claims_per_second)``.
        lock_delay: how long an expired lease's task stays unclaimable.
        max_attempts: the attempt limit of a grant whose claim sends none;
            None for no limit.
        update_time: when the row last changed (database clock).
    """

    namespace: str
    max_leases: int | None
    claims_per_second: float | None
    burst: float | None
    lock_delay: timedelta
    max_attempts: int | None
    update_time: datetime


def _sql() -> dict[str, str]:
    return queries.load("limits_admin.sql")


def _row(record: asyncpg.Record) -> LimitsRow:
    return LimitsRow(
        namespace=record["namespace"],
        max_leases=record["max_leases"],
        claims_per_second=record["claims_per_second"],
        burst=record["claim_burst"],
        lock_delay=record["lock_delay"],
        max_attempts=record["max_attempts"],
        update_time=record["update_time"],
    )


def _check_namespace(namespace: str) -> None:
    """The rules of every id (validate.identifier), up to the largest id a server allows."""
    try:
        validate.identifier("namespace", namespace, MAX_NAMESPACE_BYTES)
    except InvalidArgument as exc:
        raise LimitsError("namespace", exc.description) from exc


def _check_number(field: str, value: float, low: float, high: float, low_open: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LimitsError(field, f"must be a finite number (got {value!r})")
    if (value <= low if low_open else value < low) or value > high:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        raise LimitsError(field, f"must be {bound} and at most {high:g} (got {value!r})")


def _check_whole(field: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LimitsError(field, f"must be a whole number (got {value!r})")
    _check_number(field, value, low, high, low_open=False)


def check_limits(
    max_leases: int | None = None,
    claims_per_second: float | None = None,
    burst: float | None = None,
    lock_delay_s: float | None = None,
    max_attempts: int | None = None,
) -> None:
    """Checks limit values without touching the database (None: not given).

    Raises:
        LimitsError: a value out of bounds, naming it: ``max_leases`` a whole
            number in [0, 2^31-1]; ``claims_per_second`` in (0, 1e9];
            ``burst`` in [1, 1e9]; ``lock_delay_s`` in [0, one year] seconds;
            ``max_attempts`` a whole number in [1, 1000000].
    """
    if max_leases is not None:
        _check_whole("max_leases", max_leases, 0, MAX_LEASES_CAP)
    if claims_per_second is not None:
        _check_number("claims_per_second", claims_per_second, 0, MAX_CLAIMS_PER_SECOND, True)
    if burst is not None:
        _check_number("burst", burst, 1, MAX_CLAIMS_PER_SECOND, low_open=False)
    if lock_delay_s is not None:
        _check_number("lock_delay_s", lock_delay_s, 0, MAX_LOCK_DELAY_S, low_open=False)
    if max_attempts is not None:
        _check_whole("max_attempts", max_attempts, 1, MAX_ATTEMPTS_CAP)


async def set_limits(
    conn: asyncpg.Connection,
    namespace: str,
    *,
    max_leases: int | None = None,
    claims_per_second: float | None = None,
    burst: float | None = None,
    lock_delay_s: float | None = None,
    max_attempts: int | None = None,
) -> tuple[bool, LimitsRow]:
    """Sets some of a namespace's limits, keeping the others. Atomic; idempotent.

    Args:
        conn: a connection to the leasekeeper database (not in a transaction).
        namespace: the namespace (1+ characters, no control characters).
        max_leases: most live leases at once (0 refuses every claim).
        claims_per_second: claim bucket refill rate, claims per second.
        burst: claim bucket size, in claims; needs a rate (given now or set before).
        lock_delay_s: how long, in seconds, an expired lease's task stays
            unclaimable.
        max_attempts: the attempt limit of a grant whose claim sends none
            (ClaimRequest.max_attempts 0): that many leases ended without a
            release quarantine the task. Applies to grants made after the
            change.

    Returns:
        Whether the call changed the row (False: every value given was set
        already; nothing written), and the namespace's limits after it.

    Raises:
        LimitsError: a bad value (see :func:`check_limits`), no value given,
            or a burst without a rate; nothing was changed.
        asyncpg.PostgresError: the statement failed (e.g. schema not migrated).
    """
    _check_namespace(namespace)
    check_limits(max_leases, claims_per_second, burst, lock_delay_s, max_attempts)
    given = (max_leases, claims_per_second, burst, lock_delay_s, max_attempts)
    if all(value is None for value in given):
        raise LimitsError("limits", "give at least one limit to set")
    lock_delay = None if lock_delay_s is None else timedelta(seconds=lock_delay_s)
    async with conn.transaction():
        record = await conn.fetchrow(
            _sql()["set_limits"],
            namespace,
            max_leases,
            None if claims_per_second is None else float(claims_per_second),
            None if burst is None else float(burst),
            lock_delay,
            max_attempts,
        )
        changed = record is not None
        if record is None:  # the values were set already: the row as it is
            record = await conn.fetchrow(_sql()["get_limits"], namespace)
        row = _row(record)
        if row.burst is not None and row.claims_per_second is None:
            raise LimitsError("burst", "needs claims_per_second (a bucket needs a refill rate)")
    return changed, row


async def clear_limits(
    conn: asyncpg.Connection,
    namespace: str,
    *,
    max_leases: bool = False,
    claims_per_second: bool = False,
    burst: bool = False,
    lock_delay: bool = False,
    max_attempts: bool = False,
) -> tuple[bool, LimitsRow | None]:
    """Clears some of a namespace's limits (the rate takes its burst along). Atomic; idempotent.

    Clearing everything (every flag true) removes the row, as does clearing
    the last limit it held.

    Args:
        conn: a connection to the leasekeeper database (not in a transaction).
        namespace: the namespace.
        max_leases: clear the live-lease limit.
        claims_per_second: clear the claim rate limit (and its burst).
        burst: clear the burst alone (back to ``max(1, claims_per_second)``).
        lock_delay: clear the lock delay (back to 0 seconds).
        max_attempts: clear the default attempt limit (claims without one
            carry none).

    Returns:
        Whether the call changed anything (False: none of the limits named
        was set; nothing written), and the limits left, or None when the
        namespace has none now (no row).

    Raises:
        LimitsError: an empty or malformed namespace, or no flag given.
        asyncpg.PostgresError: the statement failed (e.g. schema not migrated).
    """
    _check_namespace(namespace)
    flags = (max_leases, claims_per_second, burst, lock_delay, max_attempts)
    if not any(flags):
        raise LimitsError("limits", "give at least one limit to clear")
    async with conn.transaction():
        if all(flags):
            deleted = await conn.fetchval(_sql()["delete_limits"], namespace)
            return deleted is not None, None
        record = await conn.fetchrow(_sql()["clear_limits"], namespace, *flags)
        changed = record is not None
        if record is None:  # nothing named was set: the row as it is, if any
            record = await conn.fetchrow(_sql()["get_limits"], namespace)
        if record is None:
            return changed, None
        if await conn.fetchval(_sql()["delete_empty_limits"], namespace):
            return True, None
        return changed, _row(record)


async def list_limits(conn: asyncpg.Connection) -> list[LimitsRow]:
    """Every namespace that has limits, ordered by namespace (byte for byte).

    Raises:
        asyncpg.PostgresError: the statement failed (e.g. schema not migrated).
    """
    return [_row(record) for record in await conn.fetch(_sql()["list_limits"])]
