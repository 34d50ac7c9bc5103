"""The history checker finds each kind of violation in a hand-made history, and none in a clean one.

Without these, a checker that never reports anything would pass every seed of
``tests/fault/test_history.py``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.fault.history.checker import check

S = 1_000_000  # microseconds per second


def clean() -> dict[str, list[dict[str, Any]]]:
    """Task t: fence 1 (owner a) claimed at 0 s, renewed to 3 s, released at 2 s; fence 2 (b).

    With the runs of :func:`add_runs`: t's checkpoint, and task q's attempts,
    quarantine, Retry and Cancel.
    """
    history = base()
    add_runs(history)
    return history


def data(fence: int, version: int) -> str:
    """A worker's checkpoint data (tests/fault/history/worker.py checkpoint_data)."""
    return json.dumps({"task": "t", "fence": fence, "owner": "a", "v": version})


def add_runs(h: dict[str, list[dict[str, Any]]]) -> None:
    """Adds checkpoints, attempts and the operator's calls to the history of :func:`base`.

    t: fence 1 saves checkpoint v1 at 0.5 s (its renewal), fence 2 is granted
    with it; the operator reads it. q (max_attempts 2): fence 1 (a) expires at
    11 s, fence 2 (b) takes over at 12 s as attempt 2 and expires at 13 s; the
    sweeper stores the quarantine at 13.5 s; the operator's Retry at 14 s;
    fence 3 (a) at 15 s; the operator's Cancel at 15.5 s.
    """
    # fmt: off
    no_checkpoint = {"checkpoint_version": None, "checkpoint_fence": None,
                     "checkpoint_us": None, "checkpoint_data": None}
    v1 = {"checkpoint_version": 1, "checkpoint_fence": 1, "checkpoint_us": S // 2,
          "checkpoint_data": data(1, 1)}
    for version, stored in zip(h["versions"], [no_checkpoint, v1, v1, v1], strict=True):
        version.update(attempts=0, max_attempts=None, **stored)
    h["tasks"][0].update(state="held", **v1)
    h["events"][0].update(attempts=0, max_attempts=0, cp_version=0)
    h["events"][4].update(attempts=0, max_attempts=0, cp_version=1, cp_fence=1,
                          cp_write_us=S // 2, cp_data=data(1, 1))
    q = {"task_id": "q", "max_attempts": 2, **no_checkpoint}
    h["versions"] += [
        dict(q, owner_id="a", fence=1, state="held", claim_us=10 * S, expire_us=11 * S,
             update_us=10 * S, attempts=0),
        dict(q, owner_id="b", fence=2, state="held", claim_us=12 * S, expire_us=13 * S,
             update_us=12 * S, attempts=1),
        dict(q, owner_id="b", fence=2, state="quarantined", claim_us=12 * S, expire_us=13 * S,
             update_us=27 * S // 2, attempts=2),
        dict(q, owner_id="b", fence=2, state="retried", claim_us=12 * S, expire_us=13 * S,
             update_us=14 * S, attempts=0),
        dict(q, owner_id="a", fence=3, state="held", claim_us=15 * S, expire_us=16 * S,
             update_us=15 * S, attempts=0),
        dict(q, owner_id="a", fence=3, state="cancelled", claim_us=15 * S,
             expire_us=31 * S // 2, update_us=31 * S // 2, attempts=0),
    ]
    h["tasks"].append(dict(q, owner_id="a", fence=3, state="cancelled", attempts=0))
    h["events"] += [
        {"ev": "checkpoint_saved", "w": "w1", "t": 10.15, "task": "t", "fence": 1,
         "version": 1, "via": "beat", "saved_version": 1, "saved_fence": 1, "write_us": None},
        {"ev": "observed", "w": "op", "t": 14.0, "task": "t", "state": "HELD", "fence": 2,
         "attempts": 0, "max_attempts": 0, "cp_version": 1, "cp_fence": 1,
         "cp_write_us": S // 2, "cp_data": data(1, 1)},
        {"ev": "claim_quarantined", "w": "w2", "t": 20.0, "task": "q",
         "reason": "TASK_QUARANTINED"},
        {"ev": "observed", "w": "op", "t": 20.1, "task": "q", "state": "QUARANTINED",
         "fence": 2, "attempts": 2, "max_attempts": 2, "cp_version": 0},
        {"ev": "retry", "w": "op", "t": 20.2, "task": "q", "state": "FREE", "fence": 2,
         "attempts": 0, "max_attempts": 2},
        {"ev": "cancel", "w": "op", "t": 21.0, "task": "q", "state": "CANCELLED", "fence": 3,
         "attempts": 0, "max_attempts": 2},
    ]
    h["task_history"] = [
        {"task_id": "t", "kind": "granted", "fence": 1, "owner_id": "a", "attempt": 1,
         "event_us": 0, "checkpoint_version": 0},
        {"task_id": "t", "kind": "checkpoint_saved", "fence": 1, "owner_id": "a", "attempt": 0,
         "event_us": S // 2, "checkpoint_version": 1},
        {"task_id": "t", "kind": "released", "fence": 1, "owner_id": "a", "attempt": 0,
         "event_us": 2 * S, "checkpoint_version": 0},
        {"task_id": "t", "kind": "granted", "fence": 2, "owner_id": "b", "attempt": 1,
         "event_us": 2 * S, "checkpoint_version": 0},
        {"task_id": "q", "kind": "granted", "fence": 1, "owner_id": "a", "attempt": 1,
         "event_us": 10 * S, "checkpoint_version": 0},
        {"task_id": "q", "kind": "granted", "fence": 2, "owner_id": "b", "attempt": 2,
         "event_us": 12 * S, "checkpoint_version": 0},
        {"task_id": "q", "kind": "granted", "fence": 3, "owner_id": "a", "attempt": 1,
         "event_us": 15 * S, "checkpoint_version": 0},
    ]
    # fmt: on


def base() -> dict[str, list[dict[str, Any]]]:
    """Task t without checkpoints or attempts (as tests/fault/test_three_replicas.py records)."""
    return {
        "events": [
            {"ev": "grant", "w": "w1", "t": 10.0, "task": "t", "fence": 1, "owner": "a",
             "claim_us": 0, "db_now_us": 20, "deadline": 10.8},
            {"ev": "validate", "w": "w1", "t": 10.1, "task": "t", "fence": 1, "valid": True,
             "db_now_us": 1 * S},
            {"ev": "apply", "w": "w1", "t": 10.2, "task": "t", "fence": 1, "key": "once-0",
             "policy": "ONCE", "deadline": 10.9, "lost": False},
            {"ev": "effect", "w": "w1", "t": 10.3, "task": "t", "fence": 1, "key": "once-0",
             "policy": "ONCE", "fresh": True, "result": "apply-1"},
            {"ev": "grant", "w": "w2", "t": 13.0, "task": "t", "fence": 2, "owner": "b",
             "claim_us": 2 * S, "db_now_us": 2 * S + 15, "deadline": 13.8},
            {"ev": "effect", "w": "w2", "t": 13.1, "task": "t", "fence": 2, "key": "once-0",
             "policy": "ONCE", "fresh": False, "result": "apply-1"},
            {"ev": "validate", "w": "w2", "t": 13.2, "task": "t", "fence": 2, "valid": False,
             "db_now_us": None},
            {"ev": "cancelled", "w": "w2", "t": 13.9, "task": "t", "fence": 2,
             "reason": "LEASE_EXPIRED", "deadline": 13.8, "lost_t": 13.85},
        ],
        "faults": [{"kind": "pause_worker", "target": "w3", "t": 0.0, "until": 1.0}],
        "versions": [
            {"task_id": "t", "owner_id": "a", "fence": 1, "state": "held", "claim_us": 0,
             "expire_us": 1 * S, "update_us": 0},
            {"task_id": "t", "owner_id": "a", "fence": 1, "state": "held", "claim_us": 0,
             "expire_us": 3 * S, "update_us": S // 2},
            {"task_id": "t", "owner_id": "a", "fence": 1, "state": "released", "claim_us": 0,
             "expire_us": 2 * S, "update_us": 2 * S},
            {"task_id": "t", "owner_id": "b", "fence": 2, "state": "held", "claim_us": 2 * S,
             "expire_us": 4 * S, "update_us": 2 * S},
        ],
        "tasks": [{"task_id": "t", "fence": 2}],
        "applies": [
            {"apply_id": 1, "task_id": "t", "effect_key": "once-0", "policy": "ONCE",
             "fence": 1},
        ],
        "effects": [
            {"task_id": "t", "effect_key": "once-0", "policy": "ONCE", "state": "succeeded",
             "result": "apply-1"},
        ],
    }  # fmt: skip


def run(history: dict[str, list[dict[str, Any]]]) -> list[str]:
    return check(**history).violations  # type: ignore[arg-type]


def test_clean_history_has_no_violation_and_counts() -> None:
    verdict = check(**clean())  # type: ignore[arg-type]
    assert verdict.violations == []
    assert verdict.counts["grants.database"] == 5
    assert verdict.counts["validate.valid"] == 1
    assert verdict.counts["stale_fences_refused"] == 1
    assert verdict.counts["lost.max_late_ms"] == 50
    assert verdict.counts["checkpoints.written"] == 1
    assert verdict.counts["checkpoints.acknowledged.beat"] == 1
    assert verdict.counts["checkpoints.resumed"] == 1
    assert verdict.counts["quarantines"] == 1
    assert verdict.counts["retries"] == 1
    assert verdict.counts["tasks.cancelled"] == 1
    assert verdict.counts["acknowledged.cancel"] == 1


def test_history_without_checkpoints_or_attempts_has_no_violation() -> None:
    """A record without the newer columns (tests/fault/test_three_replicas.py's) still checks."""
    assert check(**base()).violations == []  # type: ignore[arg-type]


def mutated(change: Any) -> dict[str, list[dict[str, Any]]]:
    history = copy.deepcopy(clean())
    change(history)
    return history


CASES = {
    "fence goes back": (
        lambda h: h["versions"].append(dict(h["versions"][0], fence=1, claim_us=5 * S,
                                            expire_us=6 * S)),
        "fence-order: t went from fence 2 back to 1",
    ),
    "one fence, two owners in the database": (
        lambda h: h["versions"].append(dict(h["versions"][3], owner_id="c")),
        "fence-order: t fence 2 given to b and c",
    ),
    "acknowledged grant lost": (
        lambda h: h["events"].append({"ev": "grant", "w": "w9", "t": 20.0, "task": "t",
                                      "fence": 3, "owner": "z", "claim_us": 5 * S,
                                      "db_now_us": 5 * S, "deadline": None}),
        "fence-order: grant t/3 to z acknowledged but the database has no such grant",
    ),
    "two workers told the same fence": (
        lambda h: h["events"].append(dict(h["events"][4], w="w9", owner="z")),
        "fence-order: workers b and z were both granted t/2",
    ),
    "overlapping leases": (
        lambda h: h["versions"][3].update(claim_us=1 * S),
        "one-holder: t fence 2 (b) claimed 1.000000 s before fence 1 (a) ended",
    ),
    "valid after a newer fence of the same owner": (
        lambda h: (
            h["versions"][3].update(owner_id="a", claim_us=S // 2),
            h["events"][1].update(db_now_us=S),
        ),
        "validate: t/1 valid at 1000000, outside its lease [0, 500000)",
    ),
    "valid after the lease ended": (
        lambda h: h["events"][1].update(db_now_us=2 * S),
        "validate: t/1 valid at 2000000, outside its lease [0, 2000000)",
    ),
    "renewal after expiry": (
        lambda h: h["versions"][1].update(update_us=S),
        "no-revival: t fence 1 renewed 0.000000 s after it expired",
    ),
    "remaining ttl overstated": (
        lambda h: h["events"][0].update(db_now_us=-S // 2),
        "remaining-ttl: grant t/1 to w1 describes an instant 0.500000 s before the grant",
    ),
    "ONCE applied twice": (
        lambda h: h["applies"].append({"apply_id": 2, "task_id": "t", "effect_key": "once-0",
                                       "policy": "ONCE", "fence": 2}),
        "effect-once: ONCE effect t/once-0 applied 2 times: [1, 2]",
    ),
    "stale fence applied after a newer one": (
        lambda h: h["applies"].extend([
            {"apply_id": 2, "task_id": "t", "effect_key": "latest-1", "policy": "LATEST",
             "fence": 2},
            {"apply_id": 3, "task_id": "t", "effect_key": "latest-1", "policy": "LATEST",
             "fence": 1},
        ]),
        "effect-once: t apply 3 with fence 1 accepted after fence 2",
    ),
    "ledger failed but applied": (
        lambda h: h["effects"][0].update(state="failed", result="reconciled"),
        "effect-once: ledger says t/once-0 failed, but it was applied as [1]",
    ),
    "ledger names an apply that does not exist": (
        lambda h: h["effects"][0].update(result="apply-7"),
        "effect-once: ledger says t/once-0 succeeded as 'apply-7'",
    ),
    "a worker told another result": (
        lambda h: h["events"][5].update(result="apply-9"),
        "effect-once: worker w2 got 'apply-9' for t/once-0",
    ),
    "loss learnt late": (
        lambda h: h["events"][7].update(lost_t=15.0),
        "trust: worker w2 learnt of losing t/2 (LEASE_EXPIRED) 1.200 s after its trust deadline",
    ),
    "apply after the deadline": (
        lambda h: h["events"][2].update(t=12.0),
        "trust: worker w1 started an apply of t/1 1.100 s after its trust deadline",
    ),
    "checkpoint written after the lease expired": (
        lambda h: h["versions"][1].update(checkpoint_us=S),
        "checkpoint: t v1 by fence 1 at 1000000 but the lease was not live then "
        "(fence 1 held until 1000000)",
    ),
    "checkpoint written by a superseded fence": (
        lambda h: h["versions"].append(dict(h["versions"][3], checkpoint_version=2,
                                            checkpoint_fence=1, checkpoint_us=3 * S)),
        "checkpoint: t v2 by fence 1 at 3000000 stored in a held row of fence 2",
    ),
    "checkpoint written in a released row": (
        lambda h: h["versions"][2].update(checkpoint_version=2, checkpoint_us=2 * S,
                                          checkpoint_data=data(1, 2)),
        "checkpoint: t v2 by fence 1 at 2000000 stored in a released row of fence 1",
    ),
    "checkpoint version goes back": (
        lambda h: h["versions"].append(dict(h["versions"][3], checkpoint_version=1,
                                            checkpoint_fence=2, checkpoint_us=3 * S,
                                            checkpoint_data=data(2, 1))),
        "checkpoint: t v1 by fence 2 at 3000000 after v1: the version went back",
    ),
    "checkpoint cleared": (
        lambda h: h["versions"].append(dict(h["versions"][3], checkpoint_version=None,
                                            checkpoint_fence=None, checkpoint_us=None)),
        "checkpoint: t's checkpoint v1 was cleared",
    ),
    "checkpoint data of another fence": (
        lambda h: h["versions"][1].update(checkpoint_data=data(7, 1)),
        "checkpoint: t v1 by fence 1 at 500000 carries the data written by fence 7 as v1",
    ),
    "grant hands out an older checkpoint than the stored one": (
        lambda h: h["events"][4].update(cp_version=0),
        "checkpoint: grant t/2 to w2 handed v0, the database had v1 at the grant",
    ),
    "grants hand out checkpoints going back": (
        lambda h: (h["events"][0].update(cp_version=1), h["events"][4].update(cp_version=0)),
        "checkpoint: t's grant of fence 2 handed v0 after fence 1's grant handed v1",
    ),
    "grant hands out a checkpoint never stored": (
        lambda h: h["events"][4].update(cp_version=5),
        "checkpoint: grant t/2 to w2 handed t v5, which the database never stored",
    ),
    "GetLease reads other data": (
        lambda h: h["events"][9].update(cp_data=data(2, 1)),
        "checkpoint: GetLease read t v1 as (fence, instant, data) (1, 500000,",
    ),
    "acknowledged save never stored": (
        lambda h: h["events"][8].update(version=2, saved_version=2),
        "checkpoint: w1's save of t v2 by fence 1 acknowledged OK, but the database has no "
        "such write",
    ),
    "stale fence's save acknowledged": (
        lambda h: h["events"][8].update(fence=2, saved_fence=2),
        "checkpoint: w1's save of t v1 by fence 2 acknowledged OK, but the database has the "
        "write of fence 1",
    ),
    "acknowledged save lost": (
        lambda h: h["tasks"][0].update(checkpoint_version=None, checkpoint_fence=None),
        "checkpoint: w1's save of t v1 by fence 1 acknowledged OK is lost: t ends at v0",
    ),
    "save refused as not newer": (
        lambda h: h["events"].append({"ev": "checkpoint_not_newer", "w": "w2", "t": 13.5,
                                      "task": "t", "fence": 2, "version": 2, "current": 1,
                                      "via": "call"}),
        "checkpoint: w2's save of t v2 by fence 2 refused as not newer (stored v1)",
    ),
    "grant after a cancel": (
        lambda h: h["versions"].append(dict(h["versions"][-1], owner_id="b", fence=4,
                                            state="held", claim_us=17 * S, expire_us=18 * S)),
        "terminal: q cancelled at fence 3, then held at fence 4",
    ),
    "acknowledged cancel lost": (
        lambda h: h["tasks"][1].update(state="held"),
        "terminal: op's cancel of q acknowledged OK (answered CANCELLED), but the task ends held",
    ),
    "grant while quarantined": (
        lambda h: h["versions"].remove(h["versions"][7]),
        "attempts: q fence 3 granted while QUARANTINED (fence 2 quarantined, attempts 2 of 2)",
    ),
    "grant over an expiry that used up the last attempt": (
        lambda h: (h["versions"].remove(h["versions"][7]), h["versions"].remove(h["versions"][6])),
        "attempts: q fence 3 granted while QUARANTINED (fence 2 held, attempts 1 of 2)",
    ),
    "retry of a task not quarantined": (
        lambda h: h["versions"].insert(5, dict(h["versions"][4], state="retried",
                                               update_us=21 * S // 2)),
        "attempts: q retried at fence 1 while held",
    ),
    "grant beyond the attempt limit": (
        lambda h: h["versions"][8].update(attempts=2),
        "attempts: q fence 3 held as attempt 3 of 2",
    ),
    "quarantined above the limit": (
        lambda h: h["versions"][6].update(attempts=3),
        "attempts: q stored QUARANTINED after 3 attempts of 2",
    ),
    "GetLease answers quarantined above the limit": (
        lambda h: h["events"][11].update(attempts=3),
        "attempts: GetLease answered q QUARANTINED after 3 attempts of 2",
    ),
    "grant missing from the task history": (
        lambda h: h["task_history"].pop(3),
        "task-history: t grant (fence, owner, attempt) (2, 'b', 1) is not in the task's history",
    ),
    "checkpoint write missing from the task history": (
        lambda h: h["task_history"].pop(1),
        "task-history: t checkpoint (version, fence) (1, 1) is not in the task's history",
    ),
    "task history names a grant the database does not have": (
        lambda h: h["task_history"][6].update(owner_id="z"),
        "task-history: the task's history has q grant (fence, owner, attempt) (3, 'z', 1)",
    ),
    "task history entry at another instant": (
        lambda h: h["task_history"][1].update(event_us=S),
        "task-history: t checkpoint (version, fence) (1, 1) at 500000, its history entry at "
        "1000000",
    ),
}  # fmt: skip


def test_an_owner_superseding_its_own_lease_is_not_two_holders() -> None:
    history = mutated(lambda h: h["versions"][3].update(owner_id="a", claim_us=3 * S // 2))
    history["events"][4]["owner"] = "a"
    history["task_history"][3].update(owner_id="a", event_us=3 * S // 2)
    assert run(history) == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_violation_is_found(case: str) -> None:
    change, expected = CASES[case]
    violations = run(mutated(change))
    assert any(v.startswith(expected) for v in violations), violations


def test_late_loss_of_a_paused_worker_is_excused_and_counted() -> None:
    history = mutated(lambda h: h["events"][7].update(lost_t=15.0))
    history["faults"].append({"kind": "pause_worker", "target": "w2", "t": 13.5, "until": 14.9})
    verdict = check(**history)  # type: ignore[arg-type]
    assert verdict.violations == []
    assert verdict.counts["lost.late_after_pause"] == 1


def test_late_loss_of_a_starved_worker_is_excused_and_counted() -> None:
    history = mutated(lambda h: h["events"][7].update(lost_t=15.0))
    history["events"].append({"ev": "stall", "w": "w2", "t": 15.0, "since": 14.0, "stall_s": 0.9})
    verdict = check(**history)  # type: ignore[arg-type]
    assert verdict.violations == []
    assert verdict.counts["lost.late_after_stall"] == 1
    assert verdict.counts["stalls.max_ms"] == 900


def test_a_stall_of_another_worker_excuses_nothing() -> None:
    history = mutated(lambda h: h["events"][7].update(lost_t=15.0))
    history["events"].append({"ev": "stall", "w": "w1", "t": 15.0, "since": 14.0, "stall_s": 0.9})
    assert len(run(history)) == 1


def validate_during_cancel(sent_t: float) -> dict[str, list[dict[str, Any]]]:
    """q/3 answered valid at 15.7 s: after the Cancel's instant (15.5 s), before its expiry."""
    history = clean()
    history["events"].append(
        {"ev": "validate", "w": "w2", "t": 21.05, "sent_t": sent_t, "task": "q", "fence": 3,
         "valid": True, "db_now_us": 157 * S // 10}
    )  # fmt: skip
    return history


def test_validate_sent_before_the_cancel_was_acknowledged_is_excused_and_counted() -> None:
    verdict = check(**validate_during_cancel(sent_t=20.9))  # type: ignore[arg-type]
    assert verdict.violations == []
    assert verdict.counts["validate.concurrent_with_cancel"] == 1


def test_validate_sent_after_the_cancel_was_acknowledged_is_found() -> None:
    violations = run(validate_during_cancel(sent_t=21.01))
    assert violations == ["validate: q/3 valid at 15700000, outside its lease [15000000, 15500000)"]
