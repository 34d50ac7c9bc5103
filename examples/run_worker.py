"""A worker that runs a task in durable steps, and resumes where its predecessor stopped.

The loop of a resumable run, each step on real calls::

    1. claim the run and receive its fence          client.hold(...) -> lease.fence
    2. load the checkpoint and validate it again    lease.checkpoint -> the next step
    3. run a bounded step                           draft part N of the summary
    4. persist the step's output and the next       lease.effect(..., next_checkpoint=N):
       checkpoint together                          outcome and checkpoint in one transaction
    5. renew before the next step                   the heartbeat; a step starts only with
                                                    --step-s of trust left
    6. before the side effect, send the fence to    the gateway's Send carries the fence and
       the action boundary                          refuses an older one
    7. persist the result, then end the run         lease.complete(): COMPLETED

Each step publishes its part through the demo gateway (``gateway.py``) as the
effect ``part-N`` (policy ONCE), so a replacement that finds a step in doubt
asks the gateway (Lookup) instead of publishing twice.

Faults, for the demo and the tests: ``--stop-in-step N`` makes the worker
print ``worker NAME: in step N`` and stop itself (SIGSTOP) during step N,
before its effect, so that it can be killed (SIGKILL) there.

One line on stdout per event (``worker NAME: ...``); exit codes are
:class:`Exit`::

    python examples/run_worker.py --name A --target 127.0.0.1:9457 \
        --gateway 127.0.0.1:50051 --namespace demo --task-id report-7 --steps 4
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import os
import signal
import sys
from typing import Any

import grpc
from worker import add_worker_arguments, error_reason, run_to_exit, say

from leasekeeper import (
    Checkpoint,
    ClaimTimeout,
    EffectFailed,
    EffectRecord,
    HeldLease,
    LeaseClient,
    LeaseLost,
    Performed,
    TaskEnded,
    TaskQuarantined,
    request_digest,
)

SEND_METHOD = "/demo.v1.Gateway/Send"
LOOKUP_METHOD = "/demo.v1.Gateway/Lookup"
CALL_TIMEOUT_S = 10.0
CONTENT_TYPE = "application/json"


class Exit(enum.IntEnum):
    """The worker's exit codes."""

    COMPLETED = 0
    """Every step ran (here or before) and the task is COMPLETED."""
    ERROR = 1
    """Anything unexpected."""
    LOST = 3
    """The lease was lost (the block was cancelled, or a fence check refused it)."""
    NOT_ACQUIRED = 8
    """Another owner held the task for the whole wait."""
    ENDED = 9
    """The task had ended already (completed, failed, cancelled) or is quarantined."""


def resume_point(checkpoint: Checkpoint | None, steps: int) -> int:
    """The first step to run after ``checkpoint``, validated again (step 2 of the loop).

    Raises:
        ValueError: the checkpoint does not describe this run (its data does not
            name the step its version says, or a step past the run's end).
    """
    if checkpoint is None:
        return 1
    state = json.loads(checkpoint.data)
    if state.get("step") != checkpoint.version or not 1 <= checkpoint.version <= steps:
        raise ValueError(f"checkpoint {checkpoint.version} does not describe this run: {state}")
    return checkpoint.version + 1


