"""Attempts and quarantine on both implementations (migrations/0008_runs.sql).

A grant that ends without a release is an attempt: an expired lease (counted
when read, stored when a claim takes it over or the sweeper marks it) and a
revoked one. When the ending of a lease uses up its grant's ``max_attempts``
the task is QUARANTINED: derived from the expired row before the sweeper
comes by, stored after (and stored at once by a revoke); claims are refused
TASK_QUARANTINED until an operator retries it (attempts back to 0).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from leasekeeper_server.core.errors import (
    LeaseLost,
    TaskNotClaimable,
    TaskNotFound,
    TaskNotQuarantined,
)
from leasekeeper_server.core.limits import NamespaceLimits
from leasekeeper_server.core.model import Lease, LossReason, TaskState, fence_loss
from tests.conformance.conftest import HOUR, MINUTE, World

SHORT = timedelta(milliseconds=200)


async def expire(world: World, task_id: str = "t") -> Lease:
    """Lets the task's lease (of a one-minute ttl) run out; returns the task read after."""
    await world.advance(2 * MINUTE)
    return await world.lease(task_id)


async def quarantined(world: World, owner_id: str = "w9", **kw: Any) -> TaskNotClaimable:
    """The refusal of a claim of a quarantined task."""
    with pytest.raises(TaskNotClaimable) as refused:
        await world.claim(owner_id=owner_id, **kw)
    assert refused.value.loss is LossReason.TASK_QUARANTINED
    assert refused.value.reason == "TASK_QUARANTINED"
    return refused.value


async def test_each_expiry_taken_over_is_an_attempt(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE)
    assert (first.attempts, first.recorded_attempts, first.max_attempts) == (0, 0, None)
    expired = await expire(world)
    # Counted when read; stored when a claim takes the lease over.
    assert expired.state is TaskState.EXPIRED
    assert (expired.attempts, expired.recorded_attempts) == (1, 0)
    second = await world.held(owner_id="w2", ttl=MINUTE)
    assert (second.attempts, second.recorded_attempts) == (1, 1)
    await expire(world)
    third = await world.held(owner_id="w3", ttl=MINUTE)
    assert third.recorded_attempts == 2
    # A release is no attempt, nor is the grant after it.
    await world.store.release(world.ref(third), complete=False)
    assert (await world.lease()).attempts == 2
    fourth = await world.held(owner_id="w4", ttl=MINUTE)
    assert fourth.recorded_attempts == 2 and fourth.fence == first.fence + 3


async def test_a_lease_that_really_runs_out_is_an_attempt(world: World) -> None:
    lease = await world.held(owner_id="w1", ttl=SHORT)
    expired = await world.run_out()
    assert expired.state is TaskState.EXPIRED and expired.attempts == 1
    assert (await world.held(owner_id="w2")).recorded_attempts == 1
    assert lease.recorded_attempts == 0


async def test_a_new_incarnation_over_an_expired_lease_is_an_attempt(world: World) -> None:
    delay = NamespaceLimits(lock_delay=HOUR)
    await world.held(owner_id="w1", ttl=MINUTE, request_id="r1", limits=delay)
    await expire(world)
    # Within the lock delay: the holder's new request id needs no wait.
    second = await world.held(owner_id="w1", request_id="r2", limits=delay)
    assert second.recorded_attempts == 1


async def test_a_revoke_is_an_attempt(world: World) -> None:
    await world.held(owner_id="w1")
    revoked, task = await world.store.revoke(world.key(), "operator", 0)
    assert revoked and task.state is TaskState.FREE
    assert (task.attempts, task.recorded_attempts) == (1, 1)
    # An expired lease revoked counts once, not twice.
    await world.held(owner_id="w2", ttl=MINUTE)
    await expire(world)
    _, task = await world.store.revoke(world.key(), "cleanup", 0)
    assert task.row_state == "revoked" and task.attempts == 2
    assert (await world.held(owner_id="w3")).recorded_attempts == 2


async def test_the_grant_carries_its_claims_attempt_limit(world: World) -> None:
    first = await world.held(owner_id="w1", max_attempts=3)
    assert first.max_attempts == 3 and (await world.lease()).max_attempts == 3
    await world.store.release(world.ref(first), complete=False)
    second = await world.held(owner_id="w2")
    assert second.max_attempts is None


async def test_the_last_attempt_expiring_quarantines_the_task(world: World) -> None:
    await world.held(owner_id="w1", ttl=MINUTE, max_attempts=2)
    expired = await expire(world)
    assert expired.state is TaskState.EXPIRED  # one attempt used of two
    last = await world.held(owner_id="w2", ttl=SHORT, request_id="r2", max_attempts=2)
    # Its lease really runs out on the storage's clock: derived, before any sweep.
    task = await world.run_out()
    assert task.row_state == "held" and task.state is TaskState.QUARANTINED
    assert (task.attempts, task.recorded_attempts) == (2, 1)
    assert task.attempt_used_up and task.unclaimable is LossReason.TASK_QUARANTINED
    assert task.last_loss is LossReason.LEASE_EXPIRED
    refused = await quarantined(world, max_attempts=2)
    assert refused.fence == last.fence
    # Neither a new incarnation of its owner nor its retry takes it over.
    await quarantined(world, owner_id="w2", request_id="r3")
    await quarantined(world, owner_id="w2", request_id="r2")
    # The sweeper stores it.
    await world.sweep()
    swept = await world.lease()
    assert swept.row_state == "quarantined" and swept.state is TaskState.QUARANTINED
    assert (swept.attempts, swept.recorded_attempts) == (2, 2)
    assert swept.end_reason == "LEASE_EXPIRED" and swept.last_loss is LossReason.LEASE_EXPIRED
    assert swept.fence == last.fence and swept.owner_id == "w2"
    await quarantined(world)
    # Its fence is lost for the reason its lease ended, before and after the sweep.
    assert fence_loss(swept, last.fence) is LossReason.LEASE_EXPIRED
    with pytest.raises(LeaseLost) as lost:
        await world.store.renew(world.ref(last), MINUTE)
    assert lost.value.loss is LossReason.LEASE_EXPIRED


