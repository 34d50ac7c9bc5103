"""Claim's request_id (AIP-155): a retry of one claim versus a new incarnation of its owner.

The owner of a live lease claims the task again:

* with the request_id of the claim that granted it: a retry, the same lease back;
* with another request_id: a new incarnation (a restarted process reusing its
  owner id): the next fence, and the earlier fence is superseded everywhere
  (Renew, Release, ValidateFence, BeginEffect, its heartbeat stream);
* with no request_id: the same lease back, as before the field existed.

Tested at the wire with the raw stubs, like the other contract tests.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.helpers import dur, error_info
from tests.integration.contract_helpers import (
    backdate,
    expect_error,
    release,
    renew,
    row,
    validate,
)

pytestmark = pytest.mark.timeout(30)

LOSS_PUSH_S = 1.0  # as in test_contract_heartbeat.py


async def claim(
    stub: rpc.LeaseServiceStub,
    namespace: str,
    request_id: str,
    owner_id: str = "worker-0",
    ttl_s: float = 5.0,
) -> pb.ClaimResponse:
    return await stub.Claim(
        pb.ClaimRequest(
            namespace=namespace,
            task_id="t",
            owner_id=owner_id,
            ttl=dur(ttl_s),
            request_id=request_id,
        )
    )


async def test_claim_retry_with_same_request_id_returns_same_lease_without_write(
    stub, namespace, db
):
    first = await claim(stub, namespace, "r-1")
    stored = await row(db, namespace, "t")

    again = await claim(stub, namespace, "r-1", ttl_s=9.0)  # a retry's ttl is not compared

    assert first.acquired and again.acquired
    assert again.lease.fence == first.lease.fence == 1
    assert again.lease.expire_time == first.lease.expire_time
    assert again.lease.claim_time == first.lease.claim_time
    assert await row(db, namespace, "t") == stored  # the retry wrote nothing
    assert stored["claim_request_id"] == "r-1"


async def test_claim_same_owner_new_request_id_while_live_grants_next_fence(stub, namespace, db):
    old = (await claim(stub, namespace, "incarnation-1")).lease

    reply = await claim(stub, namespace, "incarnation-2")

    assert reply.acquired
    new = reply.lease
    assert (new.owner_id, new.fence, new.state) == ("worker-0", 2, pb.TASK_STATE_HELD)
    assert new.claim_time.ToDatetime() > old.claim_time.ToDatetime()
    stored = await row(db, namespace, "t")
    assert (stored["fence"], stored["claim_request_id"]) == (2, "incarnation-2")

    check = await validate(stub, namespace, "t", 1)
    assert (check.valid, check.reason, check.current_fence) == (
        False,
        pb.LOSS_REASON_LEASE_SUPERSEDED,
        2,
    )
    assert (await validate(stub, namespace, "t", 2)).valid
    aborted = grpc.StatusCode.ABORTED
    await expect_error(renew(stub, namespace, "t", "worker-0", 1), aborted, "LEASE_SUPERSEDED")
    await expect_error(release(stub, namespace, "t", "worker-0", 1), aborted, "LEASE_SUPERSEDED")
    begin = pb.BeginEffectRequest(
        namespace=namespace,
        task_id="t",
        fence=1,
        effect_key="send",
        policy=pb.EFFECT_POLICY_ONCE,
    )
    await expect_error(stub.BeginEffect(begin), aborted, "LEASE_SUPERSEDED")
    assert (await row(db, namespace, "t"))["fence"] == 2  # the refusals changed nothing


async def test_claim_without_request_id_by_live_owner_returns_same_lease(stub, namespace):
    granted = await claim(stub, namespace, "r-1")

    again = await claim(stub, namespace, "")  # an old client: no request_id

    assert again.acquired
    assert (again.lease.fence, again.lease.expire_time) == (1, granted.lease.expire_time)


async def test_claim_without_request_id_twice_returns_same_lease(stub, namespace, db):
    first = await claim(stub, namespace, "")
    again = await claim(stub, namespace, "")

    assert first.acquired and again.acquired
    assert again.lease.fence == first.lease.fence == 1
    assert (await row(db, namespace, "t"))["claim_request_id"] is None


async def test_claim_with_request_id_after_grant_without_one_is_new_incarnation(stub, namespace):
    await claim(stub, namespace, "")

    reply = await claim(stub, namespace, "r-1")

    assert (reply.acquired, reply.lease.fence) == (True, 2)


async def test_claim_earlier_incarnations_request_id_after_newer_one_grants_again(stub, namespace):
    """Only the current grant's request id is remembered: the latest claim wins, fence by fence."""
    await claim(stub, namespace, "incarnation-1")
    await claim(stub, namespace, "incarnation-2")

    reply = await claim(stub, namespace, "incarnation-1")

    assert (reply.acquired, reply.lease.fence) == (True, 3)


