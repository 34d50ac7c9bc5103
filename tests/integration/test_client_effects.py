"""``lease.effect``: the client's effect runner against a real server and PostgreSQL.

Each worker is a LeaseClient of its own (its own owner id) holding the task
with ``hold()``. A worker hands the task over by leaving its block (release)
or, where its lease must be lost mid-effect, by a backdated expire_time and a
real claim of the next worker: the database clock decides.
"""

from __future__ import annotations

import asyncio

import pytest

from leasekeeper import (
    ClaimResult,
    EffectFailed,
    EffectInDoubt,
    EffectKeyReused,
    EffectRecord,
    LeaseLost,
    request_digest,
)
from tests.integration import contract_helpers as h
from tests.integration.conftest import Worker

pytestmark = pytest.mark.timeout(30)

TASK = "t"
TTL_S = 5.0


class OutsideSystem:
    """A stand-in for the effect's target (a mail vendor): it counts what it accepted."""

    def __init__(self) -> None:
        self.sends: list[str] = []

    async def send(self, body: str = "hello") -> str:
        self.sends.append(body)
        return f"msg-{len(self.sends)}"

    async def send_then_time_out(self, body: str = "hello") -> str:
        """Accepts the send, but the caller never hears back."""
        await self.send(body)
        raise TimeoutError("no answer from the outside system")

    async def find(self, earlier: EffectRecord) -> str | None:
        """Reconciles: the message id if a send was accepted, else None."""
        return f"msg-{len(self.sends)}" if self.sends else None


async def leave_in_doubt(worker: Worker, effect_key: str = "email", policy: str = "ONCE") -> None:
    """A first worker's send is accepted but unconfirmed; it then releases the task."""
    outside = OutsideSystem()
    with pytest.raises(TimeoutError):
        async with worker().hold(TASK, ttl=TTL_S) as lease:
            await lease.effect(effect_key, policy=policy).run(outside.send_then_time_out)
    assert outside.sends == ["hello"]


async def test_effect_proceed_runs_fn_once_and_records_result(worker):
    client, outside = worker(), OutsideSystem()
    async with client.hold(TASK, ttl=TTL_S) as lease:

        @lease.effect("email", policy="ONCE", request_digest=request_digest({"to": "ana"}))
        async def send_welcome() -> str:
            return await outside.send("welcome")

        outcome = await send_welcome()

    assert outside.sends == ["welcome"]
    assert (outcome.result, outcome.fresh) == (b"msg-1", True)
    effect = outcome.effect
    assert (effect.state, effect.policy, effect.fence, effect.complete_fence) == (
        "SUCCEEDED",
        "ONCE",
        lease.fence,
        lease.fence,
    )
    assert effect.request_digest == request_digest({"to": "ana"})
    assert effect.complete_time is not None and effect.complete_time >= effect.begin_time
    listed, token = await client.list_effects(TASK)
    assert (listed, token) == ([effect], "")


async def test_effect_run_again_in_same_lease_returns_recorded_result_without_running(worker):
    outside = OutsideSystem()
    async with worker().hold(TASK, ttl=TTL_S) as lease:
        send = lease.effect("email", policy="ONCE")(outside.send)
        first = await send("welcome")
        again = await send("welcome")

    assert outside.sends == ["welcome"]
    assert (again.result, again.fresh) == (first.result, False)
    assert again.effect.attempts == 1


async def test_effect_once_by_next_owner_returns_recorded_result_without_running(worker):
    outside = OutsideSystem()
    async with worker().hold(TASK, ttl=TTL_S) as first:
        await first.effect("email", policy="ONCE").run(outside.send)

    async with worker().hold(TASK, ttl=TTL_S) as second:
        outcome = await second.effect("email", policy="ONCE").run(outside.send)

    assert second.fence == first.fence + 1
    assert outside.sends == ["hello"]
    assert (outcome.result, outcome.fresh) == (b"msg-1", False)
    assert (outcome.effect.fence, outcome.effect.complete_fence) == (first.fence, first.fence)


