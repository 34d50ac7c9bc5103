"""`leasekeeper serve --workers 2`: two server processes on one port and one database.

The supervisor and its workers are real processes. Which worker a connection
landed on is read from the workers' own metrics endpoints (worker k on the
metrics port + k): the one whose count of acquired claims went up. Each
channel keeps a subchannel of its own, so each is a new connection the
kernel may hand to either worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from leasekeeper import LeaseClient, LeaseError
from tests.fault.processes import ServerProcess, leasekeeper_command, server_env
from tests.helpers import poll

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

WORKERS = 2
STARTUP_TIMEOUT_S = 30.0
STEP_TIMEOUT_S = 15.0
POLL_S = 0.05
MAX_CHANNELS = 64  # new connections tried before giving up on reaching a given worker
_ALL_SERVING = re.compile(rf"serving on \S+ \(port (\d+)\) with {WORKERS} workers")


def free_port_run(count: int) -> int:
    """A port p with p .. p+count-1 all free on 127.0.0.1 now."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for offset in range(1, count):
                    with socket.socket() as other:
                        other.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
            return port
    raise AssertionError(f"no {count} consecutive free ports")


def children(pid: int) -> dict[int, list[str]]:
    """The live child processes of ``pid``: their pids and command lines (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if int(ppid) == pid and state != "Z":
            found[int(entry.name)] = [part.decode() for part in cmdline if part]
    return found


def worker_pids(supervisor_pid: int) -> dict[int, int]:
    """Worker index -> pid, of the supervisor's live worker processes."""
    pids = {}
    for pid, argv in children(supervisor_pid).items():
        if "--index" in argv:
            pids[int(argv[argv.index("--index") + 1])] = pid
    return pids


async def acquired_claims(metrics_port: int, namespace: str) -> float | None:
    """A worker's count of acquired claims in ``namespace``; None when its endpoint is down."""

    def scrape() -> str:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.read().decode()

    try:
        text = await asyncio.to_thread(scrape)
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "leasekeeper_claims_total" and sample.labels == {
                "namespace": namespace,
                "result": "acquired",
            }:
                return sample.value
    return 0.0


class Connections:
    """Clients on connections of their own, and the worker each one landed on."""

    def __init__(self, target: str, namespace: str, metrics_port: int) -> None:
        self.target = target
        self.namespace = namespace
        self.metrics_port = metrics_port
        self.opened: list[tuple[grpc.aio.Channel, LeaseClient]] = []
        self.serial = 0

    def open(self) -> LeaseClient:
        channel = grpc.aio.insecure_channel(
            self.target, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        client = LeaseClient(namespace=self.namespace, channel=channel)
        self.opened.append((channel, client))
        return client

    async def counts(self) -> list[float | None]:
        return [
            await acquired_claims(self.metrics_port + k, self.namespace) for k in range(WORKERS)
        ]

    async def claim_and_locate(self, client: LeaseClient) -> int:
        """Claims (and releases) a fresh task through ``client``; the worker that answered."""
        before = await self.counts()
        self.serial += 1
        result = await client.claim(f"probe-{self.serial}", ttl=5.0)
        assert result.acquired and result.lease is not None
        await client.release(f"probe-{self.serial}", result.lease.fence)
        after = await self.counts()
        moved = [
            k for k in range(WORKERS) if after[k] is not None and after[k] != (before[k] or 0.0)
        ]
        assert len(moved) == 1, f"claim counts before {before}, after {after}"
        return moved[0]

    async def client_on(self, worker: int) -> LeaseClient:
        """A client whose connection landed on ``worker`` (new connections until one does)."""
        for _ in range(MAX_CHANNELS):
            client = self.open()
            if await self.claim_and_locate(client) == worker:
                return client
        raise AssertionError(f"{MAX_CHANNELS} new connections, none reached worker {worker}")

    async def close(self) -> None:
        for channel, client in self.opened:
            await client.close()
            await channel.close()


@contextlib.asynccontextmanager
async def serve_workers(
    tmp_path: Path, database_url: str, metrics_port: int
) -> AsyncIterator[ServerProcess]:
    """``leasekeeper serve --workers 2`` in a session of its own; killed (the group) at the end."""
    env = server_env(
        database_url,
        metrics_listen=f"127.0.0.1:{metrics_port}",
        shutdown_grace_s=1.0,
        health_interval_s=0.2,
    )
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            *leasekeeper_command(),
            "serve",
            "--workers",
            str(WORKERS),
            env=env,
            cwd=tmp_path,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    server = ServerProcess(proc, log_path)
    try:

        async def all_serving():
            assert proc.returncode is None, f"serve exited early:\n{server.logs()}"
            return _ALL_SERVING.search(server.logs())

        match = await poll(all_serving, "all workers serving", STARTUP_TIMEOUT_S, POLL_S)
        server.port = int(match.group(1))
        await server.wait_serving(STEP_TIMEOUT_S)
        yield server
    finally:
        await server.kill()


@contextlib.asynccontextmanager
async def connections(
    server: ServerProcess, namespace: str, metrics_port: int
) -> AsyncIterator[Connections]:
    conns = Connections(server.target, namespace, metrics_port)
    try:
        yield conns
    finally:
        await conns.close()


async def serve_elsewhere(
    tmp_path: Path, database_url: str, listen: str, argv: list[str]
) -> tuple[int, str]:
    """Runs another ``leasekeeper ARGV`` on ``listen``; its exit code and output."""
    proc = await asyncio.create_subprocess_exec(
        *leasekeeper_command(),
        *argv,
        env=server_env(database_url, listen=listen, startup_wait_s=0),
        cwd=tmp_path,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), STEP_TIMEOUT_S)
    return proc.returncode or 0, out.decode(errors="replace")


