"""The shortest path through the service: claim, validate, release."""

from __future__ import annotations

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import dur


async def test_claim_free_task_grants_fence_one(stub, namespace):
    reply = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(5))
    )
    assert reply.acquired
    assert reply.lease.fence == 1
    assert reply.lease.state == pb.TASK_STATE_HELD
    assert 4.0 < reply.lease.remaining_ttl.ToTimedelta().total_seconds() <= 5.0

    check = await stub.ValidateFence(
        pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=1)
    )
    assert check.valid and check.current_fence == 1

    released = await stub.Release(
        pb.ReleaseRequest(namespace=namespace, task_id="t", owner_id="a", fence=1)
    )
    assert released.lease.state == pb.TASK_STATE_FREE
    check = await stub.ValidateFence(
        pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=1)
    )
    assert not check.valid
    assert check.reason == pb.LOSS_REASON_LEASE_RELEASED
