"""PostgreSQL crash-restarted under load: nothing acknowledged is lost, fences stay monotonic.

A real ``leasekeeper serve`` process runs on a private cluster (``cluster.py``).
Four workers, one owner each, loop over three shared tasks: claim, renew,
validate, one heartbeat beat, release; every fifth round a worker claims a
task of its own and completes it. Each step is retried on UNAVAILABLE until it
has a definite answer, as a client must (safe: a retried claim gives the owner
its own lease back, a repeated release is idempotent). Meanwhile the cluster is
crashed and started again, twice (first ``pg_ctl stop -m immediate``: no
checkpoint, nothing flushed; then SIGKILL to every PostgreSQL process), each
time once more grants have been acknowledged, and kept down until the workers'
calls have met the outage.

Afterwards, against the database:

* each task's acknowledged fences are exactly 1, 2, ..., its row's fence, in
  acknowledgement order, each acknowledged once and so to one owner: nothing
  acknowledged was lost, and every grant that committed reached its owner;
* every acknowledged release is in the row (released, or superseded by a newer
  fence); every acknowledged completion is a completed row;
* every failed call failed UNAVAILABLE with DATABASE_UNAVAILABLE (never
  INTERNAL, never ABORTED: no lease came near its ttl; the one exception is a
  Release retried after an UNAVAILABLE whose attempt had committed, refused
  LEASE_SUPERSEDED once another owner claimed the task), and no call sent after a
  crash and answered before the restart began was answered OK;
* the same server process says SERVING and grants a fresh claim within
  ``RECOVER_WITHIN_S`` of the database accepting connections again.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.observability.health import LIVENESS
from leasekeeper_server.storage.migrate import migrate
from tests.fault.cluster import PgCluster
from tests.fault.processes import (
    NOT_SERVING,
    QUICK_OUTAGE_SETTINGS,
    SERVING,
    ServerProcess,
    health_status,
    server_env,
    server_process,
)
from tests.helpers import dur, error_info, poll

pytestmark = [pytest.mark.timeout(90), pytest.mark.process]

NAMESPACE = "restart"
SHARED_TASKS = ("t0", "t1", "t2")
WORKERS = 4
CRASHES = ("immediate", "kill")
GRANTS_PER_PHASE = 25
# Calls that must fail while the database is down before it is started again.
FAILURES_PER_OUTAGE = 2 * WORKERS
# Small timeouts, so the outage is noticed (and left) in about a second; every
# beat renews (no minimum interval), so a heartbeat always reaches the database.
SETTINGS: dict[str, float] = {
    **QUICK_OUTAGE_SETTINGS,
    "min_ttl_s": 0.1,
    "min_renew_interval_s": 0.0,
    "shutdown_grace_s": 1.0,
}
SLACK_S = 2.0  # a loaded 2-core machine
# After the cluster accepts connections again, the health monitor's next ping
# (at most health_interval_s away) takes a pool connection: the pool noticed
# that the crash closed the old ones and opens a new one, which succeeds at
# once, but one attempt begun just before the restart may use up to
# connect_timeout_s. A claim takes the same path.
RECOVER_WITHIN_S = SETTINGS["health_interval_s"] + SETTINGS["connect_timeout_s"] + SLACK_S
# With the database down (connections refused at once), the next ping fails.
NOT_SERVING_WITHIN_S = SETTINGS["health_interval_s"] + SETTINGS["connect_timeout_s"] + SLACK_S
# Far beyond any outage here, so no lease may expire: an ABORTED is a bug.
TTL_S = 20.0
CALL_TIMEOUT_S = 10.0
RETRY_PAUSE_S = 0.05

T = TypeVar("T")


@dataclass(frozen=True)
class Grant:
    seq: int
    task_id: str
    fence: int
    owner_id: str


@dataclass(frozen=True)
class Answer:
    method: str
    sent: float
    answered: float
    code: grpc.StatusCode
    reason: str = ""
    retry: bool = False  # an earlier attempt of the same call ended UNAVAILABLE


@dataclass
class Record:
    """Every answer the workers got, in the order they got them."""

    grants: list[Grant] = field(default_factory=list)
    releases: list[tuple[str, int, str, bool]] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    invalid_fences: list[tuple[str, int, Any]] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def grant(self, task_id: str, fence: int, owner_id: str) -> None:
        self.grants.append(Grant(next(self._seq), task_id, fence, owner_id))
        self.changed.set()

    def failures(self) -> int:
        return sum(1 for a in self.answers if a.code != grpc.StatusCode.OK)

    async def wait_until(self, done: Callable[[], bool], within_s: float, what: str) -> None:
        """Waits until ``done()`` after a recorded answer."""
        deadline = time.monotonic() + within_s
        while not done():
            self.changed.clear()
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {what} after {within_s} s"
            await asyncio.wait_for(self.changed.wait(), remaining)

    async def wait_grants(self, count: int, within_s: float) -> None:
        await self.wait_until(lambda: len(self.grants) >= count, within_s, f"{count} grants")

    async def call(self, method: str, make: Callable[[], Awaitable[T]]) -> T | None:
        """Runs a call until it has a definite answer; None if that answer is an error.

        UNAVAILABLE is retried (recorded each time); any other error is recorded
        and ends the step.
        """
        retry = False
        while True:
            sent = time.monotonic()
            try:
                reply = await make()
            except grpc.aio.AioRpcError as exc:
                reason = _reason(exc)
                answer = Answer(method, sent, time.monotonic(), exc.code(), reason, retry)
                self.answers.append(answer)
                retry = True
                self.changed.set()
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return None
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            self.answers.append(Answer(method, sent, time.monotonic(), grpc.StatusCode.OK))
            return reply


def _reason(exc: grpc.aio.AioRpcError) -> str:
    try:
        return error_info(exc).reason
    except AssertionError:
        return f"<no ErrorInfo: {exc.details()}>"


async def heartbeat_once(
    stub: rpc.LeaseServiceStub, request: pb.HeartbeatRequest
) -> list[pb.HeartbeatResponse]:
    """One beat, then half-close: the replies of a stream that must end OK."""
    call = stub.Heartbeat(iter([request]), timeout=CALL_TIMEOUT_S)
    return [reply async for reply in call]


async def worker(
    stub: rpc.LeaseServiceStub, owner: str, record: Record, stop: asyncio.Event
) -> None:
    """Plays rounds until ``stop`` is set; a round in progress is always finished."""
    rng = random.Random(owner)
    for round_no in itertools.count(1):
        if stop.is_set():
            return
        if round_no % 5 == 0:
            await play_round(stub, record, owner, f"done-{owner}-{round_no}", complete=True)
        else:
            await play_round(stub, record, owner, rng.choice(SHARED_TASKS), complete=False)


async def play_round(
    stub: rpc.LeaseServiceStub, record: Record, owner: str, task: str, complete: bool
) -> None:
    """Claim, renew, validate, one heartbeat beat, release (or complete) one task."""
    ttl = dur(TTL_S)
    key = {"namespace": NAMESPACE, "task_id": task, "owner_id": owner}
    claimed = await record.call(
        "Claim", lambda: stub.Claim(pb.ClaimRequest(**key, ttl=ttl), timeout=CALL_TIMEOUT_S)
    )
    if claimed is None:
        return
    if not claimed.acquired:
        await asyncio.sleep(0.01)  # someone else holds it: pace the next try
        return
    fence = claimed.lease.fence
    record.grant(task, fence, owner)
    lease = {**key, "fence": fence}
    await record.call(
        "Renew", lambda: stub.Renew(pb.RenewRequest(**lease, ttl=ttl), timeout=CALL_TIMEOUT_S)
    )
    check = await record.call(
        "ValidateFence",
        lambda: stub.ValidateFence(
            pb.ValidateFenceRequest(namespace=NAMESPACE, task_id=task, fence=fence),
            timeout=CALL_TIMEOUT_S,
        ),
    )
    if check is not None and not check.valid:
        record.invalid_fences.append((task, fence, check))
    beats = await record.call(
        "Heartbeat", lambda: heartbeat_once(stub, pb.HeartbeatRequest(**lease, ttl=ttl))
    )
    assert beats is None or [(b.fence, b.renewed) for b in beats] == [(fence, True)], beats
    released = await record.call(
        "Release",
        lambda: stub.Release(pb.ReleaseRequest(**lease, complete=complete), timeout=CALL_TIMEOUT_S),
    )
    if released is not None:
        record.releases.append((task, fence, owner, complete))


async def wait_health(target: str, wanted: int, within_s: float) -> float:
    """Polls health until it says ``wanted``; returns the seconds it took."""
    start = time.monotonic()

    async def says() -> bool:
        return await health_status(target, 1.0) == wanted

    await poll(says, f"health {wanted}", within_s=within_s)
    return time.monotonic() - start


async def serves_again(server: ServerProcess, stub: rpc.LeaseServiceStub, probe: str) -> float:
    """Seconds until health says SERVING and a fresh claim is granted (UNAVAILABLE retried)."""
    start = time.monotonic()
    await wait_health(server.target, SERVING, RECOVER_WITHIN_S)
    request = pb.ClaimRequest(namespace=NAMESPACE, task_id=probe, owner_id="prober", ttl=dur(5))

    async def answered() -> pb.ClaimResponse | None:
        try:
            return await stub.Claim(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return None  # the database is not back yet: retried

    left_s = max(0.0, RECOVER_WITHIN_S - (time.monotonic() - start))
    granted = await poll(answered, "a claim answered after the restart", left_s)
    assert granted.acquired and granted.lease.fence == 1, granted
    return time.monotonic() - start


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[PgCluster]:
    async with PgCluster(tmp_path / "pg") as pg:
        await pg.init()
        await pg.start()
        await migrate(pg.url())
        yield pg


async def test_postgres_crash_restart_under_load_keeps_acknowledged_and_recovers(
    cluster: PgCluster, tmp_path: Path
) -> None:
    record = Record()
    stop = asyncio.Event()
    outages: list[tuple[float, float]] = []  # (crashed, restart begun)
    recoveries_s: list[float] = []
    async with (
        server_process(tmp_path / "server", server_env(cluster.url(), **SETTINGS)) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        pid = server.proc.pid
        workers = [
            asyncio.create_task(worker(stub, f"owner-{n}", record, stop)) for n in range(WORKERS)
        ]
        try:
            for crash_no, how in enumerate(CRASHES):
                await record.wait_grants(len(record.grants) + GRANTS_PER_PHASE, within_s=30)
                failed_before = record.failures()
                await cluster.crash(how)
                crashed = time.monotonic()
                # With the database gone: a call fails UNAVAILABLE, health follows.
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Claim(
                        pb.ClaimRequest(
                            namespace=NAMESPACE, task_id="down", owner_id="prober", ttl=dur(5)
                        ),
                        timeout=CALL_TIMEOUT_S,
                    )
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
                assert error_info(caught.value).reason == "DATABASE_UNAVAILABLE"
                await wait_health(server.target, NOT_SERVING, NOT_SERVING_WITHIN_S)
                # Liveness does not follow the database: no restart for an outage.
                assert await health_status(server.target, 1.0, LIVENESS) == SERVING
                await record.wait_until(
                    lambda: record.failures() >= failed_before + FAILURES_PER_OUTAGE,  # noqa: B023
                    within_s=10,
                    what="failed calls during the outage",
                )
                outages.append((crashed, time.monotonic()))
                await cluster.restart()
                recoveries_s.append(await serves_again(server, stub, f"probe-{crash_no}"))
            await record.wait_grants(len(record.grants) + GRANTS_PER_PHASE, within_s=30)
        finally:
            stop.set()
            done, _ = await asyncio.wait(workers, timeout=30)
            for task in workers:
                task.cancel()
        for task in done:
            task.result()  # a worker's own assertion
        assert len(done) == WORKERS, "workers did not finish their last round"
        assert server.proc.returncode is None and server.proc.pid == pid
        assert await health_status(server.target, 2.0) == SERVING
        logs = server.logs()
    assert "internal error" not in logs, logs

    # Every failed call failed UNAVAILABLE/DATABASE_UNAVAILABLE; there were such calls.
    # Except one honest outcome: a Release whose first attempt committed but was
    # answered UNAVAILABLE, retried after another owner claimed the task, is
    # refused LEASE_SUPERSEDED (a stale release leaves the newer lease alone).
    superseded_retries = [
        a
        for a in record.answers
        if (a.method, a.code, a.reason, a.retry)
        == ("Release", grpc.StatusCode.ABORTED, "LEASE_SUPERSEDED", True)
    ]
    failures = Counter(
        (a.method, a.code.name, a.reason)
        for a in record.answers
        if a.code != grpc.StatusCode.OK and a not in superseded_retries
    )
    assert set(failures) <= {
        (m, "UNAVAILABLE", "DATABASE_UNAVAILABLE")
        for m in ("Claim", "Renew", "ValidateFence", "Heartbeat", "Release")
    }, failures
    assert failures, "no call met the outage"
    # No OK for a call sent after a crash and answered before the restart began.
    wrong_oks = [
        a
        for a in record.answers
        if a.code == grpc.StatusCode.OK
        for crashed, restarting in outages
        if crashed < a.sent and a.answered < restarting
    ]
    assert not wrong_oks, wrong_oks
    assert not record.invalid_fences, record.invalid_fences
    assert all(took < RECOVER_WITHIN_S for took in recoveries_s), recoveries_s

    conn = await cluster.connect()
    try:
        rows = {
            r["task_id"]: r
            for r in await conn.fetch(
                "SELECT task_id, owner_id, fence, state FROM leasekeeper_tasks"
                " WHERE namespace = $1",
                NAMESPACE,
            )
        }
    finally:
        await conn.close()

    by_task: defaultdict[str, list[Grant]] = defaultdict(list)
    for grant in record.grants:  # already in acknowledgement order
        by_task[grant.task_id].append(grant)
    for task_id, grants in by_task.items():
        row = rows[task_id]
        fences = [g.fence for g in grants]
        assert fences == list(range(1, row["fence"] + 1)), (task_id, fences, dict(row))
        assert grants[-1].owner_id == row["owner_id"], (task_id, grants[-1], dict(row))
    for task_id, fence, owner, complete in record.releases:
        row = rows[task_id]
        if complete:
            assert (row["fence"], row["state"], row["owner_id"]) == (fence, "completed", owner)
        else:
            assert row["fence"] > fence or row["state"] == "released", (task_id, fence, dict(row))
    completions = sum(1 for *_, complete in record.releases if complete)
    assert completions >= WORKERS, record.releases
    # Every worker ended its last round with a release, so no shared task is held.
    assert all(rows[t]["state"] == "released" for t in SHARED_TASKS if t in rows), rows