async def claim_until_answered(client: LeaseClient, task_id: str) -> int:
    """Claims ``task_id`` through a connection whose worker may have died; the fence granted."""

    async def answered():
        try:
            return await client.claim(task_id, ttl=5.0)
        except LeaseError:  # UNAVAILABLE while the channel reconnects
            return None

    result = await poll(answered, f"a claim of {task_id} answered", STEP_TIMEOUT_S, POLL_S)
    assert result.acquired and result.lease is not None
    await client.release(task_id, result.lease.fence)
    return result.lease.fence


async def test_two_workers_share_one_port_and_database_restart_and_drain(
    database_url, namespace, tmp_path
):
    metrics_port = free_port_run(WORKERS)
    async with (
        serve_workers(tmp_path, database_url, metrics_port) as server,
        connections(server, namespace, metrics_port) as conns,
    ):
        supervisor = server.proc.pid
        pids = worker_pids(supervisor)
        assert sorted(pids) == [0, 1], f"workers {pids}\n{server.logs()}"
        assert len(set(pids.values())) == WORKERS
        assert supervisor not in pids.values()
        assert await conns.counts() == [0.0, 0.0]  # both metrics ports answer, nothing claimed

        # Claims through both workers, on one database: each new fence is higher.
        on = {k: await conns.client_on(k) for k in (0, 1)}
        fences = []
        for k in (0, 1, 0, 1):
            result = await on[k].claim("shared", ttl=5.0)
            assert result.acquired and result.lease is not None
            fences.append(result.lease.fence)
            await on[k].release("shared", result.lease.fence)
        assert fences == sorted(set(fences)), fences
        # Held through one worker, it is held for the other.
        held = await on[0].claim("held", ttl=5.0)
        assert held.acquired
        assert not (await on[1].claim("held", ttl=5.0)).acquired

        # SIGKILL worker 0: worker 1 keeps serving; the supervisor starts a new worker 0.
        killed = pids[0]
        os.kill(killed, signal.SIGKILL)
        fences.append(await claim_until_answered(on[1], "shared"))
        fences.append(await claim_until_answered(on[0], "shared"))  # reconnected elsewhere
        assert fences == sorted(set(fences)), fences

        async def restarted() -> bool:
            now = worker_pids(supervisor)
            return (
                now.get(0, killed) != killed
                and "serving again" in server.logs()
                and await acquired_claims(metrics_port, namespace) is not None
            )

        await poll(restarted, "worker 0 not restarted", STEP_TIMEOUT_S, POLL_S, details=server.logs)
        assert f"worker 0 (pid {killed}) was killed by SIGKILL" in server.logs()
        assert worker_pids(supervisor)[1] == pids[1]
        await conns.client_on(0)  # new connections reach the new worker 0 too
        await conns.client_on(1)

        # The port is shared on purpose only: another `serve` cannot take it, and says so
        # in one line before touching the database (no migration logged first).
        for argv in (["serve"], ["serve", "--workers", "2"]):
            code, out = await serve_elsewhere(tmp_path, database_url, server.target, argv)
            assert code == 1, out
            assert out.count("\n") == 1, out
            assert f"cannot listen on {server.target}" in out, out
            assert "LEASEKEEPER_LISTEN" in out, out

        # SIGTERM to the supervisor only: it forwards it, every worker drains, all exit 0.
        workers_now = worker_pids(supervisor)
        server.proc.send_signal(signal.SIGTERM)
        assert await server.wait_exit(STEP_TIMEOUT_S) == 0, server.logs()
        logs = server.logs()
        for k, pid in workers_now.items():
            assert f"worker {k} (pid {pid}) exited with status 0" in logs, logs
            with pytest.raises(ProcessLookupError):  # ended, and reaped by the supervisor
                os.kill(pid, 0)
        assert "all workers stopped" in logs
