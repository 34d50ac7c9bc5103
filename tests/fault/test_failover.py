"""Fences across a failover to an asynchronous standby: a lost grant's fence is never reissued.

Primary and standby are private clusters (``cluster.py``); the standby streams
through a TcpProxy, so replication can be black-holed without a reset. A real
server on the primary grants fences; once the standby has replayed them,
replication is black-holed and more fences are granted (and one is accepted by
an effect service's fence table, in a database of its own): the grants the
failover loses. The primary crashes, the standby is promoted (timeline 2) and
a new server starts on it.

Asserted: the lost grants are absent on the standby; the holders of lost
fences are refused at their next call (ValidateFence, Renew, Release,
Heartbeat); every fence granted afterwards is above every fence handed out
before, lost or not (the timeline floor of ``migrations/0003_fence_timeline.sql``:
(2 - 1) * 2**40 + 1), and the next grant on the same timeline is one higher;
the fence table that had accepted a lost fence accepts the new one and refuses
the lost one afterwards; fences above 2**31 work through renew, heartbeat,
the effect ledger and release.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from leasekeeper import FenceRef
from leasekeeper.fence_table import FenceRefused, accept_fence_asyncpg, ensure_schema_asyncpg
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.storage.migrate import migrate
from tests.fault.cluster import PgCluster
from tests.fault.processes import server_env, server_process
from tests.fault.proxy import TcpProxy, tcp_proxy
from tests.helpers import dur, error_info, poll

pytestmark = [pytest.mark.timeout(90), pytest.mark.process]

SETTINGS: dict[str, float] = {
    "statement_timeout_s": 2.0,
    "connect_timeout_s": 1.0,
    "lock_timeout_s": 1.0,
    "health_interval_s": 0.2,
    "min_ttl_s": 0.1,
    "min_renew_interval_s": 0.0,
    "shutdown_grace_s": 1.0,
}
FENCES_PER_TIMELINE = 2**40
FLOOR_TIMELINE_2 = FENCES_PER_TIMELINE + 1
LONG_TTL_S = 60.0
# Task "a"'s durable lease runs out on its own after the failover (polled on
# the database clock, not slept).
SHORT_TTL_S = 1.0
EXPIRY_WITHIN_S = SHORT_TTL_S + 10.0
CALL_TIMEOUT_S = 10.0


@dataclass
class Clusters:
    primary: PgCluster
    standby: PgCluster
    replication: TcpProxy  # what the standby streams through


@pytest.fixture
async def clusters(tmp_path: Path) -> AsyncIterator[Clusters]:
    async with (
        PgCluster(tmp_path / "primary") as primary,
        PgCluster(tmp_path / "standby") as standby,
    ):
        await primary.init()
        await primary.start()
        await migrate(primary.url())
        async with tcp_proxy("127.0.0.1", primary.port) as proxy:
            await standby.make_standby(primary, via_port=proxy.port)
            await standby.start()
            await standby.wait_streaming()
            yield Clusters(primary, standby, proxy)


@pytest.fixture
async def effects_db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """The effect service's own database: not the cluster that fails over."""
    conn = await asyncpg.connect(database_url)
    await ensure_schema_asyncpg(conn)
    try:
        yield conn
    finally:
        await conn.close()


