"""The effect ledger's decision table (leasekeeper_server/core/effect_rules.py), rule by rule."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from leasekeeper_server.core.effect_rules import (
    BeginDecision,
    BeginRequest,
    Effect,
    EffectKey,
    EffectPolicy,
    EffectState,
    Outcome,
    check_complete,
    decide_begin,
)
from leasekeeper_server.core.errors import EffectAlreadyCompleted, EffectKeyReused, EffectNotBegun

ONCE, LATEST = EffectPolicy.ONCE, EffectPolicy.LATEST
RESERVED, SUCCEEDED, FAILED = EffectState.RESERVED, EffectState.SUCCEEDED, EffectState.FAILED
PROCEED = BeginDecision.PROCEED
APPLIED = BeginDecision.ALREADY_APPLIED
IN_DOUBT = BeginDecision.IN_DOUBT
KEY = EffectKey("ns", "t", "send")


def record(
    policy: EffectPolicy, state: EffectState, retryable: bool = False, fence: int = 1
) -> Effect:
    done = state is not RESERVED
    return Effect(
        *(KEY.namespace, KEY.task_id, KEY.effect_key),
        policy=policy,
        request_digest=b"d",
        state=state,
        fence=fence,
        complete_fence=fence if done else None,
        retryable=retryable,
        result=b"r" if done else b"",
        attempts=1,
        begin_time=datetime(2026, 1, 1, tzinfo=UTC),
        complete_time=datetime(2026, 1, 1, tzinfo=UTC) if done else None,
    )


# (policy, state, retryable, caller's fence (record's is 1), decision)
TABLE = [
    (ONCE, FAILED, True, 1, PROCEED),
    (ONCE, FAILED, True, 2, PROCEED),
    (ONCE, SUCCEEDED, False, 1, APPLIED),
    (ONCE, SUCCEEDED, False, 2, APPLIED),
    (ONCE, FAILED, False, 1, APPLIED),
    (ONCE, FAILED, False, 2, APPLIED),
    (ONCE, RESERVED, False, 1, IN_DOUBT),
    (ONCE, RESERVED, False, 2, IN_DOUBT),
    (LATEST, FAILED, True, 1, PROCEED),
    (LATEST, FAILED, True, 2, PROCEED),
    (LATEST, SUCCEEDED, False, 1, APPLIED),
    (LATEST, SUCCEEDED, False, 2, PROCEED),
    (LATEST, FAILED, False, 1, APPLIED),
    (LATEST, FAILED, False, 2, PROCEED),
    (LATEST, RESERVED, False, 1, IN_DOUBT),
    (LATEST, RESERVED, False, 2, PROCEED),
]


@pytest.mark.parametrize(("policy", "state", "retryable", "fence", "decision"), TABLE)
def test_begin_decision_table(policy, state, retryable, fence, decision):
    request = BeginRequest(KEY, fence, policy, b"d")
    assert decide_begin(record(policy, state, retryable), request) is decision


@pytest.mark.parametrize("fence", [1, 2])
def test_begin_with_another_policy_is_key_reuse(fence):
    with pytest.raises(EffectKeyReused) as caught:
        decide_begin(record(ONCE, SUCCEEDED), BeginRequest(KEY, fence, LATEST, b"d"))
    assert caught.value.field == "policy"


@pytest.mark.parametrize(
    ("policy", "fence", "reused"),
    [(ONCE, 1, True), (ONCE, 2, True), (LATEST, 1, True), (LATEST, 2, False)],
)
def test_digest_may_change_only_when_a_newer_fence_supersedes_latest(policy, fence, reused):
    request = BeginRequest(KEY, fence, policy, b"other")
    if reused:
        with pytest.raises(EffectKeyReused):
            decide_begin(record(policy, SUCCEEDED), request)
    else:
        assert decide_begin(record(policy, SUCCEEDED), request) is PROCEED


def test_latest_outcome_recorded_by_the_callers_own_fence_is_already_applied():
    """A replacement (fence 2) that reconciled fence 1's attempt wrote the outcome itself."""
    reconciled = dataclasses.replace(record(LATEST, SUCCEEDED), complete_fence=2)
    assert decide_begin(reconciled, BeginRequest(KEY, 2, LATEST, b"d")) is APPLIED
    with pytest.raises(EffectKeyReused):
        decide_begin(reconciled, BeginRequest(KEY, 2, LATEST, b"other"))
    assert decide_begin(reconciled, BeginRequest(KEY, 3, LATEST, b"other")) is PROCEED


def test_complete_writes_over_a_reservation_only():
    outcome = Outcome(SUCCEEDED, False, b"r")
    assert check_complete(record(ONCE, RESERVED), outcome) is True
    assert check_complete(record(ONCE, SUCCEEDED), outcome) is False  # same values: idempotent
    with pytest.raises(EffectAlreadyCompleted):
        check_complete(record(ONCE, SUCCEEDED), Outcome(SUCCEEDED, False, b"other"))
    with pytest.raises(EffectAlreadyCompleted):
        check_complete(record(ONCE, FAILED, retryable=True), outcome)
    with pytest.raises(EffectNotBegun):
        check_complete(None, outcome)