class RunWorker:
    """One worker process: claim, run the remaining steps, complete."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name: str = args.name
        self._channel: grpc.aio.Channel | None = None
        self._client: LeaseClient | None = None
        self._lease: HeldLease | None = None

    def say(self, text: str) -> None:
        """Print one event line."""
        say(self.name, text)

    @property
    def lease(self) -> HeldLease:
        """The held lease (inside the block)."""
        assert self._lease is not None
        return self._lease

    async def _gateway(self, method: str, body: dict[str, Any]) -> Any:
        assert self._channel is not None
        call = self._channel.unary_unary(method)  # bytes in, bytes out
        reply = await call(
            json.dumps(body).encode(), metadata=self.lease.metadata(), timeout=CALL_TIMEOUT_S
        )
        return json.loads(reply)

    async def publish(self, step: int, part: str) -> Performed:
        """Step ``step``'s side effect: the gateway records the part under this fence (6)."""
        body = {"effect_key": f"part-{step}", "message": part}
        try:
            reply = await self._gateway(SEND_METHOD, body)
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.ABORTED:
                raise
            self.say(f"step {step}: the gateway refused fence {self.lease.fence}")
            raise EffectFailed(
                "the gateway refused the fence", retryable=True, result=error_reason(error)
            ) from error
        send_id = str(reply["send_id"])
        return Performed(send_id, external_operation_id=f"send-{send_id}")

    async def lookup(self, step: int, earlier: EffectRecord) -> str | None:
        """Whether an earlier attempt of step ``step`` was published (a fenced read)."""
        found = await self._gateway(LOOKUP_METHOD, {"effect_key": f"part-{step}"})
        self.say(
            f"step {step} was in doubt (fence {earlier.fence}); gateway found={found['found']}"
        )
        return str(found["send_id"]) if found["found"] else None

    async def run_step(self, step: int) -> None:
        """Steps 3 to 6 of the loop for one step."""
        lease = self.lease
        # (5) renew before the step: a lost lease raises LeaseLost here, before any work
        assert self._client is not None
        renewed = await self._client.renew(lease.task_id, lease.fence, ttl=self.args.ttl_s)
        self.say(f"step {step}: renewed fence {lease.fence}, {renewed.remaining_ttl:.1f} s left")
        if step == self.args.stop_in_step:
            self.say(f"in step {step}")
            os.kill(os.getpid(), signal.SIGSTOP)
        await asyncio.sleep(self.args.step_s)  # (3) the bounded model or tool step
        part = f"summary part {step} of {self.args.task_id}"
        state = {"step": step, "output": part}

        async def reconcile(earlier: EffectRecord) -> str | None:
            return await self.lookup(step, earlier)

        runner = lease.effect(
            f"part-{step}",
            policy="ONCE",
            request_digest=request_digest(part),
            reconcile=reconcile,
            next_checkpoint=(step, json.dumps(state).encode(), CONTENT_TYPE),  # (4)
        )
        outcome = await runner.run(self.publish, step, part)
        self.say(
            f"step {step} done: published send_id={outcome.result.decode()} "
            f"fresh={outcome.fresh}; checkpoint {step} saved with it (fence {lease.fence})"
        )

    async def run(self) -> Exit:
        """Claim, run the steps after the checkpoint, complete."""
        args = self.args
        client = LeaseClient(args.target, namespace=args.namespace, owner_id=args.owner_id)
        async with client, grpc.aio.insecure_channel(args.gateway) as channel:
            self._channel, self._client = channel, client
            try:
                async with client.hold(args.task_id, ttl=args.ttl_s, wait=args.wait_s) as lease:
                    self._lease = lease  # (1)
                    start = resume_point(lease.checkpoint, args.steps)  # (2)
                    self.say(
                        f"claimed task={args.task_id} fence={lease.fence} "
                        f"owner={lease.owner_id} checkpoint="
                        f"{lease.checkpoint.version if lease.checkpoint else 'none'} "
                        f"-> starting at step {start}"
                    )
                    for step in range(start, args.steps + 1):
                        await self.run_step(step)
                    await lease.complete()  # (7)
                    self.say(f"all {args.steps} steps done: task completed")
            except ClaimTimeout as error:
                self.say(f"not acquired: {error}")
                return Exit.NOT_ACQUIRED
            except (TaskEnded, TaskQuarantined) as error:
                self.say(f"the task has ended: {error.reason}")
                return Exit.ENDED
            except LeaseLost as error:
                self.say(f"lost the lease: {error.reason}")
                return Exit.LOST
        return Exit.COMPLETED


def main(argv: list[str] | None = None) -> int:
    """Entry point; the exit code is an :class:`Exit`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_worker_arguments(parser)
    parser.add_argument("--steps", type=int, default=4, help="steps in the run")
    parser.add_argument("--step-s", type=float, default=0.3, help="each step's work (seconds)")
    parser.add_argument("--stop-in-step", type=int, default=None, help="SIGSTOP in this step")
    args = parser.parse_args(argv)
    return run_to_exit(args.name, RunWorker(args).run(), Exit.ERROR)


if __name__ == "__main__":
    sys.exit(main())
