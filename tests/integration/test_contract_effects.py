"""The effect ledger at the wire: BeginEffect, CompleteEffect, ListEffects.

Rules under test: ``leasekeeper_server/core/effect_rules.py`` (the decision table) and
the RPC comments in the proto. Every call is made on a real server on a real
PostgreSQL; lease loss is produced with real claims, releases and a backdated
expire_time (the database clock decides).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.integration import contract_helpers as h
from tests.integration.effect_helpers import (
    ALREADY_APPLIED,
    FAILED,
    IN_DOUBT,
    LATEST,
    ONCE,
    PROCEED,
    RESERVED,
    SUCCEEDED,
    begin,
    complete,
    effect_rows,
    list_effects,
)

ABORTED = grpc.StatusCode.ABORTED
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


async def test_first_begin_proceeds_and_reserves_for_the_fence(stub, namespace):
    lease = await h.grant(stub, namespace, "t", "a")
    reply = await begin(stub, namespace, lease.fence, digest=b"sha")
    assert reply.decision == PROCEED
    effect = reply.effect
    assert (effect.namespace, effect.task_id, effect.effect_key) == (namespace, "t", "send")
    assert (effect.policy, effect.state, effect.fence, effect.attempts) == (ONCE, RESERVED, 1, 1)
    assert (effect.complete_fence, effect.request_digest) == (0, b"sha")
    assert effect.HasField("begin_time") and not effect.HasField("complete_time")


async def test_completed_effect_is_already_applied_with_its_result(stub, namespace):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1)
    done = await complete(stub, namespace, 1, result=b"vendor-id-7")
    assert (done.state, done.complete_fence, done.result) == (SUCCEEDED, 1, b"vendor-id-7")
    again = await begin(stub, namespace, 1)
    assert again.decision == ALREADY_APPLIED
    assert (again.effect.result, again.effect.attempts) == (b"vendor-id-7", 1)


async def test_begin_again_before_completion_is_in_doubt_even_for_the_same_fence(stub, namespace):
    """The caller cannot know whether its first attempt reached the outside system."""
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1)
    again = await begin(stub, namespace, 1)
    assert again.decision == IN_DOUBT
    assert (again.effect.fence, again.effect.state) == (1, RESERVED)


async def test_replacement_reconciles_an_in_doubt_attempt_and_the_old_fence_is_refused(
    stub, namespace, db
):
    await h.grant(stub, namespace, "t", "a")
    assert (await begin(stub, namespace, 1)).decision == PROCEED
    await h.backdate(db, namespace, "t")  # worker a paused past its ttl
    await h.grant(stub, namespace, "t", "b")

    doubt = await begin(stub, namespace, 2)
    assert doubt.decision == IN_DOUBT
    assert (doubt.effect.fence, doubt.effect.state) == (1, RESERVED)

    # b asked the outside system: the send happened. It records that.
    done = await complete(stub, namespace, 2, result=b"found-by-b")
    assert (done.state, done.fence, done.complete_fence) == (SUCCEEDED, 1, 2)
    # a wakes up and completes: refused, the record keeps b's outcome.
    await h.expect_error(complete(stub, namespace, 1, result=b"by-a"), ABORTED, "LEASE_SUPERSEDED")
    after = await begin(stub, namespace, 2)
    assert (after.decision, after.effect.result) == (ALREADY_APPLIED, b"found-by-b")


async def test_failed_retryable_allows_exactly_one_new_attempt(stub, namespace):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1)
    failed = await complete(stub, namespace, 1, outcome=FAILED, retryable=True, result=b"503")
    assert (failed.state, failed.retryable) == (FAILED, True)
    retry = await begin(stub, namespace, 1)
    assert retry.decision == PROCEED
    assert (retry.effect.attempts, retry.effect.state, retry.effect.result) == (2, RESERVED, b"")
    assert (await begin(stub, namespace, 1)).decision == IN_DOUBT


async def test_failed_for_good_is_a_confirmed_outcome(stub, namespace):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1)
    await complete(stub, namespace, 1, outcome=FAILED, retryable=False, result=b"card declined")
    again = await begin(stub, namespace, 1)
    assert again.decision == ALREADY_APPLIED
    assert (again.effect.state, again.effect.retryable) == (FAILED, False)
    assert again.effect.result == b"card declined"


async def test_once_outcome_stands_for_every_later_fence(stub, namespace, db):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1)
    await complete(stub, namespace, 1, result=b"first")
    await h.release(stub, namespace, "t", "a", 1)
    await h.grant(stub, namespace, "t", "b")
    later = await begin(stub, namespace, 2)
    assert (later.decision, later.effect.result, later.effect.fence) == (
        ALREADY_APPLIED,
        b"first",
        1,
    )


async def test_latest_newer_fence_supersedes_a_reservation_and_refuses_the_old_completion(
    stub, namespace, db
):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1, policy=LATEST, digest=b"draft-v1")
    await h.backdate(db, namespace, "t")
    await h.grant(stub, namespace, "t", "b")
    newer = await begin(stub, namespace, 2, policy=LATEST, digest=b"draft-v2")
    assert newer.decision == PROCEED
    assert (newer.effect.fence, newer.effect.attempts) == (2, 2)
    assert newer.effect.request_digest == b"draft-v2"
    await h.expect_error(complete(stub, namespace, 1), ABORTED, "LEASE_SUPERSEDED")
    done = await complete(stub, namespace, 2, result=b"v2")
    assert (done.state, done.fence, done.complete_fence) == (SUCCEEDED, 2, 2)


async def test_latest_newer_fence_redoes_a_succeeded_effect_the_same_fence_does_not(
    stub, namespace
):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1, policy=LATEST)
    await complete(stub, namespace, 1, result=b"v1")
    same = await begin(stub, namespace, 1, policy=LATEST)
    assert (same.decision, same.effect.result) == (ALREADY_APPLIED, b"v1")
    await h.release(stub, namespace, "t", "a", 1)
    await h.grant(stub, namespace, "t", "b")
    newer = await begin(stub, namespace, 2, policy=LATEST)
    assert (newer.decision, newer.effect.fence, newer.effect.result) == (PROCEED, 2, b"")


async def test_latest_outcome_reconciled_by_the_new_fence_is_already_applied_to_it(
    stub, namespace, db
):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1, policy=LATEST)
    await h.backdate(db, namespace, "t")
    await h.grant(stub, namespace, "t", "b")
    await complete(stub, namespace, 2, result=b"found")  # b reconciled a's attempt
    again = await begin(stub, namespace, 2, policy=LATEST)
    assert (again.decision, again.effect.attempts, again.effect.result) == (
        ALREADY_APPLIED,
        1,
        b"found",
    )


async def test_latest_same_fence_reservation_is_in_doubt(stub, namespace):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1, policy=LATEST)
    assert (await begin(stub, namespace, 1, policy=LATEST)).decision == IN_DOUBT


@pytest.mark.parametrize(
    ("policy", "digest", "field"),
    [(ONCE, b"d2", "request_digest"), (LATEST, b"d1", "policy"), (ONCE, b"", "request_digest")],
)
async def test_key_reused_for_another_effect_is_refused_and_changes_nothing(
    stub, namespace, db, policy, digest, field
):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1, policy=ONCE, digest=b"d1")
    before = await effect_rows(db, namespace)
    error = await h.failure(begin(stub, namespace, 1, policy=policy, digest=digest))
    info = h.error_info(error)
    assert (error.code(), info.reason) == (FAILED_PRECONDITION, "EFFECT_KEY_REUSED")
    assert (info.metadata["field"], info.metadata["recorded_fence"]) == (field, "1")
    assert await effect_rows(db, namespace) == before


async def test_latest_digest_may_change_only_with_a_newer_fence(stub, namespace):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1, policy=LATEST, digest=b"v1")
    await complete(stub, namespace, 1)
    await h.expect_error(
        begin(stub, namespace, 1, policy=LATEST, digest=b"v2"),
        FAILED_PRECONDITION,
        "EFFECT_KEY_REUSED",
    )


async def test_complete_is_idempotent_for_the_same_outcome_only(stub, namespace, db):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1)
    first = await complete(stub, namespace, 1, result=b"r")
    again = await complete(stub, namespace, 1, result=b"r")
    assert again == first
    before = await effect_rows(db, namespace)
    for outcome, retryable, result in [(SUCCEEDED, False, b"other"), (FAILED, True, b"r")]:
        error = await h.failure(
            complete(stub, namespace, 1, outcome=outcome, retryable=retryable, result=result)
        )
        info = h.error_info(error)
        assert (error.code(), info.reason) == (FAILED_PRECONDITION, "EFFECT_ALREADY_COMPLETED")
        assert (info.metadata["state"], info.metadata["complete_fence"]) == ("SUCCEEDED", "1")
    assert await effect_rows(db, namespace) == before


async def test_complete_without_begin_is_refused(stub, namespace, db):
    await h.grant(stub, namespace, "t", "a")
    await h.expect_error(complete(stub, namespace, 1), FAILED_PRECONDITION, "EFFECT_NOT_BEGUN")
    assert await effect_rows(db, namespace) == []


LOSSES = [
    (h.lost_by_expiry, "LEASE_EXPIRED"),
    (h.lost_to_newer_claim, "LEASE_SUPERSEDED"),
    (h.fence_above_issued, "FENCE_UNKNOWN"),
    (h.unknown_task, "FENCE_UNKNOWN"),
    (h.released, "LEASE_RELEASED"),
    (h.completed, "TASK_COMPLETED"),
    (h.revoked, "LEASE_REVOKED"),
    (h.superseded_then_completed, "TASK_COMPLETED"),
]


@pytest.mark.parametrize(("lose", "reason"), LOSSES, ids=[r for _, r in LOSSES])
async def test_begin_with_a_fence_that_may_not_act_is_aborted_and_reserves_nothing(
    stub, namespace, db, lose, reason
):
    _, fence = await lose(stub, namespace, db)
    error = await h.failure(begin(stub, namespace, fence))
    assert (error.code(), h.error_info(error).reason) == (ABORTED, reason)
    assert await effect_rows(db, namespace) == []


async def test_runtime_budget_spent_refuses_effects(stub, namespace, db):
    await h.grant(stub, namespace, "t", "a", ttl_s=5.0, max_runtime_s=5.0)
    await db.execute(
        "UPDATE leasekeeper_tasks SET expire_time = c.now, runtime_deadline = c.now"
        " FROM (SELECT clock_timestamp() AS now) c WHERE namespace = $1",
        namespace,
    )
    await h.expect_error(begin(stub, namespace, 1), ABORTED, "RUNTIME_EXCEEDED")


async def test_a_step_that_outlives_its_lease_cannot_complete_its_effect(stub, namespace, db):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1)
    await h.backdate(db, namespace, "t")  # the model call took longer than the ttl
    await h.expect_error(complete(stub, namespace, 1), ABORTED, "LEASE_EXPIRED")
    [effect] = await list_effects(stub, namespace)
    assert (effect.state, effect.fence) == (RESERVED, 1)  # left in doubt for the replacement


@pytest.mark.parametrize("cancel", ["complete", "revoke"])
async def test_cancelling_the_task_during_a_step_refuses_its_fence(stub, namespace, db, cancel):
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1, effect_key="first")
    if cancel == "complete":
        await h.release(stub, namespace, "t", "a", 1, complete=True)
        reason = "TASK_COMPLETED"
    else:
        await h.revoke_in_database(db, namespace, "t")
        reason = "LEASE_REVOKED"
    await h.expect_error(complete(stub, namespace, 1, effect_key="first"), ABORTED, reason)
    await h.expect_error(begin(stub, namespace, 1, effect_key="second"), ABORTED, reason)
    [effect] = await list_effects(stub, namespace)
    assert (effect.effect_key, effect.state) == ("first", RESERVED)


async def test_twenty_concurrent_begins_on_one_key_give_exactly_one_proceed(stub, namespace):
    await h.grant(stub, namespace, "t", "a")
    replies = await asyncio.gather(*(begin(stub, namespace, 1) for _ in range(20)))
    decisions = Counter(pb.EffectDecision.Name(r.decision) for r in replies)
    assert decisions == {"EFFECT_DECISION_PROCEED": 1, "EFFECT_DECISION_IN_DOUBT": 19}
    [effect] = await list_effects(stub, namespace)
    assert effect.attempts == 1


async def test_begins_racing_a_release_either_reserve_or_are_refused(stub, namespace, db):
    """Each begin is decided wholly before the release or wholly after it."""
    await h.grant(stub, namespace, "t", "a")
    calls = [begin(stub, namespace, 1, effect_key=f"k{i:02}") for i in range(20)]
    results = await asyncio.gather(
        *calls[:10], h.release(stub, namespace, "t", "a", 1), *calls[10:], return_exceptions=True
    )
    proceeded = [r for r in results if isinstance(r, pb.BeginEffectResponse)]
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(proceeded) + len(refused) == 20
    assert {h.error_info(r).reason for r in refused} <= {"LEASE_RELEASED"}
    assert all(r.decision == PROCEED for r in proceeded)
    assert len(await effect_rows(db, namespace)) == len(proceeded)


async def test_begin_waits_for_a_claim_in_flight_and_is_then_refused(stub, namespace, db, monitor):
    """A reservation is decided on the task row's newest version, after its lock."""
    await h.grant(stub, namespace, "t", "a")
    async with db.transaction():
        # A claim by another owner, not yet committed, holds the task row.
        await db.execute(
            "UPDATE leasekeeper_tasks SET fence = fence + 1, owner_id = 'b'"
            " WHERE namespace = $1 AND task_id = 't'",
            namespace,
        )
        pending = asyncio.create_task(begin(stub, namespace, 1))
        await h.wait_for_lock_waiters(monitor, 1)
        assert not pending.done(), "BeginEffect decided while the task row was locked"
    error = await h.failure(pending)
    assert (error.code(), h.error_info(error).reason) == (ABORTED, "LEASE_SUPERSEDED")
    assert await effect_rows(db, namespace) == []


