"""A fleet of heartbeat streams: N leases, each kept by its own stream beating every k seconds.

Claims N tasks (through the real client, in crowds), opens one Heartbeat
stream per lease spread over several channels, then beats each stream every
``interval_s`` seconds (phases spread evenly) for ``duration_s`` seconds and
records every beat's round trip. Reports how many beats were sent and
acknowledged as renewed, the latency percentiles, and the server's resident
set size (RSS) with all streams open.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc
from google.protobuf import duration_pb2

from leasekeeper import LeaseClient
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.cli.startup import tune_gc

from .procstat import cpu_seconds, rss_bytes

STREAMS_PER_CHANNEL = 500


async def run_fleet(
    target: str,
    pid: int,
    namespace: str,
    streams: int,
    interval_s: float,
    duration_s: float,
    ttl_s: float = 90.0,
    window: Callable[[], AbstractAsyncContextManager[object]] | None = None,
) -> dict[str, Any]:
    """Runs the fleet against the server at ``target`` (process ``pid``); returns its figures.

    ``window``, if given, is entered when the beats start and left when they
    end (every stream open, the claims done): a caller's readings around them.

    This process holds all the client streams too: its own collector is made
    rare (the server's ``tune_gc``), or its pauses would be counted as the
    server's latency.
    """
    tune_gc()
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range((streams + STREAMS_PER_CHANNEL - 1) // STREAMS_PER_CHANNEL)
    ]
    run_id = f"fleet-{random.getrandbits(32):08x}"
    ttl = duration_pb2.Duration(seconds=int(ttl_s))
    calls: list[Any] = []
    latencies: list[float] = []
    sent = acked = 0
    try:
        client = LeaseClient(namespace=namespace, owner_id=run_id, channel=channels[0])
        fences: list[int] = []
        for start in range(0, streams, 1000):
            results = await asyncio.gather(
                *(
                    client.claim(f"{run_id}-{i}", ttl=ttl_s)
                    for i in range(start, min(streams, start + 1000))
                )
            )
            fences += [r.lease.fence for r in results if r.lease is not None]
        assert len(fences) == streams, f"{len(fences)} of {streams} claims granted"
        rss_before = rss_bytes(pid)

        async def open_stream(i: int) -> Any:
            stub = LeaseClient(channel=channels[i // STREAMS_PER_CHANNEL]).stub
            call = stub.Heartbeat()
            await call.write(
                pb.HeartbeatRequest(
                    namespace=namespace,
                    task_id=f"{run_id}-{i}",
                    owner_id=run_id,
                    fence=fences[i],
                    ttl=ttl,
                )
            )
            reply = await call.read()
            assert reply is not grpc.aio.EOF and reply.renewed, reply
            return call

        for start in range(0, streams, 1000):
            calls += await asyncio.gather(
                *(open_stream(i) for i in range(start, min(streams, start + 1000)))
            )
        rss_open = rss_bytes(pid)
        beat = pb.HeartbeatRequest()
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + duration_s
        cpu0 = cpu_seconds(pid)

        async def keep(i: int, call: Any) -> None:
            nonlocal sent, acked
            await asyncio.sleep(interval_s * i / streams)  # spread the phases
            next_at = loop.time()
            while next_at < stop_at:
                began = time.perf_counter()
                sent += 1
                await call.write(beat)
                reply = await call.read()
                if reply is not grpc.aio.EOF and reply.renewed:
                    acked += 1
                    latencies.append(time.perf_counter() - began)
                next_at += interval_s
                if next_at >= stop_at:
                    break  # no idle tail after the last beat
                await asyncio.sleep(max(0.0, next_at - loop.time()))

        async with window() if window is not None else contextlib.nullcontext():
            await asyncio.gather(*(keep(i, call) for i, call in enumerate(calls)))
        cpu = cpu_seconds(pid) - cpu0
        rss_end = rss_bytes(pid)
    finally:
        for call in calls:
            with contextlib.suppress(Exception):
                call.cancel()
        for channel in channels:
            await channel.close()
    ordered = sorted(latencies)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1000 if ordered else 0

    return {
        "streams": streams,
        "interval_s": interval_s,
        "duration_s": duration_s,
        "sent": sent,
        "acked": acked,
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "max_ms": ordered[-1] * 1000 if ordered else 0,
        "server_rss_bytes_before": rss_before,
        "server_rss_bytes": max(rss_open, rss_end),
        "server_cpu_ms_per_beat": cpu * 1000 / max(sent, 1),
    }
