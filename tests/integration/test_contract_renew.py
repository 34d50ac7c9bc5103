"""Renew: extends a live lease, never revives one, and says why it cannot."""

from __future__ import annotations

import asyncio

import asyncpg
import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import error_info
from tests.integration.contract_helpers import (
    LEASE_ROWS,
    claim,
    completed,
    expect_error,
    failure,
    fence_above_issued,
    get_lease,
    grant,
    held_by_other_owner,
    lost_to_newer_claim,
    released,
    renew,
    revoked,
    row,
    secs,
    superseded_then_completed,
    unknown_task,
    wait_for_lock_waiters,
    wait_for_state,
    wait_past_expiry,
)

pytestmark = pytest.mark.timeout(30)


async def test_renew_live_lease_extends_expire_time(stub, namespace, db):
    lease = await grant(stub, namespace, "t", "a", ttl_s=1.0)

    reply = await renew(stub, namespace, "t", "a", lease.fence, ttl_s=4.0)

    assert reply.lease.fence == lease.fence
    assert reply.lease.state == pb.TASK_STATE_HELD
    assert 3.5 < secs(reply.lease.remaining_ttl) <= 4.0
    assert reply.lease.expire_time.ToDatetime() > lease.expire_time.ToDatetime()
    assert reply.lease.claim_time == lease.claim_time
    stored = await row(db, namespace, "t")
    assert stored["expire_time"].replace(tzinfo=None) == reply.lease.expire_time.ToDatetime()


async def test_renew_shorter_ttl_shortens_lease(stub, namespace):
    lease = await grant(stub, namespace, "t", "a", ttl_s=5.0)

    reply = await renew(stub, namespace, "t", "a", lease.fence, ttl_s=0.5)

    assert secs(reply.lease.remaining_ttl) <= 0.5


async def test_renew_unset_ttl_uses_server_default(stub, namespace):
    lease = await grant(stub, namespace, "t", "a", ttl_s=1.0)

    reply = await renew(stub, namespace, "t", "a", lease.fence)

    assert 4.5 < secs(reply.lease.remaining_ttl) <= 5.0


async def test_renew_expired_lease_aborts_lease_expired_and_does_not_revive(stub, namespace, db):
    lease = await grant(stub, namespace, "t", "a", ttl_s=0.1)
    await wait_for_state(stub, namespace, "t", pb.TASK_STATE_EXPIRED)
    before = await row(db, namespace, "t")

    await expect_error(
        renew(stub, namespace, "t", "a", lease.fence, ttl_s=5.0),
        grpc.StatusCode.ABORTED,
        "LEASE_EXPIRED",
    )
    assert await row(db, namespace, "t") == before
    assert (await get_lease(stub, namespace, "t")).state == pb.TASK_STATE_EXPIRED


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (lost_to_newer_claim, "LEASE_SUPERSEDED"),
        (held_by_other_owner, "NOT_OWNER"),
        (fence_above_issued, "FENCE_UNKNOWN"),
        (unknown_task, "FENCE_UNKNOWN"),
        (released, "LEASE_RELEASED"),
        (completed, "TASK_COMPLETED"),
        (revoked, "LEASE_REVOKED"),
        (superseded_then_completed, "TASK_COMPLETED"),
    ],
    ids=lambda v: v.__name__ if callable(v) else v,
)
async def test_renew_lost_lease_aborts_with_reason(stub, namespace, db, setup, reason):
    owner, fence = await setup(stub, namespace, db)
    before = await db.fetch(LEASE_ROWS, namespace)

    exc = await failure(renew(stub, namespace, "t", owner, fence, ttl_s=5.0))

    assert exc.code() == grpc.StatusCode.ABORTED
    info = error_info(exc)
    assert info.reason == reason
    assert "current_fence" in info.metadata
    after = await db.fetch(LEASE_ROWS, namespace)
    assert after == before


