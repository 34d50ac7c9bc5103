"""Many leases through sessions: 100,000 leases held through 1,000 Session streams, one server.

    .venv/bin/python -m bench.sessions_scale [--leases 100000] [--sessions 1000]
        [--interval 30] [--duration 90] [--ttl 90] [--database-url URL] [--out DIR]

Starts one ``leasekeeper serve`` process on a database of its own (a new one
on 127.0.0.1:5432, else an embedded PostgreSQL; ``bench.servers``), claims
the leases through the real client (in crowds), then opens the sessions over
several channels, each adding its share of the leases in one message, and
beats every session every ``interval`` seconds (phases spread evenly over the
interval) for ``duration`` seconds: by default a beat every 30 s for leases of
a 90 s ttl, the cadence ``hold()`` keeps (ttl / 3), as the heartbeat fleet of
``bench/run.py`` beats. Every beat must come back with each of
its session's leases renewed. Reports the renewals sent and acknowledged, the
latency of a renewal (a beat's round trip: each renewal waits for its beat's
answer) as p50 / p99 / max, the server's resident set size (RSS) before the
sessions, with them open, and at the end, its CPU per renewal, and the load
of the machine (``os.getloadavg``) around the run. Targets (issue 20): RSS
under 1 GiB, every renewal acknowledged, p99 under 50 ms.

This process drives every stream (raw ``Session`` calls, as ``fleet.py``
drives heartbeats): its own collector is made rare (the server's
``tune_gc``), or its pauses would count as the server's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

# Servers and PostgreSQL are started as subprocesses (fork + exec): grpc's fork
# handlers have nothing to do for them and only log about it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402
from google.protobuf import duration_pb2  # noqa: E402

from bench.procstat import cpu_seconds, rss_bytes  # noqa: E402
from bench.servers import bench_database, leasekeeper_server  # noqa: E402
from leasekeeper import LeaseClient  # noqa: E402
from leasekeeper.v1 import lease_service_pb2 as pb  # noqa: E402
from leasekeeper_server.cli.startup import tune_gc  # noqa: E402
from leasekeeper_server.storage.migrate import migrate  # noqa: E402

NAMESPACE = "bench-sessions"
SESSIONS_PER_CHANNEL = 250
CLAIM_CROWD = 1000
CLAIM_TTL_S = 1800.0
GiB = 1 << 30


async def claim_all(channel: grpc.aio.Channel, run_id: str, leases: int, ttl_s: float) -> None:
    """Claims ``run_id``-0 ... through the real client, CLAIM_CROWD at a time."""
    client = LeaseClient(namespace=NAMESPACE, owner_id=run_id, channel=channel)
    for start in range(0, leases, CLAIM_CROWD):
        results = await asyncio.gather(
            *(
                client.claim(f"{run_id}-{i}", ttl=ttl_s)
                for i in range(start, min(leases, start + CLAIM_CROWD))
            )
        )
        granted = [r for r in results if r.acquired and r.lease is not None and r.lease.fence]
        assert len(granted) == len(results), f"{len(results) - len(granted)} claims refused"


class Sessions:
    """The sessions' calls and what their beats saw."""

    def __init__(self) -> None:
        self.sent = 0  # renewals asked for (each lease of each beat)
        self.acked = 0  # renewals answered renewed (held, with a database write)
        self.latencies: list[float] = []  # one per renewal acknowledged: its beat's round trip
        self.errors: list[str] = []


async def open_session(
    channel: grpc.aio.Channel, run_id: str, first: int, count: int, ttl: duration_pb2.Duration
) -> Any:
    """A Session stream holding leases ``first`` .. ``first + count - 1`` (added in one message)."""
    stub = LeaseClient(channel=channel).stub
    call = stub.Session()
    adds = [
        pb.SessionRequest.Add(
            id=i + 1,
            namespace=NAMESPACE,
            task_id=f"{run_id}-{first + i}",
            owner_id=run_id,
            fence=1,
            ttl=ttl,
        )
        for i in range(count)
    ]
    await call.write(pb.SessionRequest(sequence=1, add=adds))
    reply = await call.read()
    assert reply is not grpc.aio.EOF, "the session ended"
    held = sum(h.renewed for h in reply.held)
    assert held == count, f"{held} of {count} leases added: {list(reply.lost)[:1]}"
    return call


