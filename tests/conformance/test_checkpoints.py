"""Checkpoints on both implementations (SQL ``renew`` with a checkpoint, ``get_checkpoint``).

One checkpoint per task, the latest: only the owner of the live current fence
writes it, and only with a higher version; a write repeated by its fence with
the same data and content type is answered with what is stored. Nothing
clears it: it outlives every ending of a lease, and a grant hands it over.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from leasekeeper_server.core.errors import CheckpointNotNewer, LeaseLost
from leasekeeper_server.core.limits import NamespaceLimits
from leasekeeper_server.core.model import Checkpoint, CheckpointWrite, LeaseRef, LossReason
from tests.conformance.conftest import MINUTE, SLACK, World, close_to


def write(
    version: int, data: bytes = b"progress", content_type: str = "text/plain"
) -> CheckpointWrite:
    return CheckpointWrite(version, data, content_type)


def written(checkpoint: Checkpoint | None) -> tuple[int, bytes, str, int] | None:
    """What a checkpoint holds, without its write_time."""
    if checkpoint is None:
        return None
    return (checkpoint.version, checkpoint.data, checkpoint.content_type, checkpoint.fence)


async def not_newer(world: World, ref: LeaseRef, checkpoint: CheckpointWrite) -> CheckpointNotNewer:
    with pytest.raises(CheckpointNotNewer) as refused:
        await world.store.save_checkpoint(ref, checkpoint)
    return refused.value


async def lost(world: World, ref: LeaseRef, checkpoint: CheckpointWrite) -> LeaseLost:
    with pytest.raises(LeaseLost) as raised:
        await world.store.save_checkpoint(ref, checkpoint)
    return raised.value


async def test_save_checkpoint_stores_it_with_its_fence(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    assert lease.checkpoint_version is None and lease.checkpoint_size is None
    assert await world.store.get_checkpoint(world.key()) is None
    saved, task = await world.store.save_checkpoint(world.ref(lease), write(1, b"12345"))
    assert (saved.version, saved.data, saved.content_type, saved.fence) == (
        1,
        b"12345",
        "text/plain",
        lease.fence,
    )
    assert timedelta(0) <= task.db_now - saved.write_time <= SLACK
    assert (task.checkpoint_version, task.checkpoint_size) == (1, 5)
    assert await world.store.get_checkpoint(world.key()) == saved
    read = await world.lease()
    assert (read.checkpoint_version, read.checkpoint_size) == (1, 5)


async def test_a_checkpoint_only_moves_forward(world: World) -> None:
    lease = await world.held()
    ref = world.ref(lease)
    await world.store.save_checkpoint(ref, write(1))
    third, _ = await world.store.save_checkpoint(ref, write(3, b"three"))  # versions may skip
    for older in (write(2), write(3, b"other"), write(3, b"three", "application/json")):
        refused = await not_newer(world, ref, older)
        assert (refused.version, refused.current_version) == (older.version, 3)
    assert await world.store.get_checkpoint(world.key()) == third


async def test_the_same_write_again_is_answered_with_what_is_stored(world: World) -> None:
    lease = await world.held()
    saved, _ = await world.store.save_checkpoint(world.ref(lease), write(1, b"a"))
    await world.advance(MINUTE)
    stored = await world.store.get_checkpoint(world.key())
    assert stored is not None and stored.write_time <= saved.write_time
    again, task = await world.store.save_checkpoint(world.ref(lease), write(1, b"a"))
    assert again == stored  # the first write, its instant included
    assert task.checkpoint_version == 1
    assert [e.kind for e in await world.history()].count("checkpoint_saved") == 1


async def test_saving_a_checkpoint_does_not_renew_the_lease(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    await world.advance(MINUTE)
    before = await world.lease()
    _, task = await world.store.save_checkpoint(world.ref(lease), write(1))
    assert task.expire_time == before.expire_time
    assert close_to(task.remaining_ttl, 9 * MINUTE)


async def test_only_the_live_lease_of_its_owner_and_fence_writes_a_checkpoint(
    world: World,
) -> None:
    lease = await world.held(owner_id="w1", ttl=MINUTE)
    other = await lost(world, world.ref(lease, owner_id="w2"), write(1))
    assert (other.loss, other.current_fence) == (LossReason.NOT_OWNER, lease.fence)
    unknown = await lost(world, world.ref(lease, fence=lease.fence + 1), write(1))
    assert unknown.loss is LossReason.FENCE_UNKNOWN
    never = await lost(world, LeaseRef(world.key("never"), "w1", 1), write(1))
    assert (never.loss, never.current_fence) == (LossReason.FENCE_UNKNOWN, 0)
    await world.advance(2 * MINUTE)
    expired = await lost(world, world.ref(lease), write(1))
    assert expired.loss is LossReason.LEASE_EXPIRED
    # Nothing was stored by any of them.
    assert await world.store.get_checkpoint(world.key()) is None
    assert (await world.lease()).checkpoint_version is None


async def test_a_stale_fence_writes_no_checkpoint(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE)
    await world.store.save_checkpoint(world.ref(first), write(1))
    await world.advance(2 * MINUTE)
    second = await world.held(owner_id="w2")
    stale = await lost(world, world.ref(first), write(9))
    assert (stale.loss, stale.current_fence) == (LossReason.LEASE_SUPERSEDED, second.fence)
    with pytest.raises(LeaseLost) as renewal:
        await world.store.write_checkpoint(world.ref(first), write(9), MINUTE)
    assert renewal.value.loss is LossReason.LEASE_SUPERSEDED
    stored = await world.store.get_checkpoint(world.key())
    assert stored is not None and (stored.version, stored.fence) == (1, first.fence)


async def test_a_new_fence_writes_a_higher_version_only(world: World) -> None:
    first = await world.held(owner_id="w1")
    await world.store.save_checkpoint(world.ref(first), write(1, b"a"))
    await world.store.release(world.ref(first), complete=False)
    second = await world.held(owner_id="w2")
    # The same version and data, but written by another fence: not a retry of it.
    refused = await not_newer(world, world.ref(second), write(1, b"a"))
    assert refused.current_version == 1
    saved, _ = await world.store.save_checkpoint(world.ref(second), write(2, b"b"))
    assert (saved.version, saved.fence) == (2, second.fence)


async def test_a_renewal_carries_a_checkpoint(world: World) -> None:
    lease = await world.held(ttl=MINUTE)
    renewed, saved = await world.store.write_checkpoint(
        world.ref(lease), write(1, b"one"), 5 * MINUTE
    )
    assert renewed.checkpoint_version == 1 and renewed.checkpoint_size == 3
    assert saved is not None and (saved.version, saved.data) == (1, b"one")
    assert close_to(renewed.remaining_ttl, 5 * MINUTE)
    # A version that does not move forward is not stored; the renewal still happens.
    await world.advance(MINUTE)
    again, other = await world.store.write_checkpoint(
        world.ref(lease), write(1, b"other"), 5 * MINUTE
    )
    assert other is None  # the same version, other data: not this write's
    assert again.checkpoint_version == 1 and close_to(again.remaining_ttl, 5 * MINUTE)
    stored = await world.store.get_checkpoint(world.key())
    assert stored is not None and stored.data == b"one"
    resent, same = await world.store.write_checkpoint(world.ref(lease), write(1, b"one"), MINUTE)
    assert same is not None and same.data == b"one"  # a resend of the stored one by its fence
    # No ttl: the checkpoint only, the expiry stays.
    kept, two = await world.store.write_checkpoint(world.ref(lease), write(2, b"two"))
    assert two is not None and kept.checkpoint_version == 2
    assert kept.expire_time == resent.expire_time


async def test_a_claim_hands_the_checkpoint_over(world: World) -> None:
    outcome = await world.claim(owner_id="w1", request_id="r1")
    assert outcome.acquired and outcome.checkpoint is None
    saved, _ = await world.store.save_checkpoint(world.ref(outcome.lease), write(1, b"x"))
    # The holder's retry gets its lease back, with the checkpoint.
    retry = await world.claim(owner_id="w1", request_id="r1")
    assert retry.acquired and retry.checkpoint == saved
    refused = await world.claim(owner_id="w2")
    assert not refused.acquired and refused.checkpoint is None
    await world.store.release(world.ref(outcome.lease), complete=False)
    granted = await world.claim(owner_id="w2")
    assert granted.acquired and granted.checkpoint == saved
    assert granted.lease.checkpoint_version == 1 and granted.lease.checkpoint_size == 1


async def test_a_claim_in_a_limited_namespace_hands_the_checkpoint_over(world: World) -> None:
    """The limited path (one transaction holding the namespace's limits row) does too."""
    limits = NamespaceLimits(max_leases=10)
    await world.set_limits(limits)
    first = await world.held(owner_id="w1", limits=limits)
    saved, _ = await world.store.save_checkpoint(world.ref(first), write(2, b"yz"))
    await world.store.revoke(world.key(), "move it", 0)
    granted = await world.claim(owner_id="w2", limits=limits)
    assert granted.acquired and granted.checkpoint == saved


@pytest.mark.parametrize("ending", ["release", "expiry", "revoke", "cancel", "complete", "fail"])
async def test_the_checkpoint_outlives_the_lease(world: World, ending: str) -> None:
    lease = await world.held(owner_id="w1", ttl=MINUTE)
    saved, _ = await world.store.save_checkpoint(world.ref(lease), write(4, b"state"))
    if ending == "expiry":
        await world.advance(2 * MINUTE)
        await world.sweep()
    elif ending == "revoke":
        await world.store.revoke(world.key(), "operator", 0)
    elif ending == "cancel":
        await world.store.cancel(world.key(), "not needed")
    else:
        await world.store.release(
            world.ref(lease), complete=ending == "complete", fail=ending == "fail"
        )
    # (Its write_time moved into the past with the clock, on PostgreSQL.)
    assert written(await world.store.get_checkpoint(world.key())) == written(saved)
    read = await world.lease()
    assert (read.checkpoint_version, read.checkpoint_size) == (4, 5)
    if ending in ("release", "expiry", "revoke"):
        granted = await world.claim(owner_id="w2")
        assert granted.acquired and written(granted.checkpoint) == written(saved)


async def test_checkpoints_are_per_task(world: World) -> None:
    a = await world.held(task_id="a")
    await world.held(task_id="b")
    saved, _ = await world.store.save_checkpoint(world.ref(a), write(1))
    assert await world.store.get_checkpoint(world.key("a")) == saved
    assert await world.store.get_checkpoint(world.key("b")) is None
    assert await world.store.get_checkpoint(world.key("never")) is None
