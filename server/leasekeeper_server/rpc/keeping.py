"""What the two streams that keep leases alive share: Heartbeat (one lease) and Session (many).

Both renew a lease at most once per renew interval (a beat sooner than that is
answered from the last renewal), answer a beat that was not written with the
ttl left since that renewal, and, when a lease's task changed or its expiry
came, decide with one read on the database clock whether the lease is lost.
The server's monotonic clock only schedules that read and shortens the
remaining ttl of an answer made without a write; it never decides a loss.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from leasekeeper_server.core.model import Lease, LeaseRef, LossReason, owner_loss
from leasekeeper_server.observability.metrics import Metrics
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage.protocol import LeaseStore


def renew_interval_s(settings: Settings, ttl: timedelta) -> float:
    """Seconds after a renewal during which a beat is answered without a write.

    ``min(min_renew_interval_s, ttl / 3)``: a flood of beats never becomes a
    write storm, and a lease with a short ttl can still be renewed several
    times within it, however the server is configured.
    """
    return min(settings.min_renew_interval_s, ttl.total_seconds() / 3)


def remaining_since(lease: Lease, seen_at: float) -> timedelta:
    """The ttl ``lease`` (read at monotonic ``seen_at``) has left now, never below zero.

    Its remaining ttl less the time since the read: for an answer made without
    a database write.
    """
    elapsed = timedelta(seconds=time.monotonic() - seen_at)
    return max(timedelta(0), lease.remaining_ttl - elapsed)


def seconds_left(lease: Lease, seen_at: float) -> float:
    """Seconds until the instant the database said ``lease`` would end (read at ``seen_at``)."""
    return lease.remaining_ttl.total_seconds() - (time.monotonic() - seen_at)


async def read_loss(
    store: LeaseStore, ref: LeaseRef, metrics: Metrics
) -> tuple[Lease | None, LossReason | None]:
    """One read of ``ref``'s task on the database clock: the lease as read, and why it is lost.

    The reason is None while ``ref``'s owner and fence hold the lease
    (``core.model.owner_loss``). A loss is reported to ``metrics`` as the
    loss-notice time (:meth:`Metrics.loss_told`): only this read sees when it
    was learned.

    Raises:
        DatabaseUnavailable: the database is out of reach (UNAVAILABLE).
    """
    lease = await store.get_lease(ref.key)
    reason = owner_loss(lease, ref.owner_id, ref.fence)
    if reason is not None and lease is not None:
        metrics.loss_told(_loss_age_s(lease, reason))
    return lease, reason


def log_loss(log: logging.Logger, what: str, ref: LeaseRef, reason: LossReason) -> None:
    """Logs a loss a stream tells its client: ``"<what>: <REASON> namespace=... fence=..."``."""
    log.info(
        "%s: %s namespace=%r task_id=%r fence=%d",
        what,
        reason.value,
        ref.key.namespace,
        ref.key.task_id,
        ref.fence,
        extra={
            "namespace": ref.key.namespace,
            "task_id": ref.key.task_id,
            "owner_id": ref.owner_id,
            "fence": ref.fence,
            "reason": reason.value,
        },
    )


def _loss_age_s(lease: Lease, reason: LossReason) -> float:
    """Seconds from the loss to this read (database clock), for the loss-notice metric.

    The loss instant is the expire_time for an expiry, and for a release,
    revoke or completion too (those set expire_time to the instant they
    happened); for a newer grant it is that grant's claim_time (the old
    lease may have expired earlier: the age is then a lower bound).
    """
    lost_at = lease.claim_time if reason is LossReason.LEASE_SUPERSEDED else lease.expire_time
    return max(0.0, (lease.db_now - lost_at).total_seconds())
