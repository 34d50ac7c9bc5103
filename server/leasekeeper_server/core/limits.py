"""Per-namespace limits: the servers' cache of them, and the claim bucket rule.

Operators set limits per namespace (``leasekeeper limits set``; table
``leasekeeper_namespace_limits``, migrations/0005_operations.sql):

* ``max_leases`` — most live leases at once. A claim that would grant one
  more is refused RESOURCE_EXHAUSTED ``LEASE_LIMIT``.
* ``claims_per_second`` (and ``burst``) — a token bucket per namespace, kept
  in the limits row, so the rate holds across every replica. A Claim call
  takes one token; with none left it is refused RESOURCE_EXHAUSTED
  ``CLAIM_RATE_LIMIT``.
* ``lock_delay`` — after a lease expires without a release, its task stays
  unclaimable for that long (Chubby's lock-delay, Consul's ``LockDelay``):
  a holder that lost its lease without knowing gets that much time to stop.
* ``max_attempts`` — the attempt limit a grant carries when its claim sends
  none (ClaimRequest.max_attempts 0; migrations/0008_runs.sql): when that many
  of the task's leases ended without a release, the task is QUARANTINED until
  an operator calls Retry or Cancel.

The two refusals (LEASE_LIMIT, CLAIM_RATE_LIMIT) carry google.rpc.RetryInfo
and change nothing. The cache is loaded at start, reloaded when the database
announces a change on channel ``leasekeeper_config`` (payload ``limits``),
and every ``refresh_s`` seconds as a backstop. Enforcement never trusts the
cache for the counts: a limited claim locks the namespace's row and decides
on the database's values and clock; the cache only says whether to take that
path, the lock delay and the default attempt limit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from leasekeeper_server.core.model import ZERO

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NamespaceLimits:
    """One namespace's limits.

    Attributes:
        max_leases: most live leases at once; None for no limit.
        claims_per_second: the claim bucket's refill rate (claims per
            second); None for no limit.
        burst: the bucket's size (claims); None when there is no rate limit.
        lock_delay: how long an expired lease's task stays unclaimable.
        max_attempts: the default attempt limit of a grant whose claim sends
            max_attempts 0 (>= 1); None for no limit.
    """

    max_leases: int | None = None
    claims_per_second: float | None = None
    burst: float | None = None
    lock_delay: timedelta = ZERO
    max_attempts: int | None = None

    @property
    def needs_lock(self) -> bool:
        """True when claims must take the namespace's row lock (a count or a bucket)."""
        return self.max_leases is not None or self.claims_per_second is not None


NO_LIMITS = NamespaceLimits()


@dataclass(frozen=True, slots=True)
class Bucket:
    """The claim bucket's state after refilling, on the database clock.

    Attributes:
        tokens: claims available now (may be fractional).
        at: the database instant the tokens were counted at.
    """

    tokens: float
    at: datetime


def refill(
    tokens: float | None, since: datetime | None, now: datetime, rate: float, burst: float
) -> Bucket:
    """The bucket at ``now``: ``tokens`` at ``since`` plus ``rate`` per second, capped at burst.

    A bucket never used (``tokens`` None) starts full. Time never runs
    backwards in the bucket: a database clock step back adds nothing.
    """
    if tokens is None or since is None:
        return Bucket(burst, now)
    elapsed_s = max(0.0, (now - since).total_seconds())
    return Bucket(min(burst, tokens + elapsed_s * rate), now)


def wait_for_token_s(bucket: Bucket, rate: float) -> float:
    """Seconds until the bucket holds one whole token (0 if it does)."""
    return max(0.0, (1.0 - bucket.tokens) / rate)


class LimitsCache:
    """Every namespace's limits, as last loaded from the database."""

    def __init__(self) -> None:
        self._limits: dict[str, NamespaceLimits] = {}

    def get(self, namespace: str) -> NamespaceLimits:
        """The namespace's limits (NO_LIMITS when it has none)."""
        return self._limits.get(namespace, NO_LIMITS)

    def replace(self, limits: Mapping[str, NamespaceLimits]) -> None:
        """Swaps in a freshly loaded set."""
        self._limits = dict(limits)

    def all(self) -> dict[str, NamespaceLimits]:
        """A copy of every namespace's limits."""
        return dict(self._limits)
