"""The effect ledger on both implementations: ``core/effect_rules.py`` behind the fence check.

Begin and Complete under ONCE and LATEST, with the current fence, a stale
one, a lease that ran out, and a replacement worker that reconciles; an
outcome recorded together with a checkpoint: both or neither.
"""

from __future__ import annotations

import pytest

from leasekeeper_server.core.effect_rules import (
    BeginDecision,
    BeginRequest,
    Effect,
    EffectKey,
    EffectPolicy,
    EffectState,
    Outcome,
)
from leasekeeper_server.core.errors import (
    CheckpointNotNewer,
    EffectAlreadyCompleted,
    EffectKeyReused,
    EffectNotBegun,
    LeaseLost,
)
from leasekeeper_server.core.model import CheckpointWrite, Lease, LossReason
from tests.conformance.conftest import MINUTE, World

ONCE, LATEST = EffectPolicy.ONCE, EffectPolicy.LATEST
PROCEED = BeginDecision.PROCEED
APPLIED = BeginDecision.ALREADY_APPLIED
IN_DOUBT = BeginDecision.IN_DOUBT
SUCCEEDED = Outcome(EffectState.SUCCEEDED, False, b"receipt-1")
FAILED_RETRYABLE = Outcome(EffectState.FAILED, True, b"timeout")
FAILED_FOR_GOOD = Outcome(EffectState.FAILED, False, b"declined")


def effect_key(world: World, name: str = "email") -> EffectKey:
    return EffectKey(world.namespace, "t", name)


async def begin(
    world: World,
    lease: Lease,
    policy: EffectPolicy = ONCE,
    digest: bytes = b"d1",
    name: str = "email",
) -> tuple[BeginDecision, Effect]:
    return await world.ledger.begin(
        BeginRequest(effect_key(world, name), lease.fence, policy, digest)
    )


async def complete(
    world: World, lease: Lease, outcome: Outcome = SUCCEEDED, name: str = "email"
) -> Effect:
    return await world.ledger.complete(effect_key(world, name), lease.fence, outcome)


async def replaced(world: World, lease: Lease, owner_id: str = "w2") -> Lease:
    """The lease of a replacement worker, granted after ``lease`` expired."""
    await world.advance(lease.expire_time - lease.db_now + MINUTE)
    return await world.held(owner_id=owner_id, ttl=10 * MINUTE)


