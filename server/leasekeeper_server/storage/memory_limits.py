"""The in-memory namespace limits: the limits rows, the claim buckets and the live-lease count.

What the limited claim's transaction does in SQL (``Store._limited_claim``):
``lock_limits`` and ``take_claim_token`` (:meth:`MemoryLimits.take_token`,
then :meth:`MemoryLimits.keep_token` when the claim commits) and
``count_live_leases`` (:func:`check_lease_limit`). The rate rules are
``core/limits.py``'s (``refill``, ``wait_for_token_s``), reused.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from leasekeeper_server.core.errors import ClaimRateLimit, LeaseLimit
from leasekeeper_server.core.limits import Bucket, NamespaceLimits, refill, wait_for_token_s
from leasekeeper_server.core.model import TaskKey
from leasekeeper_server.storage.memory_rows import TaskRow


class MemoryLimits:
    """Each namespace's limits row (``leasekeeper_namespace_limits``) and claim bucket."""

    def __init__(self) -> None:
        self._limits: dict[str, NamespaceLimits] = {}
        self._buckets: dict[str, Bucket] = {}

    def write(self, namespace: str, limits: NamespaceLimits | None) -> None:
        """Sets (or, with None, removes) a namespace's limits row; a new rate starts full."""
        self._buckets.pop(namespace, None)
        if limits is None:
            self._limits.pop(namespace, None)
        else:
            self._limits[namespace] = limits

    def stored(self, namespace: str) -> NamespaceLimits | None:
        """The namespace's limits row, or None."""
        return self._limits.get(namespace)

    def take_token(
        self, namespace: str, stored: NamespaceLimits, rate: float, now: datetime
    ) -> Bucket:
        """The namespace's claim bucket after taking one token (SQL ``lock_limits``).

        The caller keeps it (:meth:`keep_token`) when the claim commits (SQL
        ``take_claim_token``).

        Args:
            namespace: whose bucket.
            stored: the namespace's limits row (its ``burst``).
            rate: claims per second (> 0).
            now: the claim's instant.

        Raises:
            ClaimRateLimit: the bucket holds less than one token (RESOURCE_EXHAUSTED).
        """
        burst = stored.burst if stored.burst is not None else max(1.0, rate)
        last = self._buckets.get(namespace)
        bucket = refill(last.tokens if last else None, last.at if last else None, now, rate, burst)
        if bucket.tokens < 1.0:
            raise ClaimRateLimit(
                namespace,
                wait_for_token_s(bucket, rate),
                f"namespace {namespace!r} is limited to {rate:g} claims per second",
            )
        return Bucket(bucket.tokens - 1.0, bucket.at)

    def keep_token(self, namespace: str, bucket: Bucket) -> None:
        """Stores the bucket a claim took its token from (SQL ``take_claim_token``)."""
        self._buckets[namespace] = bucket


def check_lease_limit(
    rows: Iterable[TaskRow], key: TaskKey, max_leases: int, now: datetime
) -> None:
    """Refuses a grant past ``max_leases`` (SQL ``count_live_leases``).

    Counts the live leases of the namespace other than this task, in
    task_id order, stopping at the limit; the retry hint is the earliest
    expiry among those counted.

    Raises:
        LeaseLimit: the namespace holds ``max_leases`` live leases
            (RESOURCE_EXHAUSTED); nothing changes (the transaction rolls
            back, the claim's token included).
    """
    live = sorted(
        (row.task_id, row.expire_time)
        for row in rows
        if row.namespace == key.namespace
        and row.task_id != key.task_id
        and row.live(now)
        and row.expiry_announced_fence != row.fence
    )[:max_leases]
    if len(live) >= max_leases:
        first = min((expiry for _, expiry in live), default=None)
        wait = (first - now).total_seconds() if first is not None else 0.0
        raise LeaseLimit(
            key.namespace,
            max(0.0, wait),
            f"namespace {key.namespace!r} holds its maximum of {max_leases} live leases",
        )
