"""A task's history on both implementations (``list_history``, ``record_refusal``).

The entries are those the triggers of migrations/0008_runs.sql write: every
change of a task writes its entry in the same decision (grants with the
attempt they start, endings, checkpoints, effect reservations and outcomes);
a fence refused at ValidateFence or BeginEffect is recorded on request.
Entries come oldest first, by a sequence shared by all tasks.
"""

from __future__ import annotations

from typing import Any

from leasekeeper_server.core.effect_rules import (
    BeginRequest,
    EffectKey,
    EffectPolicy,
    EffectState,
    Outcome,
)
from leasekeeper_server.core.model import CheckpointWrite, HistoryEntry, LossReason
from tests.conformance.conftest import MINUTE, World


def summary(entries: list[HistoryEntry], base: int) -> list[tuple[Any, ...]]:
    """Each entry as (kind, fence - base, owner, attempt, reason), and what else its kind uses."""
    rows: list[tuple[Any, ...]] = []
    for e in entries:
        row: tuple[Any, ...] = (e.kind, e.fence - base, e.owner_id, e.attempt, e.reason)
        if e.kind == "checkpoint_saved":
            row += (e.checkpoint_version, e.checkpoint_size)
        elif e.kind.startswith("effect_"):
            row += (e.effect_key, e.effect_outcome, e.external_operation_id)
        elif e.kind == "fence_refused":
            row += (e.method,)
        rows.append(row)
    return rows


async def test_a_task_never_claimed_has_no_history(world: World) -> None:
    await world.store.record_refusal(world.key("never"), 3, LossReason.FENCE_UNKNOWN, "x")
    assert await world.history("never") == []


async def test_a_run_is_recorded_in_order(world: World) -> None:
    first = await world.held(owner_id="w1", ttl=MINUTE, max_attempts=3)
    base = first.fence
    await world.store.renew(world.ref(first), MINUTE)  # a renewal is no entry
    await world.store.save_checkpoint(world.ref(first), CheckpointWrite(1, b"abc", "text/plain"))
    await world.store.write_checkpoint(world.ref(first), CheckpointWrite(1, b"abc", ""), MINUTE)
    effect = EffectKey(world.namespace, "t", "email")
    await world.ledger.begin(BeginRequest(effect, base, EffectPolicy.ONCE, b"d"))
    await world.ledger.begin(BeginRequest(effect, base, EffectPolicy.ONCE, b"d"))  # in doubt
    done = Outcome(EffectState.SUCCEEDED, False, b"ok", "op-1")
    await world.ledger.complete(effect, base, done)
    await world.ledger.complete(effect, base, done)  # the same outcome again: no entry
    assert not (await world.claim(owner_id="other")).acquired  # a refused claim: no entry
    await world.advance(2 * MINUTE)
    expired = await world.lease()
    await world.held(owner_id="w2", ttl=MINUTE, max_attempts=3)
    await world.store.revoke(world.key(), "stuck", 0)
    await world.held(owner_id="w3", ttl=MINUTE, max_attempts=3)
    await world.advance(2 * MINUTE)
    await world.sweep()  # the third attempt ran out: quarantined
    await world.store.retry(world.key(), "fixed the input")
    fourth = await world.held(owner_id="w4")
    await world.store.release(world.ref(fourth), complete=False)
    fifth = await world.held(owner_id="w5")
    await world.store.record_refusal(world.key(), base, LossReason.LEASE_SUPERSEDED, "BeginEffect")
    await world.store.record_refusal(world.key(), fifth.fence, LossReason.NOT_OWNER, "Validate")
    await world.store.release(world.ref(fifth), complete=False, fail=True, fail_reason="bad data")
    entries = await world.history()
    assert summary(entries, base) == [
        ("granted", 0, "w1", 1, ""),
        ("checkpoint_saved", 0, "w1", 0, "", 1, 3),
        ("effect_reserved", 0, "", 1, "", "email", "", ""),
        ("effect_completed", 0, "", 1, "", "email", "succeeded", "op-1"),
        ("expired", 0, "w1", 0, "LEASE_EXPIRED"),
        ("granted", 1, "w2", 2, ""),
        ("revoked", 1, "w2", 0, "stuck"),
        ("granted", 2, "w3", 3, ""),
        ("expired", 2, "w3", 0, "LEASE_EXPIRED"),
        ("quarantined", 2, "w3", 3, "LEASE_EXPIRED"),
        ("retried", 2, "w3", 0, "fixed the input"),
        ("granted", 3, "w4", 1, ""),
        ("released", 3, "w4", 0, ""),
        ("granted", 4, "w5", 1, ""),
        ("fence_refused", 0, "", 0, "LEASE_SUPERSEDED", "BeginEffect"),
        ("fence_refused", 4, "w5", 0, "NOT_OWNER", "Validate"),
        ("failed", 4, "w5", 0, "bad data"),
    ]
    sequences = [e.sequence for e in entries]
    assert sequences == sorted(set(sequences))
    for entry in entries:
        assert entry.event_time.tzinfo is not None
    # An expiry is dated at its expire_time, a grant at its claim_time.
    assert entries[4].event_time == expired.expire_time
    assert entries[13].event_time == fifth.claim_time


