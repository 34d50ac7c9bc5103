"""Small helpers for tests: building requests, reading rich errors, polling real state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status


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
    probe: Callable[[], Awaitable[Any]],
    what: str,
    within_s: float = STEP_S,
    interval_s: float = 0.02,
) -> Any:
    """Awaits ``probe()`` every ``interval_s`` until it returns something truthy; returns it.

    The way tests wait: on real state (a row, a scrape, a log line), bounded,
    never a fixed sleep followed by an assertion.
    """
    deadline = time.monotonic() + within_s
    while True:
        if result := await probe():
            return result
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(interval_s)