class Client:
    """Stubs on one server, with the namespace filled in."""

    def __init__(self, channel: grpc.aio.Channel, namespace: str) -> None:
        self.stub = rpc.LeaseServiceStub(channel)
        self.ns = namespace

    async def claim(self, task: str, owner: str, ttl_s: float = LONG_TTL_S) -> pb.ClaimResponse:
        request = pb.ClaimRequest(namespace=self.ns, task_id=task, owner_id=owner, ttl=dur(ttl_s))
        return await self.stub.Claim(request, timeout=CALL_TIMEOUT_S)

    async def grant(self, task: str, owner: str, ttl_s: float = LONG_TTL_S) -> int:
        reply = await self.claim(task, owner, ttl_s)
        assert reply.acquired, reply
        return reply.lease.fence

    async def release(self, task: str, owner: str, fence: int, complete: bool = False) -> None:
        request = pb.ReleaseRequest(
            namespace=self.ns, task_id=task, owner_id=owner, fence=fence, complete=complete
        )
        await self.stub.Release(request, timeout=CALL_TIMEOUT_S)

    async def validate(self, task: str, fence: int) -> pb.ValidateFenceResponse:
        request = pb.ValidateFenceRequest(namespace=self.ns, task_id=task, fence=fence)
        return await self.stub.ValidateFence(request, timeout=CALL_TIMEOUT_S)

    async def renew(self, task: str, owner: str, fence: int) -> pb.RenewResponse:
        request = pb.RenewRequest(
            namespace=self.ns, task_id=task, owner_id=owner, fence=fence, ttl=dur(LONG_TTL_S)
        )
        return await self.stub.Renew(request, timeout=CALL_TIMEOUT_S)

    async def begin_effect(self, task: str, fence: int) -> pb.BeginEffectResponse:
        request = pb.BeginEffectRequest(
            namespace=self.ns,
            task_id=task,
            fence=fence,
            effect_key="send",
            policy=pb.EFFECT_POLICY_ONCE,
            request_digest=b"digest",
        )
        return await self.stub.BeginEffect(request, timeout=CALL_TIMEOUT_S)

    async def beat(self, task: str, owner: str, fence: int) -> list[pb.HeartbeatResponse]:
        request = pb.HeartbeatRequest(
            namespace=self.ns, task_id=task, owner_id=owner, fence=fence, ttl=dur(LONG_TTL_S)
        )
        return [r async for r in self.stub.Heartbeat(iter([request]), timeout=CALL_TIMEOUT_S)]


async def aborted_reason(call: object) -> str:
    """Awaits a call that must fail ABORTED; returns its reason."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    assert caught.value.code() == grpc.StatusCode.ABORTED, caught.value
    return error_info(caught.value).reason


async def accept(db: asyncpg.Connection, ref: FenceRef) -> int:
    """The effect service's transaction: accept the fence (the effect itself is left out)."""
    async with db.transaction():
        return await accept_fence_asyncpg(db, ref)


async def rows(cluster: PgCluster, namespace: str) -> dict[str, tuple[str, int, str]]:
    conn = await cluster.connect()
    try:
        found = await conn.fetch(
            "SELECT task_id, owner_id, fence, state FROM leasekeeper_tasks WHERE namespace = $1",
            namespace,
        )
    finally:
        await conn.close()
    return {r["task_id"]: (r["owner_id"], r["fence"], r["state"]) for r in found}