async def test_one_attempt_quarantines_at_the_first_expiry(world: World) -> None:
    """Within the lock delay too: QUARANTINED is refused, not answered with a wait."""
    delay = NamespaceLimits(lock_delay=10 * MINUTE)
    await world.held(owner_id="w1", ttl=MINUTE, max_attempts=1, limits=delay)
    task = await expire(world)
    assert task.state is TaskState.QUARANTINED and task.attempts == 1
    await quarantined(world, limits=delay)
    await world.advance(20 * MINUTE)
    await quarantined(world, limits=delay)


async def test_a_lease_ending_at_its_runtime_budget_is_quarantined_so(world: World) -> None:
    await world.held(ttl=MINUTE, max_runtime=MINUTE, max_attempts=1)
    task = await expire(world)
    assert task.state is TaskState.QUARANTINED
    assert task.last_loss is LossReason.RUNTIME_EXCEEDED
    await world.sweep()
    swept = await world.lease()
    assert swept.row_state == "quarantined" and swept.end_reason == "RUNTIME_EXCEEDED"


async def test_a_revoke_of_the_last_attempt_quarantines_the_task(world: World) -> None:
    lease = await world.held(owner_id="w1", max_attempts=1)
    revoked, task = await world.store.revoke(world.key(), "stuck", 0)
    assert revoked
    assert task.row_state == "quarantined" and task.state is TaskState.QUARANTINED
    assert (task.attempts, task.end_reason, task.revoke_reason) == (1, "LEASE_REVOKED", "stuck")
    assert task.last_loss is LossReason.LEASE_REVOKED
    await quarantined(world)
    with pytest.raises(LeaseLost) as lost:
        await world.store.renew(world.ref(lease), MINUTE)
    assert lost.value.loss is LossReason.LEASE_REVOKED
    # Nothing left to revoke.
    again, same = await world.store.revoke(world.key(), "again", 0)
    assert not again and same.state is TaskState.QUARANTINED and same.attempts == 1


async def test_a_release_never_uses_up_an_attempt(world: World) -> None:
    for owner in ("w1", "w2", "w3"):
        lease = await world.held(owner_id=owner, max_attempts=1)
        released = await world.store.release(world.ref(lease), complete=False)
        assert released.state is TaskState.FREE and released.attempts == 0


@pytest.mark.parametrize("how", ["derived", "swept", "revoked"])
async def test_retry_puts_a_quarantined_task_back(world: World, how: str) -> None:
    lease = await world.held(owner_id="w1", ttl=MINUTE, max_attempts=1)
    if how == "revoked":
        await world.store.revoke(world.key(), "stuck", 0)
    else:
        await expire(world)
        if how == "swept":
            await world.sweep()
    assert (await world.lease()).state is TaskState.QUARANTINED
    retried = await world.store.retry(world.key(), "fixed the input")
    assert retried.row_state == "retried" and retried.state is TaskState.FREE
    assert (retried.attempts, retried.recorded_attempts) == (0, 0)
    assert retried.state_reason == "fixed the input"
    assert (retried.fence, retried.owner_id) == (lease.fence, "w1")
    ended = LossReason.LEASE_REVOKED if how == "revoked" else LossReason.LEASE_EXPIRED
    assert retried.end_reason == ended.value and retried.last_loss is ended
    # The old fence stays lost; the next claim gets the next fence and attempt 1 of its limit.
    assert fence_loss(retried, lease.fence) is ended
    granted = await world.held(owner_id="w2", ttl=MINUTE, max_attempts=1)
    assert granted.fence == lease.fence + 1
    assert granted.recorded_attempts == 0 and granted.state_reason is None
    # And the limit counts again from there.
    assert (await expire(world)).state is TaskState.QUARANTINED


async def test_retry_of_a_task_not_quarantined_is_refused(world: World) -> None:
    with pytest.raises(TaskNotFound):
        await world.store.retry(world.key("never"), "r")

    async def refused(task_id: str) -> str:
        before = await world.lease(task_id)
        with pytest.raises(TaskNotQuarantined) as raised:
            await world.store.retry(world.key(task_id), "r")
        after = await world.lease(task_id)
        assert (after.row_state, after.attempts) == (before.row_state, before.attempts)
        return raised.value.state

    await world.held(task_id="held", max_attempts=1)
    assert await refused("held") == "HELD"
    await world.held(task_id="expired", ttl=MINUTE, max_attempts=2)
    free = await world.held(task_id="free", max_attempts=1)
    await world.store.release(world.ref(free), complete=False)
    done = await world.held(task_id="done", max_attempts=1)
    await world.store.release(world.ref(done), complete=True)
    await world.advance(2 * MINUTE)
    assert await refused("expired") == "EXPIRED"
    assert await refused("free") == "FREE"
    assert await refused("done") == "COMPLETED"
    # A task retried once is FREE: a second retry is refused.
    await world.held(task_id="again", ttl=MINUTE, max_attempts=1)
    await expire(world, "again")
    await world.store.retry(world.key("again"), "once")
    assert await refused("again") == "FREE"