async def test_the_first_begin_reserves_and_a_second_is_in_doubt(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    decision, record = await begin(world, lease)
    assert decision is PROCEED
    assert (record.state, record.fence, record.attempts) == (EffectState.RESERVED, lease.fence, 1)
    assert (record.policy, record.request_digest) == (ONCE, b"d1")
    assert record.complete_fence is None and record.complete_time is None
    assert (record.retryable, record.result) == (False, b"")
    # Asking again cannot tell whether the first attempt reached the outside system.
    decision, again = await begin(world, lease)
    assert decision is IN_DOUBT and again == record


async def test_complete_records_once_and_is_idempotent_for_the_same_outcome(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    await begin(world, lease)
    done = await complete(world, lease)
    assert (done.state, done.result, done.complete_fence) == (
        EffectState.SUCCEEDED,
        b"receipt-1",
        lease.fence,
    )
    assert done.complete_time is not None and done.attempts == 1
    assert await complete(world, lease) == done
    with pytest.raises(EffectAlreadyCompleted) as refused:
        await complete(world, lease, FAILED_FOR_GOOD)
    assert (refused.value.state, refused.value.complete_fence) == ("SUCCEEDED", lease.fence)
    decision, record = await begin(world, lease)
    assert decision is APPLIED and record == done


async def test_complete_of_an_effect_never_begun_is_refused(world: World) -> None:
    lease = await world.held()
    with pytest.raises(EffectNotBegun):
        await complete(world, lease, name="never")


async def test_a_retryable_failure_may_be_attempted_again(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    await begin(world, lease)
    failed = await complete(world, lease, FAILED_RETRYABLE)
    assert (failed.state, failed.retryable) == (EffectState.FAILED, True)
    decision, record = await begin(world, lease)
    assert decision is PROCEED
    assert (record.state, record.attempts, record.fence) == (EffectState.RESERVED, 2, lease.fence)
    assert (record.complete_fence, record.retryable, record.result) == (None, False, b"")


async def test_a_failure_for_good_is_already_applied(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    await begin(world, lease)
    failed = await complete(world, lease, FAILED_FOR_GOOD)
    decision, record = await begin(world, lease)
    assert decision is APPLIED and record == failed


async def test_a_key_names_one_effect(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    await begin(world, lease, ONCE, b"d1")
    with pytest.raises(EffectKeyReused) as digest:
        await begin(world, lease, ONCE, b"other")
    assert digest.value.field == "request_digest"
    with pytest.raises(EffectKeyReused) as policy:
        await begin(world, lease, LATEST, b"d1")
    assert policy.value.field == "policy"


async def test_a_stale_or_lost_fence_reserves_and_records_nothing(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE)
    await begin(world, first)
    second = await replaced(world, first)
    with pytest.raises(LeaseLost) as lost_begin:
        await begin(world, first)
    with pytest.raises(LeaseLost) as lost_complete:
        await complete(world, first)
    for lost in (lost_begin, lost_complete):
        assert (lost.value.loss, lost.value.current_fence) == (
            LossReason.LEASE_SUPERSEDED,
            second.fence,
        )
    # The lease of the current fence runs out: nothing more either.
    await world.advance(11 * MINUTE)
    with pytest.raises(LeaseLost) as expired:
        await begin(world, second, name="other")
    assert expired.value.loss is LossReason.LEASE_EXPIRED
    with pytest.raises(LeaseLost) as unknown:
        await world.ledger.begin(BeginRequest(effect_key(world), second.fence + 1, ONCE, b"d1"))
    assert unknown.value.loss is LossReason.FENCE_UNKNOWN
    (record,) = await world.ledger.list(world.key(), "", 10, None)
    assert (record.state, record.fence, record.attempts) == (EffectState.RESERVED, first.fence, 1)


async def test_once_a_replacement_finds_the_earlier_attempt(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE)
    await begin(world, first, ONCE, name="reserved")
    await begin(world, first, ONCE, name="done")
    done = await complete(world, first, name="done")
    second = await replaced(world, first)
    decision, record = await begin(world, second, ONCE, name="reserved")
    assert decision is IN_DOUBT and record.fence == first.fence
    decision, record = await begin(world, second, ONCE, name="done")
    assert decision is APPLIED and record == done
    # The replacement reconciles: it records what it learned of the earlier attempt.
    reconciled = await complete(world, second, name="reserved")
    assert (reconciled.fence, reconciled.complete_fence) == (first.fence, second.fence)
    decision, _ = await begin(world, second, ONCE, name="reserved")
    assert decision is APPLIED


async def test_latest_a_newer_fence_supersedes(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE)
    await begin(world, first, LATEST, b"v1", name="reserved")
    await begin(world, first, LATEST, b"v1", name="done")
    await complete(world, first, name="done")
    # The fence that wrote a record is answered as ONCE would be.
    decision, _ = await begin(world, first, LATEST, b"v1", name="reserved")
    assert decision is IN_DOUBT
    decision, _ = await begin(world, first, LATEST, b"v1", name="done")
    assert decision is APPLIED
    second = await replaced(world, first)
    for name in ("reserved", "done"):
        # A newer fence proceeds, with another request digest if it likes.
        decision, record = await begin(world, second, LATEST, b"v2", name=name)
        assert decision is PROCEED, name
        assert (record.state, record.fence, record.attempts) == (
            EffectState.RESERVED,
            second.fence,
            2,
        )
        assert record.request_digest == b"v2" and record.policy is LATEST
        decision, _ = await begin(world, second, LATEST, b"v2", name=name)
        assert decision is IN_DOUBT
        with pytest.raises(EffectKeyReused):
            await begin(world, second, LATEST, b"v3", name=name)


async def test_latest_a_reconciled_record_belongs_to_the_fence_that_wrote_it(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE)
    await begin(world, first, LATEST, b"v1")
    second = await replaced(world, first)
    reconciled = await complete(world, second)  # over the first fence's reservation
    assert (reconciled.fence, reconciled.complete_fence) == (first.fence, second.fence)
    decision, record = await begin(world, second, LATEST, b"v1")
    assert decision is APPLIED and record == reconciled
    with pytest.raises(EffectKeyReused):
        await begin(world, second, LATEST, b"v2")
    third = await replaced(world, second, owner_id="w3")
    decision, record = await begin(world, third, LATEST, b"v3")
    assert decision is PROCEED and record.fence == third.fence and record.attempts == 2


async def test_list_effects_pages_by_key_and_filters_by_state(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    for name in ("c", "a", "d", "b"):
        await begin(world, lease, name=name)
    await complete(world, lease, name="b")
    await complete(world, lease, FAILED_RETRYABLE, name="d")
    task = world.key()
    listed = await world.ledger.list(task, "", 10, None)
    assert [r.effect_key for r in listed] == ["a", "b", "c", "d"]
    page = await world.ledger.list(task, "a", 2, None)
    assert [r.effect_key for r in page] == ["b", "c"]
    reserved = await world.ledger.list(task, "", 10, EffectState.RESERVED)
    assert [r.effect_key for r in reserved] == ["a", "c"]
    succeeded = await world.ledger.list(task, "", 10, EffectState.SUCCEEDED)
    assert [r.effect_key for r in succeeded] == ["b"]
    failed = await world.ledger.list(task, "b", 10, EffectState.FAILED)
    assert [r.effect_key for r in failed] == ["d"]
    assert await world.ledger.list(world.key("other"), "", 10, None) == []


# An outcome and a checkpoint together (EffectStore.complete_and_save)


def progress(version: int, data: bytes = b"step") -> CheckpointWrite:
    return CheckpointWrite(version, data, "application/octet-stream")


async def test_complete_and_save_records_both(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    await begin(world, lease)
    outcome = Outcome(EffectState.SUCCEEDED, False, b"receipt", "op-42")
    record, saved = await world.ledger.complete_and_save(
        effect_key(world), lease.fence, outcome, progress(1)
    )
    assert (record.state, record.complete_fence, record.external_operation_id) == (
        EffectState.SUCCEEDED,
        lease.fence,
        "op-42",
    )
    assert (saved.version, saved.data, saved.fence) == (1, b"step", lease.fence)
    assert await world.store.get_checkpoint(world.key()) == saved
    assert await world.ledger.list(world.key(), "", 10, None) == [record]
    # Both repeated: the same record and the same checkpoint.
    again = await world.ledger.complete_and_save(
        effect_key(world), lease.fence, outcome, progress(1)
    )
    assert again == (record, saved)


async def test_complete_and_save_refused_checkpoint_records_no_outcome(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    stored, _ = await world.store.save_checkpoint(world.ref(lease), progress(5))
    _, reserved = await begin(world, lease)
    with pytest.raises(CheckpointNotNewer) as refused:
        await world.ledger.complete_and_save(effect_key(world), lease.fence, SUCCEEDED, progress(3))
    assert refused.value.current_version == 5
    assert await world.ledger.list(world.key(), "", 10, None) == [reserved]
    assert await world.store.get_checkpoint(world.key()) == stored
    # A fence that may not act: lost, and nothing recorded either. (The checkpoint's
    # owner is the fence's, read from the task: a caller cannot name another.)
    with pytest.raises(LeaseLost) as lost:
        await world.ledger.complete_and_save(
            effect_key(world), lease.fence + 1, SUCCEEDED, progress(6)
        )
    assert lost.value.loss is LossReason.FENCE_UNKNOWN
    assert await world.ledger.list(world.key(), "", 10, None) == [reserved]
    assert [e.kind for e in await world.history()] == [
        "granted",
        "checkpoint_saved",
        "effect_reserved",
    ]
    # A higher version: both.
    record, saved = await world.ledger.complete_and_save(
        effect_key(world), lease.fence, SUCCEEDED, progress(6)
    )
    assert record.state is EffectState.SUCCEEDED and saved.version == 6


async def test_complete_and_save_refused_outcome_saves_no_checkpoint(world: World) -> None:
    lease = await world.held(ttl=10 * MINUTE)
    with pytest.raises(EffectNotBegun):
        await world.ledger.complete_and_save(
            effect_key(world, "never"), lease.fence, SUCCEEDED, progress(1)
        )
    await begin(world, lease)
    await complete(world, lease)
    with pytest.raises(EffectAlreadyCompleted):
        await world.ledger.complete_and_save(
            effect_key(world), lease.fence, FAILED_FOR_GOOD, progress(1)
        )
    await world.advance(11 * MINUTE)
    with pytest.raises(LeaseLost) as expired:
        await world.ledger.complete_and_save(effect_key(world), lease.fence, SUCCEEDED, progress(1))
    assert expired.value.loss is LossReason.LEASE_EXPIRED
    assert await world.store.get_checkpoint(world.key()) is None
