"""Cancel and fail on both implementations (SQL ``cancel``, ``release`` with fail).

Both end the task for good, as a completion does: CANCELLED (an operator's
call, whatever the lease) or FAILED (the owner's disposition of its run).
Every fence of an ended task is refused with the task's own reason, no claim
is granted again, and the checkpoint stays.
"""

from __future__ import annotations

import pytest

from leasekeeper_server.core.effect_rules import BeginRequest, EffectKey, EffectPolicy
from leasekeeper_server.core.errors import LeaseLost, TaskNotClaimable, TaskNotFound
from leasekeeper_server.core.model import Lease, LossReason, TaskState, fence_loss, owner_loss
from tests.conformance.conftest import MINUTE, World


async def refused_claims(world: World, loss: LossReason, fence: int) -> None:
    """Every claim of the task is refused with ``loss``: the holder's, a new incarnation's."""
    for owner, request_id in (("w9", None), ("w1", "r9"), ("w1", None)):
        with pytest.raises(TaskNotClaimable) as refused:
            await world.claim(owner_id=owner, request_id=request_id)
        assert (refused.value.loss, refused.value.fence) == (loss, fence)


async def every_fence_refused(world: World, fences: list[Lease], loss: LossReason) -> None:
    """Each fence the task had is refused with ``loss``: validation, renewal, release, effects."""
    task = await world.lease()
    for lease in fences:
        assert fence_loss(task, lease.fence) is loss
        assert owner_loss(task, "someone else", lease.fence) is loss
        for call in ("renew", "release", "complete", "fail", "effect"):
            with pytest.raises(LeaseLost) as lost:
                if call == "renew":
                    await world.store.renew(world.ref(lease), MINUTE)
                elif call == "effect":
                    key = EffectKey(world.namespace, "t", "email")
                    await world.ledger.begin(
                        BeginRequest(key, lease.fence, EffectPolicy.ONCE, b"d")
                    )
                else:
                    await world.store.release(
                        world.ref(lease), complete=call == "complete", fail=call == "fail"
                    )
            assert (lost.value.loss, lost.value.current_fence) == (loss, task.fence), call


# Cancel


async def test_cancel_ends_the_task_and_its_live_lease(world: World) -> None:
    first = await world.held(owner_id="w1")
    await world.store.release(world.ref(first), complete=False)
    lease = await world.held(owner_id="w1", ttl=10 * MINUTE)
    changed, cancelled = await world.store.cancel(world.key(), "no longer needed")
    assert changed
    assert cancelled.row_state == "cancelled" and cancelled.state is TaskState.CANCELLED
    assert (cancelled.fence, cancelled.owner_id) == (lease.fence, "w1")
    assert cancelled.end_reason == "TASK_CANCELLED"
    assert cancelled.state_reason == "no longer needed"
    assert cancelled.expire_time <= cancelled.db_now  # the lease ended now
    assert cancelled.remaining_ttl.total_seconds() == 0
    assert cancelled.unclaimable is LossReason.TASK_CANCELLED
    assert cancelled.last_loss is LossReason.TASK_CANCELLED
    await refused_claims(world, LossReason.TASK_CANCELLED, lease.fence)
    await every_fence_refused(world, [first, lease], LossReason.TASK_CANCELLED)
    with pytest.raises(TaskNotClaimable) as revoke:
        await world.store.revoke(world.key(), "late", 0)
    assert revoke.value.loss is LossReason.TASK_CANCELLED


async def test_cancel_is_idempotent(world: World) -> None:
    await world.held()
    changed, cancelled = await world.store.cancel(world.key(), "first words")
    history = await world.history()
    changed_again, again = await world.store.cancel(world.key(), "second words")
    assert (changed, changed_again) == (True, False)  # the second changed nothing
    assert await world.history() == history  # and wrote nothing
    assert again.state is TaskState.CANCELLED
    assert again.state_reason == "first words"  # the first cancel stands
    assert again.expire_time == cancelled.expire_time


