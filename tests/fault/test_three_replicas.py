"""Three replicas on one database behave as one service (real server processes).

Three ``leasekeeper serve`` processes (replicas r1, r2, r3) share the test
database. Four clients, each with its own gRPC channel listing all three
(``ipv4:a,b,c`` with the ``round_robin`` policy: what a client does with a
Kubernetes headless Service, see deploy/README.md), run sixteen holders:
twelve hold a task each for the whole test (each client's three heartbeat
streams land on three different replicas), four contend in pairs for two tasks
(claim, work 0.2 s, release, again), so those tasks change hands many times.

Which replica wrote each version of each task row is recorded in the database
itself: every replica connects with a custom session setting naming it
(``leasekeeper_test.replica``, from its database URL), and a trigger, in the
same transaction as the change, copies the row with that name into
``replica_task_versions``. So "whose stream renewed this lease" is read from
the database, not guessed.

The test:

1. waits until each client is connected to every replica and every held
   lease was renewed by its stream; all three replicas carry streams;
2. SIGKILLs the replica carrying the most streams: each of its streams
   resumes on another replica with the same owner and fence (renewals after
   the kill, written by survivors), and no holder sees LeaseLost;
3. SIGTERMs another replica (drain: its streams end UNAVAILABLE and resume on
   the last one), then starts it again on the same port: the clients come back
   to it (versions written by it after its restart);
4. stops every holder and checks the whole database history with the history
   checker (``history/checker.py``): per task fences never decrease and each
   belongs to one owner, no two owners held a task at one database instant,
   no renewal revived an expired lease; and, here, every grant is exactly one
   fence above the previous one, every grant a holder was told of is in the
   database, and each steady lease kept fence 1 from its claim to its release.

A claim that reaches the SIGTERMed replica in the instant it stops can end
CANCELLED: gRPC cancels calls that arrived but were not yet handed to the
service when the server shuts down. ``hold()`` retries it with the same request
id, like UNAVAILABLE and DEADLINE_EXCEEDED, so no holder sees it.

Nothing waits with a fixed sleep before an assertion: every step polls the
state it needs (the database, the process's sockets).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from leasekeeper import ClaimTimeout, HeldLease, LeaseClient
from tests.fault.history.checker import check
from tests.fault.history.worker import micros
from tests.fault.processes import ServerProcess, server_env, spawn_server
from tests.helpers import STEP_S, poll

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

REPLICAS = ("r1", "r2", "r3")
CLIENTS = 4
STEADY_PER_CLIENT = 3
STEADY_TTL_S = 3.0  # beats every 1 s; trust window 2.7 s after each confirmed renewal
CONTEND_TTL_S = 2.0
WORK_S = 0.2  # a contender's work while it holds its task
CONTEND_WAIT_S = 8.0
POLL_S = 0.05
SETTINGS = {"min_ttl_s": 0.1, "health_interval_s": 0.2, "shutdown_grace_s": 2.0}
REPLICA_SETTING = "leasekeeper_test.replica"
NAMESPACE_PREFIX = "replicas-"

# Client-side load balancing over the listed replicas, as deploy/README.md
# recommends: round_robin, skipping a replica whose health service says
# NOT_SERVING (client-side health checking: its database is out of reach, or
# it is draining). Quick reconnection to a replica that comes back (gRPC's
# default backoff starts at 1 s and grows to 120 s). Each channel keeps its own
# connections: in one process, channels with equal arguments otherwise share them.
SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": "leasekeeper.v1.LeaseService"},
}
CHANNEL_OPTIONS = (
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)

SCHEMA_SQL = f"""
SELECT pg_advisory_xact_lock(727275);
CREATE TABLE IF NOT EXISTS replica_task_versions (
    version_id   bigserial PRIMARY KEY,
    namespace    text NOT NULL,
    task_id      text NOT NULL,
    owner_id     text NOT NULL,
    fence        bigint NOT NULL,
    state        text NOT NULL,
    expire_time  timestamptz,
    claim_time   timestamptz,
    update_time  timestamptz,
    replica      text,
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION replica_record_task_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.namespace LIKE '{NAMESPACE_PREFIX}%' THEN
        INSERT INTO replica_task_versions
            (namespace, task_id, owner_id, fence, state, expire_time, claim_time,
             update_time, replica)
        VALUES (NEW.namespace, NEW.task_id, NEW.owner_id, NEW.fence, NEW.state,
                NEW.expire_time, NEW.claim_time, NEW.update_time,
                current_setting('{REPLICA_SETTING}', true));
    END IF;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS replica_record_task_version ON leasekeeper_tasks;
CREATE TRIGGER replica_record_task_version
    AFTER INSERT OR UPDATE ON leasekeeper_tasks
    FOR EACH ROW EXECUTE FUNCTION replica_record_task_version();
"""

DROP_SQL = """
SELECT pg_advisory_xact_lock(727275);
DROP TRIGGER IF EXISTS replica_record_task_version ON leasekeeper_tasks;
DROP FUNCTION IF EXISTS replica_record_task_version();
DROP TABLE IF EXISTS replica_task_versions;
"""


def replica_url(database_url: str, replica: str) -> str:
    """``database_url`` with a session setting naming the replica on every connection."""
    separator = "&" if "?" in database_url else "?"
    return f"{database_url}{separator}{REPLICA_SETTING}={replica}"


def established_counts(pid: int, ports: Iterable[int]) -> Counter[int]:
    """How many ESTABLISHED TCP connections process ``pid`` has to each of ``ports``.

    Read from the kernel: the socket inodes among the process's file
    descriptors, matched with /proc/net/tcp and tcp6.
    """
    wanted = set(ports)
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    found: Counter[int] = Counter()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for line in rows.readlines()[1:]:
                fields = line.split()
                port = int(fields[2].rsplit(":", 1)[1], 16)
                if fields[3] == "01" and fields[9] in inodes and port in wanted:
                    found[port] += 1
    return found


@dataclass
class Replica:
    """One server process of the three, by name; ``process`` changes on a restart."""

    name: str
    process: ServerProcess
    log_dir: Path

    @property
    def port(self) -> int:
        return self.process.port


@dataclass
class Holders:
    """What the holders saw: steady leases, contenders' grants, how each ended."""

    steady: dict[str, HeldLease] = field(default_factory=dict)
    grants: list[tuple[str, int, str]] = field(default_factory=list)  # (task, fence, owner)
    claim_timeouts: int = 0


@contextlib.asynccontextmanager
async def replica_set(tmp_path: Path, database_url: str) -> AsyncIterator[list[Replica]]:
    """The three replicas, started together and SERVING; all killed on exit."""
    replicas = [
        Replica(
            name,
            await spawn_server(
                tmp_path / name, server_env(replica_url(database_url, name), **SETTINGS)
            ),
            tmp_path / name,
        )
        for name in REPLICAS
    ]
    try:
        await asyncio.gather(*(r.process.wait_serving(STEP_S) for r in replicas))
        yield replicas
    finally:
        for replica in replicas:
            await replica.process.kill()


@contextlib.asynccontextmanager
async def recorded_versions(database_url: str) -> AsyncIterator[None]:
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            await conn.execute(SCHEMA_SQL)
        yield
    finally:
        async with conn.transaction():
            await conn.execute(DROP_SQL)
        await conn.close()


async def hold_steady(
    client: LeaseClient, task_id: str, holders: Holders, stop: asyncio.Event
) -> None:
    async with client.hold(task_id, ttl=STEADY_TTL_S, wait=STEP_S) as lease:
        holders.steady[task_id] = lease
        await stop.wait()


async def contend(client: LeaseClient, task_id: str, holders: Holders, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with client.hold(task_id, ttl=CONTEND_TTL_S, wait=CONTEND_WAIT_S) as lease:
                holders.grants.append((task_id, lease.fence, lease.owner_id))
                await asyncio.sleep(WORK_S)  # the work
        except ClaimTimeout:
            holders.claim_timeouts += 1  # the other contender kept it: not a fault
        await asyncio.sleep(WORK_S / 2)  # pacing, so the other contender gets its turn


async def now(db: asyncpg.Pool) -> datetime:
    """The database clock."""
    return await db.fetchval("SELECT clock_timestamp()")


async def versions(db: asyncpg.Pool, namespace: str) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT * FROM replica_task_versions WHERE namespace = $1 ORDER BY version_id", namespace
    )


def stream_replicas(rows: list[asyncpg.Record], tasks: Iterable[str]) -> dict[str, str]:
    """Per task, the replica of its latest renewal (claim_time < update_time), if any."""
    wanted = set(tasks)
    latest: dict[str, str] = {}
    for row in rows:
        if row["task_id"] in wanted and row["state"] == "held":
            if row["update_time"] > row["claim_time"]:
                latest[row["task_id"]] = row["replica"]
    return latest


def renewed_since(
    rows: list[asyncpg.Record], tasks: Iterable[str], since: datetime
) -> dict[str, set[str]]:
    """Per task, the replicas that renewed it after ``since`` (database clock)."""
    by: dict[str, set[str]] = defaultdict(set)
    wanted = set(tasks)
    for row in rows:
        if (
            row["task_id"] in wanted
            and row["state"] == "held"
            and row["recorded_at"] > since
            and row["update_time"] > row["claim_time"]
        ):
            by[row["task_id"]].add(row["replica"])
    return by


def microsecond_row(row: asyncpg.Record) -> dict[str, Any]:
    """A version as the history checker reads it (instants in microseconds)."""
    out = dict(row)
    for name in ("expire_time", "claim_time", "update_time"):
        out[name.replace("_time", "_us")] = micros(out.pop(name))
    return out


async def test_three_replicas_one_killed_one_restarted_leases_kept_and_never_double_granted(
    tmp_path, database_url
):
    namespace = f"{NAMESPACE_PREFIX}{uuid.uuid4().hex[:12]}"
    steady_tasks = [f"steady-{i}" for i in range(CLIENTS * STEADY_PER_CLIENT)]
    contested = ["contested-0", "contested-1"]
    holders = Holders()
    stop = asyncio.Event()
    started = time.monotonic()

    async with (
        recorded_versions(database_url),
        asyncpg.create_pool(database_url, min_size=1, max_size=CLIENTS) as db,
        replica_set(tmp_path, database_url) as replicas,
    ):
        by_name = {r.name: r for r in replicas}
        target = "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in replicas)
        ports = [r.port for r in replicas]
        channels = [
            grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(CLIENTS)
        ]
        # A heartbeat per lease (sessions=False): each client's streams are to land on three
        # replicas. (A client keeping several leases otherwise puts them on one Session
        # stream, one replica; its resumption is tests/integration/test_session.py's.)
        clients = [LeaseClient(channel=ch, namespace=namespace, sessions=False) for ch in channels]
        work: list[asyncio.Task[None]] = []
        try:
            # 1. Every client connected to every replica, then the holders start.
            for channel in channels:
                channel.get_state(try_to_connect=True)

            async def all_connected() -> bool:
                counts = established_counts(os.getpid(), ports)
                return all(counts[p] >= CLIENTS for p in ports)

            await poll(
                all_connected, "each client connected to all three replicas", interval_s=POLL_S
            )

            async def start_client(i: int, client: LeaseClient) -> None:
                # One hold at a time, each once its stream renewed: a client's calls then
                # alternate claim, stream, claim, ... over the replicas in turn, so its
                # three streams land on three different replicas.
                for task_id in steady_tasks[i * STEADY_PER_CLIENT : (i + 1) * STEADY_PER_CLIENT]:
                    work.append(asyncio.create_task(hold_steady(client, task_id, holders, stop)))

                    async def renewed(task_id: str = task_id) -> bool:
                        rows = await versions(db, namespace)
                        return task_id in stream_replicas(rows, [task_id])

                    await poll(renewed, f"{task_id} renewed by its stream", interval_s=POLL_S)
                # Clients 0 and 2 contend for contested-0, 1 and 3 for contested-1.
                work.append(asyncio.create_task(contend(client, contested[i % 2], holders, stop)))

            await asyncio.gather(*(start_client(i, c) for i, c in enumerate(clients)))

            async def streams_up() -> dict[str, str] | None:
                found = stream_replicas(await versions(db, namespace), steady_tasks)
                return found if len(found) == len(steady_tasks) else None

            before_kill = await poll(
                streams_up, "every steady lease renewed by its stream", interval_s=POLL_S
            )
            assert set(before_kill.values()) == set(REPLICAS), (
                f"streams not spread over the replicas: {before_kill}"
            )
            assert not any(t.done() for t in work), [t for t in work if t.done()]

            # 2. SIGKILL the replica carrying the most streams.
            victim = by_name[Counter(before_kill.values()).most_common(1)[0][0]]
            affected = sorted(t for t, r in before_kill.items() if r == victim.name)
            victim.process.send_signal(signal.SIGKILL)
            assert await victim.process.wait_exit(STEP_S) == -signal.SIGKILL
            killed_at = await now(db)
            survivors = [r for r in replicas if r is not victim]

            async def resumed_elsewhere() -> dict[str, set[str]] | None:
                by = renewed_since(await versions(db, namespace), steady_tasks, killed_at)
                return by if len(by) == len(steady_tasks) else None

            after_kill = await poll(
                resumed_elsewhere, "every steady lease renewed after the kill", interval_s=POLL_S
            )
            resumed_at = time.monotonic()
            for task_id in steady_tasks:
                assert after_kill[task_id] <= {r.name for r in survivors}, after_kill[task_id]
            current = stream_replicas(await versions(db, namespace), steady_tasks)

            # 3. SIGTERM another replica (drain), then start it again on its port.
            bounced = max(survivors, key=lambda r: list(current.values()).count(r.name))
            last = next(r for r in survivors if r is not bounced)
            bounced_streams = sorted(t for t, r in current.items() if r == bounced.name)
            bounced.process.send_signal(signal.SIGTERM)
            assert await bounced.process.wait_exit(STEP_S) == 0, bounced.process.logs()
            drained_at = await now(db)

            async def all_on_last() -> bool:
                by = renewed_since(await versions(db, namespace), steady_tasks, drained_at)
                return len(by) == len(steady_tasks)

            await poll(
                all_on_last,
                f"every steady lease renewed through {last.name} alone",
                interval_s=POLL_S,
            )
            env = server_env(replica_url(database_url, bounced.name), **SETTINGS)
            env["LEASEKEEPER_LISTEN"] = f"127.0.0.1:{bounced.port}"
            bounced.process = await spawn_server(bounced.log_dir, env)
            await bounced.process.wait_serving(STEP_S)
            restarted_at = await now(db)

            async def back_on_restarted() -> bool:
                rows = await versions(db, namespace)
                return any(
                    r["replica"] == bounced.name and r["recorded_at"] > restarted_at for r in rows
                )

            await poll(
                back_on_restarted,
                f"clients back on the restarted {bounced.name}",
                interval_s=POLL_S,
            )
            back_at = time.monotonic()
            assert not any(t.done() for t in work), [t for t in work if t.done()]
        finally:
            stop.set()
            results = await asyncio.wait_for(
                asyncio.gather(*work, return_exceptions=True), CONTEND_WAIT_S + STEP_S
            )
            for client in clients:
                await client.close()
            for channel in channels:
                await channel.close()

        rows = await versions(db, namespace)
        tasks = await db.fetch("SELECT * FROM leasekeeper_tasks WHERE namespace = $1", namespace)

    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors  # no LeaseLost, nothing else either
    # The history checker: fence order, one holder at a time, no revival.
    verdict = check([], [], [microsecond_row(r) for r in rows], [dict(t) for t in tasks], [], [])
    assert verdict.ok, verdict.violations

    # Each grant is exactly one fence above the previous one (one timeline).
    grants_by_task: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for row in rows:
        seen = grants_by_task[row["task_id"]]
        if not seen or seen[-1][0] != row["fence"]:
            seen.append((row["fence"], row["owner_id"]))
    for task_id, seen in grants_by_task.items():
        assert [f for f, _ in seen] == list(range(1, len(seen) + 1)), (task_id, seen)

    # Every grant a contender was told of is in the database, with its owner.
    recorded = {(r["task_id"], r["fence"], r["owner_id"]) for r in rows}
    assert set(holders.grants) <= recorded, set(holders.grants) - recorded
    assert len(set(holders.grants)) == len(holders.grants)  # no fence handed out twice
    for task_id in contested:
        owners = {owner for _, owner in grants_by_task[task_id]}
        assert len(owners) == 2, (task_id, grants_by_task[task_id])

    # Each steady lease kept fence 1 and its owner from claim to release, on several replicas.
    final = {t["task_id"]: t for t in tasks}
    for task_id in steady_tasks:
        lease = holders.steady[task_id]
        assert grants_by_task[task_id] == [(1, lease.owner_id)], grants_by_task[task_id]
        assert lease.fence == 1
        assert (final[task_id]["state"], final[task_id]["fence"]) == ("released", 1)
    for task_id in affected:
        writers = {r["replica"] for r in rows if r["task_id"] == task_id}
        assert victim.name in writers and len(writers) >= 2, (task_id, writers)

    writers = Counter(r["replica"] for r in rows)
    assert set(writers) == set(REPLICAS), writers
    print(
        f"\n[three replicas] {CLIENTS} clients (round_robin over {', '.join(REPLICAS)}),"
        f" {len(steady_tasks)} steady holders + {2 * len(contested)} contenders;"
        f" streams before the kill: {dict(Counter(before_kill.values()))};"
        f" {victim.name} SIGKILLed with {len(affected)} streams ({', '.join(affected)}):"
        f" all renewed elsewhere with fence 1 {resumed_at - started:.1f} s into the test;"
        f" {bounced.name} drained ({len(bounced_streams)} streams) and restarted, back in use"
        f" {back_at - started:.1f} s in; {len(holders.grants)} contended grants"
        f" ({holders.claim_timeouts} claim timeouts); versions written per replica"
        f" {dict(writers)}; history checker: {verdict.counts['grants.database']} grants,"
        " 0 violations"
    )
