"""Renew, Release (and complete) and Revoke, on both implementations.

SQL ``renew``, ``release``, ``revoke``; the loss reasons are ``core/model.owner_loss``'s.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from leasekeeper_server.core.errors import LeaseLost, TaskCompleted, TaskNotFound
from leasekeeper_server.core.model import LeaseRef, LossReason, TaskState
from tests.conformance.conftest import HOUR, MINUTE, SLACK, World, close_to


async def lost(world: World, ref: LeaseRef, call: str = "renew") -> LeaseLost:
    """The LeaseLost a renewal (or a release) of ``ref`` raises."""
    with pytest.raises(LeaseLost) as raised:
        if call == "renew":
            await world.store.renew(ref, MINUTE)
        else:
            await world.store.release(ref, complete=call == "complete")
    return raised.value


# Renew


async def test_renew_extends_a_live_lease_from_now(world: World) -> None:
    lease = await world.held(ttl=MINUTE)
    await world.advance(MINUTE / 2)
    renewed = await world.store.renew(world.ref(lease), 5 * MINUTE)
    assert renewed.fence == lease.fence and renewed.owner_id == lease.owner_id
    assert renewed.state is TaskState.HELD
    assert close_to(renewed.expire_time - renewed.db_now, 5 * MINUTE)
    assert close_to(renewed.remaining_ttl, 5 * MINUTE)
    read = await world.lease()
    assert read.expire_time == renewed.expire_time
    assert read.claim_time == renewed.claim_time  # a renewal is not a grant


async def test_renew_never_reaches_past_the_runtime_deadline(world: World) -> None:
    lease = await world.held(ttl=MINUTE, max_runtime=3 * MINUTE)
    await world.advance(MINUTE / 2)
    renewed = await world.store.renew(world.ref(lease), HOUR)
    assert renewed.expire_time == renewed.runtime_deadline
    assert close_to(renewed.remaining_ttl, 2 * MINUTE + MINUTE / 2)
    await world.advance(3 * MINUTE)
    loss = await lost(world, world.ref(lease))
    assert loss.loss is LossReason.RUNTIME_EXCEEDED
    assert loss.current_fence == lease.fence


async def test_renew_never_revives_an_expired_lease(world: World) -> None:
    lease = await world.held(ttl=MINUTE)
    await world.advance(2 * MINUTE)
    for _ in range(2):
        loss = await lost(world, world.ref(lease))
        assert loss.loss is LossReason.LEASE_EXPIRED and loss.current_fence == lease.fence
    read = await world.lease()
    assert read.state is TaskState.EXPIRED and read.last_loss is LossReason.LEASE_EXPIRED


async def test_a_short_lease_runs_out_on_the_storage_clock(world: World) -> None:
    lease = await world.held(ttl=timedelta(milliseconds=200), request_id="r1")
    expired = await world.run_out()
    assert expired.fence == lease.fence and expired.last_loss is LossReason.LEASE_EXPIRED
    loss = await lost(world, world.ref(lease))
    assert loss.loss is LossReason.LEASE_EXPIRED
    # Its owner's retry is a new grant now.
    assert (await world.held(request_id="r1")).fence == lease.fence + 1


async def test_renew_of_a_superseded_fence_is_lost(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE)
    await world.advance(2 * MINUTE)
    second = await world.held(owner_id="w2")
    loss = await lost(world, world.ref(first))
    assert loss.loss is LossReason.LEASE_SUPERSEDED and loss.current_fence == second.fence


async def test_renew_by_another_owner_of_the_current_fence_is_not_owner(world: World) -> None:
    lease = await world.held(owner_id="w1")
    loss = await lost(world, world.ref(lease, owner_id="w2"))
    assert loss.loss is LossReason.NOT_OWNER and loss.current_fence == lease.fence


async def test_renew_of_a_fence_never_issued_is_fence_unknown(world: World) -> None:
    lease = await world.held()
    loss = await lost(world, world.ref(lease, fence=lease.fence + 1))
    assert loss.loss is LossReason.FENCE_UNKNOWN and loss.current_fence == lease.fence
    never = await lost(world, LeaseRef(world.key("never"), "w1", 1))
    assert never.loss is LossReason.FENCE_UNKNOWN and never.current_fence == 0


async def test_renew_after_release_revoke_or_completion_says_which(world: World) -> None:
    released = await world.held(task_id="a")
    await world.store.release(world.ref(released), complete=False)
    revoked = await world.held(task_id="b")
    await world.store.revoke(world.key("b"), "operator", 0)
    completed = await world.held(task_id="c")
    await world.store.release(world.ref(completed), complete=True)
    for lease, reason in (
        (released, LossReason.LEASE_RELEASED),
        (revoked, LossReason.LEASE_REVOKED),
        (completed, LossReason.TASK_COMPLETED),
    ):
        loss = await lost(world, world.ref(lease))
        assert (loss.loss, loss.current_fence) == (reason, lease.fence)


# Release and complete


async def test_release_frees_the_task_and_keeps_fence_and_owner(world: World) -> None:
    lease = await world.held(owner_id="w1", ttl=10 * MINUTE)
    await world.advance(MINUTE)
    released = await world.store.release(world.ref(lease), complete=False)
    assert (released.fence, released.owner_id) == (lease.fence, "w1")
    assert released.row_state == "released" and released.state is TaskState.FREE
    assert released.end_reason == "LEASE_RELEASED"
    assert released.last_loss is LossReason.LEASE_RELEASED
    # The lease ends now: expire_time becomes the release's instant.
    assert timedelta(0) <= released.db_now - released.expire_time <= SLACK
    read = await world.lease()
    assert read == replace(released, db_now=read.db_now)


async def test_release_is_idempotent_per_fence(world: World) -> None:
    lease = await world.held()
    released = await world.store.release(world.ref(lease), complete=False)
    again = await world.store.release(world.ref(lease), complete=False)
    assert again == replace(released, db_now=again.db_now)


async def test_a_released_lease_may_still_be_completed_by_its_owner(world: World) -> None:
    lease = await world.held()
    await world.store.release(world.ref(lease), complete=False)
    completed = await world.store.release(world.ref(lease), complete=True)
    assert completed.row_state == "completed" and completed.state is TaskState.COMPLETED
    assert completed.end_reason == "TASK_COMPLETED" and completed.fence == lease.fence
    # Both calls repeated answer with the completed task.
    for complete in (True, False):
        again = await world.store.release(world.ref(lease), complete=complete)
        assert again == replace(completed, db_now=again.db_now)


async def test_an_expired_lease_may_still_be_released_by_its_owner(world: World) -> None:
    lease = await world.held(ttl=MINUTE)
    await world.advance(2 * MINUTE)
    expired = await world.lease()
    released = await world.store.release(world.ref(lease), complete=False)
    assert released.row_state == "released" and released.fence == lease.fence
    assert released.expire_time == expired.expire_time  # it ended at its expiry, not now
    completed = await world.held(task_id="c", ttl=MINUTE)
    await world.advance(2 * MINUTE)
    done = await world.store.release(world.ref(completed), complete=True)
    assert done.state is TaskState.COMPLETED


async def test_release_of_a_lease_not_held_says_why(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE)
    await world.advance(2 * MINUTE)
    second = await world.held(owner_id="w2")
    for complete in (False, True):
        call = "complete" if complete else "release"
        stale = await lost(world, world.ref(first), call)
        assert (stale.loss, stale.current_fence) == (LossReason.LEASE_SUPERSEDED, second.fence)
        other = await lost(world, world.ref(second, owner_id="w1"), call)
        assert (other.loss, other.current_fence) == (LossReason.NOT_OWNER, second.fence)
        unknown = await lost(world, world.ref(second, fence=second.fence + 5), call)
        assert unknown.loss is LossReason.FENCE_UNKNOWN
        never = await lost(world, LeaseRef(world.key("never"), "w1", 1), call)
        assert (never.loss, never.current_fence) == (LossReason.FENCE_UNKNOWN, 0)
    # Nothing changed.
    assert (await world.lease()).state is TaskState.HELD


async def test_release_of_a_revoked_lease_is_lost(world: World) -> None:
    lease = await world.held()
    await world.store.revoke(world.key(), "operator", 0)
    for call in ("release", "complete"):
        loss = await lost(world, world.ref(lease), call)
        assert (loss.loss, loss.current_fence) == (LossReason.LEASE_REVOKED, lease.fence)


async def test_a_completed_task_refuses_every_other_release(world: World) -> None:
    first = await world.held(owner_id="w1")
    await world.store.release(world.ref(first), complete=False)
    lease = await world.held(owner_id="w2")
    await world.store.release(world.ref(lease), complete=True)
    # TASK_COMPLETED comes before NOT_OWNER and LEASE_SUPERSEDED (core/model.fence_loss).
    for ref in (world.ref(lease, owner_id="w1"), world.ref(first)):
        for call in ("release", "complete"):
            loss = await lost(world, ref, call)
            assert (loss.loss, loss.current_fence) == (LossReason.TASK_COMPLETED, lease.fence)


# Revoke


async def test_revoke_of_any_fence_ends_the_lease_now(world: World) -> None:
    lease = await world.held(owner_id="w1", ttl=10 * MINUTE)
    revoked, task = await world.store.revoke(world.key(), "maintenance", 0)
    assert revoked
    assert task.row_state == "revoked" and task.state is TaskState.FREE
    assert (task.fence, task.owner_id) == (lease.fence, "w1")
    assert task.end_reason == "LEASE_REVOKED" and task.revoke_reason == "maintenance"
    assert task.expire_time <= task.db_now
    assert task.last_loss is LossReason.LEASE_REVOKED
    read = await world.lease()
    assert read == replace(task, db_now=read.db_now)
    # Nothing left to revoke: the task as it is.
    again, same = await world.store.revoke(world.key(), "again", 0)
    assert not again and same == replace(task, db_now=same.db_now)


async def test_revoke_of_a_given_fence(world: World) -> None:
    lease = await world.held()
    missed, task = await world.store.revoke(world.key(), "stale", lease.fence + 1)
    assert not missed and task.state is TaskState.HELD and task.revoke_reason is None
    hit, task = await world.store.revoke(world.key(), "exact", lease.fence)
    assert hit and task.row_state == "revoked" and task.revoke_reason == "exact"


async def test_revoke_of_an_expired_lease(world: World) -> None:
    lease = await world.held(ttl=MINUTE)
    await world.advance(2 * MINUTE)
    expired = await world.lease()
    revoked, task = await world.store.revoke(world.key(), "cleanup", lease.fence)
    assert revoked and task.row_state == "revoked"
    assert task.expire_time == expired.expire_time


async def test_revoke_of_a_free_task_changes_nothing(world: World) -> None:
    lease = await world.held()
    released = await world.store.release(world.ref(lease), complete=False)
    revoked, task = await world.store.revoke(world.key(), "late", 0)
    assert not revoked
    assert task == replace(released, db_now=task.db_now)


async def test_revoke_of_an_unknown_or_completed_task_is_refused(world: World) -> None:
    with pytest.raises(TaskNotFound):
        await world.store.revoke(world.key("never"), "r", 0)
    lease = await world.held()
    await world.store.release(world.ref(lease), complete=True)
    with pytest.raises(TaskCompleted) as refused:
        await world.store.revoke(world.key(), "r", 0)
    assert refused.value.fence == lease.fence