async def test_effect_latest_by_next_owner_runs_again(worker):
    outside = OutsideSystem()
    async with worker().hold(TASK, ttl=TTL_S) as first:
        await first.effect("draft", policy="LATEST").run(outside.send, "v1")

    async with worker().hold(TASK, ttl=TTL_S) as second:
        outcome = await second.effect("draft", policy="LATEST").run(outside.send, "v2")

    assert outside.sends == ["v1", "v2"]
    assert (outcome.result, outcome.fresh) == (b"msg-2", True)
    assert (outcome.effect.fence, outcome.effect.complete_fence) == (second.fence, second.fence)
    assert outcome.effect.attempts == 2


async def test_effect_in_doubt_without_reconcile_raises_with_earlier_attempt(worker):
    await leave_in_doubt(worker)
    outside = OutsideSystem()

    async with worker().hold(TASK, ttl=TTL_S) as lease:
        with pytest.raises(EffectInDoubt) as caught:
            await lease.effect("email", policy="ONCE").run(outside.send)

    assert outside.sends == []
    earlier = caught.value.effect
    assert (earlier.state, earlier.fence, earlier.attempts) == ("RESERVED", lease.fence - 1, 1)
    assert f"fence {lease.fence - 1}" in str(caught.value)


async def test_effect_in_doubt_reconciled_as_done_is_recorded_without_running(worker):
    await leave_in_doubt(worker)
    asked: list[EffectRecord] = []

    async def found_sent(earlier: EffectRecord) -> bytes:
        asked.append(earlier)
        return b"msg-1"

    outside = OutsideSystem()
    async with worker().hold(TASK, ttl=TTL_S) as lease:
        runner = lease.effect("email", policy="ONCE", reconcile=found_sent)
        outcome = await runner.run(outside.send)
        again = await runner.run(outside.send)

    assert outside.sends == []
    assert [(e.fence, e.state) for e in asked] == [(lease.fence - 1, "RESERVED")]
    assert (outcome.result, outcome.fresh) == (b"msg-1", False)
    effect = outcome.effect
    assert (effect.state, effect.fence, effect.complete_fence) == (
        "SUCCEEDED",
        lease.fence - 1,
        lease.fence,
    )
    assert (again.result, again.fresh) == (b"msg-1", False)


async def test_effect_in_doubt_reconciled_as_absent_makes_one_more_attempt(worker):
    await leave_in_doubt(worker)
    outside = OutsideSystem()

    async def never_sent(earlier: EffectRecord) -> None:
        return None

    async with worker().hold(TASK, ttl=TTL_S) as lease:
        outcome = await lease.effect("email", policy="ONCE", reconcile=never_sent).run(outside.send)

    assert outside.sends == ["hello"]
    assert (outcome.result, outcome.fresh) == (b"msg-1", True)
    assert (outcome.effect.fence, outcome.effect.attempts) == (lease.fence, 2)


async def test_effect_timed_out_then_reconciled_in_same_lease_never_loops(worker):
    client, outside = worker(), OutsideSystem()
    reconciles: list[int] = []

    async def never_sent(earlier: EffectRecord) -> None:
        reconciles.append(earlier.attempts)
        return None

    async with client.hold(TASK, ttl=TTL_S) as lease:
        runner = lease.effect("email", policy="ONCE", reconcile=never_sent)
        with pytest.raises(TimeoutError):
            await runner.run(outside.send_then_time_out)
        with pytest.raises(TimeoutError):
            await runner.run(outside.send_then_time_out)

    # The second run reconciled once and made exactly one more attempt.
    assert reconciles == [1]
    assert outside.sends == ["hello", "hello"]
    [effect] = [e async for e in client.iter_effects(TASK)]
    assert (effect.state, effect.attempts, effect.fence) == ("RESERVED", 2, lease.fence)


