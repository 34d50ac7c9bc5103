"""How many of the server's own frames a Claim and a beat cross to reach their SQL.

ARCHITECTURE.md promises a short path from the wire to SQL: a Claim reaches
its statement in at most four frames below its handler, and a beat in at most
four below the stream loop that reads it (interceptors and the libraries'
frames aside). A batched call crosses a task boundary (the caller waits on a
future while the batch's own task sends the statement), so the path is the
caller's suspended frames below the handler plus the sending task's frames,
both counted when the statement is sent, on a real server and database.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import FrameType
from typing import Any

import asyncpg
import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.storage.batch import Coalescer
from tests.conftest import RunningServer, running_server
from tests.helpers import dur

SERVER_PACKAGE = str(Path(__file__).resolve().parents[2] / "server" / "leasekeeper_server")
MAX_FRAMES_BELOW_HANDLER = 4


def _own(frames: list[FrameType]) -> list[str]:
    """The server package's frames among ``frames`` (oldest first), as ``file:function``."""
    return [
        f"{Path(f.f_code.co_filename).stem}:{f.f_code.co_name}"
        for f in frames
        if f.f_code.co_filename.startswith(SERVER_PACKAGE)
    ]


def _running_frames() -> list[FrameType]:
    """The running task's frames, oldest first (a running coroutine's f_back is its awaiter)."""
    frames: list[FrameType] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


@contextlib.asynccontextmanager
async def paths_to_sql(
    database_url: str, handler: str, statement_starts: str
) -> AsyncIterator[tuple[RunningServer, list[list[str]]]]:
    """A server, and the path from ``handler`` of each statement starting ``statement_starts``.

    ``handler`` is a ``file:function`` name. The path is the server's frames
    after it down to the statement; for a batched call, its frames down to
    ``Coalescer.submit`` (recorded when it submits) and then the frames of the
    batch's task that sends the statement.
    """
    paths: list[list[str]] = []
    submitted: list[list[str]] = []
    fetch, submit = asyncpg.connection.Connection.fetch, Coalescer.submit

    async def recording_submit(self: Any, item: Any) -> Any:
        submitted.append([*_own(_running_frames()), "batch:submit"])
        return await submit(self, item)

    async def recording_fetch(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
        if query.lstrip().startswith(statement_starts):
            sending = _own(_running_frames())
            callers = [sending] if handler in sending else [s for s in submitted if handler in s]
            if callers:
                path = callers[-1][callers[-1].index(handler) + 1 :]
                paths.append(path if callers[-1] is sending else path + sending)
        return await fetch(self, query, *args, **kwargs)

    # Patched before the server starts: a batched statement keeps its coalescer's bound submit.
    asyncpg.connection.Connection.fetch = recording_fetch  # type: ignore[method-assign]
    Coalescer.submit = recording_submit  # type: ignore[method-assign]
    try:
        async with running_server(database_url) as server:
            yield server, paths
    finally:
        asyncpg.connection.Connection.fetch = fetch  # type: ignore[method-assign]
        Coalescer.submit = submit  # type: ignore[method-assign]


@pytest.mark.asyncio
async def test_a_claim_reaches_its_statement_within_four_frames(database_url, namespace):
    # A statement's text starts with its comment (storage/queries.py keeps it).
    claim_sql = "-- Grants the lease of each claim"
    async with (
        paths_to_sql(database_url, "servicer:Claim", claim_sql) as (server, paths),
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        answer = await rpc.LeaseServiceStub(channel).Claim(
            pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(30))
        )
    assert answer.acquired
    assert paths, "the claim statement was not seen"
    assert all(len(p) <= MAX_FRAMES_BELOW_HANDLER for p in paths), paths


@pytest.mark.asyncio
async def test_a_beat_reaches_its_statement_within_four_frames(database_url, namespace):
    renew_sql = "-- The renewal of a batch of leases"
    async with (
        paths_to_sql(database_url, "heartbeat:run", renew_sql) as (server, paths),
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        answer = await stub.Claim(
            pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(30))
        )
        lease = answer.lease
        call = stub.Heartbeat()
        first = pb.HeartbeatRequest(
            namespace=namespace, task_id="t", owner_id="a", fence=lease.fence, ttl=dur(30)
        )
        await call.write(first)
        await call.read()  # the stream's first renewal
        beats_before = len(paths)
        await asyncio.sleep(0.1)  # past the test server's 0.05 s renew interval
        await call.write(pb.HeartbeatRequest(fence=lease.fence))
        reply = await call.read()
        await call.done_writing()
    assert reply.renewed
    beat_paths = paths[beats_before:]
    assert beat_paths, "the beat's renewal was not seen"
    assert all(len(p) <= MAX_FRAMES_BELOW_HANDLER for p in beat_paths), beat_paths