async def test_renew_caps_at_runtime_deadline_then_aborts_runtime_exceeded(stub, namespace):
    lease = await grant(stub, namespace, "t", "a", ttl_s=0.2, max_runtime_s=0.6)

    capped = await renew(stub, namespace, "t", "a", lease.fence, ttl_s=5.0)

    assert capped.lease.expire_time == capped.lease.runtime_deadline == lease.runtime_deadline
    assert secs(capped.lease.remaining_ttl) <= 0.6
    expired = await wait_for_state(stub, namespace, "t", pb.TASK_STATE_EXPIRED)
    assert expired.end_reason == pb.LOSS_REASON_RUNTIME_EXCEEDED
    await expect_error(
        renew(stub, namespace, "t", "a", lease.fence, ttl_s=5.0),
        grpc.StatusCode.ABORTED,
        "RUNTIME_EXCEEDED",
    )


async def _behind_row_lock(db, database_url, namespace, calls) -> list:
    """Runs ``calls`` (in order) while ``db`` holds the task's row lock past its expiry.

    Each call is started only once the one before it is seen waiting on the
    lock, so they queue in order; the lock is let go once the lease's
    expire_time has passed on the database clock. Returns their outcomes
    (replies or errors).
    """
    monitor = await asyncpg.connect(database_url)
    try:
        async with db.transaction():
            await db.execute(
                "SELECT 1 FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = 't' FOR UPDATE",
                namespace,
            )
            started = []
            for number, call in enumerate(calls, start=1):
                started.append(asyncio.ensure_future(call()))
                await wait_for_lock_waiters(monitor, number)
            await wait_past_expiry(db, namespace, "t")
        return await asyncio.gather(*started, return_exceptions=True)
    finally:
        await monitor.close()


def _reason(outcome) -> str:
    assert isinstance(outcome, grpc.aio.AioRpcError), f"the call did not fail: {outcome}"
    assert outcome.code() == grpc.StatusCode.ABORTED, outcome.details()
    return error_info(outcome).reason


# guarantees.md (the clock): a statement that waited on a row lock decides with the
# clock at the moment it got the row. In each test the row is locked while the
# lease (ttl 0.5 s) is live, and held until the lease has expired.


async def test_renew_that_waited_on_row_lock_past_expiry_aborts_lease_expired(
    stub, namespace, db, database_url
):
    lease = await grant(stub, namespace, "t", "a", ttl_s=0.5)

    (renewed,) = await _behind_row_lock(
        db, database_url, namespace, [lambda: renew(stub, namespace, "t", "a", lease.fence, 5.0)]
    )

    assert _reason(renewed) == "LEASE_EXPIRED"
    assert (await get_lease(stub, namespace, "t")).state == pb.TASK_STATE_EXPIRED


async def test_claim_that_waited_on_row_lock_past_expiry_grants_next_fence(
    stub, namespace, db, database_url
):
    lease = await grant(stub, namespace, "t", "a", ttl_s=0.5)

    (claimed,) = await _behind_row_lock(
        db, database_url, namespace, [lambda: claim(stub, namespace, "t", "b", ttl_s=5.0)]
    )

    assert not isinstance(claimed, BaseException), claimed
    assert claimed.acquired
    assert (claimed.lease.fence, claimed.lease.owner_id) == (lease.fence + 1, "b")


async def test_renew_then_rival_claim_waiting_on_row_lock_renew_fails_claim_granted(
    stub, namespace, db, database_url
):
    """The renewal gets the row first and must not revive the lease; the claim then wins.

    The renewal's reason is LEASE_EXPIRED, or LEASE_SUPERSEDED when the rival's
    grant commits before the store's classifying read (store.renew reads the row
    again after a renewal that changed nothing): both are true when answered.
    """
    lease = await grant(stub, namespace, "t", "a", ttl_s=0.5)

    renewed, claimed = await _behind_row_lock(
        db,
        database_url,
        namespace,
        [
            lambda: renew(stub, namespace, "t", "a", lease.fence, 5.0),
            lambda: claim(stub, namespace, "t", "b", ttl_s=5.0),
        ],
    )

    assert _reason(renewed) in ("LEASE_EXPIRED", "LEASE_SUPERSEDED")
    assert not isinstance(claimed, BaseException), claimed
    assert claimed.acquired, f"the expired lease was revived: {claimed}"
    assert (claimed.lease.fence, claimed.lease.owner_id) == (lease.fence + 1, "b")
