"""The HA tier's accounting finds each kind of loss and reuse in hand-made histories."""

from __future__ import annotations

from typing import Any

from tests.ha.accounting import account, timeline_of

FLOOR_2 = 2**40 + 1


def version(task: str, fence: int, owner: str, state: str = "held", **extra: Any) -> dict[str, Any]:
    return {"task_id": task, "fence": fence, "owner_id": owner, "state": state, **extra}


def grant(task: str, fence: int, owner: str) -> dict[str, Any]:
    return {"ev": "grant", "task": task, "fence": fence, "owner": owner}


def test_timeline_of_follows_the_floor() -> None:
    assert [timeline_of(f) for f in (1, 2**40, FLOOR_2, 2 * 2**40 + 1)] == [1, 1, 2, 3]


def test_a_history_the_database_kept_whole_loses_nothing() -> None:
    events = [
        grant("a", 1, "w1"),
        grant("a", 1, "w1"),  # the same grant answered twice (a retried claim): one grant
        {"ev": "checkpoint_saved", "task": "a", "fence": 1, "saved_version": 3},
        {"ev": "effect", "task": "a", "fence": 1, "key": "k", "policy": "ONCE", "result": "r"},
        {"ev": "effect", "task": "a", "fence": 1, "key": "l", "policy": "LATEST", "result": "x"},
        {"ev": "applied", "task": "a", "fence": 1, "apply_id": 7},
        {"ev": "completed", "task": "a", "fence": 1},
    ]
    versions = [
        version("a", 1, "w1"),
        version("a", 1, "w1", checkpoint_version=3, checkpoint_fence=1),
        version("a", 1, "w1", "completed", checkpoint_version=3, checkpoint_fence=1),
    ]
    effects = [
        {"task_id": "a", "effect_key": "k", "state": "succeeded", "fence": 1, "complete_fence": 1,
         "result": "r"},
        # A LATEST effect a later fence has begun since (reserved, in doubt): not lost.
        {"task_id": "a", "effect_key": "l", "state": "reserved", "fence": 2,
         "complete_fence": None, "result": ""},
    ]  # fmt: skip
    acc = account(events, versions, effects, [{"apply_id": 7}])
    assert acc.counts() == {
        "grants": 1, "grants_lost": 0, "releases": 1, "releases_lost": 0,
        "checkpoints": 1, "checkpoints_lost": 0, "effects": 2, "effects_lost": 0,
        "applies": 1, "applies_lost": 0, "fences_reused": 0,
    }  # fmt: skip
    assert (acc.lost, acc.findings) == (0, [])


def test_each_acknowledged_write_the_database_lacks_is_lost() -> None:
    events = [
        grant("a", 1, "w1"),
        grant("b", 2, "w2"),
        {"ev": "released_ok", "task": "a", "fence": 1},
        {"ev": "cancel", "task": "a", "fence": 1},
        {"ev": "checkpoint_saved", "task": "a", "fence": 1, "saved_version": 4},
        {"ev": "effect", "task": "a", "fence": 1, "key": "k", "policy": "ONCE", "result": "r1"},
        {"ev": "effect", "task": "a", "fence": 3, "key": "l", "policy": "LATEST", "result": "x"},
        {"ev": "effect", "task": "a", "fence": 1, "key": "gone", "policy": "LATEST", "result": "x"},
        {"ev": "applied", "task": "a", "fence": 1, "apply_id": 8},
    ]
    versions = [version("a", 1, "w1", checkpoint_version=3, checkpoint_fence=1)]
    effects = [
        # Another result than the one the worker was given.
        {"task_id": "a", "effect_key": "k", "state": "succeeded", "fence": 1,
         "complete_fence": 1, "result": "r2"},
        # Completed under an older fence than the one acknowledged.
        {"task_id": "a", "effect_key": "l", "state": "succeeded", "fence": 2,
         "complete_fence": 2, "result": "x"},
    ]  # fmt: skip
    acc = account(events, versions, effects, [{"apply_id": 7}])
    assert (acc.grants_lost, acc.releases_lost, acc.checkpoints_lost) == (1, 2, 1)
    assert (acc.effects_lost, acc.applies_lost, acc.fences_reused) == (3, 1, 0)
    assert acc.lost == 8 and len(acc.findings) == 8
    assert acc.lost_grants == [("b", 2, "w2")]


def test_a_fence_given_to_two_owners_is_reused_not_lost() -> None:
    # Acknowledged to w1, the database gives it to w2 (a lost grant reissued).
    acc = account([grant("a", 5, "w1")], [version("a", 5, "w2")])
    assert (acc.grants_lost, acc.fences_reused) == (0, 1)
    # Acknowledged to two owners.
    acc = account([grant("a", 5, "w1"), grant("a", 5, "w2")], [version("a", 5, "w1")])
    assert acc.fences_reused == 2  # w2's grant is not the database's, and 5 went to two owners
    # Two owners of one fence in the database's own versions.
    acc = account([], [version("a", 5, "w1"), version("a", 5, "w2")])
    assert acc.fences_reused == 1


def test_accountings_add_up() -> None:
    one = account([grant("a", 1, "w1")], [])
    two = account([grant("b", 1, "w1")], [version("b", 1, "w1")])
    total = one + two
    assert (total.grants, total.grants_lost, total.lost_grants) == (2, 1, [("a", 1, "w1")])
