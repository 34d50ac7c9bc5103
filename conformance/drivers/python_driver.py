"""The Python client's conformance driver: commands in on stdin, events out on stdout.

A small worker built on ``leasekeeper`` (the Python client), steered one JSON
line at a time by the conformance runner; ``conformance/PROTOCOL.md`` is the
contract every client's driver keeps. Environment: ``LEASEKEEPER_TARGET``,
``LEASEKEEPER_TOKEN``, ``LEASEKEEPER_NAMESPACE`` and ``CONFORMANCE_OUTSIDE_DIR``.

Run: ``python conformance/drivers/python_driver.py`` (it waits for commands).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from leasekeeper import (
    Checkpoint,
    ClaimTimeout,
    EffectFailed,
    EffectInDoubt,
    EffectRecord,
    HeldLease,
    LeaseClient,
    LeaseError,
    LeaseLost,
    NotAcquired,
    TaskNotFound,
)

CLIENT = "python"
LEASE_COMMANDS = frozenset({"work", "act", "save_checkpoint", "release"})
EXIT_RELEASE_S = 5.0
"""Seconds ``exit`` waits for the lease still held to be released before giving it up."""
Command = dict[str, Any]


def emit(event: str, **fields: Any) -> None:
    """Write one event line on stdout, at once."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def reason_of(error: BaseException) -> str:
    """The protocol's reason for a refusal (PROTOCOL.md, "Reasons")."""
    if isinstance(error, NotAcquired):
        return "NOT_ACQUIRED"
    if isinstance(error, ClaimTimeout):
        return "CLAIM_TIMEOUT"
    if isinstance(error, EffectInDoubt):
        return "EFFECT_IN_DOUBT"
    if isinstance(error, EffectFailed):
        return "EFFECT_FAILED"
    if isinstance(error, LeaseError):
        if error.reason:
            return error.reason
        return error.code.name if error.code is not None else type(error).__name__
    return type(error).__name__


def checkpoint_of(checkpoint: Checkpoint | None) -> dict[str, Any] | None:
    """A checkpoint as the protocol writes it (data as UTF-8 text)."""
    if checkpoint is None:
        return None
    data = checkpoint.data.decode()
    return {"version": checkpoint.version, "data": data, "fence": checkpoint.fence}


class Outside:
    """The outside system: one file per effect key, one line per time the effect was done."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def perform(self, effect_key: str, result: str) -> None:
        """Do the effect: append ``result`` to the key's file (flushed before returning)."""
        with (self.folder / effect_key).open("a", encoding="utf-8") as file:
            file.write(result + "\n")

    def lookup(self, effect_key: str) -> str | None:
        """The outside system's record of the effect (its first line), or None if never done."""
        path = self.folder / effect_key
        if not path.exists():
            return None
        lines = path.read_text(encoding="utf-8").splitlines()
        return lines[0] if lines else None


