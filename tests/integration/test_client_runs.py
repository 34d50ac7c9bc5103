"""Resumable runs through the client: checkpoints, attempts, cancel, fail and history.

Against a real server and PostgreSQL. Each worker is a LeaseClient of its own
(its own owner id); the operator is one more. A worker dies by leaving its
block without a release and closing its client; its lease is then made
EXPIRED by a backdated expire_time, so the database clock decides without
waiting out a ttl.
"""

from __future__ import annotations

import asyncio

import pytest

from leasekeeper import (
    Checkpoint,
    CheckpointNotNewer,
    HeldLease,
    HistoryKind,
    InvalidArgument,
    LeaseClient,
    LeaseLost,
    TaskCancelled,
    TaskFailed,
    TaskNotQuarantined,
    TaskQuarantined,
)
from tests.conftest import running_server
from tests.helpers import poll
from tests.integration import contract_helpers as h

pytestmark = pytest.mark.timeout(60)

TASK = "run"
TTL_S = 5.0


async def stream_answering(lease: HeldLease) -> None:
    """Waits until the lease's heartbeat stream has answered a beat: it carries checkpoints now."""
    await poll(lambda: lease._keeper is not None and lease._keeper._streaming, "a beat answered")


def count_save_calls(client: LeaseClient) -> list[int]:
    """Records the version of every SaveCheckpoint the client sends."""
    versions: list[int] = []
    send = client.save_checkpoint

    async def counted(task_id, fence, version, data, content_type=""):
        versions.append(version)
        return await send(task_id, fence, version, data, content_type)

    client.save_checkpoint = counted  # type: ignore[method-assign]
    return versions


async def die(client: LeaseClient, lease: HeldLease, db, namespace: str) -> None:
    """The worker is gone: its client closed, its lease left to expire (backdated)."""
    await client.close()
    await h.backdate(db, namespace, lease.task_id)


async def test_a_replacement_resumes_from_the_last_checkpoint_of_a_worker_that_died(
    worker, db, namespace
):
    first = worker()
    async with first.hold(TASK, ttl=TTL_S, release_on_exit=False) as lease:
        assert lease.checkpoint is None
        for step in (1, 2, 3):
            await lease.save_checkpoint(step, f"step={step}".encode(), "text/plain")
    await die(first, lease, db, namespace)

    second = worker()
    async with second.hold(TASK, ttl=TTL_S) as resumed:
        assert resumed.fence == lease.fence + 1
        checkpoint = resumed.checkpoint
        assert checkpoint is not None
        assert (checkpoint.version, checkpoint.data, checkpoint.content_type) == (
            3,
            b"step=3",
            "text/plain",
        )
        assert checkpoint.fence == lease.fence and checkpoint.write_time is not None
        await resumed.save_checkpoint(4, b"step=4", "text/plain")

    info = await second.get_lease(TASK)
    assert (info.state, info.attempts) == ("FREE", 1)  # the expiry used one attempt
    assert (info.checkpoint_version, info.checkpoint_size) == (4, len(b"step=4"))
    stored = await second.get_checkpoint(TASK)
    assert stored is not None and stored.write_time is not None
    assert stored == Checkpoint(4, b"step=4", "text/plain", resumed.fence, stored.write_time)


async def test_a_claim_receives_the_checkpoint_with_its_grant(worker, db, namespace):
    first = worker()
    claimed = await first.claim(TASK, ttl=TTL_S)
    assert claimed.acquired and claimed.checkpoint is None
    saved = await first.save_checkpoint(TASK, claimed.lease.fence, 7, b'{"row": 70}', "app/json")
    assert (saved.version, saved.data, saved.fence) == (7, b'{"row": 70}', claimed.lease.fence)
    assert saved.write_time is not None
    await h.backdate(db, namespace, TASK)

    taken = await worker().claim(TASK, ttl=TTL_S)
    assert taken.acquired and taken.checkpoint == saved


async def test_a_version_that_does_not_move_forward_is_refused_with_the_stored_one(worker):
    client = worker()
    claimed = await client.claim(TASK, ttl=TTL_S)
    fence = claimed.lease.fence
    await client.save_checkpoint(TASK, fence, 5, b"five")
    for version, data in ((5, b"other five"), (4, b"four")):
        with pytest.raises(CheckpointNotNewer) as caught:
            await client.save_checkpoint(TASK, fence, version, data)
        assert caught.value.current_version == 5
    again = await client.save_checkpoint(TASK, fence, 5, b"five")  # the same write: OK
    assert again.version == 5
    assert (await client.get_checkpoint(TASK)).data == b"five"

    async with worker().hold("held", ttl=TTL_S) as lease:
        await lease.save_checkpoint(2, b"two")
        with pytest.raises(CheckpointNotNewer) as caught:
            await lease.save_checkpoint(1, b"one")
        assert caught.value.current_version == 2
        assert not lease.lost  # a refused checkpoint is not a loss


