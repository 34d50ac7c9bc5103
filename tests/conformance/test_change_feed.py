"""The change feed on both implementations: what is announced, in which order, and who is woken.

PostgreSQL announces from the task table's trigger (migrations/0005 and
0006) through LISTEN; the memory store announces as it commits. The events
of one scenario must be the same, kind for kind, fence for fence.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from leasekeeper_server.core.model import CheckpointWrite
from leasekeeper_server.storage.protocol import EventSubscription
from tests.conformance.conftest import MINUTE, World
from tests.helpers import STEP_S, poll


async def events_until(sub: EventSubscription, task_id: str, seen: list[dict[str, Any]]) -> None:
    """Collects ``sub``'s events into ``seen`` until one of ``task_id`` arrives."""

    def arrived() -> bool:
        gap, events = sub.take()
        assert not gap
        seen.extend(events)
        return any(event["task_id"] == task_id for event in events)

    await poll(arrived, f"an event of task {task_id!r}")


async def test_each_committed_change_is_announced_once_in_order(world: World) -> None:
    seen: list[dict[str, Any]] = []
    with world.events.subscribe(world.namespace, None) as sub:
        first = await world.held(owner_id="w1", ttl=MINUTE)
        await world.store.renew(world.ref(first), MINUTE)  # not news
        await world.claim(owner_id="w1")  # handed back: not news
        assert not (await world.claim(owner_id="other")).acquired  # refused: not news
        await world.store.release(world.ref(first), complete=False)
        await world.store.release(world.ref(first), complete=False)  # repeated: not news
        second = await world.held(owner_id="w2", ttl=MINUTE)
        await world.advance(2 * MINUTE)
        third = await world.held(owner_id="w3")  # announces the unannounced expiry first
        await world.store.revoke(world.key(), "operator", 0)
        await world.store.revoke(world.key(), "operator", 0)  # nothing to revoke: not news
        fourth = await world.held(owner_id="w4", ttl=MINUTE)
        await world.advance(2 * MINUTE)
        await world.store.release(world.ref(fourth), complete=False)  # of an expired lease
        fifth = await world.held(owner_id="w5")
        await world.store.release(world.ref(fifth), complete=True)
        await world.held(task_id="end")
        await events_until(sub, "end", seen)
    base = first.fence
    assert [
        (e["event"], e["task_id"], e["fence"] - base, e["state"], e["owner_id"]) for e in seen
    ] == [
        ("claimed", "t", 0, "held", "w1"),
        ("released", "t", 0, "released", "w1"),
        ("claimed", "t", 1, "held", "w2"),
        ("expired", "t", 1, "held", "w2"),
        ("claimed", "t", 2, "held", "w3"),
        ("revoked", "t", 2, "revoked", "w3"),
        ("claimed", "t", 3, "held", "w4"),
        ("expired", "t", 3, "held", "w4"),
        ("released", "t", 3, "released", "w4"),
        ("claimed", "t", 4, "held", "w5"),
        ("completed", "t", 4, "completed", "w5"),
        ("claimed", "end", seen[-1]["fence"] - base, "held", "w1"),
    ]
    assert (second.fence, third.fence) == (base + 1, base + 2)
    by_kind = {(e["event"], e["fence"]): e for e in seen}
    revoked = by_kind[("revoked", base + 2)]
    assert (revoked["end_reason"], revoked["revoke_reason"]) == ("LEASE_REVOKED", "operator")
    for event in seen:
        instant = datetime.fromisoformat(event["event_time"])
        expected = {"claimed": "claim_time", "expired": "expire_time"}.get(event["event"])
        if expected is not None:  # a grant at its claim time, an expiry at its expire time
            assert instant == datetime.fromisoformat(event[expected]), event
        assert instant.tzinfo is not None


async def test_subscriptions_see_their_task_or_namespace_only(world: World) -> None:
    task_events: list[dict[str, Any]] = []
    namespace_events: list[dict[str, Any]] = []
    with (
        world.events.subscribe(world.namespace, "a") as one_task,
        world.events.subscribe(world.namespace, None) as namespace,
    ):
        await world.held(task_id="b")
        await world.held(task_id="a")
        await world.held(task_id="end")
        await events_until(namespace, "end", namespace_events)
        await events_until(one_task, "a", task_events)
    assert [e["task_id"] for e in namespace_events] == ["b", "a", "end"]
    assert [e["task_id"] for e in task_events] == ["a"]