async def test_claim_request_id_of_another_owner_is_not_acquired(stub, namespace):
    holder = await claim(stub, namespace, "shared-id", owner_id="a")

    reply = await claim(stub, namespace, "shared-id", owner_id="b")

    assert not reply.acquired
    assert reply.holder_expire_time == holder.lease.expire_time


async def test_claim_same_request_id_after_expiry_grants_next_fence(stub, namespace, db):
    await claim(stub, namespace, "r-1")
    await backdate(db, namespace, "t")

    reply = await claim(stub, namespace, "r-1")

    assert (reply.acquired, reply.lease.fence) == (True, 2)


async def test_claim_new_incarnation_pushes_superseded_to_old_heartbeat(server, stub, namespace):
    await claim(stub, namespace, "incarnation-1")
    call = stub.Heartbeat()
    first = pb.HeartbeatRequest(
        namespace=namespace, task_id="t", owner_id="worker-0", fence=1, ttl=dur(5.0)
    )
    await call.write(first)
    assert (await call.read()).renewed
    async with grpc.aio.insecure_channel(server.target) as channel:
        claimed_from = time.monotonic()
        reply = await claim(rpc.LeaseServiceStub(channel), namespace, "incarnation-2")
        claimed_by = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(call.read(), 5.0)
        ended_at = time.monotonic()

    assert reply.lease.fence == 2
    assert ended.value.code() == grpc.StatusCode.ABORTED
    assert error_info(ended.value).reason == "LEASE_SUPERSEDED"
    assert ended_at >= claimed_from
    assert ended_at - claimed_by < LOSS_PUSH_S


async def test_claim_20_concurrent_retries_of_one_request_get_one_lease(server, namespace, db):
    channels = [grpc.aio.insecure_channel(server.target) for _ in range(20)]
    try:
        stubs = [rpc.LeaseServiceStub(ch) for ch in channels]
        replies = await asyncio.gather(*(claim(s, namespace, "r-1") for s in stubs))
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))

    assert all(r.acquired for r in replies)
    assert {(r.lease.fence, r.lease.expire_time.ToNanoseconds()) for r in replies} == {
        (1, replies[0].lease.expire_time.ToNanoseconds())
    }
    assert (await row(db, namespace, "t"))["fence"] == 1


async def test_claim_20_concurrent_incarnations_each_get_their_own_fence(server, namespace, db):
    channels = [grpc.aio.insecure_channel(server.target) for _ in range(20)]
    try:
        stubs = [rpc.LeaseServiceStub(ch) for ch in channels]
        replies = await asyncio.gather(
            *(claim(s, namespace, f"incarnation-{i}") for i, s in enumerate(stubs))
        )
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))

    # Each claim is a new incarnation that supersedes the one before: all are
    # granted, one after another, with fences 1..20 and no repeat.
    assert all(r.acquired for r in replies)
    assert sorted(r.lease.fence for r in replies) == list(range(1, 21))
    stored = await row(db, namespace, "t")
    assert stored["fence"] == 20
    last = next(i for i, r in enumerate(replies) if r.lease.fence == 20)
    assert stored["claim_request_id"] == f"incarnation-{last}"
