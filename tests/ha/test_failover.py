"""leasekeeper on a real Patroni cluster: five faults with synchronous replication, one without.

One cluster for the session (:mod:`tests.ha.cluster`): etcd and three Patroni
nodes, PostgreSQL on each; two ``leasekeeper serve`` processes reach it with
the multi-host URL (``target_session_attrs=read-write``), which is all they
need to follow the primary: no leasekeeper setting is involved. Each test runs
the fault suite's history workload through one fault of the leader
(:func:`tests.ha.scenario.run_fault`) and adds its figures to
``build/ha/results.{json,md}``.

With synchronous replication (``synchronous_mode`` and ``_strict``), for each
fault: the history checker finds no violation, nothing acknowledged (grant,
release, checkpoint, effect, apply) is lost, no fence is reused, and the
service grants again on a new primary (a higher timeline):

* the leader's postmaster SIGKILLed (``primary_start_timeout: 0``: Patroni
  fails over to the synchronous standby instead of restarting in place);
* the leader's Patroni SIGKILLed with its PostgreSQL (a dead host: the leader
  key lives until its ttl runs out), then started again (it rejoins);
* a planned ``patronictl switchover`` to the synchronous standby;
* the leader cut off from everyone by the proxies (leasekeeper, the other
  nodes, etcd): it demotes itself, the synchronous standby takes over once the
  leader key's ttl ran out; then the partition heals and it rejoins;
* the leader cut off from leasekeeper alone (servers and workers) for a few
  seconds: Patroni sees a healthy leader and does nothing, calls answer
  UNAVAILABLE until the link heals, and the same primary serves on.

Without synchronous replication, replication to the standbys is black-holed
and grants are acknowledged on the leader only, then the leader's Patroni and
PostgreSQL are killed: the grants the failover loses are never reused (every
grant on the new timeline is above its floor, so above every fence handed out
before), and their holders are refused by the service (ValidateFence, Renew,
BeginEffect) and by an outside fence table that had accepted the lost fence.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from leasekeeper import FenceRef
from leasekeeper.fence_table import FenceRefused, accept_fence_asyncpg, ensure_schema_asyncpg
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.fault.history.workload import Report
from tests.ha.accounting import timeline_of
from tests.ha.cluster import Node, PatroniCluster
from tests.ha.conftest import Results
from tests.ha.scenario import FaultResult, HaWorkload, Probe, Repair, Timings, run_fault
from tests.helpers import dur, error_info, poll

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

CALL_TIMEOUT_S = 2.0
ANSWER_WITHIN_S = 30.0
LOST_GRANTS_WANTED = 3  # the workload's grants acknowledged while replication is dark
CUT_S = 3.0  # how long the leader is cut off from leasekeeper alone
Probes = list[Probe]


# -- faults ------------------------------------------------------------------------


async def kill_postmaster(cluster: PatroniCluster, leader: Node, _: Probes) -> Repair | None:
    await cluster.kill_postmaster(leader)
    return None  # Patroni starts it again, as a standby of the new leader


async def kill_patroni_with_postgres(
    cluster: PatroniCluster, leader: Node, _: Probes
) -> Repair | None:
    await cluster.kill_node(leader)

    async def restart() -> None:
        await cluster.start_node(leader)

    return restart


async def switchover(cluster: PatroniCluster, leader: Node, _: Probes) -> Repair | None:
    members = await cluster.members()
    candidate = next(m.name for m in members if m.role == "sync_standby")
    await cluster.switchover(leader, cluster.node(candidate))
    return None


async def partition(cluster: PatroniCluster, leader: Node, _: Probes) -> Repair | None:
    cluster.partition(leader)

    async def heal() -> None:
        cluster.heal(leader)

    return heal


async def cut_from_leasekeeper(
    cluster: PatroniCluster, leader: Node, probes: Probes
) -> Repair | None:
    """The leader's link to leasekeeper (servers and workers) cut for CUT_S, then healed."""
    leader.clients.cut()
    cut_t = time.monotonic()

    def cut_long_enough() -> bool:
        failing = all(any(c.code != "OK" and c.sent >= cut_t for c in p.calls) for p in probes)
        return failing and time.monotonic() - cut_t >= CUT_S

    await poll(cut_long_enough, "every server failing through the cut", 30, 0.05)
    leader.clients.restore()
    return None


# -- checks --------------------------------------------------------------------------


def assert_nothing_lost(result: FaultResult, report: Report, new_primary: bool = True) -> None:
    summary = f"{report.summary()}\n{result.accounting.findings}"
    assert result.violations == [], summary
    acc = result.accounting
    assert (acc.lost, acc.fences_reused) == (0, 0), summary
    if new_primary:
        assert result.timeline_after > result.timeline_before, summary
        assert result.new_leader != result.old_leader, summary
    else:
        assert result.timeline_after == result.timeline_before, summary
        assert result.new_leader == result.old_leader, summary
    # The run did what it is for: grants, effects, checkpoints, on both sides of the fault.
    assert acc.grants >= 20 and acc.releases >= 10, summary
    assert acc.effects >= 3 and acc.checkpoints >= 3, summary
    assert report.verdict.counts["workers.crashed"] == 0, summary


