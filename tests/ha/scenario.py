"""One fault of the HA tier, under the fault suite's history workload, measured.

:func:`run_fault` runs the history workload (:mod:`tests.fault.history.workload`:
worker processes, the operator, two ``leasekeeper serve`` processes) against
a :class:`~tests.ha.cluster.PatroniCluster`: both servers (and the workers'
outside system) connect with the cluster's multi-host URL, which finds the
primary (``target_session_attrs=read-write``). The workload injects no
random fault of its own: its fault loop calls :meth:`HaWorkload.inject` once,
as soon as the workers run, and that runs the scenario (the loop's window is
set to end one second after the workers started, so it ends with the scenario):

1. warm up: the workload's grants reach the database and each server's
   :class:`Probe` is granted;
2. the fault (a coroutine given by the test: kill the leader's postmaster,
   kill its Patroni with its PostgreSQL, switch over, partition it, cut it
   off from leasekeeper), at ``t = 0``;
3. recovery: every server's probe is granted on the new primary (a timeline
   above the old one), or, when the fault promotes no other node, granted
   again after the fault ended;
4. the repair (restart a killed node, heal a partition, or nothing), and the
   wait until the cluster is whole again, under the load;
5. more load: the workload's grants go on after the repair.

Then the workload stops its workers and the history checker judges the run;
:mod:`tests.ha.accounting` counts what was acknowledged and lost, and fences
reused, over the workload's and the probes' namespaces.

The probes (in this process) measure what a caller sees: each one, against
one server directly, claims a fresh task (its fence tells the timeline:
migration 0003's floor, ``(timeline - 1) * 2**40 + 1``) and releases it, every
``PROBE_INTERVAL_S``, each call with a ``PROBE_TIMEOUT_S`` deadline.
``unavailable_s`` is, on the server where it is longest, the span from the
sending of the first call that failed after the fault to the answer of the
last one that failed; ``first_grant_s`` is when the first grant of the
recovery (on the new primary) was answered, ``recovered_s`` when the last
server's first one was; ``whole_again_s`` when the cluster was whole again
(every standby streaming, after the repair).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.fault.history.workload import (
    SERVER_SETTINGS,
    Link,
    Report,
    Workload,
    WorkloadConfig,
    _effect_row,
    _microsecond_row,
)
from tests.fault.processes import faketime_env, server_env, server_process
from tests.fault.proxy import TcpProxy
from tests.ha.accounting import Accounting, account, timeline_of
from tests.ha.cluster import Node, PatroniCluster
from tests.helpers import dur, poll

PROBE_INTERVAL_S = 0.05
PROBE_TIMEOUT_S = 1.0
PROBE_TTL_S = 30.0
WARM_GRANTS = 5  # the workload's grants before the fault, and again after the repair
RECOVERY_WITHIN_S = 90.0
STEP_WITHIN_S = 60.0

# A fault: given the cluster and its leader, does the harm; returns the repair to run
# once the service recovered (None: nothing to repair, Patroni rejoins the node itself).
Repair = Callable[[], Awaitable[None]]
Fault = Callable[[PatroniCluster, Node, "list[Probe]"], Awaitable[Repair | None]]


@dataclasses.dataclass
class Call:
    """One probe call: when it was sent and answered (monotonic), and how it ended."""

    method: str
    sent: float
    answered: float
    code: str
    fence: int = 0


class Probe:
    """Claims and releases fresh tasks on one server, recording every call (module docstring)."""

    def __init__(self, index: int, target: str, namespace: str) -> None:
        self.index = index
        self.target = target
        self.namespace = namespace
        self.owner = f"probe-{index}"
        self.calls: list[Call] = []
        self.events: list[dict[str, Any]] = []
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await self._task

    async def _call(self, method: str, call: Awaitable[Any]) -> tuple[Call, Any]:
        sent = time.monotonic()
        try:
            reply = await call
        except grpc.aio.AioRpcError as error:
            record = Call(method, sent, time.monotonic(), error.code().name)
            reply = None
        else:
            record = Call(method, sent, time.monotonic(), "OK")
        self.calls.append(record)
        return record, reply

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            n = 0
            while not self._stopping.is_set():
                n += 1
                task = f"probe{self.index}-{n}"
                claim = pb.ClaimRequest(
                    namespace=self.namespace, task_id=task, owner_id=self.owner,
                    ttl=dur(PROBE_TTL_S),
                )  # fmt: skip
                record, reply = await self._call(
                    "Claim", stub.Claim(claim, timeout=PROBE_TIMEOUT_S)
                )
                if reply is not None and reply.acquired:
                    fence = record.fence = reply.lease.fence
                    self.events.append(
                        {"ev": "grant", "task": task, "fence": fence, "owner": self.owner,
                         "t": record.answered}
                    )  # fmt: skip
                    release = pb.ReleaseRequest(
                        namespace=self.namespace, task_id=task, owner_id=self.owner, fence=fence
                    )
                    done, _ = await self._call(
                        "Release", stub.Release(release, timeout=PROBE_TIMEOUT_S)
                    )
                    if done.code == "OK":
                        self.events.append(
                            {"ev": "released_ok", "task": task, "fence": fence, "t": done.answered}
                        )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), PROBE_INTERVAL_S)

    def grants(self, after: float = float("-inf")) -> list[Call]:
        return [c for c in self.calls if c.method == "Claim" and c.fence and c.sent >= after]


@dataclasses.dataclass
class FaultResult:
    """One fault's figures (seconds after the fault) and its run's checks."""

    name: str
    mode: str  # "sync" or "async"
    old_leader: str
    new_leader: str
    timeline_before: int
    timeline_after: int
    unavailable_s: float
    first_grant_s: float
    recovered_s: float
    whole_again_s: float
    failed_calls: dict[str, int]
    violations: list[str]
    accounting: Accounting
    counts: dict[str, int]
    elapsed_s: float
    claim_ms_before: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def figures(self) -> dict[str, Any]:
        """The figures as results.json keeps them."""
        return {
            "fault": self.name,
            "replication": self.mode,
            "primary": f"{self.old_leader} -> {self.new_leader}",
            "old_leader": self.old_leader,
            "new_leader": self.new_leader,
            "timeline_before": self.timeline_before,
            "timeline_after": self.timeline_after,
            "unavailable_s": round(self.unavailable_s, 2),
            "first_grant_s": round(self.first_grant_s, 2),
            "recovered_s": round(self.recovered_s, 2),
            "whole_again_s": round(self.whole_again_s, 2),
            "claim_ms_before": self.claim_ms_before,
            "failed_calls": self.failed_calls,
            "checker_violations": len(self.violations),
            **{f"acknowledged_{k}": v for k, v in self.accounting.counts().items()},
            "workload": {
                k: self.counts.get(k, 0)
                for k in (
                    "grants.database",
                    "event.applied",
                    "checkpoints.written",
                    "event.completed",
                    "stale_fences_refused",
                    "workers.started",
                    "workers.crashed",
                )
            },
            "run_s": round(self.elapsed_s, 1),
            **self.extra,
        }


class HaWorkload(Workload):
    """The history workload on a Patroni cluster, running one fault scenario.

    Servers connect with the cluster's multi-host URL (not through a proxy of
    the workload's own: the cluster's nodes have theirs). The fault loop
    (``Workload.run``) draws its first fault at once (``fault_interval_s`` is
    tiny) and ends at ``duration_s`` after the run started, which the last
    initial worker's start sets to one second after itself; ``inject`` runs the
    scenario the first time the loop calls it, so the loop ends when it does.
    """

    def __init__(
        self,
        config: WorkloadConfig,
        cluster: PatroniCluster,
        scenario: Callable[[HaWorkload], Awaitable[None]],
    ) -> None:
        super().__init__(config)
        self.cluster = cluster
        self._scenario = scenario
        self._ran = False
        self._started = 0.0

    async def start_links(self) -> None:
        self._started = time.monotonic()
        for index in range(self.config.servers):
            # The workload heals and closes a link's database proxy; here the
            # servers' database links are the cluster's own proxies, so this one
            # is a stand-in that carries nothing.
            unused = TcpProxy("127.0.0.1", 1)
            await unused.start()
            proxy = TcpProxy("127.0.0.1", 1)  # pointed at its server once it runs
            await proxy.start()
            link = Link(index, unused, proxy)
            self.links.append(link)
            if index > 0 and self.config.skew_clocks:
                offset_s = self.rng.choice([-1, 1]) * self.rng.randint(30, 7200)
                self.clock_offsets[index] = f"{offset_s:+d}s"
            await self.start_server(link)

    async def start_server(self, link: Link) -> None:
        env = server_env(self.cluster.url, **SERVER_SETTINGS)
        env.update(faketime_env(self.clock_offsets.get(link.index)))
        link.stack = contextlib.AsyncExitStack()
        link.server = await link.stack.enter_async_context(
            server_process(self.workdir / "servers", env)
        )
        link.proxy.target_port = link.server.port

    async def start_worker(self) -> str:
        name = await super().start_worker()
        if len(self.workers) == self.config.workers and not self._ran:
            self.config.duration_s = time.monotonic() - self._started + 1.0
        return name

    async def inject(self, kind: str) -> None:
        if not self._ran:
            self._ran = True
            await self._scenario(self)

    def events(self) -> list[dict[str, Any]]:
        """Every worker's and the operator's history events so far."""
        events: list[dict[str, Any]] = []
        for path in sorted([*self.workdir.glob("w*.jsonl"), *self.workdir.glob("op.jsonl")]):
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    events.append(json.loads(line))
        return events


async def database_grants(url: str, namespace: str) -> int:
    """How many grants of ``namespace`` the database has (distinct task and fence)."""
    conn = await asyncpg.connect(url, timeout=5)
    try:
        return int(
            await conn.fetchval(
                "SELECT count(DISTINCT (task_id, fence)) FROM history_task_versions"
                " WHERE namespace = $1",
                namespace,
                timeout=5,
            )
        )
    finally:
        await conn.close()


async def grants_reached(url: str, namespace: str, count: int) -> bool:
    """Whether the database has ``count`` grants of ``namespace``; False while it cannot say."""
    try:
        return await database_grants(url, namespace) >= count
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
        return False


async def read_namespace(url: str, namespace: str) -> dict[str, list[dict[str, Any]]]:
    """A namespace's row versions, ledger records and applies, as the checker reads them."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        versions = await conn.fetch(
            "SELECT * FROM history_task_versions WHERE namespace = $1 ORDER BY version_id",
            namespace,
        )
        effects = await conn.fetch(
            "SELECT * FROM leasekeeper_effects WHERE namespace = $1", namespace
        )
        applies = await conn.fetch(
            "SELECT * FROM history_applies WHERE namespace = $1 ORDER BY apply_id", namespace
        )
    finally:
        await conn.close()
    return {
        "versions": [_microsecond_row(r) for r in versions],
        "effects": [_effect_row(r) for r in effects],
        "applies": [dict(r) for r in applies],
    }


