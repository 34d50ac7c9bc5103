"""Claim's decisions, on both implementations (SQL ``claim``; ``core/model.py`` "claim").

Fences are compared with the task's first fence: 1 on a fresh database, but a
promoted database starts its timeline higher (migrations/0003).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from leasekeeper_server.core.errors import LeaseLost, TaskCompleted
from leasekeeper_server.core.limits import NamespaceLimits
from leasekeeper_server.core.model import LossReason, TaskState
from tests.conformance.conftest import HOUR, MINUTE, World, close_to


async def test_a_new_task_is_granted_with_the_first_fence(world: World) -> None:
    outcome = await world.claim(owner_id="w1", ttl=5 * MINUTE, max_runtime=HOUR, request_id="r1")
    assert outcome.acquired
    lease = outcome.lease
    assert (lease.namespace, lease.task_id, lease.owner_id) == (world.namespace, "t", "w1")
    assert lease.fence >= 1
    if world.name == "memory":
        assert lease.fence == 1
    assert lease.row_state == "held" and lease.state is TaskState.HELD
    assert lease.claim_request_id == "r1"
    assert lease.end_reason is None and lease.revoke_reason is None
    # One reading of the clock for every instant of the grant.
    assert lease.expire_time - lease.claim_time == 5 * MINUTE
    assert lease.runtime_deadline - lease.claim_time == HOUR
    assert close_to(lease.remaining_ttl, 5 * MINUTE)
    assert outcome.retry_after == timedelta(0)
    read = await world.lease()
    assert read == replace(lease, db_now=read.db_now)


async def test_a_task_held_by_another_owner_is_refused_with_its_remaining_ttl(
    world: World,
) -> None:
    first = await world.held(owner_id="w1", ttl=10 * MINUTE)
    await world.advance(3 * MINUTE)
    outcome = await world.claim(owner_id="w2")
    assert not outcome.acquired
    assert outcome.lease.fence == first.fence and outcome.lease.owner_id == "w1"
    assert outcome.lease.state is TaskState.HELD
    assert close_to(outcome.retry_after, 7 * MINUTE)
    # The lock delay is added: the task cannot be granted before expiry + delay.
    delayed = await world.claim(owner_id="w2", limits=NamespaceLimits(lock_delay=MINUTE))
    assert not delayed.acquired
    assert close_to(delayed.retry_after, 8 * MINUTE)


async def test_a_retry_with_the_same_request_id_gets_the_same_lease_unchanged(
    world: World,
) -> None:
    first = await world.held(owner_id="w1", request_id="r1")
    await world.advance(MINUTE)
    before = await world.lease()
    again = await world.claim(owner_id="w1", request_id="r1")
    assert again.acquired
    assert again.lease.fence == first.fence
    # Handed back, not renewed: the row is as it was.
    assert again.lease == replace(before, db_now=again.lease.db_now)
    assert close_to(again.lease.remaining_ttl, 9 * MINUTE)


async def test_a_claim_without_request_id_by_the_holder_gets_the_lease_unchanged(
    world: World,
) -> None:
    first = await world.held(owner_id="w1", request_id="r1")
    again = await world.claim(owner_id="w1", request_id=None)
    assert again.acquired and again.lease.fence == first.fence
    assert again.lease.expire_time == first.expire_time
    assert again.lease.claim_request_id == "r1"


async def test_another_request_id_of_the_holder_is_a_new_incarnation(world: World) -> None:
    first = await world.held(owner_id="w1", request_id="r1")
    second = await world.held(owner_id="w1", request_id="r2")
    assert second.fence == first.fence + 1
    assert second.claim_request_id == "r2"
    # The earlier incarnation's fence is superseded.
    with pytest.raises(LeaseLost) as lost:
        await world.store.renew(world.ref(first), MINUTE)
    assert lost.value.loss is LossReason.LEASE_SUPERSEDED
    assert lost.value.current_fence == second.fence


async def test_a_request_id_after_a_claim_without_one_is_a_new_incarnation(world: World) -> None:
    first = await world.held(owner_id="w1", request_id=None)
    second = await world.held(owner_id="w1", request_id="r1")
    assert second.fence == first.fence + 1


async def test_a_released_task_is_granted_with_the_next_fence_at_once(world: World) -> None:
    first = await world.held(owner_id="w1")
    await world.store.release(world.ref(first), complete=False)
    # A release ends the lease on purpose: no lock delay applies.
    second = await world.held(owner_id="w2", limits=NamespaceLimits(lock_delay=HOUR))
    assert second.fence == first.fence + 1
    assert second.owner_id == "w2" and second.end_reason is None


async def test_a_revoked_task_is_granted_at_once_and_the_reason_cleared(world: World) -> None:
    first = await world.held(owner_id="w1")
    await world.store.revoke(world.key(), "maintenance", 0)
    second = await world.held(owner_id="w2", limits=NamespaceLimits(lock_delay=HOUR))
    assert second.fence == first.fence + 1
    read = await world.lease()
    assert read.revoke_reason is None and read.end_reason is None


async def test_an_expired_task_is_granted_to_another_owner(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE)
    await world.advance(2 * MINUTE)
    assert (await world.lease()).state is TaskState.EXPIRED
    second = await world.held(owner_id="w2", ttl=MINUTE)
    assert second.fence == first.fence + 1 and second.owner_id == "w2"


async def test_an_expired_lease_is_granted_again_to_its_owner_with_a_new_fence(
    world: World,
) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE, request_id="r1")
    await world.advance(2 * MINUTE)
    # The same request id: the lease it names is gone, so this is a new grant.
    second = await world.held(owner_id="w1", ttl=MINUTE, request_id="r1")
    assert second.fence == first.fence + 1


async def test_lock_delay_keeps_an_expired_task_unclaimable(world: World) -> None:
    delay = NamespaceLimits(lock_delay=5 * MINUTE)
    first = await world.held(owner_id="w1", ttl=MINUTE, request_id="r1", limits=delay)
    await world.advance(3 * MINUTE)  # expired 2 minutes ago: 3 minutes of delay left
    refused = await world.claim(owner_id="w2", limits=delay)
    assert not refused.acquired
    assert refused.lease.state is TaskState.EXPIRED and refused.lease.fence == first.fence
    assert close_to(refused.retry_after, 3 * MINUTE)
    # The holder's retry does not get past the delay either: its lease expired.
    retry = await world.claim(owner_id="w1", request_id="r1", limits=delay)
    assert not retry.acquired
    assert close_to(retry.retry_after, 3 * MINUTE)
    # Without the namespace's delay the same task is claimable.
    await world.advance(3 * MINUTE)
    granted = await world.held(owner_id="w2", limits=delay)
    assert granted.fence == first.fence + 1


async def test_a_new_incarnation_of_the_holder_is_granted_within_the_lock_delay(
    world: World,
) -> None:
    """SQL ``claim``'s third branch: the holder's new request id needs no expiry at all."""
    delay = NamespaceLimits(lock_delay=HOUR)
    first = await world.held(owner_id="w1", ttl=MINUTE, request_id="r1", limits=delay)
    await world.advance(2 * MINUTE)
    second = await world.held(owner_id="w1", request_id="r2", limits=delay)
    assert second.fence == first.fence + 1


async def test_a_completed_task_is_never_granted_again(world: World) -> None:
    first = await world.held(owner_id="w1")
    await world.store.release(world.ref(first), complete=True)
    for owner, request_id in (("w2", None), ("w1", "r9"), ("w1", None)):
        with pytest.raises(TaskCompleted) as refused:
            await world.claim(owner_id=owner, request_id=request_id)
        assert refused.value.fence == first.fence


async def test_the_ttl_is_clamped_to_the_runtime_budget(world: World) -> None:
    lease = await world.held(ttl=HOUR, max_runtime=10 * MINUTE)
    assert lease.expire_time == lease.runtime_deadline
    assert lease.runtime_deadline - lease.claim_time == 10 * MINUTE
    assert close_to(lease.remaining_ttl, 10 * MINUTE)


async def test_fences_grow_by_one_per_grant(world: World) -> None:
    fences = []
    for n in range(5):
        lease = await world.held(owner_id=f"w{n}", ttl=MINUTE)
        fences.append(lease.fence)
        await world.store.release(world.ref(lease), complete=False)
    assert fences == list(range(fences[0], fences[0] + 5))
    # A claim that was refused or handed back grants nothing.
    held = await world.held(owner_id="a", request_id="x")
    assert not (await world.claim(owner_id="b")).acquired
    assert (await world.claim(owner_id="a", request_id="x")).lease.fence == held.fence
    assert held.fence == fences[-1] + 1
