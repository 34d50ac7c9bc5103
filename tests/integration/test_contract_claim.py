"""Claim: guarantees.md's RPC table, row by row, and the fence rules."""

from __future__ import annotations

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import error_info
from tests.integration.contract_helpers import (
    backdate,
    claim,
    expect_error,
    failure,
    get_lease,
    grant,
    release,
    row,
    secs,
    wait_for_state,
)

pytestmark = pytest.mark.timeout(30)


async def test_claim_new_task_grants_fence_one_for_ttl(stub, namespace, db):
    reply = await claim(stub, namespace, "t", "a", ttl_s=2.0)

    assert reply.acquired
    lease = reply.lease
    assert (lease.namespace, lease.task_id, lease.owner_id) == (namespace, "t", "a")
    assert lease.fence == 1
    assert lease.state == pb.TASK_STATE_HELD
    # expire_time is claim_time + ttl exactly; remaining_ttl is measured from a
    # database instant read after the grant, so it is at most the ttl.
    ttl = lease.expire_time.ToDatetime() - lease.claim_time.ToDatetime()
    assert ttl.total_seconds() == 2.0
    assert 0 < secs(lease.remaining_ttl) <= 2.0
    assert lease.end_reason == pb.LOSS_REASON_UNSPECIFIED
    stored = await row(db, namespace, "t")
    assert (stored["owner_id"], stored["fence"], stored["state"]) == ("a", 1, "held")
    assert (
        lease.expire_time.ToDatetime(tzinfo=stored["expire_time"].tzinfo) == (stored["expire_time"])
    )
    # expire_time = claim time + ttl, both on the database clock.
    assert (stored["expire_time"] - stored["claim_time"]).total_seconds() == pytest.approx(
        2.0, abs=0.01
    )


async def test_claim_unset_ttl_uses_server_default(stub, namespace):
    reply = await claim(stub, namespace, "t", "a", ttl_s=None)

    assert reply.acquired
    assert 4.5 < secs(reply.lease.remaining_ttl) <= 5.0  # test settings: default_ttl_s 5


async def test_claim_released_task_grants_next_fence(stub, namespace):
    first = await grant(stub, namespace, "t", "a")
    await release(stub, namespace, "t", "a", first.fence)

    reply = await claim(stub, namespace, "t", "b")

    assert reply.acquired
    assert (reply.lease.fence, reply.lease.owner_id) == (2, "b")
    assert reply.lease.state == pb.TASK_STATE_HELD


async def test_claim_expired_task_grants_next_fence(stub, namespace):
    await grant(stub, namespace, "t", "a", ttl_s=0.1)
    await wait_for_state(stub, namespace, "t", pb.TASK_STATE_EXPIRED)

    reply = await claim(stub, namespace, "t", "b")

    assert reply.acquired
    assert (reply.lease.fence, reply.lease.owner_id) == (2, "b")


async def test_claim_expired_task_by_same_owner_grants_next_fence(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    await backdate(db, namespace, "t")

    reply = await claim(stub, namespace, "t", "a")

    assert reply.acquired
    assert reply.lease.fence == 2
    assert secs(reply.lease.remaining_ttl) > 4.0


async def test_claim_retried_by_live_owner_returns_same_lease(stub, namespace, db):
    first = await grant(stub, namespace, "t", "a", ttl_s=3.0)
    before = await row(db, namespace, "t")

    again = await claim(stub, namespace, "t", "a", ttl_s=3.0)

    assert again.acquired
    assert again.lease.fence == first.fence == 1
    assert again.lease.expire_time == first.expire_time
    assert again.lease.claim_time == first.claim_time
    assert again.lease.runtime_deadline == first.runtime_deadline
    assert secs(again.lease.remaining_ttl) <= secs(first.remaining_ttl)
    assert await row(db, namespace, "t") == before


async def test_claim_held_by_another_answers_not_acquired_with_holder_ttl(stub, namespace, db):
    holder = await grant(stub, namespace, "t", "a", ttl_s=3.0)
    before = await row(db, namespace, "t")

    reply = await claim(stub, namespace, "t", "b", ttl_s=3.0)

    assert not reply.acquired
    assert not reply.HasField("lease")
    assert 2.0 < secs(reply.holder_remaining_ttl) <= secs(holder.remaining_ttl)
    assert reply.holder_expire_time == holder.expire_time
    assert await row(db, namespace, "t") == before


async def test_claim_completed_task_fails_precondition_task_completed(stub, namespace):
    lease = await grant(stub, namespace, "t", "a")
    await release(stub, namespace, "t", "a", lease.fence, complete=True)

    for owner in ("b", "a"):  # nobody, not even the last owner, is granted again
        exc = await failure(claim(stub, namespace, "t", owner))
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(exc).reason == "TASK_COMPLETED"
    assert (await get_lease(stub, namespace, "t")).state == pb.TASK_STATE_COMPLETED


async def test_claim_completed_after_expiry_never_granted_again(stub, namespace, db):
    lease = await grant(stub, namespace, "t", "a")
    await backdate(db, namespace, "t")
    # An expired lease may still be released (here: completed) by its owner.
    await release(stub, namespace, "t", "a", lease.fence, complete=True)

    await expect_error(
        claim(stub, namespace, "t", "b"), grpc.StatusCode.FAILED_PRECONDITION, "TASK_COMPLETED"
    )
    assert (await row(db, namespace, "t"))["fence"] == 1


async def test_claim_fences_never_decrease_or_repeat_across_release_expiry_completion(
    stub, namespace, db
):
    fences = []
    lease = await grant(stub, namespace, "t", "w1")  # new
    fences.append(lease.fence)
    await release(stub, namespace, "t", "w1", lease.fence)
    lease = await grant(stub, namespace, "t", "w2")  # released
    fences.append(lease.fence)
    await backdate(db, namespace, "t")
    lease = await grant(stub, namespace, "t", "w3", ttl_s=0.1)  # expired (backdated)
    fences.append(lease.fence)
    await wait_for_state(stub, namespace, "t", pb.TASK_STATE_EXPIRED)
    lease = await grant(stub, namespace, "t", "w4")  # expired (ttl)
    fences.append(lease.fence)
    await release(stub, namespace, "t", "w4", lease.fence)
    lease = await grant(stub, namespace, "t", "w5")  # released again
    fences.append(lease.fence)
    await release(stub, namespace, "t", "w5", lease.fence, complete=True)

    assert fences == [1, 2, 3, 4, 5]
    await expect_error(
        claim(stub, namespace, "t", "w6"), grpc.StatusCode.FAILED_PRECONDITION, "TASK_COMPLETED"
    )
    final = await get_lease(stub, namespace, "t")
    assert (final.state, final.fence, final.owner_id) == (pb.TASK_STATE_COMPLETED, 5, "w5")


async def test_claim_max_runtime_caps_first_expire_time(stub, namespace):
    reply = await claim(stub, namespace, "t", "a", ttl_s=5.0, max_runtime_s=1.0)

    assert reply.acquired
    lease = reply.lease
    assert lease.expire_time == lease.runtime_deadline
    assert secs(lease.remaining_ttl) <= 1.0


async def test_claim_ids_are_opaque_bytes_without_normalisation(stub, namespace):
    composed, decomposed = "caf\u00e9", "cafe\u0301"  # the same text in NFC and NFD

    first = await claim(stub, namespace, composed, "a")
    second = await claim(stub, namespace, decomposed, "b")

    assert first.acquired and second.acquired
    assert first.lease.task_id == composed
    assert second.lease.task_id == decomposed
    assert second.lease.fence == 1