@dataclasses.dataclass
class Timings:
    """What the scenario saw, in monotonic seconds."""

    new_primary: bool = True
    fault_t: float = 0.0
    fault_end_t: float = 0.0
    whole_again_t: float = 0.0
    old_leader: str = ""
    new_leader: str = ""
    timeline_before: int = 0
    timeline_after: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def recovery(self, call: Call) -> bool:
        """Whether a probe's grant shows the service back: on a new primary, or after the fault."""
        if not call.fence or call.sent < self.fault_t:
            return False
        if self.new_primary:
            return timeline_of(call.fence) > self.timeline_before
        return call.sent >= self.fault_end_t


def unavailable_s(probes: list[Probe], fault_t: float) -> float:
    """Where it is longest: from the first failed call's sending to the last one's answer."""
    longest = 0.0
    for probe in probes:
        failed = [c for c in probe.calls if c.code != "OK" and c.answered > fault_t]
        if failed:
            longest = max(longest, failed[-1].answered - min(c.sent for c in failed))
    return longest


def claim_latency_ms(probes: list[Probe], before: float) -> dict[str, float]:
    """Median and 95th percentile of the probes' granted Claims sent before ``before``, ms."""
    took = sorted(
        (c.answered - c.sent) * 1000 for p in probes for c in p.grants() if c.sent < before
    )
    if not took:
        return {}
    return {
        "p50": round(statistics.median(took), 2),
        "p95": round(took[int(len(took) * 0.95)], 2),
        "calls": len(took),
    }


