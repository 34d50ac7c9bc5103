"""The console's shared answers for /leases.json: shared only among viewers the service allowed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import pytest

from leasekeeper import LeaseInfo
from leasekeeper_server.console.refresh import Snapshots, identity
from leasekeeper_server.console.service import Refusal

NS = "orders"
KEY = ("ListLeases", NS, "", "", "")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lease(task_id: str, remaining: float = 10.0) -> LeaseInfo:
    return LeaseInfo(
        namespace=NS,
        task_id=task_id,
        owner_id="w",
        fence=1,
        state="HELD",
        expire_time=datetime(2026, 1, 1, tzinfo=UTC),
        remaining_ttl=remaining,
        runtime_deadline=None,
        claim_time=None,
        end_reason=None,
    )


class Service:
    """Answers ListLeases for the tokens it allows; counts the calls."""

    def __init__(self, allowed: set[str | None]) -> None:
        self.allowed = allowed
        self.calls: list[str | None] = []
        self.gate: asyncio.Event | None = None

    def call(
        self, token: str | None, task_id: str = "t"
    ) -> Callable[[], Awaitable[list[LeaseInfo]]]:
        async def list_leases() -> list[LeaseInfo]:
            self.calls.append(token)
            if self.gate is not None:
                await self.gate.wait()
            if token not in self.allowed:
                raise Refusal(403, "Not allowed", "no", "PERMISSION_DENIED")
            return [lease(task_id)]

        return list_leases


async def test_allowed_viewers_share_a_fresh_answer_then_it_is_asked_again() -> None:
    clock = Clock()
    store = Snapshots(fresh_s=2.0, access_s=60.0, clock=clock)
    service = Service({"a", "b"})
    store.allow("a", NS, "ListLeases")
    store.allow("b", NS, "ListLeases")
    first, age = await store.get(KEY, "a", NS, "ListLeases", service.call("a"))
    clock.now += 1.5
    shared, shared_age = await store.get(KEY, "b", NS, "ListLeases", service.call("b"))
    assert shared is first and (age, shared_age) == (0.0, 1.5)
    assert service.calls == ["a"]
    clock.now += 1.0  # 2.5 s old: asked again, with the asking viewer's token
    await store.get(KEY, "b", NS, "ListLeases", service.call("b"))
    assert service.calls == ["a", "b"]


async def test_a_viewer_not_on_record_makes_its_own_call_and_gets_its_refusal() -> None:
    clock = Clock()
    store = Snapshots(fresh_s=60.0, clock=clock)
    service = Service({"admin"})
    await store.get(KEY, "admin", NS, "ListLeases", service.call("admin"))
    with pytest.raises(Refusal) as refused:
        await store.get(KEY, "stranger", NS, "ListLeases", service.call("stranger"))
    assert refused.value.status == 403
    with pytest.raises(Refusal):
        await store.get(KEY, None, NS, "ListLeases", service.call(None))
    assert service.calls == ["admin", "stranger", None]
    assert not store.allowed("stranger", NS, "ListLeases")
    assert not store.allowed(None, NS, "ListLeases")
    # Access is per namespace and per method: GetLease allowed is not ListLeases allowed.
    store.allow("reader", NS, "GetLease")
    assert not store.allowed("reader", NS, "ListLeases")
    assert not store.allowed("admin", "other", "ListLeases")


async def test_many_viewers_at_once_cost_one_call() -> None:
    store = Snapshots(fresh_s=2.0)
    service = Service({None})
    service.gate = asyncio.Event()
    store.allow(None, NS, "ListLeases")
    asked = [
        asyncio.ensure_future(store.get(KEY, None, NS, "ListLeases", service.call(None)))
        for _ in range(50)
    ]
    await asyncio.sleep(0)
    service.gate.set()
    answers = await asyncio.gather(*asked)
    assert len(service.calls) == 1 and store.calls == 1
    assert all(leases[0].task_id == "t" for leases, _age in answers)


async def test_a_failed_call_in_flight_is_not_handed_to_the_viewers_waiting_on_it() -> None:
    store = Snapshots(fresh_s=2.0)
    service = Service({"admin"})
    service.gate = asyncio.Event()
    store.allow("admin", NS, "ListLeases")
    stranger = asyncio.ensure_future(
        store.get(KEY, "stranger", NS, "ListLeases", service.call("stranger"))
    )
    await asyncio.sleep(0)  # the stranger's call is in flight
    admin = asyncio.ensure_future(store.get(KEY, "admin", NS, "ListLeases", service.call("admin")))
    await asyncio.sleep(0)
    service.gate.set()
    with pytest.raises(Refusal):
        await stranger
    leases, _age = await admin  # the admin called again, with its own token
    assert leases[0].task_id == "t" and service.calls == ["stranger", "admin"]


async def test_checked_access_lasts_access_s_and_a_refusal_ends_it() -> None:
    clock = Clock()
    store = Snapshots(fresh_s=1.0, access_s=60.0, clock=clock)
    service = Service({"a"})
    await store.get(KEY, "a", NS, "ListLeases", service.call("a"))
    assert store.allowed("a", NS, "ListLeases")
    clock.now += 59.0
    assert store.allowed("a", NS, "ListLeases")
    clock.now += 2.0
    assert not store.allowed("a", NS, "ListLeases")
    store.allow("a", NS, "ListLeases")
    service.allowed.clear()  # the token is revoked
    with pytest.raises(Refusal):
        await store.get(KEY, "a", NS, "ListLeases", service.call("a"))
    assert not store.allowed("a", NS, "ListLeases")


def test_a_token_is_known_by_its_hash_only() -> None:
    store = Snapshots()
    store.allow("lk_secret_value", NS, "ListLeases")
    assert "lk_secret_value" not in repr(store.__dict__)
    assert identity("lk_secret_value") != identity("lk_secret_valuf")
    assert identity(None) == identity("") == b""


async def test_the_store_keeps_at_most_max_kept_answers() -> None:
    clock = Clock()
    store = Snapshots(fresh_s=2.0, clock=clock, max_kept=3)
    service = Service({None})
    for number in range(5):
        key = ("GetLease", NS, f"t{number}")
        await store.get(key, None, NS, "GetLease", service.call(None, f"t{number}"))
    assert len(store._kept) == 3
