"""ValidateFence: valid iff current fence, HELD on the database clock, not COMPLETED."""

from __future__ import annotations

import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.integration.contract_helpers import (
    backdate,
    grant,
    release,
    revoke_in_database,
    secs,
    validate,
    wait_for_state,
)

pytestmark = pytest.mark.timeout(30)


async def test_validate_fence_live_lease_is_valid_with_remaining_ttl(stub, namespace):
    lease = await grant(stub, namespace, "t", "a", ttl_s=3.0)

    check = await validate(stub, namespace, "t", lease.fence)

    assert check.valid
    assert check.current_fence == 1
    assert check.reason == pb.LOSS_REASON_UNSPECIFIED
    assert 2.0 < secs(check.remaining_ttl) <= 3.0
    assert check.expire_time == lease.expire_time


async def _expired_by_ttl(stub, namespace, db):
    await grant(stub, namespace, "t", "a", ttl_s=0.1)
    await wait_for_state(stub, namespace, "t", pb.TASK_STATE_EXPIRED)
    return 1


async def _expired_backdated(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    await backdate(db, namespace, "t")
    return 1


async def _superseded(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    await backdate(db, namespace, "t")
    await grant(stub, namespace, "t", "b")
    return 1


async def _released(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    await release(stub, namespace, "t", "a", 1)
    return 1


async def _completed(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    await release(stub, namespace, "t", "a", 1, complete=True)
    return 1


async def _superseded_then_completed(stub, namespace, db):
    await _superseded(stub, namespace, db)
    await release(stub, namespace, "t", "b", 2, complete=True)
    return 1


async def _runtime_spent(stub, namespace, db):
    await grant(stub, namespace, "t", "a", ttl_s=5.0, max_runtime_s=0.2)
    await wait_for_state(stub, namespace, "t", pb.TASK_STATE_EXPIRED)
    return 1


async def _revoked(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    await revoke_in_database(db, namespace, "t")
    return 1


async def _fence_above_issued(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    return 2


async def _fence_far_above_issued(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    return 2**63 - 1


async def _unknown_task(stub, namespace, db):
    return 1


@pytest.mark.parametrize(
    ("setup", "reason", "current_fence"),
    [
        (_expired_by_ttl, pb.LOSS_REASON_LEASE_EXPIRED, 1),
        (_expired_backdated, pb.LOSS_REASON_LEASE_EXPIRED, 1),
        (_superseded, pb.LOSS_REASON_LEASE_SUPERSEDED, 2),
        (_released, pb.LOSS_REASON_LEASE_RELEASED, 1),
        (_completed, pb.LOSS_REASON_TASK_COMPLETED, 1),
        (_superseded_then_completed, pb.LOSS_REASON_TASK_COMPLETED, 2),
        (_runtime_spent, pb.LOSS_REASON_RUNTIME_EXCEEDED, 1),
        (_revoked, pb.LOSS_REASON_LEASE_REVOKED, 1),
        (_fence_above_issued, pb.LOSS_REASON_FENCE_UNKNOWN, 1),
        (_fence_far_above_issued, pb.LOSS_REASON_FENCE_UNKNOWN, 1),
        (_unknown_task, pb.LOSS_REASON_FENCE_UNKNOWN, 0),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
async def test_validate_fence_not_live_is_invalid_with_reason(
    stub, namespace, db, setup, reason, current_fence
):
    fence = await setup(stub, namespace, db)

    check = await validate(stub, namespace, "t", fence)

    assert not check.valid
    assert pb.LossReason.Name(check.reason) == pb.LossReason.Name(reason)
    assert check.current_fence == current_fence
    assert not check.HasField("remaining_ttl")


async def test_validate_fence_newer_lease_valid_while_older_superseded(stub, namespace, db):
    await _superseded(stub, namespace, db)

    newer = await validate(stub, namespace, "t", 2)
    older = await validate(stub, namespace, "t", 1)

    assert newer.valid and newer.current_fence == 2
    assert not older.valid and older.reason == pb.LOSS_REASON_LEASE_SUPERSEDED
