"""Runs one conformance scenario against one client's driver, on real processes.

For each run: a ``leasekeeper serve`` process (``tests/fault/processes.py``) on
the test database with tokens on (a worker token for the drivers, an admin
token for the runner's operator calls) and its metrics endpoint; the fault
proxy (``tests/fault/proxy.py``) between the drivers and the server; one
driver process per worker of the scenario (the command of
``conformance/drivers.toml``), started in a session of its own so a signal
reaches all of it. Steps run in order (``scenarios.py`` says what each does);
nothing waits with a fixed sleep: events are awaited, server state is polled.

At the end every driver still alive is told ``exit`` and must say ``bye`` and
exit 0; then the protocol's rules (PROTOCOL.md, "Rules") are checked on
everything each driver wrote, and the scenario's ``never`` steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from leasekeeper import LeaseClient, TaskNotFound
from leasekeeper_server.security.tokens import file_entry, new_token
from tests.client_conformance.scenarios import (
    EVENTS,
    ROOT,
    CheckStep,
    ExpectStep,
    LeaseCheck,
    NeverStep,
    OperatorStep,
    OutsideCheck,
    ProxyStep,
    RecordsCheck,
    Scenario,
    SendStep,
    SignalStep,
    StreamsCheck,
    WaitStep,
)
from tests.fault.processes import ServerProcess, server_env, server_process
from tests.fault.proxy import TcpProxy, tcp_proxy

DRIVERS_FILE = ROOT / "conformance" / "drivers.toml"
REQUIRE_ENV = "LEASEKEEPER_CONFORMANCE_REQUIRE"
POLL_S = 0.02
EXIT_S = 15.0
_METRICS_LINE = re.compile(r"metrics on \S+ \(port (\d+)\)")


# --- the drivers (conformance/drivers.toml) ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DriverSpec:
    """One client's driver, as ``conformance/drivers.toml`` lists it."""

    name: str
    command: tuple[str, ...]
    needs: tuple[str, ...] = ()
    required: bool = False

    def argv(self) -> list[str]:
        """The command, ``{python}`` replaced by this interpreter."""
        return [part.replace("{python}", sys.executable) for part in self.command]

    def missing(self, root: Path = ROOT) -> list[str]:
        """The paths of ``needs`` that do not exist (the client is not built)."""
        return [path for path in self.needs if not (root / path).exists()]


def load_drivers(path: Path = DRIVERS_FILE) -> list[DriverSpec]:
    """Every driver of the file, in its order.

    Raises:
        ValueError: a malformed entry, the field named.
    """
    with path.open("rb") as file:
        entries = tomllib.load(file).get("drivers")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path.name}: drivers: a non-empty array of tables")
    drivers = []
    for index, entry in enumerate(entries):
        where = f"{path.name}: drivers[{index}]"
        unknown = set(entry) - {"name", "command", "needs", "required"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        name, command = entry.get("name"), entry.get("command")
        if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9-]*", name):
            raise ValueError(f"{where}.name: lowercase letters, digits and dashes")
        if (
            not isinstance(command, list)
            or not command
            or not all(isinstance(part, str) for part in command)
        ):
            raise ValueError(f"{where}.command: a non-empty array of strings")
        needs = entry.get("needs", [])
        if not isinstance(needs, list) or not all(isinstance(part, str) for part in needs):
            raise ValueError(f"{where}.needs: an array of paths")
        required = entry.get("required", False)
        if not isinstance(required, bool):
            raise ValueError(f"{where}.required: true or false")
        drivers.append(DriverSpec(name, tuple(command), tuple(needs), required))
    names = [driver.name for driver in drivers]
    if len(set(names)) != len(names):
        raise ValueError(f"{path.name}: drivers: each name once")
    return drivers


def driver_params(
    drivers: list[DriverSpec], required_env: str | None, root: Path = ROOT
) -> list[Any]:
    """The drivers as ``pytest.param``s: a driver whose client is not built is skipped.

    Skipped only when it is not required (``required`` in the file, or named in
    ``required_env``, comma-separated) and a path of its ``needs`` is missing;
    the skip's reason names the path. A required driver always runs: what is
    missing then fails its cases.
    """
    required = {name.strip() for name in (required_env or "").split(",") if name.strip()}
    unknown = required - {driver.name for driver in drivers}
    if unknown:
        raise ValueError(f"{REQUIRE_ENV}: no driver named {', '.join(sorted(unknown))}")
    params = []
    for driver in drivers:
        missing = driver.missing(root)
        marks = []
        if missing and not (driver.required or driver.name in required):
            reason = f"the {driver.name} client is not built: {', '.join(missing)} missing"
            marks.append(pytest.mark.skip(reason=reason))
        params.append(pytest.param(driver, id=driver.name, marks=marks))
    return params


