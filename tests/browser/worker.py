"""A worker for the browser tests: holds one task with ``hold()`` until it loses it.

Usage: ``python tests/browser/worker.py TARGET NAMESPACE TASK_ID``

Prints ``held <fence>`` once the lease is granted, then keeps it (a heartbeat
every ttl / 3); when ``hold()`` raises LeaseLost it prints ``LeaseLost
<reason>`` and exits 0. Anything else ends it with a traceback (exit 1).
"""

from __future__ import annotations

import asyncio
import sys

from leasekeeper import LeaseClient, LeaseLost

TTL_S = 30.0


async def main(target: str, namespace: str, task_id: str) -> int:
    async with LeaseClient(target, namespace=namespace, token="") as client:
        try:
            async with client.hold(task_id, ttl=TTL_S) as lease:
                print(f"held {lease.fence}", flush=True)
                await asyncio.Event().wait()  # the work: until hold() cancels it
        except LeaseLost as lost:
            print(f"LeaseLost {lost.reason}", flush=True)
            return 0
    return 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(*sys.argv[1:4])))