async def test_endings_by_completion_cancel_and_a_revoke_of_the_last_attempt(
    world: World,
) -> None:
    done = await world.held(task_id="done")
    await world.store.release(world.ref(done), complete=True)
    await world.store.release(world.ref(done), complete=True)  # repeated: no entry
    await world.held(task_id="cancelled")
    await world.store.cancel(world.key("cancelled"), "not needed")
    await world.store.cancel(world.key("cancelled"), "again")  # cancelled already: no entry
    await world.held(task_id="revoked", max_attempts=1)
    await world.store.revoke(world.key("revoked"), "stuck", 0)
    kinds = {
        task_id: [(e.kind, e.attempt, e.reason) for e in await world.history(task_id)]
        for task_id in ("done", "cancelled", "revoked")
    }
    assert kinds == {
        "done": [("granted", 1, ""), ("completed", 0, "")],
        "cancelled": [("granted", 1, ""), ("cancelled", 0, "not needed")],
        "revoked": [
            ("granted", 1, ""),
            ("revoked", 0, "stuck"),
            ("quarantined", 1, "LEASE_REVOKED"),
        ],
    }


async def test_a_change_ending_an_unannounced_expiry_records_the_expiry_first(
    world: World,
) -> None:
    for task_id in ("cancel", "retry", "release"):
        await world.held(task_id=task_id, ttl=MINUTE, max_attempts=1 if task_id == "retry" else 5)
    held = await world.lease("release")
    await world.advance(2 * MINUTE)
    await world.store.cancel(world.key("cancel"), "stop")
    await world.store.retry(world.key("retry"), "again")
    await world.store.release(world.ref(held), complete=False)
    for task_id, ending in (("cancel", "cancelled"), ("retry", "retried"), ("release", "released")):
        entries = await world.history(task_id)
        assert [e.kind for e in entries] == ["granted", "expired", ending], task_id


async def test_a_runtime_budget_spent_is_recorded_as_such(world: World) -> None:
    await world.held(ttl=MINUTE, max_runtime=MINUTE)
    await world.advance(2 * MINUTE)
    await world.sweep()
    *_, expired = await world.history()
    assert (expired.kind, expired.reason) == ("expired", "RUNTIME_EXCEEDED")


async def test_history_pages_by_sequence(world: World) -> None:
    lease = await world.held(owner_id="w1")
    for version in range(1, 6):
        await world.store.save_checkpoint(world.ref(lease), CheckpointWrite(version, b"x", ""))
    await world.held(task_id="other")
    entries = await world.history()
    assert [e.kind for e in entries] == ["granted"] + ["checkpoint_saved"] * 5
    assert [e.checkpoint_version for e in entries[1:]] == [1, 2, 3, 4, 5]
    page = await world.store.list_history(world.key(), entries[1].sequence, 2)
    assert page == entries[2:4]
    rest = await world.store.list_history(world.key(), page[-1].sequence, 10)
    assert rest == entries[4:]
    assert await world.store.list_history(world.key(), entries[-1].sequence, 10) == []
    # The sequence is shared by every task: another task's entries come after.
    (other,) = await world.history("other")
    assert other.sequence > entries[-1].sequence


async def test_complete_and_save_records_the_outcome_then_the_checkpoint(world: World) -> None:
    lease = await world.held()
    effect = EffectKey(world.namespace, "t", "charge")
    await world.ledger.begin(BeginRequest(effect, lease.fence, EffectPolicy.ONCE, b"d"))
    outcome = Outcome(EffectState.FAILED, True, b"timeout", "op-7")
    await world.ledger.complete_and_save(
        effect, lease.fence, outcome, CheckpointWrite(2, b"cp", "")
    )
    entries = await world.history()
    assert [(e.kind, e.effect_outcome, e.checkpoint_version) for e in entries] == [
        ("granted", "", 0),
        ("effect_reserved", "", 0),
        ("effect_completed", "failed", 0),
        ("checkpoint_saved", "", 2),
    ]
    assert entries[2].external_operation_id == "op-7"
