"""Small helpers for tests: building requests, reading rich errors, polling real state."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from leasekeeper.v1 import lease_service_pb2 as pb


def dur(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromTimedelta(timedelta(seconds=seconds))
    return d


def varint(value: int) -> bytes:
    """``value`` in protobuf's base-128 varint encoding (a negative one as ten bytes)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    """A protobuf field's key: its number and wire type."""
    return varint(number << 3 | wire_type)


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The single ErrorInfo of a failed call (asserts there is exactly one)."""
    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status on the error"
    infos = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            infos.append(info)
    assert len(infos) == 1, f"expected one ErrorInfo, got {len(infos)}"
    assert infos[0].domain == "leasekeeper"
    return infos[0]


def bad_request_fields(error: grpc.aio.AioRpcError) -> list[str]:
    """The field names of the BadRequest detail of a failed call."""
    status = rpc_status.from_call(error)
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            detail.Unpack(br)
            return [v.field for v in br.field_violations]
    return []


STEP_S = 15.0  # the longest one step may take on a loaded machine


async def poll(
    probe: Callable[[], Awaitable[Any]] | Callable[[], Any],
    what: str,
    within_s: float = STEP_S,
    interval_s: float = 0.02,
    details: Callable[[], str] | None = None,
) -> Any:
    """Calls ``probe()`` every ``interval_s`` until it returns something truthy; returns it.

    The way tests wait: on real state (a row, a scrape, a log line, a fake's
    state), bounded, never a fixed sleep followed by an assertion. ``probe``
    may be a coroutine function or a plain one. When it is not truthy within
    ``within_s`` seconds: AssertionError naming ``what``, followed by
    ``details()`` when given (a process's logs).
    """
    deadline = time.monotonic() + within_s
    while True:
        result = probe()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() >= deadline:
            message = f"not within {within_s} s: {what}"
            raise AssertionError(f"{message}\n{details()}" if details else message)
        await asyncio.sleep(interval_s)


async def claim_held(
    stub: Any, namespace: str, task_id: str, owner: str = "w", ttl: float = 30
) -> int:
    """Claims ``task_id`` for ``owner`` over ``stub`` (a LeaseServiceStub); asserts it was acquired.

    Returns:
        The lease's fence.
    """
    reply = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id=task_id, owner_id=owner, ttl=dur(ttl))
    )
    assert reply.acquired
    return int(reply.lease.fence)


async def seed_task_story(client: Any, ttl: float) -> None:
    """Gives ``job-1`` a story for the console's task page, and holds ``job-2``.

    ``job-1``: a grant, a checkpoint, a revoke, a second grant, its first fence
    refused at ValidateFence, and an effect reserved by the second fence.
    ``client`` is a ``leasekeeper.LeaseClient``; ``ttl`` is in seconds.
    """
    first = await client.claim("job-1", ttl=ttl)
    assert first.lease is not None
    await client.save_checkpoint("job-1", first.lease.fence, 1, b"step 1", "text/plain")
    await client.revoke("job-1", "moved to another host")
    second = await client.claim("job-1", ttl=ttl)
    assert second.lease is not None
    await client.validate_fence("job-1", first.lease.fence)  # a stale fence, refused
    await client.begin_effect("job-1", second.lease.fence, "email:welcome", policy="ONCE")
    await client.claim("job-2", ttl=ttl)
