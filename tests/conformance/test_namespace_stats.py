"""A namespace's figures (GetNamespaceStats) on both implementations.

SQL ``namespace_stats`` and ``MemoryStore.namespace_stats``: tasks counted by
their state at one instant, the history's last minute by kind, the effects
in doubt, each count stopped at the limit by the same rule
(``core.model.namespace_stats``).
"""

from __future__ import annotations

from datetime import timedelta

from leasekeeper_server.core.effect_rules import (
    BeginRequest,
    EffectKey,
    EffectPolicy,
    EffectState,
    Outcome,
)
from leasekeeper_server.core.model import STATS_WINDOW, LossReason, NamespaceStats, TaskKey
from tests.conformance.conftest import MINUTE, SLACK, World

SHORT = timedelta(seconds=0.5)  # a lease that runs out while the test waits (PostgreSQL)
FIGURES = (
    "leases_held",
    "leases_expired",
    "tasks_quarantined",
    "claims_last_minute",
    "stale_fences_last_minute",
    "leases_lost_last_minute",
    "effects_in_doubt",
)


def counts(stats: NamespaceStats) -> dict[str, int]:
    """The figures that are not 0, by name."""
    return {name: getattr(stats, name) for name in FIGURES if getattr(stats, name)}


def capped(stats: NamespaceStats) -> set[str]:
    """The figures whose count stopped at the limit."""
    return {name for name in FIGURES if getattr(stats, f"{name}_capped")}


async def test_a_namespace_without_tasks_counts_nothing(world: World) -> None:
    stats = await world.store.namespace_stats(world.namespace)
    assert stats.namespace == world.namespace
    assert counts(stats) == {} and capped(stats) == set()
    assert stats.as_of.tzinfo is not None


async def test_tasks_are_counted_by_their_state_at_one_instant(world: World) -> None:
    await world.held(task_id="expired", ttl=MINUTE)
    await world.held(task_id="quarantined", ttl=MINUTE, max_attempts=1)
    free = await world.held(task_id="free")
    await world.store.release(world.ref(free), complete=False)
    done = await world.held(task_id="done")
    await world.store.release(world.ref(done), complete=True)
    await world.advance(2 * MINUTE)
    held = await world.held(task_id="held", ttl=10 * MINUTE)

    stats = await world.store.namespace_stats(world.namespace)
    # Expired a moment ago, not yet announced: judged at as_of.
    assert {k: v for k, v in counts(stats).items() if not k.endswith("_last_minute")} == {
        "leases_held": 1,
        "leases_expired": 1,
        "tasks_quarantined": 1,
    }
    assert capped(stats) == set()
    assert held.db_now - SLACK <= stats.as_of

    await world.sweep()  # announced: the expired lease stays, the quarantine is stored
    stats = await world.store.namespace_stats(world.namespace)
    assert (stats.leases_held, stats.leases_expired, stats.tasks_quarantined) == (1, 1, 1)

    await world.held(task_id="expired", owner_id="w2")  # taken over: held, no longer expired
    await world.store.retry(world.key("quarantined"), "fixed")
    stats = await world.store.namespace_stats(world.namespace)
    assert (stats.leases_held, stats.leases_expired, stats.tasks_quarantined) == (2, 0, 0)


async def test_a_revoke_of_the_last_attempt_is_a_quarantine(world: World) -> None:
    await world.held(ttl=MINUTE, max_attempts=1)
    await world.store.revoke(world.key(), "stuck", 0)
    stats = await world.store.namespace_stats(world.namespace)
    assert (stats.leases_held, stats.tasks_quarantined, stats.leases_lost_last_minute) == (0, 1, 1)


