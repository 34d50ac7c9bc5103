"""The reference points leasekeeper's figures are divided by: ops for ``closed_loop``.

Each op is an ``op(worker, call)`` for :func:`bench.loadgen.closed_loop`.

- :func:`noop_server`: the bare grpc.aio server (``bench/noop_server.py``) in
  a process of its own; point :func:`client_claim` / :func:`client_validate`
  (the real ``LeaseClient``) or :func:`heartbeat_echo` (raw bidi streams) at it.
- :func:`raw_claim`, :func:`raw_validate`, :func:`raw_renew`: the server's own
  SQL (``leasekeeper_server/sql/queries.sql``) through an asyncpg pool of the
  server's default size, run in this process (no gRPC, no server code).
- :func:`etcd_server`, :func:`etcd_claim`: etcd doing the same claim (``bench/etcd.py``).

Every op context manager names its tasks with a tag of its own, so runs may
share a namespace. An op raises when the answer is not the expected one
(a claim not granted, a fence not valid), so the load generator counts it as
an error instead of a faster wrong path.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from google.protobuf.duration_pb2 import Duration

from bench.etcd import etcd_claim, etcd_server
from bench.loadgen import Op
from bench.reference_process import REPO_ROOT, Target, log_tail, stop
from leasekeeper import LeaseClient
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as pb_grpc
from leasekeeper_server import queries

__all__ = [
    "POOL_SIZE",
    "Target",
    "client_claim",
    "client_validate",
    "etcd_claim",
    "etcd_server",
    "heartbeat_echo",
    "noop_server",
    "raw_claim",
    "raw_renew",
    "raw_validate",
]

POOL_SIZE = 20  # the server's default pool_max_size
TTL = timedelta(seconds=30)
MAX_RUNTIME = timedelta(hours=1)
NO_LOCK_DELAY = timedelta(0)
START_TIMEOUT_S = 15.0


def _tag() -> str:
    return uuid.uuid4().hex[:10]


@contextlib.asynccontextmanager
async def noop_server(loop: str = "uvloop") -> AsyncIterator[Target]:
    """The bare grpc.aio LeaseService (``python -m bench.noop_server``) in a process of its own.

    Args:
        loop: its event loop, ``"uvloop"`` or ``"asyncio"``.

    Yields:
        Its address (``127.0.0.1:PORT``) and process id, once it listens.

    Raises:
        RuntimeError: it exited or did not listen within 15 s (with its stderr's tail).
    """
    with tempfile.TemporaryDirectory(prefix="bench-noop-") as tmp:
        log_path = Path(tmp) / "stderr.log"
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.noop_server",
                "--listen",
                "127.0.0.1:0",
                "--loop",
                loop,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        try:
            assert process.stdout is not None
            try:
                line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
            except TimeoutError:
                line = b""
            words = line.decode().split()
            if words[:2] != ["serving", "on"] or not words[-1].rstrip(")").isdigit():
                raise RuntimeError(
                    f"the no-op server did not start (said {line!r}):\n{log_tail(log_path)}"
                )
            yield Target(f"127.0.0.1:{words[-1].rstrip(')')}", process.pid)
        finally:
            await stop(process)


@contextlib.asynccontextmanager
async def client_claim(address: str, namespace: str = "default") -> AsyncIterator[Op]:
    """An op calling Claim through the real client, on a new task each call.

    Yields:
        ``op(worker, call)``; it raises ``RuntimeError`` when the claim is not
        granted, and the client's errors.
    """
    tag = _tag()
    async with LeaseClient(address, namespace=namespace) as client:

        async def claim(worker: int, call: int) -> object:
            result = await client.claim(f"claim-{tag}-{worker}-{call}", ttl=TTL)
            if not result.acquired:
                raise RuntimeError("claim not granted")
            return result

        yield claim


@contextlib.asynccontextmanager
async def client_validate(address: str, namespace: str = "default") -> AsyncIterator[Op]:
    """An op calling ValidateFence through the real client on a lease of its worker.

    Each worker claims one task on its first call (counted as that call), then
    validates its fence.

    Yields:
        ``op(worker, call)``; it raises ``RuntimeError`` when the fence is not
        valid, and the client's errors.
    """
    tag = _tag()
    fences: dict[int, tuple[str, int]] = {}
    async with LeaseClient(address, namespace=namespace) as client:

        async def validate(worker: int, call: int) -> object:
            held = fences.get(worker)
            if held is None:
                task_id = f"validate-{tag}-{worker}"
                claimed = await client.claim(task_id, ttl=timedelta(hours=1))
                if claimed.lease is None:
                    raise RuntimeError("claim not granted")
                fences[worker] = (task_id, claimed.lease.fence)
                return claimed
            check = await client.validate_fence(held[0], held[1])
            if not check.valid:
                raise RuntimeError(f"fence not valid: {check.reason}")
            return check

        yield validate


@contextlib.asynccontextmanager
async def heartbeat_echo(address: str, namespace: str = "default") -> AsyncIterator[Op]:
    """An op doing one ping-pong on its worker's own Heartbeat stream (raw stub, no client).

    A worker opens its stream on its first call; each call writes one
    ``HeartbeatRequest`` and reads one ``HeartbeatResponse``: a call is one
    echoed message. Meant for the no-op server, which echoes the fence.

    Yields:
        ``op(worker, call)``; it raises ``RuntimeError`` when the stream ends or
        the echoed fence differs.
    """
    tag = _tag()
    streams: dict[int, Any] = {}
    ttl = Duration(seconds=30)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.LeaseServiceStub(channel)

        async def echo(worker: int, call: int) -> object:
            stream = streams.get(worker)
            if stream is None:
                stream = streams[worker] = stub.Heartbeat()
            fence = call + 1
            await stream.write(
                pb.HeartbeatRequest(
                    namespace=namespace,
                    task_id=f"echo-{tag}-{worker}",
                    owner_id=f"echo-{tag}",
                    fence=fence,
                    ttl=ttl,
                )
            )
            response = await stream.read()
            if response is grpc.aio.EOF or response.fence != fence:
                raise RuntimeError(f"no echo: {response!r}")
            return response

        try:
            yield echo
        finally:
            for stream in streams.values():
                stream.cancel()


@contextlib.asynccontextmanager
async def _pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(dsn, min_size=POOL_SIZE, max_size=POOL_SIZE)
    try:
        yield pool
    finally:
        await pool.close()


@contextlib.asynccontextmanager
async def raw_claim(dsn: str, namespace: str) -> AsyncIterator[Op]:
    """An op running the server's claim statement through asyncpg, on a new task each call.

    The statement and arguments of ``Store.claim`` (ttl 30 s, runtime budget
    1 h, a request id, no lock delay), task ids ``raw-{tag}-{worker}-{call}``,
    through a pool of 20 connections (the server's default). The database must
    be migrated (``leasekeeper_server.migrate.migrate``).

    Yields:
        ``op(worker, call)``; it raises ``RuntimeError`` when no lease was
        granted, and asyncpg's errors.
    """
    sql = queries.load()["claim"]
    tag = _tag()
    owner = f"raw-owner-{tag}"
    async with _pool(dsn) as pool:

        async def claim(worker: int, call: int) -> object:
            task_id = f"raw-{tag}-{worker}-{call}"
            row = await pool.fetchrow(
                sql, namespace, task_id, owner, TTL, MAX_RUNTIME, task_id, NO_LOCK_DELAY
            )
            if row is None:
                raise RuntimeError(f"task {task_id} not granted")
            return row

        yield claim


async def _claim_once(pool: asyncpg.Pool, namespace: str, task_id: str, owner: str) -> int:
    """Claims ``task_id`` (ttl 1 h) with the server's statement; returns the fence."""
    hour = timedelta(hours=1)
    row = await pool.fetchrow(
        queries.load()["claim"], namespace, task_id, owner, hour, hour, task_id, NO_LOCK_DELAY
    )
    if row is None:
        raise RuntimeError(f"task {task_id} not granted")
    return int(row["fence"])


Act = Callable[[asyncpg.Pool, str, str, int], Awaitable[object]]


@contextlib.asynccontextmanager
async def _on_own_lease(dsn: str, namespace: str, kind: str, act: Act) -> AsyncIterator[Op]:
    """An op whose worker claims a task of its own on its first call (counted as that call),
    then runs ``act(pool, task_id, owner, fence)`` on it at every call."""
    tag = _tag()
    owner = f"raw-owner-{tag}"
    fences: dict[int, int] = {}
    async with _pool(dsn) as pool:

        async def op(worker: int, call: int) -> object:
            task_id = f"raw-{kind}-{tag}-{worker}"
            fence = fences.get(worker)
            if fence is None:
                fences[worker] = await _claim_once(pool, namespace, task_id, owner)
                return fences[worker]
            return await act(pool, task_id, owner, fence)

        yield op


def raw_validate(dsn: str, namespace: str) -> contextlib.AbstractAsyncContextManager[Op]:
    """An op running ValidateFence's read (the ``get_task`` statement) through asyncpg.

    Each worker claims a task of its own on its first call, then reads it and
    checks its fence is the one held; ``op`` raises ``RuntimeError`` when it
    is not, and asyncpg's errors.
    """
    sql = queries.load()["get_task"]

    async def validate(pool: asyncpg.Pool, task_id: str, owner: str, fence: int) -> object:
        row = await pool.fetchrow(sql, namespace, task_id)
        if row is None or row["fence"] != fence or row["state"] != "held":
            raise RuntimeError(f"fence {fence} of {task_id} not valid")
        return row

    return _on_own_lease(dsn, namespace, "validate", validate)


def raw_renew(dsn: str, namespace: str) -> contextlib.AbstractAsyncContextManager[Op]:
    """An op running the server's renew statement (ttl 30 s) through asyncpg.

    Each worker claims a task of its own on its first call, then renews it;
    ``op`` raises ``RuntimeError`` when the lease was not renewed, and
    asyncpg's errors.
    """
    sql = queries.load()["renew"]

    async def renew(pool: asyncpg.Pool, task_id: str, owner: str, fence: int) -> object:
        row = await pool.fetchrow(sql, namespace, task_id, owner, fence, TTL)
        if row is None:
            raise RuntimeError(f"lease {fence} of {task_id} not renewed")
        return row

    return _on_own_lease(dsn, namespace, "renew", renew)