async def sync_fault(
    name: str,
    fault: Any,
    cluster: PatroniCluster,
    results: Results,
    tmp_path: Path,
    seed: int,
    new_primary: bool = True,
) -> FaultResult:
    if not cluster.synchronous:
        await cluster.set_synchronous(True)
    result, report, _, _ = await run_fault(
        name, cluster, fault, tmp_path / "run", seed, new_primary=new_primary
    )
    results.add(result.figures())
    assert_nothing_lost(result, report, new_primary)
    return result


async def test_sync_postmaster_killed_nothing_acknowledged_lost(
    cluster: PatroniCluster, ha_results: Results, tmp_path: Path
) -> None:
    await sync_fault("postmaster SIGKILL", kill_postmaster, cluster, ha_results, tmp_path, 611)


async def test_sync_patroni_killed_with_postgres_nothing_acknowledged_lost(
    cluster: PatroniCluster, ha_results: Results, tmp_path: Path
) -> None:
    fault = kill_patroni_with_postgres
    await sync_fault("Patroni + PostgreSQL SIGKILL", fault, cluster, ha_results, tmp_path, 622)


async def test_sync_switchover_nothing_acknowledged_lost(
    cluster: PatroniCluster, ha_results: Results, tmp_path: Path
) -> None:
    await sync_fault("patronictl switchover", switchover, cluster, ha_results, tmp_path, 633)


async def test_sync_partitioned_primary_nothing_acknowledged_lost(
    cluster: PatroniCluster, ha_results: Results, tmp_path: Path
) -> None:
    await sync_fault("primary partitioned", partition, cluster, ha_results, tmp_path, 644)


async def test_sync_primary_cut_off_from_leasekeeper_alone_is_no_failover(
    cluster: PatroniCluster, ha_results: Results, tmp_path: Path
) -> None:
    name = f"primary cut off from leasekeeper alone, {CUT_S:.0f} s"
    fault = cut_from_leasekeeper
    await sync_fault(name, fault, cluster, ha_results, tmp_path, 666, new_primary=False)


# -- asynchronous replication ----------------------------------------------------------


async def answer(call: Any) -> Any:
    """A call's answer, or its error if not UNAVAILABLE/DEADLINE_EXCEEDED (those are retried)."""

    async def once() -> Any:
        try:
            return ("ok", await call())
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return None
            return ("error", error)

    return await poll(once, "an answer that is not UNAVAILABLE", ANSWER_WITHIN_S, 0.1)


async def refusal(call: Any) -> str:
    """The reason of a call that must be refused ABORTED."""
    kind, value = await answer(call)
    assert kind == "error", value
    assert value.code() == grpc.StatusCode.ABORTED, value
    return str(error_info(value).reason)


async def accept(db: asyncpg.Connection, namespace: str, task: str, fence: int) -> int:
    """The outside system's transaction: accept the fence (the effect itself left out)."""
    async with db.transaction():
        return await accept_fence_asyncpg(db, FenceRef(namespace, task, fence))


