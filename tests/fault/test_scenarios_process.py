"""Three failure scenarios on real processes, each with one exact outcome.

Servers are ``leasekeeper serve`` processes on the test database
(``processes.py``); workers are Python processes using the client library
(``resume_worker.py``, ``examples/worker.py``). Nothing waits with a fixed
sleep: every step polls the state it needs (the database row, a process's
sockets, a line of output).

a. A server killed between the commit of a claim and its reply: the reply is
   swallowed by a proxy that black-holes the server-to-client direction, the
   claim is seen committed in the database, the server is SIGKILLed. The
   retry, with the same request_id, on another replica gets the same lease and
   fence back, unchanged (guarantees.md: "Claim again by the current live owner: the
   same lease back, no new fence"); ``hold()`` does that retry on its own.
b. Server replicas killed while heartbeat streams are open on them: every
   worker resumes its heartbeat on the surviving replica with the same fence,
   well inside its trust window, and never sees LeaseLost.
c. An owner id reused by a restarted process: the new incarnation's claim (a
   new request_id) gets the next fence; the old incarnation, frozen and then
   resumed, is refused by ValidateFence and by the effect boundary's fence
   table, and its heartbeat ends LEASE_SUPERSEDED.

Each test prints what it measured (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from leasekeeper import LeaseClient, LeaseInfo
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.fault.processes import ServerProcess, server_env, server_process
from tests.fault.proxy import tcp_proxy
from tests.helpers import STEP_S, dur, poll

# The process scenes of tests/process start the example scripts, which import
# each other by module name (as tests/process/conftest.py arranges there).
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))

from gateway import read_sends  # noqa: E402
from worker import Exit  # noqa: E402

from tests.process.scene import Scene  # noqa: E402

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]

RESUME_WORKER = Path(__file__).with_name("resume_worker.py")
SETTINGS = {"min_ttl_s": 0.1, "health_interval_s": 0.2}


@contextlib.asynccontextmanager
async def servers(
    count: int, tmp_path: Path, database_url: str
) -> AsyncIterator[list[ServerProcess]]:
    """``count`` server processes on the test database, started together."""
    async with contextlib.AsyncExitStack() as stack:
        env = server_env(database_url, **SETTINGS)
        started = await asyncio.gather(
            *(
                stack.enter_async_context(server_process(tmp_path / f"s{i}", env))
                for i in range(count)
            )
        )
        yield list(started)


async def task_row(db: asyncpg.Connection, namespace: str, task_id: str) -> asyncpg.Record | None:
    return await db.fetchrow(
        "SELECT owner_id, fence, state, expire_time, claim_time, update_time, claim_request_id"
        " FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = $2",
        namespace,
        task_id,
    )


def instant(value: Any) -> datetime:
    """A Timestamp proto as an aware UTC datetime (as asyncpg returns timestamptz)."""
    return value.ToDatetime(tzinfo=UTC)


def connected_ports(pid: int, ports: Sequence[int]) -> set[int]:
    """Which of ``ports`` (on 127.0.0.1) process ``pid`` has an ESTABLISHED TCP connection to.

    Read from the kernel: the socket inodes among the process's file
    descriptors, matched with /proc/net/tcp and tcp6 (gRPC's sockets are
    dual-stack: an IPv4 peer shows as ``::ffff:127.0.0.1``).
    """
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            link = os.readlink(f"{fd_dir}/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for line in rows.readlines()[1:]:
                fields = line.split()
                remote, state, inode = fields[2], fields[3], fields[9]
                port = int(remote.rsplit(":", 1)[1], 16)
                if state == "01" and inode in inodes and port in ports:
                    found.add(port)
    return found


def replicas(*servers: ServerProcess) -> str:
    """A gRPC target listing the servers in order (pick_first: the first that answers)."""
    return "ipv4:" + ",".join(s.target for s in servers)


# --- a. killed between the commit of a claim and its reply -----------------------------


async def test_server_killed_after_claim_commit_retry_elsewhere_gets_same_lease_and_fence(
    tmp_path, database_url, db, namespace
):
    request = pb.ClaimRequest(
        namespace=namespace,
        task_id="t",
        owner_id="worker-a",
        ttl=dur(30.0),
        request_id="7c9e6679-7425-40de-944b-e07fc1f90ae7",
    )
    async with servers(2, tmp_path, database_url) as (first, second):
        async with tcp_proxy("127.0.0.1", first.port) as proxy:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
                await asyncio.wait_for(channel.channel_ready(), STEP_S)
                proxy.black_hole("downstream")  # the request goes through, the reply never
                sent = time.monotonic()
                pending = asyncio.ensure_future(rpc.LeaseServiceStub(channel).Claim(request))

                async def committed() -> asyncpg.Record | None:
                    return await task_row(db, namespace, "t")

                granted = await poll(committed, "the claim committed")
                seen_committed = time.monotonic()
                assert not pending.done(), "the reply got through the black hole"
                await first.kill()
                killed = time.monotonic()
                proxy.restore()  # the partition heals; the connection to the dead server resets
                with pytest.raises(grpc.aio.AioRpcError) as lost:
                    await asyncio.wait_for(pending, STEP_S)
        assert lost.value.code() is grpc.StatusCode.UNAVAILABLE
        assert first.proc.returncode == -signal.SIGKILL
        assert (granted["owner_id"], granted["fence"], granted["state"]) == ("worker-a", 1, "held")
        assert granted["claim_request_id"] == request.request_id

        async with grpc.aio.insecure_channel(second.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            retry = await stub.Claim(request, timeout=STEP_S)
            answered = time.monotonic()
            old_client = await stub.Claim(
                pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="worker-a"),
                timeout=STEP_S,
            )
            check = await stub.ValidateFence(
                pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=1), timeout=STEP_S
            )

    assert retry.acquired
    lease = retry.lease
    assert (lease.owner_id, lease.fence, lease.state) == ("worker-a", 1, pb.TASK_STATE_HELD)
    assert instant(lease.expire_time) == granted["expire_time"]  # the same lease, not renewed
    assert instant(lease.claim_time) == granted["claim_time"]
    assert await task_row(db, namespace, "t") == granted  # the retry wrote nothing
    assert (old_client.acquired, old_client.lease.fence) == (True, 1)  # no request_id: the same
    assert check.valid and check.current_fence == 1
    print(
        f"\n[a: raw retry] committed {seen_committed - sent:.3f} s after sending;"
        f" killed {killed - seen_committed:.3f} s later; the retry on the other replica answered"
        f" {answered - killed:.3f} s after the kill: acquired fence={lease.fence},"
        f" expire_time unchanged, row unchanged"
    )


async def test_hold_retries_lost_claim_reply_on_next_replica_with_same_request_id(
    tmp_path, database_url, db, namespace
):
    async with servers(2, tmp_path, database_url) as (first, second):
        async with tcp_proxy("127.0.0.1", first.port) as proxy:
            # The proxy (to the first server) is listed first: pick_first connects there.
            target = f"ipv4:127.0.0.1:{proxy.port},{second.target}"
            async with LeaseClient(target, namespace=namespace, owner_id="worker-b") as client:
                await client.validate_fence("t", 1)  # the channel is up, through the proxy
                assert proxy.connections == 1
                proxy.black_hole("downstream")

                entered = asyncio.Event()
                leave = asyncio.Event()
                held: list[LeaseInfo] = []

                async def work() -> None:
                    async with client.hold("t", ttl=3.0, wait=STEP_S) as lease:
                        held.append(lease.info)
                        entered.set()
                        await leave.wait()

                started = time.monotonic()
                worker = asyncio.ensure_future(work())

                async def committed() -> asyncpg.Record | None:
                    return await task_row(db, namespace, "t")

                granted = await poll(committed, "the claim committed")
                assert not entered.is_set(), "hold() entered without the claim's reply"
                await first.kill()
                killed = time.monotonic()
                proxy.restore()
                await asyncio.wait_for(entered.wait(), STEP_S)
                entered_at = time.monotonic()

                async def renewed() -> bool:
                    now = await task_row(db, namespace, "t")
                    assert now is not None and now["fence"] == granted["fence"]
                    return now["expire_time"] > granted["expire_time"]

                await poll(renewed, "a renewal through the second server")
                renewed_at = time.monotonic()
                leave.set()
                await asyncio.wait_for(worker, STEP_S)

    info = held[0]
    assert (granted["owner_id"], granted["fence"]) == ("worker-b", 1)
    assert (info.owner_id, info.fence) == ("worker-b", 1)
    assert info.claim_time == granted["claim_time"]
    assert info.expire_time == granted["expire_time"]  # the committed lease, handed back
    after = await task_row(db, namespace, "t")
    assert after is not None
    # Released on exit with the same fence; the grant's request id is the one hold() retried with.
    assert (after["state"], after["fence"]) == ("released", 1)
    assert after["claim_request_id"] == granted["claim_request_id"]
    print(
        f"\n[a: hold()] claim committed {granted['claim_time']:%H:%M:%S.%f}; server killed;"
        f" hold() entered {entered_at - killed:.3f} s after the kill (started"
        f" {entered_at - started:.3f} s before) with fence={info.fence}; first renewal through"
        f" the other replica {renewed_at - entered_at:.3f} s later"
    )


# --- b. replicas killed with heartbeat streams open --------------------------------------

WORKERS = 4
HOLD_TTL_S = 3.0  # beats every 1 s; trust window 2.7 s after each confirmed renewal
TRUST_WINDOW_S = HOLD_TTL_S - min(1.0, HOLD_TTL_S / 10)


async def test_replicas_killed_with_streams_open_workers_resume_elsewhere_with_same_fence(
    tmp_path, database_url, db, namespace
):
    async with servers(3, tmp_path, database_url) as (s1, s2, s3):
        ports = [s1.port, s2.port, s3.port]
        # Half the workers reach s1 first, half s2; s3 carries no stream until the kill.
        orders = [(s1, s2, s3), (s2, s1, s3)]
        home = {i: orders[i % 2][0].port for i in range(WORKERS)}
        scene = Scene(s3.target, namespace, tmp_path)
        try:
            workers = [
                await scene.spawn(
                    f"worker-{i}",
                    [
                        sys.executable,
                        str(RESUME_WORKER),
                        replicas(*orders[i % 2]),
                        *(namespace, f"task-{i}", str(HOLD_TTL_S), f"owner-{i}"),
                    ],
                )
                for i in range(WORKERS)
            ]
            for worker in workers:
                assert (await worker.wait_for(r"claimed fence=(\d+)")).group(1) == "1"

            def on(port_of: Callable[[int], int]) -> Callable[[], Awaitable[bool]]:
                async def probe() -> bool:
                    return all(
                        connected_ports(w.process.pid, ports) == {port_of(i)}
                        for i, w in enumerate(workers)
                    )

                return probe

            async def renewed_by_stream() -> bool:
                rows = [await task_row(db, namespace, f"task-{i}") for i in range(WORKERS)]
                ttl = timedelta(seconds=HOLD_TTL_S)
                return all(r is not None and r["expire_time"] > r["claim_time"] + ttl for r in rows)

            await poll(on(lambda i: home[i]), "each worker connected to its first replica only")
            await poll(renewed_by_stream, "each lease renewed by its heartbeat stream")
            before = [await task_row(db, namespace, f"task-{i}") for i in range(WORKERS)]

            s1.send_signal(signal.SIGKILL)
            s2.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            assert await s1.wait_exit(STEP_S) == -signal.SIGKILL
            assert await s2.wait_exit(STEP_S) == -signal.SIGKILL

            await poll(on(lambda i: s3.port), "each worker reconnected to s3")
            moved = time.monotonic()
            at_move = [await task_row(db, namespace, f"task-{i}") for i in range(WORKERS)]

            def confirmations(worker: Any) -> list[float]:
                return [
                    float(m[1])
                    for m in re.finditer(r"confirmed mono=(\S+)", "\n".join(worker.lines))
                ]

            async def renewing_through_s3() -> bool:
                for i in range(WORKERS):
                    now = await task_row(db, namespace, f"task-{i}")
                    assert now is not None
                    assert (now["owner_id"], now["fence"], now["state"]) == (
                        f"owner-{i}",
                        1,
                        "held",
                    ), f"task-{i} changed hands: {dict(now)}"
                    if now["expire_time"] <= at_move[i]["expire_time"]:
                        return False
                return all(len([t for t in confirmations(w) if t > killed]) >= 3 for w in workers)

            # Renewals go on through s3, the only replica left: the database's expire_time
            # moves on after the move, and each worker confirms three renewals after the kill.
            await poll(renewing_through_s3, "renewals through s3")
            after = [await task_row(db, namespace, f"task-{i}") for i in range(WORKERS)]

            for worker in workers:
                worker.signal(signal.SIGTERM)
            codes = [await worker.exit_code(STEP_S) for worker in workers]
        finally:
            await scene.close()

    gaps, firsts, summaries = [], [], []
    for i, worker in enumerate(workers):
        assert codes[i] == 0, scene.stderr_of(worker)
        assert not worker.has("LeaseLost"), worker.lines
        line = await worker.wait_for(
            r"summary renewals=(\d+) max_gap_s=(\S+) min_remaining_s=(\S+)"
        )
        max_gap_s, min_remaining_s = float(line[2]), float(line[3])
        summaries.append((max_gap_s, min_remaining_s))
        # Across the kill: the last renewal confirmed before it and the first after it.
        confirmed = confirmations(worker)
        last_before = max(t for t in confirmed if t < killed)
        first_after = min(t for t in confirmed if t > killed)
        gaps.append(first_after - last_before)
        firsts.append(first_after - killed)
        assert first_after - last_before < TRUST_WINDOW_S
        assert max_gap_s < TRUST_WINDOW_S, line[0]
        assert min_remaining_s > 0.0, line[0]
        assert after[i]["expire_time"] > at_move[i]["expire_time"] >= before[i]["expire_time"]
        final = await task_row(db, namespace, f"task-{i}")
        assert final is not None and (final["state"], final["fence"]) == ("released", 1)
    print(
        f"\n[b] {WORKERS} workers with streams on s1 and s2 (ttl {HOLD_TTL_S} s, trust window"
        f" {TRUST_WINDOW_S:.1f} s); s1 and s2 SIGKILLed; every worker connected to s3 only"
        f" {moved - killed:.3f} s after the kill; first renewal confirmed after the kill "
        + ", ".join(f"{t:.3f}" for t in firsts)
        + " s after the kill; gap without a confirmed renewal across the kill "
        + ", ".join(f"{g:.3f}" for g in gaps)
        + " s (longest over the whole run "
        + ", ".join(f"{m[0]:.3f}" for m in summaries)
        + " s); least trust left "
        + ", ".join(f"{m[1]:.3f}" for m in summaries)
        + " s; no LeaseLost; owner and fence 1 unchanged"
    )


# --- c. an owner id reused after a restart ----------------------------------------------

TASK_ID = "contract-summary-r42"
REUSED_OWNER = "worker-0"
OWNER_TTL_S = 30.0  # far from expiry: only the new incarnation's claim can end A's lease
WORK_S = 4.0  # A sends this long after its claim: after it is resumed (see below)


async def test_owner_id_reused_by_new_process_supersedes_old_incarnations_fence(
    tmp_path, database_url, db, namespace
):
    async with (
        servers(1, tmp_path, database_url) as (server,),
        LeaseClient(server.target, namespace=namespace) as client,
    ):
        scene = Scene(server.target, namespace, tmp_path)
        try:
            gateway = await scene.start_gateway("--ledger-only")  # its fence table decides alone

            def worker(name: str, work_s: float, *extra: str) -> list[str]:
                argv = [sys.executable, str(EXAMPLES_DIR / "worker.py"), "--name", name]
                argv += ["--target", server.target, "--gateway", scene.gateway_address]
                argv += ["--namespace", namespace, "--task-id", TASK_ID]
                argv += ["--ttl-s", str(OWNER_TTL_S), "--work-s", str(work_s)]
                return [*argv, "--owner-id", REUSED_OWNER, *extra]

            a = await scene.spawn("worker-A", worker("A", WORK_S))
            assert (await a.wait_for(r"claimed .*fence=(\d+)")).group(1) == "1"
            claimed_a = time.monotonic()

            async def renewed_by_stream() -> bool:
                row = await task_row(db, namespace, TASK_ID)
                ttl = timedelta(seconds=OWNER_TTL_S)
                return row is not None and row["expire_time"] > row["claim_time"] + ttl

            await poll(renewed_by_stream, "A's heartbeat stream renewed its lease")
            a_row = await task_row(db, namespace, TASK_ID)
            a.signal(signal.SIGSTOP)  # frozen (a GC pause, a VM stall) with its stream open
            assert not a.has(r"send "), a.lines

            b = await scene.spawn("worker-B", worker("B", 0.0, "--wait-s", str(STEP_S)))
            assert await b.exit_code(STEP_S) == Exit.SENT, scene.stderr_of(b)
            claimed_b = await b.wait_for(r"claimed .*fence=(\d+)")
            b_row = await task_row(db, namespace, TASK_ID)

            def pushed() -> Awaitable[bool]:
                async def probe() -> bool:
                    return bool(
                        re.search(r"heartbeat ends: LEASE_SUPERSEDED .*fence=1", server.logs())
                    )

                return probe()

            await poll(pushed, "the server ended A's stream while A was frozen")
            check = await client.validate_fence(TASK_ID, 1)

            # A must be resumed before its send is due, so that its loss is decided before
            # it sends (the send itself is refused either way; see examples/worker.py).
            assert time.monotonic() - claimed_a < WORK_S - 1.0, "B took too long; raise WORK_S"
            a.signal(signal.SIGCONT)
            resumed = time.monotonic()
            code_a = await a.exit_code(STEP_S)
        finally:
            await scene.close()

    assert a_row is not None and b_row is not None
    assert claimed_b.group(1) == "2"
    assert (b_row["owner_id"], b_row["fence"]) == (REUSED_OWNER, 2)
    assert b_row["claim_request_id"] != a_row["claim_request_id"]
    assert b.has(r"send accepted fence=2 send_id=1 status=accepted"), b.lines
    assert b_row["claim_time"] < a_row["expire_time"]  # B took over a lease that was still live

    assert (check.valid, check.reason, check.current_fence) == (False, "LEASE_SUPERSEDED", 2)

    assert code_a == Exit.REFUSED_LEASE_LOST, scene.stderr_of(a)
    assert a.has(r"heartbeat stream ended code=ABORTED reason=LEASE_SUPERSEDED"), a.lines
    assert a.has(r"LeaseLost reason=LEASE_SUPERSEDED"), a.lines
    assert a.has(r"send REFUSED fence=1 code=ABORTED reason=FENCE_BELOW_ACCEPTED"), a.lines
    refusal = rf"REFUSED {re.escape(namespace)}/{TASK_ID} fence=1 by ledger"
    assert gateway.has(refusal), gateway.lines
    sends = read_sends(scene.ledger_path)
    assert [(r["task_id"], r["fence"]) for r in sends] == [(TASK_ID, 2)]
    assert "worker B" in sends[0]["message"]
    print(
        f"\n[c] A claimed fence 1 as {REUSED_OWNER!r} (ttl {OWNER_TTL_S} s), frozen; B claimed as"
        f" {REUSED_OWNER!r} {(b_row['claim_time'] - a_row['claim_time']).total_seconds():.3f} s"
        f" later with {(a_row['expire_time'] - b_row['claim_time']).total_seconds():.1f} s left on"
        f" A's lease: fence 2; ValidateFence(1): {check.reason}; A resumed"
        f" {resumed - claimed_a:.3f} s after its claim: heartbeat ended LEASE_SUPERSEDED, send"
        " refused by the fence table (FENCE_BELOW_ACCEPTED), exit 3; one send, fence 2"
    )
