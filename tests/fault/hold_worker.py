"""A worker for fault scenarios: hold a task with ``client.hold()`` and act on it in steps.

Usage::

    python tests/fault/hold_worker.py --target HOST:PORT --namespace NS --task-id T \
        --ttl-s 4 [--wait-s 15] [--steps N] [--call-timeout-s 10]

It prints one JSON object per line on stdout, each with ``event`` and ``mono``
(``time.monotonic()``: on Linux ``CLOCK_MONOTONIC``, one clock for every
process of the host, so the test can compare these instants with its own):

* ``claimed``: ``fence``, ``owner_id``;
* ``act``: one step of work, after ``lease.check()``; ``seq`` and
  ``trust_deadline`` (``mono + lease.remaining_s()``, the client's own end of
  trust at that moment);
* ``cancelled``: the body was cancelled by ``hold()`` (ownership lost), at ``mono``;
* ``lost``: ``hold()`` raised LeaseLost, with ``reason``;
* ``done``: the body finished its ``--steps`` and the lease was released;
* ``exit``: the process ends (after a loss it first waits for stdin to close,
  so the test can watch that nothing else happens).

A step every 20 ms, forever unless ``--steps`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from leasekeeper import LeaseClient, LeaseLost

STEP_INTERVAL_S = 0.02


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout, stamped with this host's monotonic clock."""
    print(json.dumps({"event": event, "mono": time.monotonic(), **fields}), flush=True)


async def wait_stdin_closed() -> None:
    """Returns when the test closes this process's stdin."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass


async def run(args: argparse.Namespace) -> int:
    client = LeaseClient(args.target, namespace=args.namespace, call_timeout=args.call_timeout_s)
    async with client:
        try:
            async with client.hold(args.task_id, ttl=args.ttl_s, wait=args.wait_s) as lease:
                emit("claimed", fence=lease.fence, owner_id=lease.owner_id)
                seq = 0
                try:
                    while args.steps is None or seq < args.steps:
                        try:
                            lease.check()
                        except LeaseLost:
                            # The deadline passed while this process was not running
                            # (hold() had no chance to cancel first): it stops all the same.
                            emit("cancelled", by="check")
                            raise
                        seq += 1
                        now = time.monotonic()
                        emit("act", seq=seq, trust_deadline=now + lease.remaining_s())
                        await asyncio.sleep(STEP_INTERVAL_S)
                except asyncio.CancelledError:
                    emit("cancelled", by="hold")
                    raise
        except LeaseLost as lost:
            emit("lost", reason=lost.reason)
            await wait_stdin_closed()
            emit("exit")
            return 3
    emit("done")
    emit("exit")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--task-id", required=True)
    parser.add_argument("--ttl-s", type=float, required=True)
    parser.add_argument("--wait-s", type=float, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--call-timeout-s", type=float, default=10.0)
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
