"""The history checker finds each kind of violation in a hand-made history, and none in a clean one.

Without these, a checker that never reports anything would pass every seed of
``tests/fault/test_history.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.fault.history.checker import check

S = 1_000_000  # microseconds per second


def clean() -> dict[str, list[dict[str, Any]]]:
    """Task t: fence 1 (owner a) claimed at 0 s, renewed to 3 s, released at 2 s; fence 2 (b)."""
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
    assert verdict.counts["grants.database"] == 2
    assert verdict.counts["validate.valid"] == 1
    assert verdict.counts["stale_fences_refused"] == 1
    assert verdict.counts["lost.max_late_ms"] == 50


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
}  # fmt: skip


def test_an_owner_superseding_its_own_lease_is_not_two_holders() -> None:
    history = mutated(lambda h: h["versions"][3].update(owner_id="a", claim_us=3 * S // 2))
    history["events"][4]["owner"] = "a"
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
