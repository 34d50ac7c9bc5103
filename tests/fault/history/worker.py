"""One worker process of the history workload: claims, holds, acts, records everything.

Run as ``python -m tests.fault.history.worker`` from the repository root (the
workload does). It loops until SIGTERM: pick one of a few task slots at
random, ``hold()`` its current task with a short ttl (and the slot's
``--max-attempts``), and in the held block run a few steps of the task's run,
each one an effect through the effect ledger (``lease.effect``) whose
function applies it to the outside system (``history_applies``, behind the
fence table), sometimes a ``ValidateFence`` of its own fence, and mostly a
checkpoint of the run's progress after it (version = the run's step number;
on the heartbeat or by SaveCheckpoint). A grant resumes the run from the
checkpoint it received; the step that reaches ``--run-steps`` ends the run
(complete, or sometimes fail). A slot whose task ended (completed, failed, or
cancelled by the operator) moves on to its next task,
``task-<slot>.<generation>``: every worker finds the same name. Every call
and answer is appended to the history file as one JSON line, written with a
single ``write`` on an ``O_APPEND`` descriptor, so a SIGKILL loses at most
the line being written.

Database instants are written as integer microseconds since the epoch
(``*_us``); ``t`` is this machine's CLOCK_MONOTONIC in seconds, shared by every
process, so the workload's fault times and the workers' times compare.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Awaitable
from datetime import datetime
from functools import partial
from typing import Any

import asyncpg

from leasekeeper import (
    Checkpoint,
    CheckpointNotNewer,
    EffectFailed,
    EffectInDoubt,
    FenceRefused,
    LeaseClient,
    LeaseError,
    LeaseLost,
    NotAcquired,
    StaleFence,
    TaskEnded,
    TaskQuarantined,
)
from leasekeeper.fence_table import accept_fence_asyncpg
from leasekeeper.lease import HeldLease

from .schema import FIND_APPLY_SQL, INSERT_APPLY_SQL

DEADLINE_SAMPLE_S = 0.02
STALL_PROBE_S = 0.02
STALL_RECORDED_S = 0.1  # a loop that woke this much late was starved (or paused)
CHECKPOINT_CONTENT_TYPE = "application/json"
# Loss reasons that end the task itself, not only the lease: its slot moves on.
TASK_ENDED_REASONS = frozenset({"TASK_COMPLETED", "TASK_CANCELLED", "TASK_FAILED"})


def micros(instant: datetime | None) -> int | None:
    """A database instant as integer microseconds since the epoch (exact)."""
    if instant is None:
        return None
    delta = instant - datetime(1970, 1, 1, tzinfo=instant.tzinfo)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def task_name(slot: int, generation: int) -> str:
    """The task of ``slot`` after ``generation`` ended ones: ``task-1``, ``task-1.1``, ..."""
    return f"task-{slot}" if generation == 0 else f"task-{slot}.{generation}"


def slot_of(task_id: str) -> tuple[int, int]:
    """``(slot, generation)`` of a :func:`task_name`."""
    slot, _, generation = task_id.removeprefix("task-").partition(".")
    return int(slot), int(generation or 0)


def checkpoint_data(task_id: str, fence: int, owner_id: str, version: int) -> bytes:
    """A checkpoint's data: it names its writer, so a reader can tell whose it is."""
    return json.dumps({"task": task_id, "fence": fence, "owner": owner_id, "v": version}).encode()


def checkpoint_fields(checkpoint: Checkpoint | None) -> dict[str, Any]:
    """A checkpoint received (claim, GetLease) as history fields (``cp_*``)."""
    if checkpoint is None:
        return {"cp_version": 0}
    return {
        "cp_version": checkpoint.version,
        "cp_fence": checkpoint.fence,
        "cp_write_us": micros(checkpoint.write_time),
        "cp_data": checkpoint.data.decode(errors="replace"),
    }


class History:
    """Appends one JSON object per line to a file shared with nobody else."""

    def __init__(self, path: str, worker: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._worker = worker

    def add(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"ev": ev, "w": self._worker, "t": time.monotonic(), **fields})
        os.write(self._fd, (line + "\n").encode())


