"""Namespace limits on both implementations (SQL ``lock_limits``, ``count_live_leases``).

The limits a claim is given only say whether to judge them (``needs_lock``)
and the lock delay; the counts and the bucket are judged on the storage's
own copy (the ``leasekeeper_namespace_limits`` row), on its clock.
"""

from __future__ import annotations

import pytest

from leasekeeper_server.core.errors import ClaimRateLimit, LeaseLimit
from leasekeeper_server.core.limits import NamespaceLimits
from leasekeeper_server.core.model import TaskState
from tests.conformance.conftest import MINUTE, World


async def test_max_leases_refuses_a_grant_past_the_limit(world: World) -> None:
    limits = NamespaceLimits(max_leases=2)
    await world.set_limits(limits)
    await world.held(task_id="a", ttl=5 * MINUTE, limits=limits)
    await world.advance(MINUTE)
    b = await world.held(task_id="b", ttl=10 * MINUTE, limits=limits)
    with pytest.raises(LeaseLimit) as refused:
        await world.claim(task_id="c", limits=limits)
    # The earliest expiry among the live leases: a's, four minutes away.
    assert 4 * 60 - 15 <= refused.value.retry_after_s <= 4 * 60
    assert await world.store.get_lease(world.key("c")) is None  # nothing changed
    # Not a grant, so not refused: the holder's retry, another owner's refused claim.
    assert (await world.claim(task_id="b", limits=limits)).lease.fence == b.fence
    assert not (await world.claim(task_id="b", owner_id="w2", limits=limits)).acquired
    # An expired lease no longer counts.
    await world.advance(5 * MINUTE)
    assert (await world.lease("a")).state is TaskState.EXPIRED
    await world.held(task_id="c", limits=limits)


async def test_a_claim_given_no_limits_is_not_judged(world: World) -> None:
    """The servers' cache says whether to judge: a stale cache without limits lets claims by."""
    await world.set_limits(NamespaceLimits(max_leases=0))
    await world.held(task_id="a")
    with pytest.raises(LeaseLimit):
        await world.claim(task_id="b", limits=NamespaceLimits(max_leases=5))


async def test_the_claim_bucket_takes_one_token_per_claim_call(world: World) -> None:
    limits = NamespaceLimits(claims_per_second=1 / 60, burst=2)
    await world.set_limits(limits)
    await world.held(task_id="a", limits=limits)
    # A refused claim takes its token too.
    assert not (await world.claim(task_id="a", owner_id="w2", limits=limits)).acquired
    with pytest.raises(ClaimRateLimit) as refused:
        await world.claim(task_id="b", limits=limits)
    assert 60 - 15 <= refused.value.retry_after_s <= 60
    # The retries of a waiting claim took theirs already.
    await world.held(task_id="b", limits=limits, take_token=False)
    await world.advance(MINUTE)  # one token back
    await world.held(task_id="c", limits=limits)
    with pytest.raises(ClaimRateLimit):
        await world.claim(task_id="d", limits=limits)


async def test_a_lease_limit_refusal_gives_the_token_back(world: World) -> None:
    """The whole claim rolls back: a refusal for the lease limit leaves the bucket as it was."""
    limits = NamespaceLimits(max_leases=1, claims_per_second=1 / 3600, burst=2)
    await world.set_limits(limits)
    a = await world.held(task_id="a", limits=limits)
    with pytest.raises(LeaseLimit):
        await world.claim(task_id="b", limits=limits)
    await world.store.release(world.ref(a), complete=False)
    await world.held(task_id="b", limits=limits)  # the second token
    with pytest.raises(ClaimRateLimit):
        await world.claim(task_id="c", limits=limits)