async def keep(
    call: Any,
    count: int,
    phase_s: float,
    interval_s: float,
    stop_at: float,
    seen: Sessions,
) -> None:
    """Beats ``call`` every ``interval_s`` from ``phase_s`` on, until ``stop_at`` (loop time)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(phase_s)
    next_at = loop.time()
    sequence = 1
    while next_at < stop_at:
        sequence += 1
        began = time.perf_counter()
        seen.sent += count
        try:
            await call.write(pb.SessionRequest(sequence=sequence, beat=True))
            reply = await call.read()
        except grpc.aio.AioRpcError as error:
            seen.errors.append(f"{error.code().name}: {error.details()}")
            return
        took = time.perf_counter() - began
        if reply is grpc.aio.EOF or reply.sequence != sequence:
            seen.errors.append(f"beat {sequence} answered {reply!r}"[:200])
            return
        renewed = sum(h.renewed for h in reply.held)
        seen.acked += renewed
        seen.latencies += [took] * renewed
        if reply.lost:
            seen.errors.append(f"{len(reply.lost)} leases lost: {reply.lost[0]}")
        next_at += interval_s
        await asyncio.sleep(max(0.0, next_at - loop.time()))


def percentile_ms(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1000


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole measurement; its figures as a dict (printed and written as JSON)."""
    tune_gc()
    load_before = os.getloadavg()
    started = time.monotonic()
    run_id = f"s{random.getrandbits(32):08x}"
    per_session = args.leases // args.sessions
    leases = per_session * args.sessions
    ttl = duration_pb2.Duration(seconds=int(args.ttl))
    out = Path(args.out)
    async with bench_database(args.database_url) as database_url:
        await migrate(database_url)
        # Every beat is a renewal (none answered from the last one), as in bench.run.
        async with leasekeeper_server(database_url, out / "logs", min_renew_interval_s=0) as server:
            print(f"server pid {server.pid} on {server.address}", flush=True)
            channels = [
                grpc.aio.insecure_channel(
                    server.address, options=[("grpc.use_local_subchannel_pool", 1)]
                )
                for _ in range((args.sessions + SESSIONS_PER_CHANNEL - 1) // SESSIONS_PER_CHANNEL)
            ]
            calls: list[Any] = []
            try:
                claimed_at = time.monotonic()
                # Claimed for long enough to outlive the claiming; each add sets its own ttl.
                await claim_all(channels[0], run_id, leases, CLAIM_TTL_S)
                claim_s = time.monotonic() - claimed_at
                print(f"{leases:,} leases claimed in {claim_s:.0f} s", flush=True)
                rss_before = rss_bytes(server.pid)
                for start in range(0, args.sessions, 100):
                    calls += await asyncio.gather(
                        *(
                            open_session(
                                channels[s // SESSIONS_PER_CHANNEL],
                                run_id,
                                s * per_session,
                                per_session,
                                ttl,
                            )
                            for s in range(start, min(args.sessions, start + 100))
                        )
                    )
                rss_open = rss_bytes(server.pid)
                print(
                    f"{len(calls):,} sessions of {per_session} leases open; "
                    f"server RSS {rss_open / 2**20:,.0f} MiB",
                    flush=True,
                )
                seen = Sessions()
                loop = asyncio.get_running_loop()
                stop_at = loop.time() + args.duration
                cpu0 = cpu_seconds(server.pid)
                rss_peak = rss_open

                async def watch_rss() -> None:
                    nonlocal rss_peak
                    while loop.time() < stop_at:
                        rss_peak = max(rss_peak, rss_bytes(server.pid))
                        await asyncio.sleep(1.0)

                watcher = asyncio.create_task(watch_rss())
                await asyncio.gather(
                    *(
                        keep(
                            call,
                            per_session,
                            args.interval * s / len(calls),
                            args.interval,
                            stop_at,
                            seen,
                        )
                        for s, call in enumerate(calls)
                    )
                )
                watcher.cancel()
                cpu_s = cpu_seconds(server.pid) - cpu0
                rss_end = rss_bytes(server.pid)
                open_gauge = server.gauge("leasekeeper_session_streams_open")
            finally:
                for call in calls:
                    with contextlib.suppress(Exception):
                        call.cancel()
                for channel in channels:
                    await channel.close()
    ordered = sorted(seen.latencies)
    rss_max = max(rss_open, rss_peak, rss_end)
    return {
        "leases": leases,
        "sessions": args.sessions,
        "leases_per_session": per_session,
        "interval_s": args.interval,
        "duration_s": args.duration,
        "ttl_s": args.ttl,
        "claim_s": round(claim_s, 1),
        "renewals_sent": seen.sent,
        "renewals_acked": seen.acked,
        "errors": seen.errors[:10],
        "renewals_per_s": round(seen.acked / args.duration),
        "p50_ms": round(percentile_ms(ordered, 50), 2),
        "p99_ms": round(percentile_ms(ordered, 99), 2),
        "max_ms": round(ordered[-1] * 1000, 2) if ordered else 0.0,
        "server_rss_bytes_before_sessions": rss_before,
        "server_rss_bytes_sessions_open": rss_open,
        "server_rss_bytes_max": rss_max,
        "server_cpu_ms_per_renewal": round(cpu_s * 1000 / max(seen.acked, 1), 4),
        "server_cpu_share": round(cpu_s / args.duration, 2),
        "session_streams_open": open_gauge,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "elapsed_s": round(time.monotonic() - started, 1),
        "targets": {
            "rss_under_1_gib": rss_max < GiB,
            "every_renewal_acknowledged": seen.acked == seen.sent and not seen.errors,
            "p99_under_50_ms": percentile_ms(ordered, 99) < 50,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sessions_scale", description=__doc__)
    parser.add_argument("--leases", type=int, default=100_000)
    parser.add_argument("--sessions", type=int, default=1_000)
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between beats")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of beats")
    parser.add_argument("--ttl", type=float, default=90.0, help="each lease's ttl, seconds")
    parser.add_argument("--database-url", default=os.environ.get("LEASEKEEPER_BENCH_DATABASE_URL"))
    parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    try:
        import uvloop

        results = uvloop.run(run(args))
    except ImportError:
        results = asyncio.run(run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sessions_scale.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0 if all(results["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