@pytest.mark.parametrize("state", ["FREE", "EXPIRED", "QUARANTINED", "HELD"])
async def test_cancel_of_a_task_in_any_unended_state(world: World, state: str) -> None:
    lease = await world.held(ttl=MINUTE, max_attempts=1 if state == "QUARANTINED" else None)
    if state == "FREE":
        await world.store.release(world.ref(lease), complete=False)
    elif state != "HELD":
        await world.advance(2 * MINUTE)
    assert (await world.lease()).state.value == state
    changed, cancelled = await world.store.cancel(world.key(), "stop")
    assert changed
    assert cancelled.state is TaskState.CANCELLED and cancelled.fence == lease.fence
    await refused_claims(world, LossReason.TASK_CANCELLED, lease.fence)


async def test_cancel_of_a_completed_or_failed_task_is_refused(world: World) -> None:
    with pytest.raises(TaskNotFound):
        await world.store.cancel(world.key("never"), "r")
    done = await world.held(task_id="done")
    await world.store.release(world.ref(done), complete=True)
    failed = await world.held(task_id="failed")
    await world.store.release(world.ref(failed), complete=False, fail=True, fail_reason="bad")
    for task_id, loss in (("done", LossReason.TASK_COMPLETED), ("failed", LossReason.TASK_FAILED)):
        before = await world.lease(task_id)
        with pytest.raises(TaskNotClaimable) as refused:
            await world.store.cancel(world.key(task_id), "too late")
        assert (refused.value.loss, refused.value.fence) == (loss, before.fence)
        after = await world.lease(task_id)
        assert (after.row_state, after.state_reason) == (before.row_state, before.state_reason)


# Fail


async def test_fail_ends_the_task_as_failed(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE)
    await world.advance(2 * MINUTE)
    lease = await world.held(owner_id="w2")
    failed = await world.store.release(
        world.ref(lease), complete=False, fail=True, fail_reason="input is malformed"
    )
    assert failed.row_state == "failed" and failed.state is TaskState.FAILED
    assert (failed.end_reason, failed.state_reason) == ("TASK_FAILED", "input is malformed")
    assert (failed.fence, failed.owner_id) == (lease.fence, "w2")
    assert failed.expire_time <= failed.db_now
    assert failed.unclaimable is LossReason.TASK_FAILED
    await refused_claims(world, LossReason.TASK_FAILED, lease.fence)
    # The same disposition again, or a plain release, answers with the task as it is.
    for fail in (True, False):
        again = await world.store.release(world.ref(lease), complete=False, fail=fail)
        assert again.state is TaskState.FAILED and again.state_reason == "input is malformed"
    await every_fence_refused(world, [first], LossReason.TASK_FAILED)
    # Its own fence may not complete it instead.
    with pytest.raises(LeaseLost) as lost:
        await world.store.release(world.ref(lease), complete=True)
    assert lost.value.loss is LossReason.TASK_FAILED


async def test_a_released_or_expired_lease_may_still_be_failed_by_its_owner(world: World) -> None:
    released = await world.held(task_id="a")
    await world.store.release(world.ref(released), complete=False)
    failed = await world.store.release(
        world.ref(released), complete=False, fail=True, fail_reason="gave up"
    )
    assert failed.state is TaskState.FAILED and failed.state_reason == "gave up"
    expired = await world.held(task_id="b", ttl=MINUTE)
    await world.advance(2 * MINUTE)
    late = await world.store.release(world.ref(expired), complete=False, fail=True)
    assert late.state is TaskState.FAILED and late.fence == expired.fence


async def test_a_completed_task_refuses_a_failure(world: World) -> None:
    lease = await world.held()
    await world.store.release(world.ref(lease), complete=True)
    with pytest.raises(LeaseLost) as lost:
        await world.store.release(world.ref(lease), complete=False, fail=True)
    assert lost.value.loss is LossReason.TASK_COMPLETED
    assert (await world.lease()).state is TaskState.COMPLETED
