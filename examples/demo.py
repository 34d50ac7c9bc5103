"""The demo: a paused worker cannot send; a crashed worker's send is not repeated.

    python examples/demo.py        (or: make demo)

It starts ``leasekeeper serve`` (on ``LEASEKEEPER_DATABASE_URL`` when set,
otherwise on its embedded PostgreSQL in a temporary folder), the effect gateway
(``gateway.py``) and two workers (``worker.py``), then plays act 1:

1. worker A claims the task (fence 1) with a 2 s ttl and starts its slow work;
2. A is frozen with SIGSTOP; its lease expires on the database clock;
3. worker B claims the task (fence 2) and sends its message: accepted;
4. A is resumed with SIGCONT and sends with fence 1: the gateway refuses it,
   and A's client raises LeaseLost;
5. the gateway's table holds exactly one send, from fence 2.

Act 2, the effect ledger, on a new task (same server and gateway), with
``ledger_worker.py`` workers that send through ``lease.effect(...)``:

1. worker A claims the task (fence 1), the ledger answers PROCEED, A sends
   (accepted) and stops itself before CompleteEffect (``--stop-at after-effect``);
2. A is killed with SIGKILL: it crashed after the effect, before confirming it;
3. A's lease expires; worker B claims the task (fence 2); the ledger answers
   IN_DOUBT; B asks the gateway (Lookup), finds A's send, records it SUCCEEDED
   and sends nothing;
4. the gateway's table holds exactly one send for the task (fence 1), and the
   ledger's record is SUCCEEDED, reserved by fence 1 and completed by fence 2.

Act 3, a run that survives its worker, on a third task, with ``run_worker.py``
workers that run the task in 4 steps, each step's part published through the
gateway with ``lease.effect(..., next_checkpoint=N)`` (outcome and checkpoint
in one transaction):

1. worker A claims the task (fence 1), runs steps 1 and 2 (checkpoints 1 and 2
   saved with their effects) and is killed with SIGKILL during step 3;
2. A's lease expires; worker B claims the task (fence 2), receives checkpoint 2
   with the grant and resumes at step 3;
3. A's checkpoint write for step 3, replayed with its old fence, is refused;
4. B runs steps 3 and 4 and completes the task; the gateway holds parts 1-2
   from fence 1 and parts 3-4 from fence 2, each once; the task's history is
   printed.

Exits 0 only if all of that happened; every process is stopped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from gateway import read_sends
from ledger_worker import Exit as LedgerExit
from run_worker import Exit as RunExit
from worker import Exit

from leasekeeper import LeaseClient, LeaseLost

HERE = Path(__file__).resolve().parent
TTL_S = 2.0
WORK_S = 1.0
LEDGER_TTL_S = 1.0  # act 2: A is killed, so its lease only ends by its ttl
RUN_TTL_S = 1.0  # act 3: the same
RUN_STEPS = 4
START_TIMEOUT_S = 30.0
STEP_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
SERVER_STOP_TIMEOUT_S = 20.0  # it stops its embedded PostgreSQL: a SIGKILL would orphan it
POLL_INTERVAL_S = 0.05


def narrate(text: str) -> None:
    """One line of the story."""
    print(f"\n== {text}", flush=True)


class Child:
    """A child process whose stdout lines are echoed (prefixed) and kept for matching."""

    def __init__(self, label: str, process: asyncio.subprocess.Process, echo: bool) -> None:
        self.label = label
        self.echo = echo
        self.process = process
        self.lines: list[str] = []
        self._new_line = asyncio.Condition()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(
        cls,
        label: str,
        argv: Sequence[str],
        env: dict[str, str],
        stderr_path: Path,
        echo: bool = True,
    ) -> Child:
        """Start ``argv``; its stderr goes to ``stderr_path`` (shown if the demo fails)."""
        with stderr_path.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=stderr, env=env
            )
        return cls(label, process, echo)

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            if self.echo:
                print(f"   {self.label:>8} | {line}", flush=True)
            async with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()
        async with self._new_line:
            self._new_line.notify_all()

    async def wait_for(self, pattern: str, timeout_s: float = STEP_TIMEOUT_S) -> re.Match[str]:
        """The first output line matching ``pattern`` (waiting for it).

        Raises:
            TimeoutError: No such line within ``timeout_s``, or the process ended first.

        """

        def found() -> re.Match[str] | None:
            return next((m for line in self.lines if (m := re.search(pattern, line))), None)

        async with asyncio.timeout(timeout_s), self._new_line:
            while (match := found()) is None:
                if self._reader.done():
                    raise TimeoutError(f"{self.label} ended without printing /{pattern}/")
                await self._new_line.wait()
        return match

    def has(self, pattern: str) -> bool:
        """True when some output line matches ``pattern``."""
        return any(re.search(pattern, line) for line in self.lines)

    async def exit_code(self, timeout_s: float = STEP_TIMEOUT_S) -> int:
        """Wait for the process to end; its exit code."""
        async with asyncio.timeout(timeout_s):
            code = await self.process.wait()
            await self._reader
        return code

    def signal(self, sig: int) -> None:
        """Send ``sig`` if the process is still running."""
        if self.process.returncode is None:
            self.process.send_signal(sig)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGCONT (it may be frozen) and SIGTERM; SIGKILL if it does not end in ``timeout_s``."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                await self.process.wait()
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.process.wait()
        with contextlib.suppress(BaseException):
            await self._reader


async def wait_for_log(path: Path, pattern: str, timeout_s: float) -> re.Match[str]:
    """The first match of ``pattern`` in the file ``path`` (a child's stderr), polling."""
    async with asyncio.timeout(timeout_s):
        while True:
            text = await asyncio.to_thread(path.read_text, errors="replace")
            if (match := re.search(pattern, text)) is not None:
                return match
            await asyncio.sleep(POLL_INTERVAL_S)


async def wait_until_renewed(target: str, namespace: str, task_id: str) -> None:
    """Poll until the task's lease has been renewed once (its heartbeat stream is open).

    ``hold()`` returns before the heartbeat stream is open; a worker frozen
    before its first renewal has no stream for the server to end.
    """
    async with LeaseClient(target, namespace=namespace) as client:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            while True:
                lease = await client.get_lease(task_id)
                if lease.expire_time > lease.claim_time + timedelta(seconds=TTL_S):
                    return
                await asyncio.sleep(POLL_INTERVAL_S)


async def wait_until_expired(target: str, namespace: str, task_id: str) -> float:
    """Poll the lease service until the task's lease is EXPIRED; returns the seconds waited."""
    started = time.monotonic()
    async with LeaseClient(target, namespace=namespace) as client:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            while True:
                if (await client.get_lease(task_id)).state == "EXPIRED":
                    break
                await asyncio.sleep(POLL_INTERVAL_S)
    return time.monotonic() - started


def show_send(row: dict[str, Any]) -> None:
    """One row of the gateway's table of sends."""
    print(
        f"   {'table':>8} | send_id={row['send_id']} task={row['namespace']}/"
        f"{row['task_id']} fence={row['fence']} message={row['message']!r}",
        flush=True,
    )


class Demo:
    """The scenario, with its processes and the checks it has passed or failed."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.namespace = f"demo-{uuid.uuid4().hex[:8]}"
        self.task_id = "contract-summary-r42"
        self.ledger_task_id = "contract-summary-r43"  # act 2's task
        self.run_task_id = "quarterly-report-r44"  # act 3's task
        self.target = ""  # the lease service's host:port, once it listens
        self.ledger_path = workdir / "gateway.sqlite3"
        self.children: list[Child] = []
        self.failures: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        """Record one expectation; print it."""
        print(f"   {'ok' if ok else 'FAILED':>8} | {what}", flush=True)
        if not ok:
            self.failures.append(what)

    async def spawn(
        self, label: str, argv: Sequence[str], env: dict[str, str], echo: bool = True
    ) -> Child:
        """Start a child that :meth:`close` will stop."""
        child = await Child.start(label, argv, env, self.workdir / f"{label}.stderr", echo)
        self.children.append(child)
        return child

    async def close(self) -> None:
        """Stop every child, newest first (the server last: it stops its PostgreSQL)."""
        for child in reversed(self.children):
            await child.stop(SERVER_STOP_TIMEOUT_S if child.label == "server" else STOP_TIMEOUT_S)

    def worker_argv(
        self, name: str, gateway: str, wait_s: float | None, work_s: float
    ) -> list[str]:
        """The command line of worker ``name``."""
        argv = [sys.executable, str(HERE / "worker.py"), "--name", name, "--target", self.target]
        argv += ["--gateway", gateway, "--namespace", self.namespace, "--task-id", self.task_id]
        argv += ["--ttl-s", str(TTL_S), "--work-s", str(work_s)]
        return argv + (["--wait-s", str(wait_s)] if wait_s is not None else [])

    def ledger_worker_argv(self, name: str, gateway: str, *flags: str) -> list[str]:
        """The command line of act 2's worker ``name`` (``ledger_worker.py``)."""
        argv = [sys.executable, str(HERE / "ledger_worker.py"), "--name", name]
        argv += ["--target", self.target, "--gateway", gateway, "--namespace", self.namespace]
        argv += ["--task-id", self.ledger_task_id, "--ttl-s", str(LEDGER_TTL_S)]
        return [*argv, "--wait-s", str(STEP_TIMEOUT_S), *flags]

    def run_worker_argv(self, name: str, gateway: str, *flags: str) -> list[str]:
        """The command line of act 3's worker ``name`` (``run_worker.py``)."""
        argv = [sys.executable, str(HERE / "run_worker.py"), "--name", name]
        argv += ["--target", self.target, "--gateway", gateway, "--namespace", self.namespace]
        argv += ["--task-id", self.run_task_id, "--ttl-s", str(RUN_TTL_S)]
        argv += ["--steps", str(RUN_STEPS), "--wait-s", str(STEP_TIMEOUT_S)]
        return [*argv, *flags]

    async def start_services(self) -> str:
        """Start the lease service and the gateway; returns the gateway's address."""
        # Port 0: the server picks a free port and logs it (INFO, on stderr).
        env = dict(
            os.environ,
            LEASEKEEPER_LISTEN="127.0.0.1:0",
            LEASEKEEPER_MIN_TTL_S="0.5",
            LEASEKEEPER_CONSOLE_LISTEN="off",  # the demo shows the terminal, not the console
        )
        env["LEASEKEEPER_LOG_LEVEL"] = "INFO"
        if os.environ.get("LEASEKEEPER_DATABASE_URL"):
            narrate("Starting leasekeeper (on LEASEKEEPER_DATABASE_URL)")
        else:
            env["LEASEKEEPER_DATA_DIR"] = str(self.workdir / "pgdata")
            narrate("Starting leasekeeper (on its embedded PostgreSQL, in a temporary folder)")
        argv = [
            sys.executable,
            "-m",
            "leasekeeper_server.cli.main",
            "serve",
        ]  # = `leasekeeper serve`
        await self.spawn("server", argv, env, echo=False)
        port = await wait_for_log(
            self.workdir / "server.stderr", r"serving on \S+ \(port (\d+)\)", START_TIMEOUT_S
        )
        self.target = f"127.0.0.1:{port.group(1)}"
        print(f"   {'server':>8} | lease service on {self.target}", flush=True)

        narrate("Starting the effect gateway (fence checks: leasekeeper + its own ledger)")
        argv = [sys.executable, str(HERE / "gateway.py"), "--leasekeeper", self.target]
        argv += ["--db", str(self.ledger_path)]
        gateway = await self.spawn("gateway", argv, dict(os.environ))
        match = await gateway.wait_for(r"listening on (\S+)")
        return match.group(1)

    async def play(self) -> None:
        """Both acts, on one lease service and one gateway."""
        gateway = await self.start_services()
        await self.act_paused_worker(gateway)
        await self.act_crashed_worker(gateway)
        await self.act_resumed_run(gateway)

    async def act_paused_worker(self, gateway: str) -> None:
        """Act 1, the seed's scenario: a paused worker cannot send."""
        env = dict(os.environ)

        narrate(f"Worker A claims {self.namespace}/{self.task_id} with a {TTL_S} s ttl")
        a = await self.spawn("worker A", self.worker_argv("A", gateway, None, WORK_S), env)
        claimed = await a.wait_for(r"claimed .*fence=(\d+)")
        await wait_until_renewed(self.target, self.namespace, self.task_id)
        a.signal(signal.SIGSTOP)
        narrate("A has renewed once; it is frozen with SIGSTOP mid-work (a GC pause, a VM stall)")
        self.check(claimed.group(1) == "1", "A claimed with fence 1")

        waited_s = await wait_until_expired(self.target, self.namespace, self.task_id)
        narrate(f"A's lease expired on the database clock ({waited_s:.1f} s later): state EXPIRED")

        narrate("Worker B claims the task and sends")
        b = await self.spawn("worker B", self.worker_argv("B", gateway, STEP_TIMEOUT_S, 0.0), env)
        b_code = await b.exit_code()
        self.check(b.has(r"claimed .*fence=2"), "B claimed with fence 2")
        self.check(b.has(r"send accepted fence=2"), "the gateway accepted B's send")
        self.check(b_code == Exit.SENT, f"B exited {b_code} (SENT)")

        narrate("A is resumed with SIGCONT: it finishes its work and sends with fence 1")
        a.signal(signal.SIGCONT)
        a_code = await a.exit_code()
        self.check(a.has(r"send REFUSED fence=1"), "the gateway refused A's send")
        lost = a.has(r"LeaseLost reason=LEASE_(SUPERSEDED|EXPIRED)")
        self.check(lost, "A's client raised LeaseLost")
        self.check(a_code == Exit.REFUSED_LEASE_LOST, f"A exited {a_code} (REFUSED_LEASE_LOST)")
        await self.check_fence_and_table()

    async def check_fence_and_table(self) -> None:
        """Ask the lease service about fence 1, and read the gateway's table."""
        narrate("ValidateFence for A's fence 1")
        async with LeaseClient(self.target, namespace=self.namespace) as client:
            answer = await client.validate_fence(self.task_id, 1)
        print(
            f"   {'leases':>8} | valid={answer.valid} reason={answer.reason} "
            f"current_fence={answer.current_fence}",
            flush=True,
        )
        self.check(
            not answer.valid and answer.reason == "LEASE_SUPERSEDED" and answer.current_fence == 2,
            "fence 1 is stale: LEASE_SUPERSEDED, current fence 2",
        )

        narrate(f"The gateway's table of sends ({self.ledger_path.name})")
        sends = read_sends(self.ledger_path)
        for row in sends:
            show_send(row)
        self.check(
            len(sends) == 1 and sends[0]["fence"] == 2, "exactly one send, made with fence 2"
        )

    async def act_crashed_worker(self, gateway: str) -> None:
        """Act 2, the effect ledger: the send of a worker that crashed is not repeated."""
        env, task = dict(os.environ), f"{self.namespace}/{self.ledger_task_id}"
        narrate(
            f"Act 2, the effect ledger: worker A claims {task} with a {LEDGER_TTL_S} s ttl "
            'and sends through lease.effect("summary", policy="ONCE")'
        )
        argv = self.ledger_worker_argv("A", gateway, "--stop-at", "after-effect")
        a = await self.spawn("worker A", argv, env)
        sent = await a.wait_for(r"send accepted fence=1 send_id=(\d+) ")
        await a.wait_for(r"at after-effect$")
        a.signal(signal.SIGKILL)
        a_code = await a.exit_code()
        narrate(
            "A stopped itself before CompleteEffect; it is killed with SIGKILL "
            "(crashed after the effect, before confirming it)"
        )
        send_id = sent.group(1)
        proceed = a.has(r"begin .* fence=1 -> PROCEED ")
        self.check(proceed, f"the ledger answered PROCEED to fence 1; A sent (send_id={send_id})")
        self.check(a_code == -signal.SIGKILL, f"A exited {a_code} (killed)")

        waited_s = await wait_until_expired(self.target, self.namespace, self.ledger_task_id)
        narrate(f"A's lease expired on the database clock ({waited_s:.1f} s later): state EXPIRED")

        narrate("Worker B claims the task and begins the same effect")
        b = await self.spawn("worker B", self.ledger_worker_argv("B", gateway), env)
        b_code = await b.exit_code()
        self.check(b.has(r"claimed .*fence=2"), "B claimed with fence 2")
        self.check(b.has(r"begin .* fence=2 -> IN_DOUBT "), "the ledger answered IN_DOUBT to B")
        found = b.has(rf"reconcile: found send_id={send_id} fence=1 ")
        self.check(found, f"B asked the gateway (Lookup): found A's send_id={send_id}")
        self.check(not b.has(r": send "), "B sent nothing")
        self.check(b_code == LedgerExit.RECONCILED, f"B exited {b_code} (RECONCILED)")
        await self.check_ledger_and_table(send_id)

    async def check_ledger_and_table(self, send_id: str) -> None:
        """Act 2's effect as the ledger recorded it, and the gateway's sends for its task."""
        narrate(f"The effect ledger's record (ListEffects for {self.ledger_task_id})")
        async with LeaseClient(self.target, namespace=self.namespace) as client:
            effects, _ = await client.list_effects(self.ledger_task_id)
        for e in effects:
            print(
                f"   {'ledger':>8} | effect_key={e.effect_key!r} state={e.state} fence={e.fence} "
                f"complete_fence={e.complete_fence} attempts={e.attempts} "
                f"result={e.result.decode(errors='replace')!r}",
                flush=True,
            )
        recorded = [(e.state, e.fence, e.complete_fence, e.result) for e in effects]
        self.check(
            recorded == [("SUCCEEDED", 1, 2, send_id.encode())],
            f"SUCCEEDED (result send_id={send_id}), reserved by fence 1, completed by fence 2",
        )

        narrate(f"The gateway's table of sends, for {self.ledger_task_id}")
        sends = [
            row
            for row in read_sends(self.ledger_path)
            if (row["namespace"], row["task_id"]) == (self.namespace, self.ledger_task_id)
        ]
        for row in sends:
            show_send(row)
        self.check([row["fence"] for row in sends] == [1], "exactly one send, made with fence 1")

    async def act_resumed_run(self, gateway: str) -> None:
        """Act 3, checkpoints: a replacement resumes where a killed worker stopped."""
        env, task = dict(os.environ), self.run_task_id
        narrate(
            f"Act 3, a run that survives its worker: worker A runs {self.namespace}/{task} in "
            f"{RUN_STEPS} steps, saving each step's checkpoint with its effect"
        )
        a = await self.spawn(
            "worker A", self.run_worker_argv("A", gateway, "--stop-in-step", "3"), env
        )
        claimed = await a.wait_for(r"claimed .*fence=(\d+) owner=(\S+) checkpoint=none")
        await a.wait_for(r"in step 3$")
        a.signal(signal.SIGKILL)
        a_code = await a.exit_code()
        a_fence, a_owner = int(claimed.group(1)), claimed.group(2)
        narrate("A saved checkpoints 1 and 2 and is killed with SIGKILL during step 3")
        self.check(a.has(r"step 2 done") and a_code == -signal.SIGKILL, "A did steps 1-2, killed")

        waited_s = await wait_until_expired(self.target, self.namespace, task)
        narrate(f"A's lease expired on the database clock ({waited_s:.1f} s later): state EXPIRED")

        narrate("Worker B claims the task and receives the checkpoint with the grant")
        b = await self.spawn("worker B", self.run_worker_argv("B", gateway), env)
        resumed = await b.wait_for(
            r"claimed .*fence=(\d+) .*checkpoint=(\d+) -> starting at step (\d+)"
        )
        self.check(
            (int(resumed.group(1)), resumed.group(2), resumed.group(3)) == (a_fence + 1, "2", "3"),
            f"B holds fence {a_fence + 1}, received checkpoint 2 and resumes at step 3",
        )

        narrate(f"A's checkpoint write for step 3, replayed with its old fence {a_fence}")
        async with LeaseClient(self.target, namespace=self.namespace, owner_id=a_owner) as client:
            try:
                await client.save_checkpoint(task, a_fence, 3, b'{"step": 3}')
                refused = "accepted"
            except LeaseLost as lost:
                refused = str(lost.reason)
        print(f"   {'leases':>8} | SaveCheckpoint fence={a_fence} -> {refused}", flush=True)
        stale = refused in ("LEASE_SUPERSEDED", "TASK_COMPLETED")
        self.check(stale, f"A's late checkpoint was refused ({refused})")

        b_code = await b.exit_code()
        self.check(b_code == RunExit.COMPLETED, f"B exited {b_code} (COMPLETED)")
        self.check(not b.has(r"step [12] done"), "B did not redo steps 1 and 2")
        await self.check_run_table_and_history(a_fence)

    async def check_run_table_and_history(self, a_fence: int) -> None:
        """Act 3's parts in the gateway's table, the stored checkpoint and the task's history."""
        task = self.run_task_id
        narrate(f"The gateway's table of sends, for {task}")
        sends = [
            row
            for row in read_sends(self.ledger_path)
            if (row["namespace"], row["task_id"]) == (self.namespace, task)
        ]
        for row in sends:
            show_send(row)
        parts = [(row["message"].split()[2], row["fence"]) for row in sends]
        b_fence = a_fence + 1
        expected = [("1", a_fence), ("2", a_fence), ("3", b_fence), ("4", b_fence)]
        self.check(parts == expected, "parts 1-2 from A's fence, 3-4 from B's, each once")

        narrate(f"The task's history (`leasekeeper tasks history {self.namespace} {task}`)")
        async with LeaseClient(self.target, namespace=self.namespace) as client:
            saved = await client.get_checkpoint(task)
            entries = [entry async for entry in client.iter_task_history(task)]
            final = await client.get_lease(task)
        for e in entries:
            detail = " ".join(
                f"{name}={value}"
                for name, value in (
                    ("owner", e.owner_id),
                    ("attempt", e.attempt),
                    ("checkpoint", e.checkpoint_version),
                    ("effect", e.effect_key),
                    ("operation", e.external_operation_id),
                    ("reason", e.reason),
                    ("method", e.method),
                )
                if value
            )
            print(f"   {'history':>8} | {e.kind:<17} fence={e.fence} {detail}", flush=True)
        self.check(
            saved is not None and (saved.version, saved.fence) == (RUN_STEPS, b_fence),
            f"checkpoint {RUN_STEPS} stored, written by fence {b_fence}",
        )
        kinds = [str(e.kind) for e in entries]
        self.check(
            final.state == "COMPLETED" and kinds.count("CHECKPOINT_SAVED") == RUN_STEPS,
            f"the task is COMPLETED; its history shows {RUN_STEPS} checkpoints and every grant",
        )


@contextlib.asynccontextmanager
async def demo_in(workdir: Path) -> AsyncIterator[Demo]:
    """A demo whose processes are all stopped on the way out."""
    demo = Demo(workdir)
    try:
        yield demo
    finally:
        await demo.close()


def show_stderr(workdir: Path) -> None:
    """Print the tail of every child's stderr (when the demo failed)."""
    for path in sorted(workdir.glob("*.stderr")):
        tail = path.read_text(errors="replace").splitlines()[-15:]
        if tail:
            print(f"\n-- {path.name} (last lines)", *tail, sep="\n", file=sys.stderr)


async def main() -> int:
    """Run the demo; 0 when everything happened as expected."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="leasekeeper-demo-") as tmp:
        workdir = Path(tmp)
        try:
            async with demo_in(workdir) as demo:
                await demo.play()
        except Exception as error:  # a step timed out or a process misbehaved
            print(f"\ndemo FAILED: {error!r}", flush=True)
            show_stderr(workdir)
            return 1
        elapsed_s = time.monotonic() - started
        if demo.failures:
            print(f"\ndemo FAILED ({elapsed_s:.1f} s): {'; '.join(demo.failures)}", flush=True)
            show_stderr(workdir)
            return 1
        print(
            f"\ndemo OK ({elapsed_s:.1f} s): the stale worker was fenced off; "
            "the crashed worker's send was not repeated; the killed worker's run was resumed.",
            flush=True,
        )
        return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