class Worker:
    """The loop of one worker process; see the module docstring."""

    def __init__(self, args: argparse.Namespace, history: History, pool: asyncpg.Pool) -> None:
        self.args = args
        self.history = history
        self.pool = pool
        self.rng = random.Random(args.seed)
        self.client = LeaseClient(args.target, args.namespace, call_timeout=args.call_timeout)
        self.stopping = asyncio.Event()
        self.deadline = 0.0  # the held lease's trust deadline (monotonic), sampled
        self.generations = [0] * args.tasks  # per slot, how many of its tasks ended
        self.step = 0  # the steps of the held task's run done (its checkpoint's version)

    def task_ended(self, task_id: str) -> None:
        """Moves the task's slot on to its next task (once, whoever learns of the end first)."""
        slot, generation = slot_of(task_id)
        self.generations[slot] = max(self.generations[slot], generation + 1)

    async def run(self) -> None:
        h = self.history
        h.add("start", owner=self.client.owner_id, pid=os.getpid())
        watch = asyncio.get_running_loop().create_task(self.watch_stalls())
        try:
            while not self.stopping.is_set():
                await self.one_lease()
        finally:
            watch.cancel()
            await self.client.close()
            h.add("stop", owner=self.client.owner_id)

    async def watch_stalls(self) -> None:
        """Records each time this process did not run for a while (``stall`` events).

        On a loaded machine a process can wait for a core long enough to miss
        its own timers, as a SIGSTOPped one does; the checker then excuses a late
        loss as it excuses one after a pause (and fences must protect the effect).
        """
        while True:
            before = time.monotonic()
            await asyncio.sleep(STALL_PROBE_S)
            late_s = time.monotonic() - before - STALL_PROBE_S
            if late_s >= STALL_RECORDED_S:
                self.history.add("stall", since=before + STALL_PROBE_S, stall_s=late_s)

    async def one_lease(self) -> None:
        h, rng, args = self.history, self.rng, self.args
        slot = rng.randrange(args.tasks)
        task_id = task_name(slot, self.generations[slot])
        max_attempts = args.max_attempts[slot] if slot < len(args.max_attempts) else 0
        release = rng.random() >= args.abandon_rate
        fence = 0
        h.add("claim", task=task_id)
        try:
            async with self.client.hold(
                task_id, ttl=args.ttl, release_on_exit=release, max_attempts=max_attempts
            ) as lease:
                fence = lease.fence
                info = lease.info
                expire_us = micros(info.expire_time)
                assert expire_us is not None
                self.deadline = time.monotonic() + lease.remaining_s()
                h.add(
                    "grant",
                    task=task_id,
                    fence=fence,
                    owner=info.owner_id,
                    claim_us=micros(info.claim_time),
                    expire_us=expire_us,
                    db_now_us=expire_us - round(info.remaining_ttl * 1e6),
                    deadline=self.deadline,
                    attempts=info.attempts,
                    max_attempts=info.max_attempts,
                    **checkpoint_fields(lease.checkpoint),
                )
                sampler = asyncio.get_running_loop().create_task(self.sample_deadline(lease))
                try:
                    await self.steps(lease)
                except asyncio.CancelledError:
                    # hold() cancels the block the moment ownership is lost: this
                    # is when the worker learns of it (the release that follows
                    # may take a while longer).
                    loss = lease.loss
                    h.add(
                        "cancelled",
                        task=task_id,
                        fence=fence,
                        deadline=self.deadline,
                        lost_t=time.monotonic(),
                        reason=loss.reason if loss else None,
                    )
                    raise
                finally:
                    sampler.cancel()
            h.add("released" if release else "abandoned", task=task_id, fence=fence)
        except NotAcquired as error:
            h.add("refused", task=task_id, holder_remaining_ttl=error.holder_remaining_ttl)
            await asyncio.sleep(rng.uniform(0.02, args.ttl / 4))
        except TaskEnded as error:
            # FAILED_PRECONDITION TASK_COMPLETED, TASK_CANCELLED or TASK_FAILED.
            h.add("claim_ended", task=task_id, reason=error.reason)
            self.task_ended(task_id)
        except TaskQuarantined as error:
            # Its attempts are used up: the operator decides (Retry or Cancel).
            h.add("claim_quarantined", task=task_id, reason=error.reason)
            await asyncio.sleep(rng.uniform(0.02, args.ttl / 4))
        except LeaseLost as error:
            # code ABORTED: the service refused the fence, or the client's own trust
            # deadline passed (the client's LeaseLost carries ABORTED for both).
            h.add(
                "lost",
                task=task_id,
                fence=fence or error.fence,
                reason=error.reason,
                code=error.code.name if error.code is not None else None,
            )
            if error.code is not None and error.reason in TASK_ENDED_REASONS:
                self.task_ended(task_id)
            if fence and rng.random() < args.zombie_rate:
                await self.zombie_save(task_id, fence)
        except StaleFence as error:
            h.add("stale", task=task_id, fence=fence, reason=error.reason)
        except (EffectInDoubt, EffectFailed) as error:
            h.add("effect_error", task=task_id, fence=fence, error=type(error).__name__)
        except LeaseError as error:
            h.add(
                "error",
                task=task_id,
                fence=fence,
                error=type(error).__name__,
                reason=error.reason,
                code=str(error.code),
            )
            await asyncio.sleep(rng.uniform(0.05, 0.3))
        # InternalClientError: asyncpg found a pooled connection of the outside system
        # still mid-operation ("another operation is in progress"), seen once under a
        # Patroni switchover (tests/ha) after an effect was cancelled mid-query; the pool
        # terminates that connection, and the next apply gets a new one.
        except (
            OSError,
            asyncpg.PostgresError,
            asyncpg.InterfaceError,
            asyncpg.InternalClientError,
            TimeoutError,
        ) as error:
            h.add("error", task=task_id, fence=fence, error=type(error).__name__)
            await asyncio.sleep(rng.uniform(0.05, 0.3))

    async def sample_deadline(self, lease: HeldLease) -> None:
        """Keeps ``self.deadline`` within a few ms of the lease's trust deadline."""
        while True:
            if not lease.lost:
                self.deadline = time.monotonic() + lease.remaining_s()
            await asyncio.sleep(DEADLINE_SAMPLE_S)

    async def steps(self, lease: HeldLease) -> None:
        """A few steps of the task's run, resumed from the checkpoint the grant carried."""
        rng, args = self.rng, self.args
        done = self.step = lease.checkpoint.version if lease.checkpoint is not None else 0
        for step in range(rng.randint(1, args.max_steps)):
            await asyncio.sleep(rng.uniform(0, args.ttl * args.work_fraction))
            if rng.random() < args.validate_rate:
                await self.validate(lease)
            policy = "ONCE" if rng.random() < args.once_rate else "LATEST"
            # ONCE keys are shared by the owners of four consecutive fences (a
            # replacement must find its predecessor's effect), then fresh ones
            # start, so a long run keeps applying new ONCE effects.
            key = f"once-r{lease.fence // 4}-{step}" if policy == "ONCE" else f"latest-{step}"
            runner = lease.effect(key, policy=policy, reconcile=partial(self.reconcile, lease, key))
            outcome = await runner.run(partial(self.apply, lease, key, policy))
            self.history.add(
                "effect",
                task=lease.task_id,
                fence=lease.fence,
                key=key,
                policy=policy,
                fresh=outcome.fresh,
                result=outcome.result.decode(errors="replace"),
            )
            done = self.step = done + 1
            if done >= args.run_steps:
                await self.end_run(lease)
                return
            if rng.random() < args.checkpoint_rate:
                await self.save_checkpoint(lease, done)
            if self.stopping.is_set():
                return

    async def save_checkpoint(self, lease: HeldLease, version: int) -> None:
        """Saves the run's progress: on the heartbeat (``lease``) or by SaveCheckpoint.

        SaveCheckpoint is sent whatever this worker believes of its lease (a
        paused worker's may be lost): the service decides.
        """
        data = checkpoint_data(lease.task_id, lease.fence, lease.owner_id, version)
        if self.rng.random() < self.args.beat_checkpoint_rate:
            via, save = "beat", lease.save_checkpoint(version, data, CHECKPOINT_CONTENT_TYPE)
        else:
            save = self.client.save_checkpoint(
                lease.task_id, lease.fence, version, data, CHECKPOINT_CONTENT_TYPE
            )
            via = "call"
        fields = {"task": lease.task_id, "fence": lease.fence, "version": version}
        await self.record_save(save, via=via, lost=lease.lost, **fields)

    async def zombie_save(self, task_id: str, fence: int) -> None:
        """After a loss, one more save under the lost fence: the service must refuse it.

        Unless the lease is in fact still live (the trust deadline comes before
        the expiry): then it is a save like any other.
        """
        version = self.step + 1
        data = checkpoint_data(task_id, fence, self.client.owner_id, version)
        save = self.client.save_checkpoint(task_id, fence, version, data, CHECKPOINT_CONTENT_TYPE)
        with contextlib.suppress(LeaseLost):
            await self.record_save(
                save, via="zombie", lost=True, task=task_id, fence=fence, version=version
            )

    async def record_save(self, save: Awaitable[Checkpoint], via: str, **fields: Any) -> None:
        """Awaits one save and records its answer.

        Only OK is recorded as ``checkpoint_saved``: the checker holds the
        service to each one. An error leaves the write unknown.

        Raises:
            LeaseLost: The lease is lost (recorded as ``checkpoint_lost``).
        """
        h = self.history
        try:
            saved = await save
        except CheckpointNotNewer as error:
            # Only this fence writes the task's checkpoint now, in rising versions:
            # the checker reports this refusal.
            h.add("checkpoint_not_newer", via=via, current=error.current_version, **fields)
            return
        except LeaseLost as error:
            code = error.code.name if error.code is not None else None
            h.add("checkpoint_lost", via=via, reason=error.reason, code=code, **fields)
            raise
        except LeaseError as error:  # UNAVAILABLE, DEADLINE_EXCEEDED: unknown; the run goes on
            h.add("checkpoint_error", via=via, error=type(error).__name__, **fields)
            return
        h.add(
            "checkpoint_saved",
            via=via,
            saved_version=saved.version,
            saved_fence=saved.fence,
            write_us=micros(saved.write_time),
            **fields,
        )

    async def end_run(self, lease: HeldLease) -> None:
        """The run's last step is done: complete the task, or sometimes fail it."""
        fail = self.rng.random() < self.args.fail_rate
        info = await (lease.fail("the run failed") if fail else lease.complete())
        event = "failed" if fail else "completed"
        self.history.add(event, task=lease.task_id, fence=lease.fence, state=info.state)
        self.task_ended(lease.task_id)

    async def validate(self, lease: HeldLease) -> None:
        sent_t = time.monotonic()  # an answer may only reflect what committed before this
        check = await self.client.validate_fence(lease.task_id, lease.fence)
        fields: dict[str, Any] = {}
        if check.valid and check.expire_time is not None:
            expire_us = micros(check.expire_time)
            assert expire_us is not None
            fields = {
                "expire_us": expire_us,
                "db_now_us": expire_us - round(check.remaining_ttl * 1e6),
            }
        self.history.add(
            "validate",
            task=lease.task_id,
            fence=lease.fence,
            valid=check.valid,
            current_fence=check.current_fence,
            reason=check.reason,
            sent_t=sent_t,
            **fields,
        )

    async def apply(self, lease: HeldLease, key: str, policy: str) -> str:
        """The effect: one transaction that accepts the fence, then records the apply."""
        h = self.history
        h.add(
            "apply",
            task=lease.task_id,
            fence=lease.fence,
            key=key,
            policy=policy,
            deadline=self.deadline,
            lost=lease.lost,
        )
        # The outside system's latency (a vendor's API): a pause or a loss can land
        # between PROCEED and the write, which the fence table must then refuse.
        await asyncio.sleep(self.rng.uniform(0, self.args.ttl * self.args.effect_latency_fraction))
        async with self.pool.acquire() as conn, conn.transaction():
            try:
                await accept_fence_asyncpg(conn, lease.ref)
            except FenceRefused as refused:
                # Nothing happened: the reservation stays in doubt for the next
                # owner, whose fenced read will find no apply.
                h.add(
                    "apply_refused",
                    task=lease.task_id,
                    fence=lease.fence,
                    key=key,
                    highest_fence=refused.highest_fence,
                )
                raise
            row = await conn.fetchrow(
                INSERT_APPLY_SQL,
                lease.namespace,
                lease.task_id,
                key,
                policy,
                lease.fence,
                lease.owner_id,
            )
        h.add(
            "applied",
            task=lease.task_id,
            fence=lease.fence,
            key=key,
            policy=policy,
            apply_id=row["apply_id"],
            apply_us=micros(row["apply_time"]),
        )
        return f"apply-{row['apply_id']}"

    async def reconcile(self, lease: HeldLease, key: str, effect: object) -> str | None:
        """A fenced read of the outside system: the apply's id, or None (never applied)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await accept_fence_asyncpg(conn, lease.ref)
            apply_id = await conn.fetchval(FIND_APPLY_SQL, lease.namespace, lease.task_id, key)
        self.history.add(
            "reconciled", task=lease.task_id, fence=lease.fence, key=key, apply_id=apply_id
        )
        return None if apply_id is None else f"apply-{apply_id}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="the lease service (gRPC target)")
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--effects-url", required=True, help="PostgreSQL of the outside system")
    parser.add_argument("--history", required=True, help="JSON-lines file to append to")
    parser.add_argument("--name", required=True, help="this worker's label in the history")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--tasks", type=int, default=3, help="task slots")
    parser.add_argument(
        "--max-attempts",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        help="per slot, the attempt limit its claims carry (comma-separated; 0 or absent: none)",
    )
    parser.add_argument(
        "--run-steps", type=int, default=12, help="steps of a task's run; the last ends it"
    )
    parser.add_argument("--checkpoint-rate", type=float, default=0.7)
    parser.add_argument(
        "--beat-checkpoint-rate",
        type=float,
        default=0.6,
        help="share of checkpoints saved on the heartbeat (the rest by SaveCheckpoint)",
    )
    parser.add_argument(
        "--fail-rate", type=float, default=0.2, help="share of finished runs ended as failed"
    )
    parser.add_argument(
        "--zombie-rate",
        type=float,
        default=0.5,
        help="share of lost leases whose owner saves a checkpoint under the lost fence",
    )
    parser.add_argument("--ttl", type=float, default=1.0, help="lease ttl, seconds")
    parser.add_argument("--call-timeout", type=float, default=2.0, help="seconds")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument(
        "--work-fraction",
        type=float,
        default=0.5,
        help="a step's work lasts up to this fraction of the ttl",
    )
    parser.add_argument(
        "--effect-latency-fraction",
        type=float,
        default=0.3,
        help="an apply takes up to this fraction of the ttl before it writes",
    )
    parser.add_argument("--validate-rate", type=float, default=0.3)
    parser.add_argument("--once-rate", type=float, default=0.6)
    parser.add_argument(
        "--abandon-rate",
        type=float,
        default=0.15,
        help="share of leases left to expire instead of released",
    )
    return parser.parse_args(argv)


async def amain(args: argparse.Namespace) -> None:
    history = History(args.history, args.name)
    # min_size=0: no connection at start, so a worker started while the database
    # is down (crashed by the workload) runs and records its errors instead of exiting.
    pool = await asyncpg.create_pool(
        args.effects_url, min_size=0, max_size=2, command_timeout=args.call_timeout * 2
    )
    worker = Worker(args, history, pool)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, worker.stopping.set)
    try:
        await worker.run()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(pool.close(), 2)


if __name__ == "__main__":
    asyncio.run(amain(parse_args()))