async def test_a_watcher_is_woken_by_each_change_of_its_task(world: World) -> None:
    key = world.key()
    with world.events.watch(key) as changed:
        lease = await world.held(owner_id="w1")
        await asyncio.wait_for(changed.wait(), STEP_S)
        changed.clear()
        await world.store.release(world.ref(lease), complete=False)
        await asyncio.wait_for(changed.wait(), STEP_S)
        changed.clear()
        await world.held(owner_id="w2")
        await asyncio.wait_for(changed.wait(), STEP_S)
        changed.clear()
        await world.store.revoke(key, "operator", 0)
        await asyncio.wait_for(changed.wait(), STEP_S)


async def test_quarantine_retry_cancel_and_failure_are_announced(world: World) -> None:
    seen: list[dict[str, Any]] = []
    with world.events.subscribe(world.namespace, None) as sub:
        first = await world.held(task_id="a", ttl=MINUTE, max_attempts=1)
        await world.advance(2 * MINUTE)
        await world.sweep()  # the only attempt ran out: quarantined
        await world.store.retry(world.key("a"), "fixed")
        second = await world.held(task_id="a", owner_id="w2")
        await world.store.save_checkpoint(world.ref(second), CheckpointWrite(1, b"abcd", ""))
        await world.store.cancel(world.key("a"), "not needed")
        failing = await world.held(task_id="b")
        await world.store.release(world.ref(failing), complete=False, fail=True, fail_reason="bad")
        await world.held(task_id="c", max_attempts=1)
        await world.store.revoke(world.key("c"), "stuck", 0)
        await world.held(task_id="end")
        await events_until(sub, "end", seen)
    base = first.fence
    assert [
        (e["event"], e["task_id"], e["fence"] - base, e["state"], e["attempts"]) for e in seen
    ] == [
        ("claimed", "a", 0, "held", 0),
        ("expired", "a", 0, "held", 0),
        ("quarantined", "a", 0, "quarantined", 1),
        ("retried", "a", 0, "retried", 0),
        ("claimed", "a", 1, "held", 0),
        ("cancelled", "a", 1, "cancelled", 0),
        ("claimed", "b", seen[6]["fence"] - base, "held", 0),
        ("failed", "b", seen[6]["fence"] - base, "failed", 0),
        ("claimed", "c", seen[8]["fence"] - base, "held", 0),
        # A revoke that quarantines is announced as both.
        ("revoked", "c", seen[8]["fence"] - base, "quarantined", 1),
        ("quarantined", "c", seen[8]["fence"] - base, "quarantined", 1),
        ("claimed", "end", seen[-1]["fence"] - base, "held", 0),
    ]
    assert seen[0]["max_attempts"] == 1 and seen[4]["max_attempts"] is None
    assert (seen[2]["end_reason"], seen[3]["state_reason"]) == ("LEASE_EXPIRED", "fixed")
    cancelled = seen[5]
    assert (cancelled["end_reason"], cancelled["state_reason"]) == ("TASK_CANCELLED", "not needed")
    assert (cancelled["checkpoint_version"], cancelled["checkpoint_size"]) == (1, 4)
    assert (seen[7]["end_reason"], seen[7]["state_reason"]) == ("TASK_FAILED", "bad")
    assert (seen[9]["end_reason"], seen[9]["revoke_reason"]) == ("LEASE_REVOKED", "stuck")
    assert seen[10]["end_reason"] == "LEASE_REVOKED"


async def test_a_grant_after_an_ended_lease_says_when_it_ended(world: World) -> None:
    """``previous_end``: the end of the lease a grant follows (None when it followed none)."""
    seen: list[dict[str, Any]] = []
    with world.events.subscribe(world.namespace, None) as sub:
        first = await world.held(owner_id="w1", ttl=MINUTE, request_id="r1")
        await world.advance(2 * MINUTE)
        expired = await world.lease()
        second = await world.held(owner_id="w2", request_id="r2")  # over the expired lease
        await world.store.release(world.ref(second), complete=False)
        released = await world.lease()
        await world.held(owner_id="w2", request_id="r3")  # after a release
        await world.held(owner_id="w2", request_id="r4")  # a new incarnation: nothing ended
        await world.held(task_id="end")
        await events_until(sub, "end", seen)
    grants = [e for e in seen if e["event"] == "claimed" and e["task_id"] == "t"]
    assert [g["fence"] - first.fence for g in grants] == [0, 1, 2, 3]
    ends = [g["previous_end"] for g in grants]
    assert ends[0] is None and ends[3] is None
    assert datetime.fromisoformat(ends[1]) == expired.expire_time
    assert datetime.fromisoformat(ends[2]) == released.expire_time