async def test_effect_failed_retryable_is_recorded_and_next_run_proceeds(worker):
    outside = OutsideSystem()

    async def rate_limited() -> str:
        raise EffectFailed("rate limited", retryable=True, result="429")

    async with worker().hold(TASK, ttl=TTL_S) as lease:
        runner = lease.effect("email", policy="ONCE")
        with pytest.raises(EffectFailed) as caught:
            await runner.run(rate_limited)
        outcome = await runner.run(outside.send)

    recorded = caught.value.effect
    assert recorded is not None
    assert (recorded.state, recorded.retryable, recorded.result) == ("FAILED", True, b"429")
    assert outside.sends == ["hello"]
    assert (outcome.fresh, outcome.effect.state, outcome.effect.attempts) == (True, "SUCCEEDED", 2)


async def test_effect_failed_permanently_is_raised_again_without_running(worker):
    outside = OutsideSystem()

    async def rejected() -> str:
        raise EffectFailed("invalid address", retryable=False, result=b"550")

    async with worker().hold(TASK, ttl=TTL_S) as first:
        with pytest.raises(EffectFailed):
            await first.effect("email", policy="ONCE").run(rejected)

    async with worker().hold(TASK, ttl=TTL_S) as second:
        with pytest.raises(EffectFailed) as caught:
            await second.effect("email", policy="ONCE").run(outside.send)

    assert outside.sends == []
    assert (caught.value.retryable, caught.value.result) == (False, b"550")
    assert caught.value.effect is not None
    assert caught.value.effect.complete_fence == first.fence


async def test_effect_on_lease_past_its_trust_deadline_refuses_to_start(worker):
    now_s = [1000.0]
    client, outside = worker(clock=lambda: now_s[0]), OutsideSystem()

    with pytest.raises(LeaseLost):
        async with client.hold(TASK, ttl=TTL_S) as lease:
            # Past the trust deadline on the client's clock; the database still has it HELD.
            now_s[0] += 2 * TTL_S
            with pytest.raises(LeaseLost) as caught:
                await lease.effect("email", policy="ONCE").run(outside.send)

    assert caught.value.reason == "LEASE_EXPIRED"
    assert outside.sends == []
    assert await client.list_effects(TASK) == ([], "")


@pytest.mark.parametrize(("policy", "next_decision"), [("ONCE", "IN_DOUBT"), ("LATEST", "PROCEED")])
async def test_effect_outliving_its_lease_cannot_complete(
    worker, db, namespace, policy, next_decision
):
    first, second = worker(), worker()
    outside = OutsideSystem()
    handover: list[asyncio.Task[ClaimResult]] = []

    async def replace() -> ClaimResult:
        await h.backdate(db, namespace, TASK)
        return await second.claim(TASK, ttl=TTL_S)

    async def send_while_replaced() -> str:
        handover.append(asyncio.create_task(replace()))
        # The hold may cancel this step as soon as it learns of the loss: the handover goes on.
        await asyncio.shield(handover[0])
        return await outside.send("v1")

    with pytest.raises(LeaseLost):
        async with first.hold(TASK, ttl=TTL_S) as lease:
            await lease.effect("draft", policy=policy).run(send_while_replaced)

    claimed = await handover[0]
    assert claimed.acquired and claimed.lease is not None
    [stale] = [e async for e in first.iter_effects(TASK)]
    assert (stale.state, stale.fence) == ("RESERVED", lease.fence)
    begun = await second.begin_effect(TASK, claimed.lease.fence, "draft", policy=policy)
    assert begun.decision == next_decision


async def test_effect_same_key_with_other_digest_is_refused(worker):
    outside = OutsideSystem()
    async with worker().hold(TASK, ttl=TTL_S) as lease:
        await lease.effect("email", policy="ONCE", request_digest=request_digest("a")).run(
            outside.send
        )
        with pytest.raises(EffectKeyReused):
            await lease.effect("email", policy="ONCE", request_digest=request_digest("b")).run(
                outside.send
            )

    assert outside.sends == ["hello"]