async def test_begin_reads_the_clock_after_the_row_lock(stub, namespace, db, monitor):
    """A lease that expires while BeginEffect waits for the row is judged expired."""
    await h.grant(stub, namespace, "t", "a", ttl_s=0.3)
    async with db.transaction():
        await db.execute(
            "SELECT 1 FROM leasekeeper_tasks WHERE namespace = $1 FOR UPDATE", namespace
        )
        pending = asyncio.create_task(begin(stub, namespace, 1))
        await h.wait_for_lock_waiters(monitor, 1)
        await h.wait_past_expiry(db, namespace, "t")  # the lease ends while the call waits
        assert not pending.done()
    await h.expect_error(pending, ABORTED, "LEASE_EXPIRED")


@pytest.mark.parametrize("call", ["begin", "complete"])
async def test_a_lease_that_runs_out_while_waiting_for_the_effect_row_is_refused(
    stub, namespace, db, monitor, call
):
    """The answer is judged on the clock read after the effect's row is held, not before."""
    await h.grant(stub, namespace, "t", "a", ttl_s=0.4)
    await begin(stub, namespace, 1)
    if call == "begin":  # a retryable failure: the next begin would PROCEED
        await complete(stub, namespace, 1, outcome=FAILED, retryable=True)
    before = await effect_rows(db, namespace)
    async with db.transaction():
        await db.execute(
            "SELECT 1 FROM leasekeeper_effects WHERE namespace = $1 FOR UPDATE", namespace
        )
        pending = asyncio.create_task(
            begin(stub, namespace, 1) if call == "begin" else complete(stub, namespace, 1)
        )
        await h.wait_for_lock_waiters(monitor, 1)
        await h.wait_past_expiry(db, namespace, "t")  # the lease ends while the call waits
        assert not pending.done()
    await h.expect_error(pending, ABORTED, "LEASE_EXPIRED")
    assert await effect_rows(db, namespace) == before