async def test_a_superseded_fence_cannot_overwrite_its_replacements_checkpoint(
    worker, db, namespace
):
    paused, replacement = worker(), worker()
    old = (await paused.claim(TASK, ttl=TTL_S)).lease
    await paused.save_checkpoint(TASK, old.fence, 1, b"old")
    await h.backdate(db, namespace, TASK)
    new = (await replacement.claim(TASK, ttl=TTL_S)).lease
    await replacement.save_checkpoint(TASK, new.fence, 2, b"new")

    with pytest.raises(LeaseLost) as caught:
        await paused.save_checkpoint(TASK, old.fence, 9, b"stale")
    assert caught.value.reason == "LEASE_SUPERSEDED"
    assert (await replacement.get_checkpoint(TASK)).data == b"new"


async def test_a_held_lease_saves_its_checkpoints_on_the_heartbeat_stream(worker):
    client = worker()
    rpc_versions = count_save_calls(client)
    async with client.hold(TASK, ttl=TTL_S) as lease:
        await stream_answering(lease)
        for version in (1, 2, 3):
            saved = await lease.save_checkpoint(version, b"v%d" % version, "text/plain")
            assert (saved.version, saved.fence) == (version, lease.fence)
        assert lease.checkpoint_version == 3
        # Written with this fence, but not through the lease: the next beat's
        # answer tells the lease what is stored.
        await client.save_checkpoint(TASK, lease.fence, 9, b"v9")
        with pytest.raises(CheckpointNotNewer) as caught:
            await lease.save_checkpoint(6, b"v6")
        assert caught.value.current_version == 9
        assert not lease.lost
    assert rpc_versions[0] == 9 and {1, 2, 3}.isdisjoint(rpc_versions)  # they rode on beats
    stored = await client.get_checkpoint(TASK)
    assert (stored.version, stored.data, stored.fence) == (9, b"v9", lease.fence)
    saves = [e async for e in client.iter_task_history(TASK)]
    saved_versions = [e.checkpoint_version for e in saves if e.kind is HistoryKind.CHECKPOINT_SAVED]
    assert saved_versions == [1, 2, 3, 9]


async def test_a_checkpoint_too_large_is_refused_and_its_lease_lives_on(database_url, namespace):
    async with (
        running_server(database_url, max_checkpoint_bytes=1024) as small,
        LeaseClient(small.target, namespace=namespace) as client,
        client.hold(TASK, ttl=TTL_S) as lease,
    ):
        await stream_answering(lease)
        with pytest.raises(InvalidArgument) as caught:
            await lease.save_checkpoint(1, b"x" * 2048)
        assert caught.value.field == "checkpoint.data"
        assert (await lease.save_checkpoint(1, b"fits")).version == 1
        assert (await client.get_checkpoint(TASK)).data == b"fits"
        # The refused beat ended its stream, not the lease: the heartbeat beats on.
        await poll(lambda: lease._keeper.streams_opened == 2, "the heartbeat stream reopened")
        await stream_answering(lease)
        assert not lease.lost


async def test_cancel_ends_the_held_leases_work_and_every_later_claim(worker, namespace):
    holder, operator = worker(), worker()
    work_cancelled = asyncio.Event()
    started = asyncio.Event()

    async def work() -> None:
        try:
            started.set()
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            work_cancelled.set()
            raise

    async def hold_and_work() -> HeldLease:
        async with holder.hold(TASK, ttl=TTL_S) as lease:
            await lease.save_checkpoint(1, b"half done")
            await work()
        return lease

    running = asyncio.create_task(hold_and_work())
    await started.wait()
    cancelled = await operator.cancel(TASK, "the customer withdrew")
    assert (cancelled.state, cancelled.cancel_reason) == ("CANCELLED", "the customer withdrew")

    with pytest.raises(LeaseLost) as caught:
        await asyncio.wait_for(running, 10)
    assert caught.value.reason == "TASK_CANCELLED"
    assert work_cancelled.is_set()

    with pytest.raises(TaskCancelled):
        await worker().claim(TASK, ttl=TTL_S)
    again = await operator.cancel(TASK, "once more")  # OK, changes nothing
    assert (again.state, again.cancel_reason) == ("CANCELLED", "the customer withdrew")
    assert (await operator.get_checkpoint(TASK)).data == b"half done"  # kept