async def run_fault(
    name: str,
    cluster: PatroniCluster,
    fault: Fault,
    workdir: Path,
    seed: int,
    *,
    new_primary: bool = True,
    before_fault: Callable[[HaWorkload, list[Probe]], Awaitable[None]] | None = None,
    after_recovery: Callable[[HaWorkload, list[Probe], Timings], Awaitable[None]] | None = None,
) -> tuple[FaultResult, Report, HaWorkload, list[Probe]]:
    """Runs the workload with one fault (see the module docstring); returns its figures.

    Args:
        name: The fault's name in the results.
        cluster: A whole cluster (its mode, sync or async, is the run's).
        fault: Does the harm to the leader (given the probes, to watch them);
            returns the repair, if any.
        workdir: Where the history and the logs go (a new folder).
        seed: The workload's seed.
        new_primary: The fault makes Patroni promote another node: recovery
            is a grant on a higher timeline. False: the same primary serves
            on; recovery is a grant sent after ``fault`` returned.
        before_fault: Runs after the warm-up, right before the fault.
        after_recovery: Runs once every server granted again, before the repair.
    """
    probe_namespace = f"history-probe-{uuid.uuid4().hex[:8]}"
    timings = Timings(new_primary=new_primary)
    probes: list[Probe] = []
    leader = await cluster.wait_healthy()
    timings.old_leader = leader.name

    async def scenario(workload: HaWorkload) -> None:
        url = cluster.url
        for link in workload.links:
            assert link.server is not None
            probes.append(Probe(link.index, link.server.target, probe_namespace))
        for probe in probes:
            probe.start()
        try:
            await poll(lambda: grants_reached(url, workload.namespace, WARM_GRANTS),
                       "the workload's first grants", STEP_WITHIN_S, 0.2)  # fmt: skip
            await poll(lambda: all(len(p.grants()) >= 3 for p in probes),
                       "every probe granted", STEP_WITHIN_S, 0.05)  # fmt: skip
            timings.timeline_before = max(timeline_of(p.grants()[-1].fence) for p in probes)
            if before_fault is not None:
                await before_fault(workload, probes)
            timings.fault_t = time.monotonic()
            repair = await fault(cluster, leader, probes)
            timings.fault_end_t = time.monotonic()

            def recovered() -> bool:
                return all(any(timings.recovery(c) for c in p.grants()) for p in probes)

            await poll(recovered, f"every server granting again after {name}",
                       RECOVERY_WITHIN_S, 0.05, details=cluster.describe)  # fmt: skip
            if after_recovery is not None:
                await after_recovery(workload, probes, timings)
            if repair is not None:
                await repair()
            new_leader = await cluster.wait_healthy()
            timings.whole_again_t = time.monotonic()
            timings.new_leader = new_leader.name
            grants = await database_grants(url, workload.namespace)
            await poll(lambda: grants_reached(url, workload.namespace, grants + WARM_GRANTS),
                       "the workload's grants after the repair", STEP_WITHIN_S, 0.2)  # fmt: skip
            timings.timeline_after = max(timeline_of(p.grants()[-1].fence) for p in probes)
        finally:
            for probe in probes:
                await probe.stop()

    config = WorkloadConfig(
        database_url=cluster.url,
        workdir=workdir,
        seed=seed,
        # The fault loop: one call of inject() at once (the scenario), then none
        # (HaWorkload.start_worker sets the loop's end).
        duration_s=0.0,
        fault_interval_s=1e-6,
        faults=("ha",),
    )
    workload = HaWorkload(config, cluster, scenario)
    report = await workload.run()
    if not timings.fault_t:
        raise AssertionError(f"{name}: the scenario did not run:\n{report.summary()}")

    data = await read_namespace(cluster.url, workload.namespace)
    probe_data = await read_namespace(cluster.url, probe_namespace)
    events = workload.events()
    accounting = account(events, data["versions"], data["effects"], data["applies"])
    probe_events = [e for p in probes for e in p.events]
    accounting = accounting + account(probe_events, probe_data["versions"])

    fault_t = timings.fault_t
    firsts = [min(c.answered for c in p.grants() if timings.recovery(c)) for p in probes]
    failed = Counter(
        c.code for p in probes for c in p.calls if c.code != "OK" and c.answered > fault_t
    )
    result = FaultResult(
        name=name,
        mode="sync" if cluster.synchronous else "async",
        old_leader=timings.old_leader,
        new_leader=timings.new_leader,
        timeline_before=timings.timeline_before,
        timeline_after=timings.timeline_after,
        unavailable_s=unavailable_s(probes, fault_t),
        first_grant_s=min(firsts) - fault_t,
        recovered_s=max(firsts) - fault_t,
        whole_again_s=timings.whole_again_t - fault_t,
        failed_calls=dict(sorted(failed.items())),
        violations=list(report.verdict.violations),
        accounting=accounting,
        counts=dict(report.verdict.counts),
        elapsed_s=report.elapsed_s,
        claim_ms_before=claim_latency_ms(probes, fault_t),
        extra=timings.extra,
    )
    print(f"{name}: {json.dumps(result.figures())}", file=sys.stderr)
    return result, report, workload, probes
