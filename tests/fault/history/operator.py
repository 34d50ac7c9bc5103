"""The operator of the history workload: reads the tasks, retries quarantined ones, cancels some.

It runs in the workload's process beside the fault injector and reaches the
servers through the same worker <-> server proxies, so it meets the same
faults. Every ``interval_s`` (on average) it reads the current task of the
next slot in turn (GetLease: its state, attempts and checkpoint) and records
what it saw; a QUARANTINED task is put back (Retry), or sometimes cancelled;
another task that has not ended is cancelled now and then. Like a worker
(:mod:`tests.fault.history.worker`), it follows a slot to its next task once
the current one has ended, and appends each call and answer to a history file
of its own, one JSON line each.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

from leasekeeper import (
    LeaseClient,
    LeaseError,
    LeaseInfo,
    TaskEnded,
    TaskNotFound,
    TaskNotQuarantined,
)

from .worker import History, checkpoint_fields, micros, slot_of, task_name

TERMINAL_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED"})


def lease_fields(info: LeaseInfo) -> dict[str, Any]:
    """A task's lease as an answer tells it, as history fields."""
    return {
        "state": info.state,
        "fence": info.fence,
        "owner": info.owner_id,
        "attempts": info.attempts,
        "max_attempts": info.max_attempts,
        "checkpoint_version": info.checkpoint_version,
        "expire_us": micros(info.expire_time),
    }


class Operator:
    """Reads, retries and cancels the workload's tasks; see the module docstring.

    Args:
        target: The lease service (gRPC target).
        namespace: The workload's namespace.
        tasks: Task slots (as the workers').
        history: Where its calls and answers go.
        seed: Fixes its choices.
        interval_s: Mean seconds between two reads.
        cancel_rate: Chance that a read of a task not ended cancels it.
        cancel_quarantined_rate: Chance that a QUARANTINED task is cancelled, not retried.
        call_timeout_s: Each call's deadline, seconds.
    """

    def __init__(
        self,
        target: str,
        namespace: str,
        tasks: int,
        history: History,
        seed: int,
        *,
        interval_s: float = 0.3,
        cancel_rate: float = 0.05,
        cancel_quarantined_rate: float = 0.25,
        call_timeout_s: float = 2.0,
    ) -> None:
        self.client = LeaseClient(target, namespace, call_timeout=call_timeout_s)
        self.history = history
        self.rng = random.Random(seed)
        self.generations = [0] * tasks
        self.interval_s = interval_s
        self.cancel_rate = cancel_rate
        self.cancel_quarantined_rate = cancel_quarantined_rate

    def task_ended(self, task_id: str) -> None:
        slot, generation = slot_of(task_id)
        self.generations[slot] = max(self.generations[slot], generation + 1)

    async def run(self) -> None:
        """Operates until cancelled; then closes its client."""
        slots = len(self.generations)
        try:
            for read in itertools.count():
                await asyncio.sleep(self.rng.expovariate(1 / self.interval_s))
                slot = read % slots  # in turn: a quarantined task waits a few reads at most
                await self.operate(task_name(slot, self.generations[slot]))
        finally:
            await self.client.close()

    async def operate(self, task_id: str) -> None:
        """One read of ``task_id``, and the Retry or Cancel it calls for."""
        h = self.history
        try:
            info = await self.client.get_lease(task_id)
            checkpoint = await self.client.get_checkpoint(task_id)
        except TaskNotFound:
            return  # never claimed yet
        except LeaseError as error:
            h.add("observe_error", task=task_id, error=type(error).__name__)
            return
        h.add("observed", task=task_id, **lease_fields(info), **checkpoint_fields(checkpoint))
        if info.state in TERMINAL_STATES:
            self.task_ended(task_id)
        elif info.state == "QUARANTINED":
            if self.rng.random() < self.cancel_quarantined_rate:
                await self.cancel(task_id)
            else:
                await self.retry(task_id)
        elif self.rng.random() < self.cancel_rate:
            await self.cancel(task_id)

    async def cancel(self, task_id: str) -> None:
        h = self.history
        h.add("cancel_sent", task=task_id)
        try:
            info = await self.client.cancel(task_id, "the operator stops this run")
        except TaskEnded as error:  # completed or failed meanwhile
            h.add("cancel_refused", task=task_id, reason=error.reason)
            self.task_ended(task_id)
            return
        except LeaseError as error:  # unknown: it may have been cancelled
            h.add("cancel_error", task=task_id, error=type(error).__name__, reason=error.reason)
            return
        h.add("cancel", task=task_id, **lease_fields(info))
        self.task_ended(task_id)

    async def retry(self, task_id: str) -> None:
        h = self.history
        h.add("retry_sent", task=task_id)
        try:
            info = await self.client.retry(task_id, "the operator puts the run back")
        except TaskNotQuarantined as error:
            h.add("retry_refused", task=task_id, reason=error.reason, metadata=error.metadata)
            return
        except LeaseError as error:  # unknown: it may have been put back
            h.add("retry_error", task=task_id, error=type(error).__name__, reason=error.reason)
            return
        h.add("retry", task=task_id, **lease_fields(info))