async def test_failover_async_standby_lost_fences_never_reissued_and_refused(
    clusters: Clusters, effects_db: asyncpg.Connection, namespace: str, tmp_path: Path
) -> None:
    primary, standby = clusters.primary, clusters.standby
    assert await primary.timeline() == 1
    handed_out: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    async with (
        server_process(tmp_path / "server-a", server_env(primary.url(), **SETTINGS)) as old,
        grpc.aio.insecure_channel(old.target) as channel,
    ):
        lk = Client(channel, namespace)
        # Durable grants: the standby replays them before the link goes dark.
        handed_out["a"].append(await lk.grant("a", "a1"))
        await lk.release("a", "a1", 1)
        handed_out["a"].append(await lk.grant("a", "a2", ttl_s=SHORT_TTL_S))
        handed_out["b"].append(await lk.grant("b", "b1"))
        assert handed_out == {"a": [1, 2], "b": [1], "c": []}
        await standby.wait_replayed(await primary.flush_lsn())

        clusters.replication.black_hole()
        # Grants the failover will lose: acknowledged, committed on the primary only.
        await lk.release("a", "a2", 2)
        handed_out["a"].append(await lk.grant("a", "a3"))
        await lk.release("b", "b1", 1)
        handed_out["b"].append(await lk.grant("b", "b2"))
        await lk.release("b", "b2", 2)
        handed_out["b"].append(await lk.grant("b", "b3"))
        handed_out["c"].append(await lk.grant("c", "c1"))
        assert handed_out == {"a": [1, 2, 3], "b": [1, 2, 3], "c": [1]}
        # a3 acts: the effect service accepts its (soon lost) fence.
        assert await accept(effects_db, FenceRef(namespace, "a", 3)) == 3

        await primary.crash("immediate")

    await standby.promote()
    # What a claim reads, right after the promotion: timeline 2's floor, even
    # while pg_control's last checkpoint may still name timeline 1.
    assert await standby.fetchval("SELECT leasekeeper_fence_floor()") == FLOOR_TIMELINE_2
    assert await standby.timeline() == 2
    # The lost grants are not there: each row's fence is below the highest handed out.
    assert await rows(standby, namespace) == {"a": ("a2", 2, "held"), "b": ("b1", 1, "held")}
    before = max(f for fences in handed_out.values() for f in fences)

    async with (
        server_process(tmp_path / "server-b", server_env(standby.url(), **SETTINGS)) as new,
        grpc.aio.insecure_channel(new.target) as channel,
    ):
        lk = Client(channel, namespace)
        # The holders of lost fences learn it at their next call.
        for task, fence in (("a", 3), ("b", 2), ("b", 3), ("c", 1)):
            check = await lk.validate(task, fence)
            assert (check.valid, check.reason) == (False, pb.LOSS_REASON_FENCE_UNKNOWN), check
        assert await aborted_reason(lk.renew("a", "a3", 3)) == "FENCE_UNKNOWN"
        assert await aborted_reason(lk.release("b", "b3", 3)) == "FENCE_UNKNOWN"
        assert await aborted_reason(lk.beat("c", "c1", 1)) == "FENCE_UNKNOWN"
        assert await aborted_reason(lk.begin_effect("a", 3)) == "FENCE_UNKNOWN"

        # New grants on timeline 2, above everything handed out on timeline 1.
        # "a": a2's lease (its release was lost) runs out on the database clock.
        async def a4_granted() -> Any:
            claimed = await lk.claim("a", "a4")
            return claimed if claimed.acquired else None

        claimed = await poll(a4_granted, "a2's lease to expire", EXPIRY_WITHIN_S, 0.05)
        # "b": b1's lease came back with its lost release; b1 (or an operator)
        # releases it again: fence 1 is the current fence on this timeline.
        await lk.release("b", "b1", 1)
        after = {
            "a": claimed.lease.fence,
            "b": await lk.grant("b", "b4"),
            "c": await lk.grant("c", "c2"),
        }
        assert after == {"a": FLOOR_TIMELINE_2, "b": FLOOR_TIMELINE_2, "c": FLOOR_TIMELINE_2}
        assert min(after.values()) > before
        # On one timeline fences go up by one, as before.
        await lk.release("c", "c2", FLOOR_TIMELINE_2)
        assert await lk.grant("c", "c3") == FLOOR_TIMELINE_2 + 1

        # A lost fence stays refused: superseded now, by the service and by the fence table.
        check = await lk.validate("a", 3)
        assert (check.valid, check.reason, check.current_fence) == (
            False,
            pb.LOSS_REASON_LEASE_SUPERSEDED,
            FLOOR_TIMELINE_2,
        )
        assert await accept(effects_db, FenceRef(namespace, "a", FLOOR_TIMELINE_2)) == (
            FLOOR_TIMELINE_2
        )
        for stale in (3, 2):
            with pytest.raises(FenceRefused) as refused:
                await accept(effects_db, FenceRef(namespace, "a", stale))
            assert refused.value.highest_fence == FLOOR_TIMELINE_2

        # Fences above 2**31 (and 2**40) work end to end.
        big = FLOOR_TIMELINE_2
        assert (await lk.validate("a", big)).valid
        assert (await lk.renew("a", "a4", big)).lease.fence == big
        assert [(r.fence, r.renewed) for r in await lk.beat("a", "a4", big)] == [(big, True)]
        begun = await lk.begin_effect("a", big)
        assert (begun.decision, begun.effect.fence) == (pb.EFFECT_DECISION_PROCEED, big)
        completed = await lk.stub.CompleteEffect(
            pb.CompleteEffectRequest(
                namespace=namespace,
                task_id="a",
                fence=big,
                effect_key="send",
                outcome=pb.EFFECT_STATE_SUCCEEDED,
                result=b"ok",
            ),
            timeout=CALL_TIMEOUT_S,
        )
        assert completed.effect.complete_fence == big
        await lk.release("a", "a4", big, complete=True)

    assert await rows(standby, namespace) == {
        "a": ("a4", big, "completed"),
        "b": ("b4", big, "held"),
        "c": ("c3", big + 1, "held"),
    }
