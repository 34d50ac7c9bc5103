"""The reference points leasekeeper's figures are divided by: ops for ``closed_loop``.

Each op is an ``op(worker, call)`` for :func:`bench.loadgen.closed_loop`.

- :func:`noop_server`: the bare grpc.aio server (``bench/noop_server.py``) in
  a process of its own; the suite drives it with the very ops it drives the
  real server with (``bench/scenarios.py``).
- :func:`raw_claim`: the server's own claim statement
  (``leasekeeper_server/storage/sql/queries.sql``) through an asyncpg pool of the
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
import dataclasses
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import asyncpg

from bench.etcd import etcd_claim, etcd_server
from bench.loadgen import Op
from bench.reference_process import REPO_ROOT, Target, log_tail, stop
from leasekeeper_server.storage import queries
from leasekeeper_server.storage.statements import ClaimParams

__all__ = [
    "POOL_SIZE",
    "Target",
    "etcd_claim",
    "etcd_server",
    "noop_server",
    "raw_claim",
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
async def _pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(dsn, min_size=POOL_SIZE, max_size=POOL_SIZE)
    try:
        yield pool
    finally:
        await pool.close()


@contextlib.asynccontextmanager
async def raw_claim(dsn: str, namespace: str) -> AsyncIterator[Op]:
    """An op running the server's claim statement through asyncpg, on a new task each call.

    The statement and arguments of ``Store.claim`` (``ClaimParams``: ttl 30 s,
    runtime budget 1 h, a request id, no lock delay, no attempt limit), task
    ids ``raw-{tag}-{worker}-{call}``, through a pool of 20 connections (the
    server's default). The database must be migrated
    (``leasekeeper_server.storage.migrate.migrate``).

    Yields:
        ``op(worker, call)``; it raises ``RuntimeError`` when no lease was
        granted, and asyncpg's errors.
    """
    sql = queries.load()["claim"]
    tag = _tag()
    owner = f"raw-owner-{tag}"
    names = [f.name for f in dataclasses.fields(ClaimParams)]
    async with _pool(dsn) as pool:

        async def claim(worker: int, call: int) -> object:
            task_id = f"raw-{tag}-{worker}-{call}"
            params = ClaimParams(
                namespace, task_id, owner, TTL, MAX_RUNTIME, task_id, NO_LOCK_DELAY, None
            )
            # A batch of one, as Store.claim sends a lone claim: an array per field.
            row = await pool.fetchrow(sql, *([getattr(params, n)] for n in names))
            if row is None:
                raise RuntimeError(f"task {task_id} not granted")
            return row

        yield claim