async def test_attempts_used_up_quarantine_the_task_until_an_operator_retries_it(
    worker, db, namespace
):
    operator = worker()
    for attempt in (1, 2):
        client = worker()
        claimed = await client.claim(TASK, ttl=TTL_S, max_attempts=2)
        assert claimed.acquired
        await client.save_checkpoint(TASK, claimed.lease.fence, attempt, b"try %d" % attempt)
        await h.backdate(db, namespace, TASK)

    info = await operator.get_lease(TASK)
    assert (info.state, info.attempts, info.max_attempts) == ("QUARANTINED", 2, 2)
    with pytest.raises(TaskQuarantined):
        await worker().claim(TASK, ttl=TTL_S)
    with pytest.raises(TaskQuarantined):
        async with worker().hold(TASK, ttl=TTL_S, wait=1.0):
            pass

    async def quarantine_recorded() -> bool:
        kinds = [e.kind async for e in operator.iter_task_history(TASK)]
        return HistoryKind.QUARANTINED in kinds

    await poll(quarantine_recorded, "the expiry sweeper recorded the quarantine")
    retried = await operator.retry(TASK, "the bug is fixed")
    assert (retried.state, retried.attempts) == ("FREE", 0)
    async with worker().hold(TASK, ttl=TTL_S, max_attempts=2) as lease:
        assert lease.fence == claimed.lease.fence + 1
        assert lease.checkpoint is not None and lease.checkpoint.data == b"try 2"
        with pytest.raises(TaskNotQuarantined) as caught:
            await operator.retry(TASK, "not now")
        assert caught.value.state == "HELD"

    kinds = [e.kind async for e in operator.iter_task_history(TASK)]
    assert HistoryKind.QUARANTINED in kinds
    assert kinds.index(HistoryKind.RETRIED) > kinds.index(HistoryKind.QUARANTINED)


async def test_fail_ends_the_run_as_failed_for_good(worker):
    client = worker()
    async with client.hold(TASK, ttl=TTL_S) as lease:
        failed = await lease.fail("the input file is corrupt")
    assert (failed.state, failed.fail_reason) == ("FAILED", "the input file is corrupt")
    assert lease.loss is None
    with pytest.raises(TaskFailed):
        await worker().claim(TASK, ttl=TTL_S)


async def test_an_effects_outcome_and_the_checkpoint_after_it_are_saved_together(worker):
    client = worker()
    async with client.hold(TASK, ttl=TTL_S) as lease:
        begun = await client.begin_effect(TASK, lease.fence, "charge", policy="ONCE")
        assert begun.decision == "PROCEED"
        effect = await client.complete_effect(
            TASK,
            lease.fence,
            "charge",
            outcome="SUCCEEDED",
            external_operation_id="pay_123",
            next_checkpoint=(1, b"charged", "text/plain"),
        )
    assert (effect.state, effect.external_operation_id) == ("SUCCEEDED", "pay_123")
    assert effect.checkpoint is not None
    assert (effect.checkpoint.version, effect.checkpoint.data) == (1, b"charged")
    assert (await client.get_checkpoint(TASK)).data == b"charged"
    [listed] = [e async for e in client.iter_effects(TASK)]
    assert listed.external_operation_id == "pay_123"


async def test_a_tasks_history_is_read_oldest_first_across_pages(worker):
    first, second = worker(), worker()
    async with first.hold(TASK, ttl=TTL_S) as old:
        await old.save_checkpoint(1, b"one")
    async with second.hold(TASK, ttl=TTL_S) as lease:
        assert not (await second.validate_fence(TASK, old.fence)).valid
        await second.begin_effect(TASK, lease.fence, "email", policy="ONCE")
        await second.complete_effect(
            TASK, lease.fence, "email", outcome="SUCCEEDED", external_operation_id="msg_9"
        )
        await lease.complete()

    entries = [e async for e in second.iter_task_history(TASK, page_size=2)]
    first_page, token = await second.list_task_history(TASK, page_size=2)
    assert entries[:2] == first_page and token
    assert [e.sequence for e in entries] == sorted({e.sequence for e in entries})
    assert [e.kind for e in entries] == [
        HistoryKind.GRANTED,
        HistoryKind.CHECKPOINT_SAVED,
        HistoryKind.RELEASED,
        HistoryKind.GRANTED,
        HistoryKind.FENCE_REFUSED,
        HistoryKind.EFFECT_RESERVED,
        HistoryKind.EFFECT_COMPLETED,
        HistoryKind.COMPLETED,
    ]
    granted = [e for e in entries if e.kind is HistoryKind.GRANTED]
    assert [(e.fence, e.owner_id, e.attempt) for e in granted] == [
        (old.fence, first.owner_id, 1),
        (lease.fence, second.owner_id, 1),
    ]
    saved = entries[1]
    assert (saved.fence, saved.checkpoint_version, saved.checkpoint_size) == (old.fence, 1, 3)
    refused = entries[4]
    assert (refused.fence, refused.reason, refused.method) == (
        old.fence,
        "LEASE_SUPERSEDED",
        "ValidateFence",
    )
    completed = entries[6]
    assert (completed.effect_key, completed.effect_outcome, completed.external_operation_id) == (
        "email",
        "SUCCEEDED",
        "msg_9",
    )
    assert all(e.event_time is not None for e in entries)