async def test_list_effects_pages_filters_and_reports_each_attempt(stub, namespace):
    await h.grant(stub, namespace, "t", "a")
    for i in range(5):
        await begin(stub, namespace, 1, effect_key=f"k{i}")
    await complete(stub, namespace, 1, effect_key="k1")
    await complete(stub, namespace, 1, effect_key="k3", outcome=FAILED, retryable=True)
    every = await list_effects(stub, namespace, page_size=2)
    assert [e.effect_key for e in every] == ["k0", "k1", "k2", "k3", "k4"]
    reserved = await list_effects(stub, namespace, state=RESERVED)
    assert [e.effect_key for e in reserved] == ["k0", "k2", "k4"]
    failed = await list_effects(stub, namespace, state=FAILED)
    assert [(e.effect_key, e.retryable) for e in failed] == [("k3", True)]
    assert await list_effects(stub, namespace, task_id="never-claimed") == []


async def test_effect_metrics_count_each_outcome(stub, namespace, server, db):
    metrics = server.server.metrics
    before = {e: metrics.effects_count(e) for e in ("begun", "proceed", "in_doubt", "refused")}
    await h.grant(stub, namespace, "t", "a")
    await begin(stub, namespace, 1)  # proceed
    await begin(stub, namespace, 1)  # in doubt
    await complete(stub, namespace, 1)  # applied
    await begin(stub, namespace, 1)  # already applied
    await h.backdate(db, namespace, "t")
    await h.failure(begin(stub, namespace, 1))  # refused
    counts = {e: metrics.effects_count(e) - before[e] for e in before}
    assert counts == {"begun": 4, "proceed": 1, "in_doubt": 1, "refused": 1}
    assert metrics.effects_count("applied") >= 1
    assert metrics.effects_count("already_applied") >= 1
