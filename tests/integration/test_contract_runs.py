"""Runs that survive their workers, on the real server: checkpoints, attempts, cancel, history.

Each test states one rule of the proto (SaveCheckpoint, Claim's checkpoint,
max_attempts and QUARANTINED, Cancel, Retry, Release with fail,
CompleteEffect's next_checkpoint, ListTaskHistory) and checks it through
gRPC against PostgreSQL. Expiry is made real by backdating a lease on the
database clock (``backdate``), never by sleeping.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.helpers import bad_request_fields, error_info
from tests.integration.contract_helpers import (
    backdate,
    expect_error,
    failure,
    get_lease,
    grant,
    heartbeat_on,
    release,
    row,
    validate,
    wait_for_state,
)

ABORTED = grpc.StatusCode.ABORTED
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT


def save(stub, lease: pb.Lease, version: int, data: bytes = b"state", content_type: str = ""):
    return stub.SaveCheckpoint(
        pb.SaveCheckpointRequest(
            namespace=lease.namespace,
            task_id=lease.task_id,
            owner_id=lease.owner_id,
            fence=lease.fence,
            checkpoint=pb.Checkpoint(version=version, data=data, content_type=content_type),
        )
    )


def cancel(stub, namespace: str, task_id: str, reason: str = "operator stops it"):
    return stub.Cancel(pb.CancelRequest(namespace=namespace, task_id=task_id, reason=reason))


def retry(stub, namespace: str, task_id: str, reason: str = "fixed the input"):
    return stub.Retry(pb.RetryRequest(namespace=namespace, task_id=task_id, reason=reason))


async def history(stub, namespace: str, task_id: str) -> list[pb.HistoryEntry]:
    entries: list[pb.HistoryEntry] = []
    token = ""
    while True:
        reply = await stub.ListTaskHistory(
            pb.ListTaskHistoryRequest(
                namespace=namespace, task_id=task_id, page_size=3, page_token=token
            )
        )
        entries.extend(reply.entries)
        token = reply.next_page_token
        if not token:
            return entries


def kinds(entries: list[pb.HistoryEntry]) -> list[str]:
    return [pb.HistoryKind.Name(e.kind).removeprefix("HISTORY_KIND_") for e in entries]


# --- checkpoints -------------------------------------------------------------------------


async def test_checkpoint_saved_by_the_owner_comes_back_with_the_next_grant(stub, namespace, db):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    first = await save(stub, a, 1, b"step-1", "application/json")
    assert (first.checkpoint.version, first.checkpoint.fence) == (1, a.fence)
    assert first.lease.checkpoint_version == 1 and first.lease.checkpoint_size == len(b"step-1")
    await save(stub, a, 2, b"step-2", "application/json")

    await backdate(db, namespace, "t")  # worker a is gone: its lease expires
    reply = await stub.Claim(pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="b"))
    assert reply.acquired and reply.lease.fence == a.fence + 1
    got = reply.checkpoint
    assert (got.version, got.data, got.content_type, got.fence) == (
        2,
        b"step-2",
        "application/json",
        a.fence,
    )
    assert got.write_time.ToDatetime() <= reply.lease.claim_time.ToDatetime()

    inspected = await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id="t"))
    assert inspected.checkpoint == got


async def test_checkpoint_version_must_move_forward_and_nothing_is_stored(stub, namespace, db):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await save(stub, a, 5, b"five")
    for version in (5, 4):
        exc = await failure(save(stub, a, version, b"other"))
        assert exc.code() == FAILED_PRECONDITION
        info = error_info(exc)
        assert (info.reason, info.metadata["current_version"]) == ("CHECKPOINT_NOT_NEWER", "5")
    stored = await row(db, namespace, "t")
    assert (stored["checkpoint_version"], bytes(stored["checkpoint_data"])) == (5, b"five")


async def test_checkpoint_rewritten_alike_by_its_fence_is_idempotent(stub, namespace):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    first = await save(stub, a, 1, b"same", "text/plain")
    again = await save(stub, a, 1, b"same", "text/plain")  # a retry whose reply was lost
    assert again.checkpoint.version == 1
    assert again.checkpoint.write_time == first.checkpoint.write_time


async def test_checkpoint_from_a_stale_fence_is_refused_with_its_loss(stub, namespace, db):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await save(stub, a, 1, b"a-1")
    await backdate(db, namespace, "t")
    await expect_error(save(stub, a, 2, b"a-2"), ABORTED, "LEASE_EXPIRED")
    b = await grant(stub, namespace, "t", "b", ttl_s=30.0)
    # worker a wakes from a pause and replays its write: the newer fence stands
    await expect_error(save(stub, a, 3, b"a-3"), ABORTED, "LEASE_SUPERSEDED")
    not_owner = pb.Lease(namespace=namespace, task_id="t", owner_id="a", fence=b.fence)
    await expect_error(save(stub, not_owner, 3, b"x"), ABORTED, "NOT_OWNER")
    stored = await row(db, namespace, "t")
    assert (stored["checkpoint_version"], stored["checkpoint_fence"]) == (1, a.fence)


async def test_checkpoint_bad_input_names_the_field_and_changes_nothing(stub, namespace, db):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    cases = [
        (pb.Checkpoint(version=0, data=b"x"), "checkpoint.version"),
        (pb.Checkpoint(version=1, data=b"x" * (256 * 1024 + 1)), "checkpoint.data"),
        (pb.Checkpoint(version=1, content_type="text/\u00e9"), "checkpoint.content_type"),
    ]
    for checkpoint, field in cases:
        call = stub.SaveCheckpoint(
            pb.SaveCheckpointRequest(
                namespace=namespace, task_id="t", owner_id="a", fence=a.fence, checkpoint=checkpoint
            )
        )
        exc = await failure(call)
        assert exc.code() == INVALID_ARGUMENT and bad_request_fields(exc) == [field]
    assert (await row(db, namespace, "t"))["checkpoint_version"] is None


async def test_checkpoint_at_the_cap_is_stored(stub, namespace):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    reply = await save(stub, a, 1, b"x" * (256 * 1024))
    assert reply.lease.checkpoint_size == 256 * 1024


async def test_heartbeat_carries_a_checkpoint_and_says_what_is_stored(stub, namespace, db):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    call, first = await heartbeat_on(stub, a)
    assert first.checkpoint_version == 0
    await call.write(pb.HeartbeatRequest(checkpoint=pb.Checkpoint(version=3, data=b"three")))
    saved = await call.read()
    assert (saved.checkpoint_version, saved.renewed) == (3, True)
    # a version that does not move forward is not stored and does not end the stream
    await call.write(pb.HeartbeatRequest(checkpoint=pb.Checkpoint(version=2, data=b"two")))
    refused = await call.read()
    assert refused.checkpoint_version == 3
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert bytes((await row(db, namespace, "t"))["checkpoint_data"]) == b"three"


@pytest.mark.parametrize("ending", ["release", "expiry", "revoke", "complete", "cancel"])
async def test_checkpoint_survives_every_ending(stub, namespace, db, ending):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await save(stub, a, 7, b"seven")
    match ending:
        case "release":
            await release(stub, namespace, "t", "a", a.fence)
        case "expiry":
            await backdate(db, namespace, "t")
        case "revoke":
            await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id="t", reason="r"))
        case "complete":
            await release(stub, namespace, "t", "a", a.fence, complete=True)
        case "cancel":
            await cancel(stub, namespace, "t")
    inspected = await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id="t"))
    assert (inspected.checkpoint.version, inspected.checkpoint.data) == (7, b"seven")


async def test_complete_effect_with_next_checkpoint_stores_both(stub, namespace):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await save(stub, a, 1)
    await stub.BeginEffect(
        pb.BeginEffectRequest(
            namespace=namespace,
            task_id="t",
            fence=a.fence,
            effect_key="charge",
            policy=pb.EFFECT_POLICY_ONCE,
        )
    )
    request = pb.CompleteEffectRequest(
        namespace=namespace,
        task_id="t",
        fence=a.fence,
        effect_key="charge",
        outcome=pb.EFFECT_STATE_SUCCEEDED,
        result=b"ok",
        external_operation_id="pay_123",
        next_checkpoint=pb.Checkpoint(version=2, data=b"charged"),
    )
    reply = await stub.CompleteEffect(request)
    assert reply.effect.external_operation_id == "pay_123"
    assert (reply.checkpoint.version, reply.checkpoint.fence) == (2, a.fence)
    again = await stub.CompleteEffect(request)  # a retry after UNAVAILABLE answers OK
    assert again.effect == reply.effect
    inspected = await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id="t"))
    assert inspected.checkpoint.data == b"charged"


async def test_complete_effect_with_a_stale_checkpoint_records_neither(stub, namespace):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await save(stub, a, 5)
    await stub.BeginEffect(
        pb.BeginEffectRequest(
            namespace=namespace,
            task_id="t",
            fence=a.fence,
            effect_key="email",
            policy=pb.EFFECT_POLICY_ONCE,
        )
    )
    call = stub.CompleteEffect(
        pb.CompleteEffectRequest(
            namespace=namespace,
            task_id="t",
            fence=a.fence,
            effect_key="email",
            outcome=pb.EFFECT_STATE_SUCCEEDED,
            next_checkpoint=pb.Checkpoint(version=5, data=b"not newer"),
        )
    )
    await expect_error(call, FAILED_PRECONDITION, "CHECKPOINT_NOT_NEWER")
    effects = await stub.ListEffects(pb.ListEffectsRequest(namespace=namespace, task_id="t"))
    assert [e.state for e in effects.effects] == [pb.EFFECT_STATE_RESERVED]


# --- attempts and quarantine -------------------------------------------------------------


async def test_attempts_count_expiries_and_revokes_not_releases(stub, namespace, db):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await release(stub, namespace, "t", "a", a.fence)
    b = await grant(stub, namespace, "t", "b", ttl_s=30.0)
    assert b.attempts == 0
    await backdate(db, namespace, "t")
    assert (await get_lease(stub, namespace, "t")).attempts == 1  # counted when read
    c = await grant(stub, namespace, "t", "c", ttl_s=30.0)
    assert c.attempts == 1
    revoked = await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id="t", reason="r"))
    assert revoked.lease.attempts == 2


async def test_max_attempts_quarantines_the_task_until_an_operator_retries(stub, namespace, db):
    request = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", max_attempts=2)
    first = await stub.Claim(request)
    assert first.lease.max_attempts == 2
    await backdate(db, namespace, "t")
    second = await stub.Claim(request)
    assert second.acquired and second.lease.attempts == 1
    await backdate(db, namespace, "t")  # the second attempt ends: attempts reach 2

    lease = await get_lease(stub, namespace, "t")
    assert (lease.state, lease.attempts) == (pb.TASK_STATE_QUARANTINED, 2)
    await expect_error(stub.Claim(request), FAILED_PRECONDITION, "TASK_QUARANTINED")
    # the sweeper stores the quarantine too, and it stays
    stored = await wait_for_row_state(db, namespace, "t", "quarantined")
    assert stored["attempts"] == 2

    back = await retry(stub, namespace, "t")
    assert (back.lease.state, back.lease.attempts) == (pb.TASK_STATE_FREE, 0)
    again = await stub.Claim(request)
    assert again.acquired and again.lease.fence == second.lease.fence + 1


async def test_revoke_of_the_last_attempt_quarantines(stub, namespace):
    request = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", max_attempts=1)
    await stub.Claim(request)
    reply = await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id="t", reason="r"))
    assert reply.revoked and reply.lease.state == pb.TASK_STATE_QUARANTINED
    await expect_error(stub.Claim(request), FAILED_PRECONDITION, "TASK_QUARANTINED")


async def test_retry_of_a_task_not_quarantined_is_refused(stub, namespace):
    await grant(stub, namespace, "t", "a", ttl_s=30.0)
    exc = await failure(retry(stub, namespace, "t"))
    assert exc.code() == FAILED_PRECONDITION
    info = error_info(exc)
    assert (info.reason, info.metadata["state"]) == ("TASK_NOT_QUARANTINED", "HELD")
    await expect_error(retry(stub, namespace, "never"), grpc.StatusCode.NOT_FOUND, "TASK_NOT_FOUND")


async def test_max_attempts_out_of_bounds_is_invalid(stub, namespace):
    exc = await failure(
        stub.Claim(pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", max_attempts=-1))
    )
    assert exc.code() == INVALID_ARGUMENT and bad_request_fields(exc) == ["max_attempts"]


# --- cancellation and the failed disposition ---------------------------------------------


async def test_cancel_ends_the_heartbeat_and_refuses_every_fence(stub, namespace):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    call, _ = await heartbeat_on(stub, a)
    reply = await cancel(stub, namespace, "t", "customer withdrew")
    assert (reply.lease.state, reply.lease.cancel_reason) == (
        pb.TASK_STATE_CANCELLED,
        "customer withdrew",
    )
    exc = await asyncio.wait_for(failure(call.read()), 10)
    assert (exc.code(), error_info(exc).reason) == (ABORTED, "TASK_CANCELLED")

    answer = await validate(stub, namespace, "t", a.fence)
    assert (answer.valid, answer.reason) == (False, pb.LOSS_REASON_TASK_CANCELLED)
    await expect_error(save(stub, a, 1), ABORTED, "TASK_CANCELLED")
    begin = stub.BeginEffect(
        pb.BeginEffectRequest(
            namespace=namespace, task_id="t", fence=a.fence, effect_key="e",
            policy=pb.EFFECT_POLICY_ONCE,
        )
    )  # fmt: skip
    await expect_error(begin, ABORTED, "TASK_CANCELLED")
    claim = stub.Claim(pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="b"))
    await expect_error(claim, FAILED_PRECONDITION, "TASK_CANCELLED")
    again = await cancel(stub, namespace, "t", "twice")  # idempotent: the first reason stays
    assert again.lease.cancel_reason == "customer withdrew"


async def test_cancel_of_an_ended_or_unknown_task_is_refused(stub, namespace):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await release(stub, namespace, "t", "a", a.fence, complete=True)
    await expect_error(cancel(stub, namespace, "t"), FAILED_PRECONDITION, "TASK_COMPLETED")
    await expect_error(cancel(stub, namespace, "nope"), grpc.StatusCode.NOT_FOUND, "TASK_NOT_FOUND")


async def test_release_with_fail_ends_the_run_as_failed(stub, namespace):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    reply = await stub.Release(
        pb.ReleaseRequest(
            namespace=namespace, task_id="t", owner_id="a", fence=a.fence, fail=True,
            fail_reason="input is malformed",
        )
    )  # fmt: skip
    assert (reply.lease.state, reply.lease.fail_reason) == (
        pb.TASK_STATE_FAILED,
        "input is malformed",
    )
    claim = stub.Claim(pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="b"))
    await expect_error(claim, FAILED_PRECONDITION, "TASK_FAILED")
    both = stub.Release(
        pb.ReleaseRequest(
            namespace=namespace, task_id="t", owner_id="a", fence=a.fence, fail=True, complete=True
        )
    )
    exc = await failure(both)
    assert exc.code() == INVALID_ARGUMENT and bad_request_fields(exc) == ["fail"]


# --- the task's history ------------------------------------------------------------------


async def test_history_tells_the_run_from_grant_to_end(stub, namespace, db):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await save(stub, a, 1, b"one")
    await backdate(db, namespace, "t")
    b = await grant(stub, namespace, "t", "b", ttl_s=30.0)
    stale = await validate(stub, namespace, "t", a.fence)
    assert not stale.valid
    await stub.BeginEffect(
        pb.BeginEffectRequest(
            namespace=namespace, task_id="t", fence=b.fence, effect_key="mail",
            policy=pb.EFFECT_POLICY_ONCE,
        )
    )  # fmt: skip
    await stub.CompleteEffect(
        pb.CompleteEffectRequest(
            namespace=namespace, task_id="t", fence=b.fence, effect_key="mail",
            outcome=pb.EFFECT_STATE_SUCCEEDED, external_operation_id="msg-9",
        )
    )  # fmt: skip
    await release(stub, namespace, "t", "b", b.fence, complete=True)

    entries = await history(stub, namespace, "t")
    assert kinds(entries) == [
        "GRANTED",
        "CHECKPOINT_SAVED",
        "EXPIRED",
        "GRANTED",
        "FENCE_REFUSED",
        "EFFECT_RESERVED",
        "EFFECT_COMPLETED",
        "COMPLETED",
    ]
    granted_a, saved, expired, granted_b, refused, _reserved, completed, _done = entries
    assert (granted_a.fence, granted_a.owner_id, granted_a.attempt) == (a.fence, "a", 1)
    assert (saved.checkpoint_version, saved.checkpoint_size, saved.fence) == (1, 3, a.fence)
    assert (expired.fence, expired.reason) == (a.fence, "LEASE_EXPIRED")
    assert (granted_b.fence, granted_b.attempt) == (b.fence, 2)
    assert (refused.fence, refused.reason, refused.method) == (
        a.fence,
        "LEASE_SUPERSEDED",
        "ValidateFence",
    )
    assert (completed.effect_key, completed.effect_outcome, completed.external_operation_id) == (
        "mail",
        pb.EFFECT_STATE_SUCCEEDED,
        "msg-9",
    )
    times = [e.event_time.ToDatetime() for e in entries]
    assert [e.sequence for e in entries] == sorted(e.sequence for e in entries)
    assert times[0] <= times[1]


async def test_history_of_a_stale_begin_effect_records_the_refusal(stub, namespace, db):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await backdate(db, namespace, "t")
    begin = stub.BeginEffect(
        pb.BeginEffectRequest(
            namespace=namespace, task_id="t", fence=a.fence, effect_key="e",
            policy=pb.EFFECT_POLICY_ONCE,
        )
    )  # fmt: skip
    await expect_error(begin, ABORTED, "LEASE_EXPIRED")
    entries = await history(stub, namespace, "t")
    refused = [e for e in entries if e.kind == pb.HISTORY_KIND_FENCE_REFUSED]
    assert [(e.fence, e.reason, e.method) for e in refused] == [
        (a.fence, "LEASE_EXPIRED", "BeginEffect")
    ]


async def test_history_of_quarantine_retry_and_cancel(stub, namespace):
    request = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", max_attempts=1)
    await stub.Claim(request)
    await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id="t", reason="stuck"))
    await retry(stub, namespace, "t", "input fixed")
    await stub.Claim(request)
    await cancel(stub, namespace, "t", "no longer wanted")
    entries = await history(stub, namespace, "t")
    assert kinds(entries) == [
        "GRANTED",
        "REVOKED",
        "QUARANTINED",
        "RETRIED",
        "GRANTED",
        "CANCELLED",
    ]
    assert [e.reason for e in entries] == [
        "",
        "stuck",
        "LEASE_REVOKED",
        "input fixed",
        "",
        "no longer wanted",
    ]
    assert entries[2].attempt == 1 and entries[4].attempt == 1


async def test_history_page_token_is_bound_to_its_task(stub, namespace):
    for owner in ("a", "b", "c"):
        lease = await grant(stub, namespace, "t", owner, ttl_s=30.0)
        await release(stub, namespace, "t", owner, lease.fence)
    page = await stub.ListTaskHistory(
        pb.ListTaskHistoryRequest(namespace=namespace, task_id="t", page_size=2)
    )
    assert len(page.entries) == 2 and page.next_page_token
    other = stub.ListTaskHistory(
        pb.ListTaskHistoryRequest(namespace=namespace, task_id="u", page_token=page.next_page_token)
    )
    exc = await failure(other)
    assert exc.code() == INVALID_ARGUMENT and bad_request_fields(exc) == ["page_token"]


async def wait_for_row_state(db, namespace: str, task_id: str, state: str):
    """Polls the task's row until its stored state is ``state`` (the sweeper's work)."""
    from tests.helpers import poll

    async def stored():
        found = await row(db, namespace, task_id)
        return found if found["state"] == state else None

    return await poll(stored, f"row state {state}", within_s=10.0)


async def test_expiry_announced_on_wait_for_state(stub, namespace, db):
    """QUARANTINED by the sweeper is seen by GetLease as the same state (no flip back)."""
    request = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", max_attempts=1)
    await stub.Claim(request)
    await backdate(db, namespace, "t")
    await wait_for_row_state(db, namespace, "t", "quarantined")
    lease = await wait_for_state(stub, namespace, "t", pb.TASK_STATE_QUARANTINED)
    assert (lease.attempts, lease.end_reason) == (1, pb.LOSS_REASON_LEASE_EXPIRED)


async def test_an_expired_lease_that_used_up_the_last_attempt_stays_quarantined(
    stub, namespace, db
):
    """Whether or not the sweeper has stored the quarantine yet: no release or revoke frees it."""
    request = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", max_attempts=1)
    granted = (await stub.Claim(request)).lease
    await db.execute(  # expired on the database clock; the sweeper may or may not come first
        "UPDATE leasekeeper_tasks SET expire_time = clock_timestamp() - interval '1 second',"
        " expiry_announced_fence = NULL WHERE namespace = $1 AND task_id = 't'",
        namespace,
    )
    done = release(stub, namespace, "t", "a", granted.fence, complete=True)
    await expect_error(done, ABORTED, "LEASE_EXPIRED")
    revoked = await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id="t", reason="r"))
    assert (revoked.revoked, revoked.lease.state) == (False, pb.TASK_STATE_QUARANTINED)
    assert (await get_lease(stub, namespace, "t")).state == pb.TASK_STATE_QUARANTINED


async def test_heartbeat_says_whether_its_own_checkpoint_is_the_stored_one(stub, namespace, db):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await save(stub, a, 5, b"Y")
    call, _ = await heartbeat_on(stub, a)
    await call.write(pb.HeartbeatRequest(checkpoint=pb.Checkpoint(version=5, data=b"X")))
    other = await call.read()  # the same version, other data: not this beat's checkpoint
    assert (other.checkpoint_version, other.checkpoint_saved) == (5, False)
    await call.write(pb.HeartbeatRequest(checkpoint=pb.Checkpoint(version=5, data=b"Y")))
    resent = await call.read()  # the stored one, resent by its fence
    assert (resent.checkpoint_version, resent.checkpoint_saved) == (5, True)
    await call.write(pb.HeartbeatRequest(checkpoint=pb.Checkpoint(version=6, data=b"Z")))
    saved = await call.read()
    assert (saved.checkpoint_version, saved.checkpoint_saved) == (6, True)
    await call.write(pb.HeartbeatRequest())
    plain = await call.read()
    assert plain.checkpoint_saved is False
    await call.done_writing()
    assert bytes((await row(db, namespace, "t"))["checkpoint_data"]) == b"Z"


async def test_a_refused_fence_is_one_history_entry_and_an_unknown_one_none(stub, namespace, db):
    a = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await release(stub, namespace, "t", "a", a.fence)
    b = await grant(stub, namespace, "t", "b", ttl_s=30.0)
    for _ in range(5):  # the same stale fence, asked again and again
        assert not (await validate(stub, namespace, "t", a.fence)).valid
    assert not (await validate(stub, namespace, "t", b.fence + 1000)).valid  # never issued
    entries = await history(stub, namespace, "t")
    refused = [e for e in entries if e.kind == pb.HISTORY_KIND_FENCE_REFUSED]
    assert [(e.fence, e.reason, e.method) for e in refused] == [
        (a.fence, "LEASE_SUPERSEDED", "ValidateFence")
    ]


async def test_retried_complete_effects_with_checkpoints_never_wait_for_the_pool(
    database_url, namespace
):
    """A retry's idempotency read uses the transaction's own connection, not a second one."""
    from tests.conftest import running_server

    async with running_server(database_url, pool_max_size=3) as running:
        async with grpc.aio.insecure_channel(running.target) as channel:
            small = rpc.LeaseServiceStub(channel)
            requests = []
            for n in range(12):
                lease = await grant(small, namespace, f"t{n}", "a", ttl_s=30.0)
                await small.BeginEffect(
                    pb.BeginEffectRequest(
                        namespace=namespace, task_id=f"t{n}", fence=lease.fence,
                        effect_key="e", policy=pb.EFFECT_POLICY_ONCE,
                    )
                )  # fmt: skip
                request = pb.CompleteEffectRequest(
                    namespace=namespace, task_id=f"t{n}", fence=lease.fence, effect_key="e",
                    outcome=pb.EFFECT_STATE_SUCCEEDED,
                    next_checkpoint=pb.Checkpoint(version=1, data=b"done"),
                )  # fmt: skip
                await small.CompleteEffect(request)
                requests.append(request)
            # every retry at once: each holds a connection for its transaction
            replies = await asyncio.gather(
                *(small.CompleteEffect(r, timeout=20) for r in requests * 3)
            )
    assert all(r.checkpoint.version == 1 for r in replies)