async def test_lease_effect_saves_the_next_checkpoint_with_its_outcome(worker):
    from leasekeeper import Performed

    client = worker()
    sends: list[str] = []
    async with client.hold(TASK, ttl=TTL_S) as lease:

        @lease.effect("charge", policy="ONCE", next_checkpoint=(1, b"charged", "text/plain"))
        async def charge() -> Performed:
            sends.append("charge")
            return Performed(b"receipt-7", external_operation_id="pay_7")

        outcome = await charge()
        again = await charge()  # ALREADY_APPLIED: nothing is charged twice

    assert sends == ["charge"] and (outcome.fresh, again.fresh) == (True, False)
    assert (outcome.result, outcome.effect.external_operation_id) == (b"receipt-7", "pay_7")
    saved = await client.get_checkpoint(TASK)
    assert saved is not None
    assert (saved.version, saved.data, saved.content_type, saved.fence) == (
        1,
        b"charged",
        "text/plain",
        lease.fence,
    )
    entries = [e async for e in client.iter_task_history(TASK)]
    completed = [e for e in entries if e.kind is HistoryKind.EFFECT_COMPLETED]
    assert [(e.effect_key, e.external_operation_id) for e in completed] == [("charge", "pay_7")]
    checkpoints = [e.checkpoint_version for e in entries if e.kind is HistoryKind.CHECKPOINT_SAVED]
    assert checkpoints == [1]


async def test_lease_effect_refuses_a_next_checkpoint_it_knows_is_not_newer(worker):
    from leasekeeper import CheckpointNotNewer

    client = worker()
    runs: list[str] = []
    async with client.hold(TASK, ttl=TTL_S) as lease:
        await lease.save_checkpoint(3, b"three")

        @lease.effect("charge", policy="ONCE", next_checkpoint=(3, b"again"))
        async def charge() -> str:
            runs.append("charge")
            return "r"

        with pytest.raises(CheckpointNotNewer) as refused:
            await charge()
    assert refused.value.current_version == 3
    assert runs == []  # refused before anything was begun or run
    effects, _ = await client.list_effects(TASK)
    assert effects == []


async def test_an_effect_whose_checkpoint_lost_a_race_is_recorded_not_left_in_doubt(worker):
    from leasekeeper import CheckpointNotNewer

    client = worker()
    async with client.hold(TASK, ttl=TTL_S) as lease:

        @lease.effect("charge", policy="ONCE", next_checkpoint=(5, b"after charge"))
        async def charge() -> str:
            # another write of this lease stores version 5 while the effect runs
            await client.save_checkpoint(TASK, lease.fence, 5, b"from elsewhere")
            return "receipt"

        with pytest.raises(CheckpointNotNewer):
            await charge()
        again = await charge()  # the outcome was recorded: nothing runs twice
    assert (again.fresh, again.result) == (False, b"receipt")
    saved = await client.get_checkpoint(TASK)
    assert saved is not None and saved.data == b"from elsewhere"


async def test_a_beat_carried_checkpoint_of_a_stored_version_with_other_data_is_refused(worker):
    from leasekeeper import CheckpointNotNewer

    client = worker()
    async with client.hold(TASK, ttl=TTL_S) as lease:
        await stream_answering(lease)
        await client.save_checkpoint(TASK, lease.fence, 5, b"Y")  # behind the lease's back
        with pytest.raises(CheckpointNotNewer) as refused:
            await lease.save_checkpoint(5, b"X")  # carried on a beat: not this one's
        assert refused.value.current_version == 5
    saved = await client.get_checkpoint(TASK)
    assert saved is not None and saved.data == b"Y"
