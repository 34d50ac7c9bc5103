"""Release: FREE or COMPLETED, fence kept, idempotent, never touches a newer lease."""

from __future__ import annotations

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import error_info
from tests.integration.contract_helpers import (
    LEASE_ROWS,
    backdate,
    failure,
    get_lease,
    grant,
    release,
    revoke_in_database,
    row,
    secs,
    validate,
)

pytestmark = pytest.mark.timeout(30)


async def test_release_live_lease_frees_task_and_keeps_fence(stub, namespace, db):
    lease = await grant(stub, namespace, "t", "a")

    reply = await release(stub, namespace, "t", "a", lease.fence)

    assert reply.lease.state == pb.TASK_STATE_FREE
    assert (reply.lease.fence, reply.lease.owner_id) == (1, "a")
    assert reply.lease.end_reason == pb.LOSS_REASON_LEASE_RELEASED
    assert secs(reply.lease.remaining_ttl) == 0
    assert not reply.lease.HasField("expire_time")
    stored = await row(db, namespace, "t")
    assert (stored["state"], stored["fence"], stored["owner_id"]) == ("released", 1, "a")
    assert (await validate(stub, namespace, "t", 1)).reason == pb.LOSS_REASON_LEASE_RELEASED


async def test_release_complete_makes_task_completed(stub, namespace, db):
    lease = await grant(stub, namespace, "t", "a")

    reply = await release(stub, namespace, "t", "a", lease.fence, complete=True)

    assert reply.lease.state == pb.TASK_STATE_COMPLETED
    assert reply.lease.fence == 1
    assert reply.lease.end_reason == pb.LOSS_REASON_TASK_COMPLETED
    assert (await row(db, namespace, "t"))["state"] == "completed"


@pytest.mark.parametrize(
    ("complete", "state"),
    [(False, pb.TASK_STATE_FREE), (True, pb.TASK_STATE_COMPLETED)],
    ids=["release", "complete"],
)
async def test_release_repeated_with_same_fence_answers_ok(stub, namespace, db, complete, state):
    lease = await grant(stub, namespace, "t", "a")
    first = await release(stub, namespace, "t", "a", lease.fence, complete=complete)
    stored = await row(db, namespace, "t")

    for _ in range(2):
        again = await release(stub, namespace, "t", "a", lease.fence, complete=complete)
        assert again.lease.state == state
        assert again.lease.fence == first.lease.fence
    assert await row(db, namespace, "t") == stored


async def test_release_plain_after_complete_keeps_task_completed(stub, namespace):
    lease = await grant(stub, namespace, "t", "a")
    await release(stub, namespace, "t", "a", lease.fence, complete=True)

    try:
        await release(stub, namespace, "t", "a", lease.fence)
    except grpc.aio.AioRpcError:
        pass  # either answer is acceptable; un-completing the task is not

    assert (await get_lease(stub, namespace, "t")).state == pb.TASK_STATE_COMPLETED


async def test_release_expired_not_superseded_answers_ok(stub, namespace, db):
    lease = await grant(stub, namespace, "t", "a")
    await backdate(db, namespace, "t")

    reply = await release(stub, namespace, "t", "a", lease.fence)

    assert reply.lease.state == pb.TASK_STATE_FREE
    assert reply.lease.fence == 1
    assert (await row(db, namespace, "t"))["state"] == "released"


@pytest.mark.parametrize("complete", [False, True], ids=["release", "complete"])
async def test_release_stale_after_newer_claim_aborts_superseded_and_keeps_newer_lease(
    stub, namespace, db, complete
):
    old = await grant(stub, namespace, "t", "a", ttl_s=0.1)
    await backdate(db, namespace, "t")
    newer = await grant(stub, namespace, "t", "b")
    before = await row(db, namespace, "t")

    exc = await failure(release(stub, namespace, "t", "a", old.fence, complete=complete))

    assert exc.code() == grpc.StatusCode.ABORTED
    info = error_info(exc)
    assert info.reason == "LEASE_SUPERSEDED"
    assert info.metadata["current_fence"] == str(newer.fence)
    assert await row(db, namespace, "t") == before
    check = await validate(stub, namespace, "t", newer.fence)
    assert check.valid


async def test_release_stale_after_newer_fence_released_aborts_superseded(stub, namespace, db):
    old = await grant(stub, namespace, "t", "a")
    await backdate(db, namespace, "t")
    newer = await grant(stub, namespace, "t", "b")
    await release(stub, namespace, "t", "b", newer.fence)
    before = await row(db, namespace, "t")

    exc = await failure(release(stub, namespace, "t", "a", old.fence))

    assert (exc.code(), error_info(exc).reason) == (grpc.StatusCode.ABORTED, "LEASE_SUPERSEDED")
    assert await row(db, namespace, "t") == before


async def _held_by_a(stub, namespace, db):
    await grant(stub, namespace, "t", "a")


async def _completed_by_a(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    await release(stub, namespace, "t", "a", 1, complete=True)


async def _revoked(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    await revoke_in_database(db, namespace, "t")


async def _nothing(stub, namespace, db):
    pass


@pytest.mark.parametrize(
    ("setup", "owner", "fence", "reason"),
    [
        (_held_by_a, "b", 1, "NOT_OWNER"),
        (_held_by_a, "a", 2, "FENCE_UNKNOWN"),
        (_nothing, "a", 1, "FENCE_UNKNOWN"),
        (_completed_by_a, "b", 1, "TASK_COMPLETED"),
        (_revoked, "a", 1, "LEASE_REVOKED"),
    ],
    ids=["not-owner", "fence-above-issued", "unknown-task", "completed-other-owner", "revoked"],
)
async def test_release_not_holding_aborts_with_reason(
    stub, namespace, db, setup, owner, fence, reason
):
    await setup(stub, namespace, db)
    before = await db.fetch(LEASE_ROWS, namespace)

    exc = await failure(release(stub, namespace, "t", owner, fence))

    assert (exc.code(), error_info(exc).reason) == (grpc.StatusCode.ABORTED, reason)
    after = await db.fetch(LEASE_ROWS, namespace)
    assert after == before