# --- a driver process -------------------------------------------------------------------------


@dataclasses.dataclass
class Received:
    """One stdout line of a driver: when it arrived (monotonic seconds), its text, its event."""

    at: float
    line: str
    event: dict[str, Any] | None
    consumed: bool = False


class DriverProcess:
    """One worker of a scenario: a driver process, its events, and its stdin for commands."""

    def __init__(self, worker: str, proc: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self.worker = worker
        self.proc = proc
        self.stderr_path = stderr_path
        self.received: list[Received] = []
        self.sent: list[dict[str, Any]] = []
        self.killed = False
        self.exited_by_request = False
        self._changed = asyncio.Condition()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(
        cls, worker: str, argv: list[str], env: dict[str, str], stderr_path: Path
    ) -> DriverProcess:
        """Start the driver from the repository's root; its stderr goes to ``stderr_path``."""
        with stderr_path.open("wb") as stderr:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=ROOT,
                env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,
            )
        return cls(worker, proc, stderr_path)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            if not isinstance(event, dict) or not isinstance(event.get("event"), str):
                event = None
            async with self._changed:
                self.received.append(Received(time.monotonic(), line, event))
                self._changed.notify_all()
        async with self._changed:
            self._changed.notify_all()

    @property
    def owner_id(self) -> str | None:
        """The owner id the driver's ``ready`` event named."""
        ready = [r.event for r in self.received if r.event and r.event["event"] == "ready"]
        return ready[0].get("owner_id") if ready else None

    async def send(self, command: dict[str, Any]) -> None:
        """Write one command line on the driver's stdin."""
        assert self.proc.stdin is not None
        self.sent.append(command)
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        await self.proc.stdin.drain()

    async def next_event(
        self, match: Callable[[dict[str, Any]], bool], deadline: float, what: str
    ) -> Received:
        """The first event not yet consumed that ``match``es, waiting until ``deadline``.

        Raises:
            AssertionError: none came by the deadline, or the driver ended first.
        """
        async with self._changed:
            while True:
                for received in self.received:
                    if not received.consumed and received.event and match(received.event):
                        received.consumed = True
                        return received
                left_s = deadline - time.monotonic()
                if left_s <= 0 or self._reader.done():
                    ended = "it ended first" if self._reader.done() else "not in time"
                    raise AssertionError(f"worker {self.worker}: {what}: {ended}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left_s)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the driver's process group (nothing if it has ended)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    async def kill(self) -> None:
        """SIGKILL the driver's process group and reap it."""
        self.killed = True
        self.signal(signal.SIGKILL)
        await self.proc.wait()
        with contextlib.suppress(Exception):
            await self._reader

    async def finish(self) -> None:
        """Ask a live driver to ``exit`` and wait for it; SIGKILL it when it does not end."""
        if self.proc.returncode is None and not self.killed:
            self.signal(signal.SIGCONT)
            with contextlib.suppress(ConnectionError):
                await self.send({"cmd": "exit"})
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            self.exited_by_request = True
        try:
            await asyncio.wait_for(self.proc.wait(), EXIT_S)
        except TimeoutError:
            self.signal(signal.SIGKILL)
            await self.proc.wait()
        with contextlib.suppress(Exception):
            await self._reader

    def story(self) -> str:
        """What the driver was sent and wrote, and its stderr: for failure messages."""
        sent = "\n".join(f"  > {json.dumps(command)}" for command in self.sent) or "  (none)"
        lines = "\n".join(f"  < {received.line}" for received in self.received) or "  (none)"
        stderr = self.stderr_path.read_text(errors="replace")[-4000:] or "(empty)"
        return f"sent:\n{sent}\nwrote:\n{lines}\nstderr (the end):\n{stderr}"


# --- matching ---------------------------------------------------------------------------------


def matches(expected: Any, actual: Any, owners: dict[str, str | None]) -> bool:
    """Whether ``actual`` matches ``expected`` (scenarios.py: the forms of a pattern's value)."""
    if isinstance(expected, dict):
        if set(expected) == {"one_of"}:
            return any(matches(value, actual, owners) for value in expected["one_of"])
        if set(expected) == {"owner_of"}:
            return actual is not None and actual == owners.get(expected["owner_of"])
        if not isinstance(actual, dict):
            return False
        return all(
            key in actual and matches(value, actual[key], owners) for key, value in expected.items()
        )
    if isinstance(expected, bool) or isinstance(actual, bool):
        return expected is actual
    return bool(expected == actual)


# --- what the server holds (the referee) ------------------------------------------------------


class Referee:
    """Reads the server with an admin token (never through the proxy) and makes operator calls."""

    def __init__(self, client: LeaseClient, metrics_url: str, outside_dir: Path) -> None:
        self.client = client
        self.metrics_url = metrics_url
        self.outside_dir = outside_dir

    async def lease(self, task_id: str) -> dict[str, Any] | None:
        """The task's lease as a mapping (GetLease), or None when the task was never claimed."""
        try:
            info = await self.client.get_lease(task_id)
        except TaskNotFound:
            return None
        return dataclasses.asdict(info)

    async def history(self, task_id: str) -> list[dict[str, Any]]:
        """The task's history entries, oldest first; ``kind`` as its name."""
        entries = [entry async for entry in self.client.iter_task_history(task_id)]
        return [{**dataclasses.asdict(entry), "kind": entry.kind.value} for entry in entries]

    async def effects(self, task_id: str) -> list[dict[str, Any]]:
        """The task's effects by key; ``result`` as text."""
        records = [effect async for effect in self.client.iter_effects(task_id)]
        return [
            {**dataclasses.asdict(record), "result": record.result.decode(errors="replace")}
            for record in records
        ]

    async def streams_open(self) -> int:
        """The server's heartbeat streams open now (``leasekeeper_heartbeat_streams_open``)."""
        async with httpx.AsyncClient() as http:
            text = (await http.get(self.metrics_url, timeout=5)).text
        for family in text_string_to_metric_families(text):
            if family.name == "leasekeeper_heartbeat_streams_open":
                return int(sum(sample.value for sample in family.samples))
        raise AssertionError(f"no leasekeeper_heartbeat_streams_open at {self.metrics_url}")

    def outside(self, effect_key: str) -> list[str]:
        """The lines of the outside system's file of ``effect_key`` (none: never done)."""
        path = self.outside_dir / effect_key
        return path.read_text(encoding="utf-8").splitlines() if path.exists() else []

    async def judge(self, check: Any, owners: dict[str, str | None]) -> tuple[bool, str]:
        """Whether ``check`` holds now, and what was seen (for the failure message)."""
        if isinstance(check, LeaseCheck):
            lease = await self.lease(check.lease)
            wanted = dict(check.model_extra or {})
            seen = lease and {key: lease.get(key, "(no such field)") for key in wanted}
            return lease is not None and matches(wanted, lease, owners), f"lease {seen}"
        if isinstance(check, RecordsCheck):
            if check.history is not None:
                records = await self.history(check.history)
            else:
                assert check.effects is not None
                records = await self.effects(check.effects)
            if check.equals is not None:
                ok = len(records) == len(check.equals) and all(
                    matches(want, record, owners)
                    for want, record in zip(check.equals, records, strict=True)
                )
                return ok, f"records {records}"
            chosen = [record for record in records if matches(check.where, record, owners)]
            return len(chosen) == check.count, f"{len(chosen)} matching of records {records}"
        if isinstance(check, OutsideCheck):
            lines = self.outside(check.outside)
            return lines == check.lines, f"outside lines {lines}"
        assert isinstance(check, StreamsCheck)
        count = await self.streams_open()
        return count == check.streams_open, f"{count} heartbeat streams open"


# --- one run ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """A scenario under way: its server, proxy, referee and workers."""

    scenario: Scenario
    server: ServerProcess
    proxy: TcpProxy
    referee: Referee
    workers: dict[str, DriverProcess]

    @property
    def owners(self) -> dict[str, str | None]:
        """Each worker's owner id (from its ``ready``)."""
        return {name: worker.owner_id for name, worker in self.workers.items()}

    def story(self) -> str:
        """Every worker's story and the server's log: for failure messages."""
        parts = [f"--- worker {name} ---\n{w.story()}" for name, w in self.workers.items()]
        parts.append(f"--- server log (the end) ---\n{self.server.logs()[-3000:]}")
        return "\n".join(parts)

    async def step(self, number: int, step: Any, previous_end: float) -> None:
        """Run step ``number`` (1-based: the ``id`` of a command it sends)."""
        if isinstance(step, SendStep):
            await self.send(number, step)
        elif isinstance(step, ExpectStep):
            pattern = {"event": step.expect.event, **step.expect.fields}
            worker = self.workers[step.expect.worker]
            got = await worker.next_event(
                lambda event: matches(pattern, event, self.owners),
                previous_end + step.within_s,
                f"step {number}: expected {pattern} within {step.within_s} s",
            )
            late_s = got.at - previous_end
            assert late_s <= step.within_s, (
                f"step {number}: {got.line} came {late_s:.2f} s after the previous step, "
                f"more than {step.within_s} s"
            )
        elif isinstance(step, SignalStep):
            await self.signal(step)
        elif isinstance(step, OperatorStep):
            if step.do == "revoke":
                await self.referee.client.revoke(step.task_id, step.reason)
            else:
                await self.referee.client.cancel(step.task_id, step.reason)
        elif isinstance(step, ProxyStep):
            if step.fault == "black_hole":
                self.proxy.black_hole(step.direction)
            elif step.fault == "delay":
                assert step.seconds is not None
                self.proxy.delay(step.seconds, step.direction)
            else:
                self.proxy.restore()
        elif isinstance(step, WaitStep):
            await self.wait(number, step)
        elif isinstance(step, CheckStep):
            ok, seen = await self.referee.judge(step.check, self.owners)
            assert ok, f"step {number}: check {step.check.model_dump(exclude_none=True)}: {seen}"
        else:
            assert isinstance(step, NeverStep)  # judged at the end

    async def send(self, number: int, step: SendStep) -> None:
        command = step.send.model_dump(exclude_none=True, exclude={"worker"})
        worker = self.workers[step.send.worker]
        await worker.send({**command, "id": number})
        deadline = time.monotonic() + step.within_s
        owners = self.owners

        def answer(pattern: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
            return lambda event: event.get("id") == number and matches(pattern, event, owners)

        for pattern in step.expect:
            await worker.next_event(
                answer(pattern),
                deadline,
                f"step {number}: expected {pattern} in answer to {command}",
            )

    async def signal(self, step: SignalStep) -> None:
        worker = self.workers[step.worker]
        if step.do == "kill":
            await worker.kill()
        else:
            worker.signal(signal.SIGSTOP if step.do == "pause" else signal.SIGCONT)

    async def wait(self, number: int, step: WaitStep) -> None:
        deadline = time.monotonic() + step.within_s
        while True:
            ok, seen = await self.referee.judge(step.wait, self.owners)
            if ok:
                return
            if time.monotonic() >= deadline:
                shown = step.wait.model_dump(exclude_none=True)
                raise AssertionError(f"step {number}: wait {shown}: after {step.within_s} s {seen}")
            await asyncio.sleep(POLL_S)

    def judge_end(self) -> None:
        """The protocol's rules on everything each driver wrote, and the ``never`` steps."""
        for name, worker in self.workers.items():
            protocol_problems = rule_breaks(worker)
            assert not protocol_problems, (
                f"worker {name} broke the protocol: {protocol_problems}\n{worker.story()}"
            )
        for number, step in enumerate(self.scenario.steps, start=1):
            if isinstance(step, NeverStep):
                pattern = {"event": step.never.event, **step.never.fields}
                worker = self.workers[step.never.worker]
                seen = [
                    received.line
                    for received in worker.received
                    if received.event and matches(pattern, received.event, self.owners)
                ]
                assert not seen, f"step {number}: never {pattern}, but: {seen}\n{worker.story()}"


def rule_breaks(worker: DriverProcess) -> list[str]:
    """How a driver's output breaks PROTOCOL.md's rules (empty: it keeps them)."""
    problems: list[str] = []
    events = [r.event for r in worker.received]
    for received in worker.received:
        if received.event is None:
            problems.append(f"not an event line: {received.line!r}")
        elif received.event["event"] not in EVENTS:
            problems.append(f"unknown event: {received.line}")
        elif received.event["event"] == "error":
            problems.append(f"error event: {received.line}")
    named = [event for event in events if event is not None]
    if not named or named[0]["event"] != "ready":
        problems.append("the first event is not ready")
    if worker.exited_by_request:
        if not named or named[-1]["event"] != "bye":
            problems.append("exited without bye as its last event")
        if worker.proc.returncode != 0:
            problems.append(f"exit code {worker.proc.returncode} after exit")
    sent_ids = {command.get("id") for command in worker.sent}
    aborted: set[Any] = set()
    answered: dict[Any, list[str]] = {}
    for event in named:
        kind, event_id = event["event"], event.get("id")
        if kind in {"ready", "bye"}:
            continue
        if event_id not in sent_ids:
            problems.append(f"{kind} names id {event_id!r}, never sent")
        if kind == "aborted":
            aborted.add(event_id)
        if kind == "progress" and event_id in aborted:
            problems.append(f"progress of work {event_id} after its aborted")
        if kind in {"granted", "refused", "lost", "released", "checkpoint_saved", "effect"}:
            answered.setdefault(event_id, []).append(kind)
    for event_id, kinds in answered.items():
        if kinds.count("granted") + kinds.count("refused") > 1 or kinds.count("lost") > 1:
            problems.append(f"command {event_id} answered {kinds}")
    return problems


async def run_scenario(
    scenario: Scenario, driver: DriverSpec, database_url: str, namespace: str, workdir: Path
) -> None:
    """Run ``scenario``, one ``driver`` process per worker; AssertionError on a failure."""
    async with running(scenario, driver, database_url, namespace, workdir) as run:
        previous_end = time.monotonic()
        try:
            for number, step in enumerate(scenario.steps, start=1):
                await run.step(number, step, previous_end)
                previous_end = time.monotonic()
        except AssertionError as failure:
            story = run.story()
            raise AssertionError(f"{scenario.name} [{driver.name}]: {failure}\n{story}") from None
        finally:
            await asyncio.gather(*(worker.finish() for worker in run.workers.values()))
        run.judge_end()


@contextlib.asynccontextmanager
async def running(
    scenario: Scenario, driver: DriverSpec, database_url: str, namespace: str, workdir: Path
) -> AsyncIterator[Run]:
    """The server, proxy, referee and ready workers of one run; all stopped on exit."""
    worker_token, admin_token = new_token()[1], new_token()[1]
    tokens_file = workdir / "tokens.toml"
    tokens_file.write_text(
        file_entry(worker_token, "conformance-worker", "worker", [namespace])
        + file_entry(admin_token, "conformance-admin", "admin", [namespace])
    )
    outside_dir = workdir / "outside"
    outside_dir.mkdir()
    env = server_env(database_url, auth="on", tokens_file=tokens_file, metrics_listen="127.0.0.1:0")
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(server_process(workdir / "server", env))
        metrics = _METRICS_LINE.search(server.logs())
        assert metrics, f"no metrics port in the server's log:\n{server.logs()}"
        proxy = await stack.enter_async_context(tcp_proxy("127.0.0.1", server.port))
        admin = await stack.enter_async_context(
            LeaseClient(server.target, namespace=namespace, token=admin_token)
        )
        referee = Referee(admin, f"http://127.0.0.1:{metrics.group(1)}/metrics", outside_dir)
        driver_env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
        driver_env |= {
            "LEASEKEEPER_TARGET": f"127.0.0.1:{proxy.port}",
            "LEASEKEEPER_TOKEN": worker_token,
            "LEASEKEEPER_NAMESPACE": namespace,
            "CONFORMANCE_OUTSIDE_DIR": str(outside_dir),
            "PYTHONUNBUFFERED": "1",
        }
        workers: dict[str, DriverProcess] = {}
        for name in scenario.workers:
            workers[name] = await DriverProcess.start(
                name, driver.argv(), driver_env, workdir / f"worker-{name}.stderr"
            )
        run = Run(scenario, server, proxy, referee, workers)
        try:
            try:
                await asyncio.gather(
                    *(
                        worker.next_event(
                            lambda event: event["event"] == "ready",
                            time.monotonic() + EXIT_S,
                            "ready (connected to the server)",
                        )
                        for worker in workers.values()
                    )
                )
            except AssertionError as failure:
                raise AssertionError(f"{failure}\n{run.story()}") from None
            yield run
        finally:
            for worker in workers.values():
                if worker.proc.returncode is None:
                    worker.signal(signal.SIGKILL)
                    await worker.proc.wait()
