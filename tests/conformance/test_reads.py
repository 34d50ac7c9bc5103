"""GetLease, ListLeases and ListNamespaces on both implementations.

SQL ``get_leases``, ``list_leases`` and ``list_namespaces``.
"""

from __future__ import annotations

import asyncio

from leasekeeper_server.core.model import NAMESPACE_COUNT_LIMIT, NamespaceCount, TaskKey, TaskState
from tests.conformance.conftest import MINUTE, World


async def test_a_task_never_claimed_has_no_lease(world: World) -> None:
    assert await world.store.get_lease(world.key("never")) is None
    assert await world.store.list_leases(world.namespace, "", 10, None) == ([], None)


async def states_by_task(world: World) -> None:
    """Four tasks, one per state: e EXPIRED, f FREE, h HELD (owner w2), x COMPLETED."""
    await world.held(task_id="e", owner_id="w1", ttl=MINUTE)
    free = await world.held(task_id="f", owner_id="w1")
    await world.store.release(world.ref(free), complete=False)
    done = await world.held(task_id="x", owner_id="w2")
    await world.store.release(world.ref(done), complete=True)
    await world.advance(2 * MINUTE)
    await world.held(task_id="h", owner_id="w2", ttl=10 * MINUTE)


async def test_list_filters_by_derived_state_and_owner(world: World) -> None:
    await states_by_task(world)

    async def listed(state: TaskState | None, owner_id: str | None = None) -> list[str]:
        leases, read_up_to = await world.store.list_leases(
            world.namespace, "", 100, state, owner_id
        )
        assert read_up_to is None
        for lease in leases:
            assert state is None or lease.state is state
        return [lease.task_id for lease in leases]

    assert await listed(None) == ["e", "f", "h", "x"]
    assert await listed(TaskState.HELD) == ["h"]
    assert await listed(TaskState.EXPIRED) == ["e"]
    assert await listed(TaskState.FREE) == ["f"]
    assert await listed(TaskState.COMPLETED) == ["x"]
    assert await listed(None, "w2") == ["h", "x"]
    assert await listed(TaskState.COMPLETED, "w1") == []
    assert await listed(None, "nobody") == []


async def test_list_pages_by_task_id_after_a_key(world: World) -> None:
    for task_id in ("t3", "t1", "t5", "t2", "t4"):
        await world.held(task_id=task_id)
    page, read_up_to = await world.store.list_leases(world.namespace, "", 2, None)
    assert [lease.task_id for lease in page] == ["t1", "t2"] and read_up_to is None
    page, _ = await world.store.list_leases(world.namespace, "t2", 2, None)
    assert [lease.task_id for lease in page] == ["t3", "t4"]
    page, _ = await world.store.list_leases(world.namespace, "t4", 2, None)
    assert [lease.task_id for lease in page] == ["t5"]
    page, _ = await world.store.list_leases(world.namespace, "t5", 2, None)
    assert page == []
    # The key need not be a task: paging goes on after where it would be.
    page, _ = await world.store.list_leases(world.namespace, "t25", 10, None)
    assert [lease.task_id for lease in page] == ["t3", "t4", "t5"]


async def test_list_orders_ids_byte_for_byte(world: World) -> None:
    """COLLATE "C": UTF-8 byte order (uppercase before lowercase, ASCII before accents)."""
    ids = ["é", "a", "B", "z", "Z", "ab", "日本"]
    for task_id in ids:
        await world.held(task_id=task_id)
    page, _ = await world.store.list_leases(world.namespace, "", 100, None)
    listed = [lease.task_id for lease in page]
    assert listed == sorted(ids, key=lambda task_id: task_id.encode("utf-8"))
    assert listed == ["B", "Z", "a", "ab", "z", "é", "日本"]


async def test_list_of_one_namespace_only(world: World) -> None:
    await world.held(task_id="mine")
    await world.store.claim(TaskKey(world.namespace + "-other", "theirs"), "w", MINUTE, MINUTE)
    page, _ = await world.store.list_leases(world.namespace, "", 100, None)
    assert [lease.task_id for lease in page] == ["mine"]


async def test_a_rare_filter_stops_at_the_scan_budget_and_says_where(world: World) -> None:
    """One call reads at most 1000 tasks (max(1000, limit)); a short page names where it stopped."""
    ids = [f"t{n:04d}" for n in range(1003)]
    await asyncio.gather(*(world.held(task_id=task_id, owner_id="many") for task_id in ids[:-1]))
    await world.held(task_id=ids[-1], owner_id="rare")
    page, read_up_to = await world.store.list_leases(world.namespace, "", 10, None, "rare")
    assert page == [] and read_up_to == ids[999]
    page, read_up_to = await world.store.list_leases(world.namespace, read_up_to, 10, None, "rare")
    assert [lease.task_id for lease in page] == [ids[-1]] and read_up_to is None
    # A full page needs no position: its last task is where the next starts.
    page, read_up_to = await world.store.list_leases(world.namespace, "", 3, None, "many")
    assert [lease.task_id for lease in page] == ids[:3] and read_up_to is None
    # A limit above the budget raises the budget: all 1003 read, one match. The
    # read filled its budget, so the page is short, not last, and says so.
    page, read_up_to = await world.store.list_leases(world.namespace, "", 1003, None, "rare")
    assert [lease.task_id for lease in page] == [ids[-1]] and read_up_to == ids[-1]
    page, read_up_to = await world.store.list_leases(world.namespace, "", 1004, None, "rare")
    assert [lease.task_id for lease in page] == [ids[-1]] and read_up_to is None