class Driver:
    """One worker: at most one lease at a time, held by a ``hold`` command's task."""

    def __init__(self, client: LeaseClient, outside: Outside) -> None:
        self.client = client
        self.outside = outside
        self.lease: HeldLease | None = None  # the latest lease, kept after its block ends
        self.holding: asyncio.Task[None] | None = None
        self.queue: asyncio.Queue[Command] = asyncio.Queue()
        self.working: dict[int, int] = {}  # work command id -> progress so far
        self.work_tasks: set[asyncio.Task[None]] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    def dispatch(self, command: Command) -> None:
        """Route one command: a lease command to the block holding the lease, others now."""
        name = command.get("cmd")
        if name == "hold":
            if self.holding is not None and not self.holding.done():
                emit("error", id=command.get("id"), message="hold while a lease is held")
                return
            self.holding = asyncio.create_task(self.hold(command))
        elif name in LEASE_COMMANDS:
            if self.holding is not None and not self.holding.done():
                self.queue.put_nowait(command)
            else:
                self.spawn(self.outside_block(command))
        else:
            emit("error", id=command.get("id"), message=f"unknown command {name!r}")

    def spawn(self, work: Awaitable[None]) -> None:
        """Run ``work`` as a task of the driver (kept referenced until done)."""
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def hold(self, command: Command) -> None:
        """``hold``: claim through the client's ``hold()``; serve lease commands in its block."""
        hold_id = command["id"]
        released: Command | None = None
        hold = self.client.hold(
            command["task_id"],
            ttl=command["ttl_s"],
            wait=command.get("wait_s"),
            heartbeat_interval=command.get("heartbeat_interval_s"),
        )
        try:
            async with hold as lease:
                self.lease = lease
                emit(
                    "granted",
                    id=hold_id,
                    task_id=lease.task_id,
                    fence=lease.fence,
                    checkpoint=checkpoint_of(lease.checkpoint),
                )
                async with asyncio.TaskGroup() as block:
                    while released is None:
                        next_command = await self.queue.get()
                        if next_command["cmd"] == "release":
                            released = next_command
                            for work in self.work_tasks:
                                work.cancel()
                        else:
                            await self.in_block(lease, next_command, block)
        except LeaseLost as loss:
            emit("lost", id=hold_id, reason=loss.reason)
            for work_id, progress in sorted(self.working.items()):
                emit("aborted", id=work_id, progress=progress)
        except LeaseError as refusal:
            emit("refused", id=hold_id, reason=reason_of(refusal))
        except Exception as error:  # a bug of the driver or the client: the run fails on it
            emit("error", id=hold_id, message=f"{type(error).__name__}: {error}")
        else:
            if released is not None and released["id"] is not None:
                emit("released", id=released["id"])
        finally:
            self.working.clear()
            self.work_tasks.clear()
        while not self.queue.empty():  # commands the block had no time for
            self.spawn(self.outside_block(self.queue.get_nowait()))

    async def in_block(self, lease: HeldLease, command: Command, block: asyncio.TaskGroup) -> None:
        """A lease command inside the hold block: cancelled with it when the lease is lost."""
        if command["cmd"] == "work":
            self.working[command["id"]] = 0
            self.work_tasks.add(block.create_task(self.work(command)))
            return
        try:
            await self.lease_command(lease, command)
        except asyncio.CancelledError:
            emit("aborted", id=command["id"])
            raise

    async def outside_block(self, command: Command) -> None:
        """A lease command with no block running: asked of the latest lease, which judges it."""
        if self.lease is None:
            emit("refused", id=command["id"], reason="NO_LEASE")
        elif command["cmd"] in {"work", "release"}:
            emit("refused", id=command["id"], reason="NOT_HELD")
        else:
            await self.lease_command(self.lease, command)

    async def lease_command(self, lease: HeldLease, command: Command) -> None:
        """``act`` or ``save_checkpoint`` with ``lease``; a refusal becomes ``refused``."""
        try:
            if command["cmd"] == "act":
                await self.act(lease, command)
            else:
                saved = await lease.save_checkpoint(
                    command["version"], command["data"].encode(), "text/plain"
                )
                emit("checkpoint_saved", id=command["id"], version=saved.version)
        except LeaseError as refusal:
            emit("refused", id=command["id"], reason=reason_of(refusal))
        except Exception as error:  # a bug of the driver or the client: the run fails on it
            emit("error", id=command["id"], message=f"{type(error).__name__}: {error}")

    async def work(self, command: Command) -> None:
        """``work``: one ``progress`` every ``interval_s`` until the block ends."""
        work_id = command["id"]
        while True:
            await asyncio.sleep(command["interval_s"])
            self.working[work_id] += 1
            emit("progress", id=work_id, n=self.working[work_id])

    async def act(self, lease: HeldLease, command: Command) -> None:
        """``act``: the effect through the ledger (``lease.effect``), done to the outside system."""
        act_id, key = command["id"], command["effect_key"]
        reconciled: list[str] = []  # what reconcile found in the outside system

        async def perform() -> str:
            await stall_if(command, "before_outside")
            self.outside.perform(key, command["result"])
            emit("outside", id=act_id, effect_key=key, fence=lease.fence)
            await stall_if(command, "after_outside")
            return str(command["result"])

        async def reconcile(effect: EffectRecord) -> str | None:
            found = self.outside.lookup(effect.effect_key)
            if found is not None:
                reconciled.append(found)
            return found

        runner = lease.effect(
            key,
            policy=command["policy"],
            reconcile=reconcile if command.get("reconcile") else None,
        )
        outcome = await runner.run(perform)
        if outcome.fresh:
            kind = "PERFORMED"
        elif reconciled:
            kind = "RECONCILED"
        else:
            kind = "ALREADY_APPLIED"
        result = outcome.result.decode()
        emit("effect", id=act_id, effect_key=key, outcome=kind, result=result)


async def stall_if(command: Command, where: str) -> None:
    """Never return when the command asks to stall here (a worker that dies at this point)."""
    if command.get("stall") == where:
        await asyncio.Event().wait()


async def read_commands(on_command: Callable[[Command], None]) -> None:
    """Feed every stdin line, parsed, to ``on_command`` until ``exit`` or the end of stdin."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async for raw in reader:
        line = raw.decode().strip()
        if not line:
            continue
        try:
            command = json.loads(line)
        except json.JSONDecodeError as error:
            emit("error", id=None, message=f"not JSON: {error}")
            continue
        if command.get("cmd") == "exit":
            return
        on_command(command)


async def main() -> int:
    """Connect, say ``ready``, run commands until ``exit``, then release and say ``bye``."""
    outside = Outside(Path(os.environ["CONFORMANCE_OUTSIDE_DIR"]))
    async with LeaseClient(
        os.environ["LEASEKEEPER_TARGET"],
        namespace=os.environ["LEASEKEEPER_NAMESPACE"],
        token=os.environ.get("LEASEKEEPER_TOKEN", ""),
    ) as client:
        with contextlib.suppress(TaskNotFound):  # one call: the channel is connected
            await client.get_lease("conformance-ready")
        emit("ready", client=CLIENT, owner_id=client.owner_id)
        driver = Driver(client, outside)
        await read_commands(driver.dispatch)
        if driver.holding is not None and not driver.holding.done():
            driver.queue.put_nowait({"cmd": "release", "id": None})
            # A hold still acquiring, or a block stalled in an effect, is given up after that.
            await asyncio.wait({driver.holding}, timeout=EXIT_RELEASE_S)
            driver.holding.cancel()
            await asyncio.gather(driver.holding, return_exceptions=True)
        for task in list(driver.tasks):
            task.cancel()
        await asyncio.gather(*driver.tasks, return_exceptions=True)
    emit("bye")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
