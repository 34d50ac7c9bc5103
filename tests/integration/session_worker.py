"""A worker process that holds several leases through one client (its Session stream).

    python tests/integration/session_worker.py TARGET NAMESPACE TTL_S TASK_ID...

Enters one ``hold()`` block per task, prints ``holding N`` once all are held,
then waits in every block. Each block that ends prints ``lost TASK_ID REASON``
(``LeaseLost``) or ``ended TASK_ID ERROR``; the process exits 0 once every
block has ended with LeaseLost, 1 otherwise. ``test_session.py`` freezes it
with SIGSTOP and resumes it with SIGCONT.
"""

from __future__ import annotations

import asyncio
import sys

from leasekeeper import LeaseClient, LeaseLost


async def hold(client: LeaseClient, task_id: str, ttl_s: float, held: asyncio.Queue[str]) -> bool:
    try:
        async with client.hold(task_id, ttl=ttl_s):
            await held.put(task_id)
            await asyncio.Event().wait()
    except LeaseLost as lost:
        print(f"lost {task_id} {lost.reason}", flush=True)
        return True
    except Exception as error:  # reported, and the exit code says it
        print(f"ended {task_id} {error!r}", flush=True)
    return False


async def main(target: str, namespace: str, ttl_s: float, task_ids: list[str]) -> int:
    held: asyncio.Queue[str] = asyncio.Queue()
    async with LeaseClient(target, namespace=namespace) as client:
        blocks = [asyncio.create_task(hold(client, t, ttl_s, held)) for t in task_ids]
        for _ in task_ids:
            await held.get()
        print(f"holding {len(task_ids)}", flush=True)
        results = await asyncio.gather(*blocks)
    return 0 if all(results) else 1


if __name__ == "__main__":
    target, namespace, ttl = sys.argv[1:4]
    sys.exit(asyncio.run(main(target, namespace, float(ttl), sys.argv[4:])))