async def test_list_filters_by_the_run_states(world: World) -> None:
    """QUARANTINED (derived or stored), CANCELLED and FAILED are listed as Lease.state judges."""
    await world.held(task_id="derived", ttl=MINUTE, max_attempts=1)
    await world.held(task_id="expired", ttl=MINUTE, max_attempts=2)
    await world.held(task_id="revoked", max_attempts=1)
    await world.store.revoke(world.key("revoked"), "stuck", 0)
    await world.held(task_id="cancelled")
    await world.store.cancel(world.key("cancelled"), "stop")
    failed = await world.held(task_id="failed")
    await world.store.release(world.ref(failed), complete=False, fail=True)
    await world.held(task_id="retried", max_attempts=1)
    await world.store.revoke(world.key("retried"), "stuck", 0)
    await world.store.retry(world.key("retried"), "again")
    await world.advance(2 * MINUTE)

    async def listed(state: TaskState) -> list[str]:
        leases, _ = await world.store.list_leases(world.namespace, "", 100, state)
        assert all(lease.state is state for lease in leases)
        return [lease.task_id for lease in leases]

    assert await listed(TaskState.QUARANTINED) == ["derived", "revoked"]
    assert await listed(TaskState.EXPIRED) == ["expired"]
    assert await listed(TaskState.CANCELLED) == ["cancelled"]
    assert await listed(TaskState.FAILED) == ["failed"]
    assert await listed(TaskState.FREE) == ["retried"]


# ListNamespaces. The PostgreSQL world shares its database with other tests, so
# each test reads the namespaces right after its own (world.namespace + "/...":
# no other test's namespace sorts between them).


async def test_list_namespaces_counts_every_task_and_pages_by_name(world: World) -> None:
    a, b, c = (f"{world.namespace}/{name}" for name in ("a", "b", "c"))
    for namespace, count in ((c, 2), (a, 3), (b, 1)):
        for n in range(count):
            await world.store.claim(TaskKey(namespace, f"t{n}"), "w", MINUTE, MINUTE)
    # Every state counts: a completed task, a free one.
    done = await world.store.get_lease(TaskKey(c, "t0"))
    assert done is not None
    await world.store.release(world.ref(done), complete=True)
    free = await world.store.get_lease(TaskKey(c, "t1"))
    assert free is not None
    await world.store.release(world.ref(free), complete=False)

    page = await world.store.list_namespaces(world.namespace, 2)
    assert page == [NamespaceCount(a, 3, False), NamespaceCount(b, 1, False)]
    page = await world.store.list_namespaces(b, 2)
    assert page[0] == NamespaceCount(c, 2, False)
    # The key need not be a namespace: paging goes on after where it would be.
    page = await world.store.list_namespaces(f"{world.namespace}/a0", 1)
    assert page == [NamespaceCount(b, 1, False)]
    # A namespace without tasks is not listed (its own name holds none).
    assert world.namespace not in [n.namespace for n in await world.store.list_namespaces("", 1000)]


async def test_list_namespaces_orders_names_byte_for_byte(world: World) -> None:
    names = [f"{world.namespace}/{suffix}" for suffix in ("é", "a", "B", "Z", "日本")]
    for namespace in names:
        await world.store.claim(TaskKey(namespace, "t"), "w", MINUTE, MINUTE)
    page = await world.store.list_namespaces(world.namespace, len(names))
    listed = [n.namespace for n in page]
    assert listed == sorted(names, key=lambda name: name.encode("utf-8"))
    assert [name.removeprefix(world.namespace) for name in listed] == [
        "/B",
        "/Z",
        "/a",
        "/é",
        "/日本",
    ]


async def test_list_namespaces_counts_up_to_the_limit(world: World) -> None:
    """A count stops after NAMESPACE_COUNT_LIMIT: more tasks than that are only "capped"."""
    full, over = f"{world.namespace}/full", f"{world.namespace}/over"
    for namespace, count in ((full, NAMESPACE_COUNT_LIMIT), (over, NAMESPACE_COUNT_LIMIT + 1)):
        await asyncio.gather(
            *(
                world.store.claim(TaskKey(namespace, f"t{n:04d}"), "w", MINUTE, MINUTE)
                for n in range(count)
            )
        )
    page = await world.store.list_namespaces(world.namespace, 2)
    assert page == [
        NamespaceCount(full, NAMESPACE_COUNT_LIMIT, False),
        NamespaceCount(over, NAMESPACE_COUNT_LIMIT, True),
    ]