async def test_async_failover_lost_grants_never_reused_and_refused(
    cluster: PatroniCluster, ha_results: Results, tmp_path: Path, database_url: str
) -> None:
    # What synchronous replication costs a commit, on this cluster at rest: each waits for
    # the synchronous standby's flush.
    sync_commit = await cluster.commit_latency_ms()
    await cluster.set_synchronous(False)
    async_commit = await cluster.commit_latency_ms()
    ha_results.note("commit_ms_sync", sync_commit)
    ha_results.note("commit_ms_async", async_commit)
    # The effect service's own fence table, in a database that does not fail over.
    outside = await asyncpg.connect(database_url)
    await ensure_schema_asyncpg(outside)
    zombie: dict[str, Any] = {}
    dark: dict[str, float] = {}

    async def before_fault(workload: HaWorkload, probes: list[Probe]) -> None:
        leader = await cluster.leader()
        assert leader is not None
        # Replication to both standbys goes dark (no reset): what the leader
        # acknowledges from now on, no standby has.
        leader.peers.black_hole()
        dark["t"] = time.monotonic()
        ns = probes[0].namespace
        async with grpc.aio.insecure_channel(probes[0].target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            claim = pb.ClaimRequest(namespace=ns, task_id="doomed", owner_id="zombie", ttl=dur(120))
            reply = await stub.Claim(claim, timeout=CALL_TIMEOUT_S)
        assert reply.acquired, reply
        zombie.update(namespace=ns, fence=reply.lease.fence)
        probes[0].events.append(
            {"ev": "grant", "task": "doomed", "fence": reply.lease.fence, "owner": "zombie"}
        )
        # The zombie acts: the outside system accepts its (soon lost) fence.
        assert await accept(outside, ns, "doomed", zombie["fence"]) == zombie["fence"]

        def grants_in_the_dark() -> bool:
            after = [e for e in workload.events() if e["ev"] == "grant" and e["t"] > dark["t"]]
            return len(after) >= LOST_GRANTS_WANTED

        await poll(grants_in_the_dark, "grants acknowledged while replication is dark", 30, 0.1)

    async def after_recovery(workload: HaWorkload, probes: list[Probe], timings: Timings) -> None:
        ns, lost = zombie["namespace"], zombie["fence"]
        async with grpc.aio.insecure_channel(probes[0].target) as channel:
            stub = rpc.LeaseServiceStub(channel)

            def validate() -> Any:
                request = pb.ValidateFenceRequest(namespace=ns, task_id="doomed", fence=lost)
                return stub.ValidateFence(request, timeout=CALL_TIMEOUT_S)

            def renew() -> Any:
                request = pb.RenewRequest(
                    namespace=ns, task_id="doomed", owner_id="zombie", fence=lost, ttl=dur(60)
                )
                return stub.Renew(request, timeout=CALL_TIMEOUT_S)

            def begin_effect() -> Any:
                request = pb.BeginEffectRequest(
                    namespace=ns, task_id="doomed", fence=lost, effect_key="send",
                    policy=pb.EFFECT_POLICY_ONCE, request_digest=b"digest",
                )  # fmt: skip
                return stub.BeginEffect(request, timeout=CALL_TIMEOUT_S)

            def claim() -> Any:
                request = pb.ClaimRequest(
                    namespace=ns, task_id="doomed", owner_id="heir", ttl=dur(60)
                )
                return stub.Claim(request, timeout=CALL_TIMEOUT_S)

            kind, check = await answer(validate)
            assert kind == "ok", check
            assert (check.valid, check.reason) == (False, pb.LOSS_REASON_FENCE_UNKNOWN), check
            reasons = [await refusal(renew), await refusal(begin_effect)]
            assert reasons == ["FENCE_UNKNOWN", "FENCE_UNKNOWN"]
            kind, granted = await answer(claim)
            assert kind == "ok" and granted.acquired, granted
        heir = granted.lease.fence
        assert timeline_of(heir) > timeline_of(lost) and heir > lost
        # The outside system takes the heir's fence, and refuses the lost one from then on.
        assert await accept(outside, ns, "doomed", heir) == heir
        with pytest.raises(FenceRefused) as refused:
            await accept(outside, ns, "doomed", lost)
        assert refused.value.highest_fence == heir
        timings.extra.update(
            lost_fence=lost, heir_fence=heir, lost_fence_refused_by=[
                "ValidateFence", "Renew", "BeginEffect", "outside fence table"
            ],
        )  # fmt: skip

    async def fault(cluster: PatroniCluster, leader: Node, _: Probes) -> Repair | None:
        await cluster.kill_node(leader)

        async def restart() -> None:
            leader.peers.restore()
            await cluster.start_node(leader)

        return restart

    try:
        result, report, workload, probes = await run_fault(
            "Patroni + PostgreSQL SIGKILL, replication dark",
            cluster, fault, tmp_path / "run", 655,
            before_fault=before_fault, after_recovery=after_recovery,
        )  # fmt: skip
    finally:
        await outside.close()

    events = workload.events()
    acc = result.accounting
    new_timeline = result.timeline_after
    first_new_t = min(
        c.answered for p in probes for c in p.grants() if timeline_of(c.fence) == new_timeline
    )
    # Every grant answered once the new primary granted is on its timeline: above its
    # floor, so above every fence handed out before, lost or not.
    late_old = [
        e for e in events
        if e["ev"] == "grant" and e["t"] > first_new_t + 1
        and timeline_of(e["fence"]) < new_timeline
    ]  # fmt: skip
    # No call with a lost fence was acknowledged once the new primary answered.
    lost = {(task, fence) for task, fence, _ in acc.lost_grants}
    stale_ok = [
        e for e in events
        if (e.get("task"), e.get("fence")) in lost
        and e["t"] > first_new_t
        and (e["ev"] in ("checkpoint_saved", "applied", "effect", "completed", "failed")
             or (e["ev"] == "validate" and e["valid"]))
    ]  # fmt: skip
    refused = [
        e for e in events
        if (e.get("task"), e.get("fence")) in lost
        and (e["ev"] in ("apply_refused", "checkpoint_lost")
             or (e["ev"] == "lost" and e.get("code") == "ABORTED")
             or (e["ev"] == "validate" and not e["valid"]))
    ]  # fmt: skip
    safety = [v for v in result.violations if v.startswith(("one-holder:", "effect-once: ONCE"))]
    result.extra.update(
        stale_refused=len(refused) + 4,  # the zombie's three calls and the fence table's refusal
        checker_violations_from_lost_writes=len(result.violations),
    )
    ha_results.add(result.figures())
    summary = f"{report.summary()}\n{acc.findings}"
    assert acc.fences_reused == 0, summary
    assert acc.grants_lost >= LOST_GRANTS_WANTED, summary  # the zombie's, workers', probes'
    assert late_old == [] and stale_ok == [] and safety == [], summary
    assert result.timeline_after > result.timeline_before, summary
    assert report.verdict.counts["workers.crashed"] == 0, summary
