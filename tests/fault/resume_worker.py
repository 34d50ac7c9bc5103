"""A worker process for test_scenarios_process.py: hold one task until SIGTERM, and say how it went.

Runs ``LeaseClient.hold()`` (heartbeat every ttl / 3) on one task and does
nothing else. While holding it samples its trust deadline every 10 ms: each
time the deadline moves forward a renewal was confirmed, so the longest time
between two moves is the longest gap with no confirmed renewal, and the least
time left before the deadline is how close the lease came to being given up.

Output, one line per event on stdout::

    claimed fence=N owner=OWNER
    confirmed mono=T                   (a renewal confirmed; T: time.monotonic(),
                                        CLOCK_MONOTONIC, shared by the host's processes)
    LeaseLost reason=REASON            (then exit 3)
    summary renewals=N max_gap_s=S min_remaining_s=S released
                                       (after SIGTERM; exit 0)

Usage: python resume_worker.py TARGET NAMESPACE TASK_ID TTL_S [OWNER_ID]
(TARGET may list replicas: ``ipv4:127.0.0.1:p1,127.0.0.1:p2``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

from leasekeeper import LeaseClient, LeaseLost

SAMPLE_S = 0.01
EXIT_LOST = 3


def say(text: str) -> None:
    print(text, flush=True)


async def hold(target: str, namespace: str, task_id: str, ttl_s: float, owner: str | None) -> int:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with LeaseClient(target, namespace=namespace, owner_id=owner) as client:
        try:
            async with client.hold(task_id, ttl=ttl_s, wait=ttl_s) as lease:
                say(f"claimed fence={lease.fence} owner={lease.owner_id}")
                renewals, max_gap_s, min_remaining_s = 0, 0.0, lease.remaining_s()
                deadline = time.monotonic() + lease.remaining_s()
                confirmed_at = time.monotonic()
                while not stop.is_set():
                    await asyncio.sleep(SAMPLE_S)
                    now = time.monotonic()
                    remaining_s = lease.remaining_s()
                    min_remaining_s = min(min_remaining_s, remaining_s)
                    if now + remaining_s > deadline + 0.001:  # the deadline moved: confirmed
                        deadline = now + remaining_s
                        max_gap_s = max(max_gap_s, now - confirmed_at)
                        confirmed_at, renewals = now, renewals + 1
                        say(f"confirmed mono={now:.6f}")
                max_gap_s = max(max_gap_s, time.monotonic() - confirmed_at)
        except LeaseLost as lost:
            say(f"LeaseLost reason={lost.reason}")
            return EXIT_LOST
    say(
        f"summary renewals={renewals} max_gap_s={max_gap_s:.3f}"
        f" min_remaining_s={min_remaining_s:.3f} released"
    )
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    target, namespace, task_id, ttl = sys.argv[1:5]
    owner = sys.argv[5] if len(sys.argv) > 5 else None
    return asyncio.run(hold(target, namespace, task_id, float(ttl), owner))


if __name__ == "__main__":
    sys.exit(main())