async def test_the_last_minute_counts_grants_refusals_and_lost_leases(world: World) -> None:
    first = await world.held(task_id="revoked")
    await world.held(task_id="ran-out", ttl=SHORT)
    await world.held(task_id="over-budget", ttl=MINUTE, max_runtime=SHORT)
    await world.store.claim(TaskKey(f"{world.namespace}-other", "t"), "w1", MINUTE, MINUTE)
    assert counts(await world.store.namespace_stats(world.namespace)) == {
        "leases_held": 3,
        "claims_last_minute": 3,
    }

    await world.store.revoke(world.key("revoked"), "stuck", 0)
    stale = world.key("revoked")
    await world.store.record_refusal(stale, first.fence, LossReason.LEASE_REVOKED, "ValidateFence")
    # The same refusal again, and a fence never issued: no new entry.
    await world.store.record_refusal(stale, first.fence, LossReason.LEASE_REVOKED, "ValidateFence")
    await world.store.record_refusal(stale, first.fence + 5, LossReason.FENCE_UNKNOWN, "X")
    await world.run_out("ran-out")
    await world.run_out("over-budget")
    await world.sweep()  # the expiries are announced: now they are history entries
    stats = await world.store.namespace_stats(world.namespace)
    assert counts(stats) == {
        "leases_expired": 2,
        "claims_last_minute": 3,
        "stale_fences_last_minute": 1,
        "leases_lost_last_minute": 3,  # a revoke, an expiry, a runtime budget spent
    }

    await world.advance(STATS_WINDOW + SLACK, history=True)  # out of the window
    assert counts(await world.store.namespace_stats(world.namespace)) == {"leases_expired": 2}


async def test_an_effect_is_in_doubt_once_its_fence_is_not_the_live_lease(world: World) -> None:
    def key(name: str, task_id: str = "t") -> EffectKey:
        return EffectKey(world.namespace, task_id, name)

    first = await world.held(ttl=MINUTE)
    await world.ledger.begin(BeginRequest(key("email"), first.fence, EffectPolicy.ONCE, b""))
    await world.ledger.begin(BeginRequest(key("done"), first.fence, EffectPolicy.ONCE, b""))
    succeeded = Outcome(EffectState.SUCCEEDED, False, b"ok")
    await world.ledger.complete(key("done"), first.fence, succeeded)
    stats = await world.store.namespace_stats(world.namespace)
    assert stats.effects_in_doubt == 0  # reserved by the live lease: still in its hands

    await world.advance(2 * MINUTE)  # the lease expired: its reservation is in doubt
    assert (await world.store.namespace_stats(world.namespace)).effects_in_doubt == 1
    second = await world.held(owner_id="w2")  # a newer fence does not change that
    assert (await world.store.namespace_stats(world.namespace)).effects_in_doubt == 1
    await world.ledger.complete(key("email"), second.fence, succeeded)  # reconciled
    assert (await world.store.namespace_stats(world.namespace)).effects_in_doubt == 0

    other = await world.held(task_id="u")
    await world.ledger.begin(BeginRequest(key("sms", "u"), other.fence, EffectPolicy.ONCE, b""))
    await world.store.release(world.ref(other), complete=True)  # ended with it reserved
    assert (await world.store.namespace_stats(world.namespace)).effects_in_doubt == 1


async def test_each_count_stops_at_the_limit(world: World) -> None:
    for task_id in ("a", "b", "c"):
        lease = await world.held(task_id=task_id)
        effect = EffectKey(world.namespace, task_id, "e")
        await world.ledger.begin(BeginRequest(effect, lease.fence, EffectPolicy.ONCE, b""))

    stats = await world.store.namespace_stats(world.namespace, limit=2)
    assert counts(stats) == {"leases_held": 2, "claims_last_minute": 2}
    # The unswept leases were read up to the limit: the three figures counted
    # from them are capped, expired and quarantined at 0 (at least 0); the
    # reserved effects were too, all of them held by live leases so far.
    assert capped(stats) == {
        "leases_held",
        "leases_expired",
        "tasks_quarantined",
        "claims_last_minute",
        "effects_in_doubt",
    }

    stats = await world.store.namespace_stats(world.namespace, limit=3)
    assert counts(stats) == {"leases_held": 3, "claims_last_minute": 3}
    assert capped(stats) == set()
