"""The randomized history workload: real workers, real servers, real faults, one seed.

``run_workload(WorkloadConfig(...))`` starts, in one namespace of its own:

* ``servers`` ``leasekeeper serve`` processes, each reaching PostgreSQL through
  a fault proxy (server <-> database) and reached by workers through another
  (worker <-> server);
* ``workers`` worker processes (:mod:`tests.fault.history.worker`) on ``tasks``
  task slots with a short ttl, each with a target listing every server's proxy
  (so a worker whose server is gone moves on to the next one): they run each
  task's steps from its checkpoint, and claim the tasks of the first slots
  with an attempt limit (``max_attempts``);
* the operator (:mod:`tests.fault.history.operator`), in this process: it
  reads the tasks, puts quarantined ones back (Retry) and cancels some;

and, for ``duration_s`` seconds, injects faults chosen by a ``random.Random``
seeded with ``seed``: SIGSTOP/SIGCONT and SIGKILL of workers (a killed worker
is replaced by a new process, a new owner), black holes, delays and resets on
a worker <-> server link (one direction or both), the server <-> database
link cut, servers SIGKILLed and restarted, and, when the database is a private
cluster (:class:`tests.fault.cluster.PgCluster`), PostgreSQL crashed
(``immediate``: no checkpoint, crash recovery at the next start) and
restarted under the load. Each fault is recorded with
its monotonic time. At the end the operator stops, every fault is healed,
workers are stopped (SIGTERM), the database's record and the service's task
history are read, and :func:`checker.check` judges the whole history.

The seed fixes the workload's own choices (which fault, when, for how long,
and each worker's seed); the operating system's scheduling still varies
between runs, so a run is reproducible in what it does, not in every
interleaving. A failing seed is rerun with the same command to look again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

from tests.fault.cluster import ClusterError
from tests.fault.dburl import database_address, proxied
from tests.fault.history.checker import Verdict, check
from tests.fault.history.operator import Operator
from tests.fault.history.schema import ensure_schema
from tests.fault.history.worker import History, micros
from tests.fault.processes import (
    QUICK_OUTAGE_SETTINGS,
    ServerProcess,
    faketime_env,
    server_env,
    server_process,
)
from tests.fault.proxy import TcpProxy

REPO_ROOT = Path(__file__).resolve().parents[3]
FAULT_KINDS = (
    "pause_worker",
    "kill_worker",
    "black_hole_link",
    "delay_link",
    "reset_link",
    "cut_database",
    "kill_server",
    "crash_database",
)
# Small timeouts, so that an outage is noticed within about a second.
SERVER_SETTINGS = {
    **QUICK_OUTAGE_SETTINGS,
    "min_ttl_s": 0.1,
    "min_renew_interval_s": 0.05,
    "shutdown_grace_s": 0.5,
}


@dataclasses.dataclass
class WorkloadConfig:
    """One run: its seed, its size and its faults.

    Attributes:
        database_url: A migrated leasekeeper database (the history tables are added).
        workdir: Where histories and process logs go.
        seed: Fixes every random choice of the workload.
        duration_s: Seconds of load and faults.
        workers: Worker processes running at any time.
        tasks: Task slots they compete for (each slot's task in turn: one ends,
            completed, failed or cancelled, and the next one starts).
        max_attempts: Per slot, the attempt limit its claims carry (the same on
            every claim of a task, as the checker assumes; 0, or a slot beyond
            these: none). A task that uses it up is QUARANTINED until the
            operator's Retry (or Cancel).
        operator: Run the operator (Retry, Cancel, GetLease reads).
        servers: Server processes.
        ttl_s: Lease ttl of every claim, seconds.
        fault_interval_s: Mean seconds between two faults.
        faults: The fault kinds to draw from (a subset of ``FAULT_KINDS``).
        spared_servers: Servers never killed (their memory is watched over a soak).
        cluster: The :class:`~tests.fault.cluster.PgCluster` serving
            ``database_url``, for the ``crash_database`` fault; None: that
            fault is skipped (the shared database is never crashed).
        skew_clocks: Run every server but the first under ``faketime`` with an
            offset drawn from the seed: no server
            clock may matter, only the database's.
    """

    database_url: str
    workdir: Path
    seed: int
    duration_s: float = 20.0
    workers: int = 5
    tasks: int = 3
    max_attempts: tuple[int, ...] = (1, 2)
    operator: bool = True
    servers: int = 2
    ttl_s: float = 1.0
    fault_interval_s: float = 0.7
    faults: tuple[str, ...] = FAULT_KINDS
    spared_servers: int = 0
    skew_clocks: bool = True
    cluster: Any = None


@dataclasses.dataclass
class Report:
    """The outcome of a run: the checker's verdict and where the history is."""

    config: WorkloadConfig
    namespace: str
    verdict: Verdict
    elapsed_s: float
    clock_offsets: dict[int, str]

    def summary(self) -> str:
        counts = self.verdict.counts
        lines = [
            f"seed {self.config.seed}: {self.elapsed_s:.1f} s, namespace {self.namespace}, "
            f"server clock offsets {self.clock_offsets or 'none'}",
            *(f"  {name} = {counts[name]}" for name in sorted(counts)),
            *(f"  VIOLATION {v}" for v in self.verdict.violations),
        ]
        return "\n".join(lines)


class Link:
    """A worker <-> server proxy whose target follows its server across restarts."""

    def __init__(self, index: int, db_proxy: TcpProxy, proxy: TcpProxy) -> None:
        self.index = index
        self.db_proxy = db_proxy
        self.proxy = proxy
        self.server: ServerProcess | None = None
        self.stack = contextlib.AsyncExitStack()


class Workload:
    """Runs one :class:`WorkloadConfig`; see the module docstring."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.namespace = f"history-{config.seed}-{uuid.uuid4().hex[:8]}"
        self.workdir = config.workdir
        self.links: list[Link] = []
        self.workers: dict[str, asyncio.subprocess.Process] = {}
        self.faults: list[dict[str, Any]] = []
        self.healing: set[asyncio.Task[None]] = set()
        self.worker_count = 0
        self.clock_offsets: dict[int, str] = {}
        self.killed: set[str] = set()
        self.database_restarting = False

    # -- servers and links ------------------------------------------------------------

    async def start_links(self) -> None:
        host, port = database_address(self.config.database_url)
        for index in range(self.config.servers):
            db_proxy = TcpProxy(host, port)
            await db_proxy.start()
            proxy = TcpProxy("127.0.0.1", 1)  # pointed at its server once it runs
            await proxy.start()
            link = Link(index, db_proxy, proxy)
            self.links.append(link)
            if index > 0 and self.config.skew_clocks:
                offset_s = self.rng.choice([-1, 1]) * self.rng.randint(30, 7200)
                self.clock_offsets[index] = f"{offset_s:+d}s"
            await self.start_server(link)

    async def start_server(self, link: Link) -> None:
        """Starts the link's server (which waits for an unreachable database by itself)."""
        env = server_env(proxied(self.config.database_url, link.db_proxy.port), **SERVER_SETTINGS)
        link.stack = contextlib.AsyncExitStack()
        env.update(faketime_env(self.clock_offsets.get(link.index)))
        link.server = await link.stack.enter_async_context(
            server_process(self.workdir / "servers", env)
        )
        link.proxy.target_port = link.server.port

    async def restart_database(self, attempts: int = 3) -> None:
        """Starts the crashed cluster again (crash recovery); a failed start is retried."""
        cluster = self.config.cluster
        try:
            for attempt in range(attempts):
                try:
                    await cluster.start()
                    return
                except ClusterError as error:
                    if attempt == attempts - 1:
                        print(f"history workload: the database did not restart: {error}")
        finally:
            self.database_restarting = False

    async def restart_server(self, link: Link, attempts: int = 3) -> None:
        """Starts the link's server again; a start that fails is retried (then logged)."""
        for attempt in range(attempts):
            try:
                await self.start_server(link)
                return
            except AssertionError as error:
                await link.stack.aclose()
                if attempt == attempts - 1:
                    print(f"history workload: server {link.index} did not restart: {error}")

    def target(self, first: int) -> str:
        """Every server's proxy, starting with ``first`` (gRPC's pick_first tries in order)."""
        order = self.links[first:] + self.links[:first]
        return "ipv4:" + ",".join(f"127.0.0.1:{link.proxy.port}" for link in order)

    # -- workers ----------------------------------------------------------------------

    async def start_worker(self) -> str:
        self.worker_count += 1
        name = f"w{self.worker_count}"
        cfg = self.config
        argv = [
            sys.executable, "-m", "tests.fault.history.worker",
            "--target", self.target(self.worker_count % len(self.links)),
            "--namespace", self.namespace,
            "--effects-url", cfg.database_url,
            "--history", str(self.workdir / f"{name}.jsonl"),
            "--name", name,
            "--seed", str(self.rng.randrange(2**32)),
            "--tasks", str(cfg.tasks),
            "--max-attempts", ",".join(map(str, cfg.max_attempts)),
            "--ttl", str(cfg.ttl_s),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
        env["PYTHONUNBUFFERED"] = "1"
        with (self.workdir / f"{name}.log").open("wb") as log:
            self.workers[name] = await asyncio.create_subprocess_exec(
                *argv, cwd=REPO_ROOT, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        return name

    def signal_worker(self, name: str, sig: int) -> None:
        proc = self.workers[name]
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

    # -- faults -----------------------------------------------------------------------

    def record(self, kind: str, target: str, duration_s: float = 0.0, **extra: Any) -> None:
        now = time.monotonic()
        self.faults.append(
            {"kind": kind, "target": target, "t": now, "until": now + duration_s, **extra}
        )

    def later(self, delay_s: float, heal: Callable[[], Coroutine[Any, Any, None]]) -> None:
        async def run() -> None:
            await asyncio.sleep(delay_s)
            await heal()

        task = asyncio.get_running_loop().create_task(run())
        self.healing.add(task)
        task.add_done_callback(self.healing.discard)

    async def inject(self, kind: str) -> None:
        rng, ttl_s = self.rng, self.config.ttl_s
        if kind in ("pause_worker", "kill_worker"):
            alive = sorted(n for n, p in self.workers.items() if p.returncode is None)
            if not alive:
                return
            name = rng.choice(alive)
            if kind == "pause_worker":
                pause_s = rng.uniform(0.1, 3 * ttl_s)
                self.record(kind, name, pause_s)
                self.signal_worker(name, signal.SIGSTOP)

                async def resume() -> None:
                    self.signal_worker(name, signal.SIGCONT)

                self.later(pause_s, resume)
            else:
                self.record(kind, name)
                self.killed.add(name)
                self.signal_worker(name, signal.SIGKILL)
                await self.workers[name].wait()
                await self.start_worker()
            return
        if kind == "crash_database":
            cluster = self.config.cluster
            if cluster is None or self.database_restarting or not cluster.running:
                return  # no crash of a database still starting from the last one
            down_s = rng.uniform(0.1, 1.5)
            self.record(kind, "database", down_s)
            self.database_restarting = True
            await cluster.crash("immediate")
            self.later(down_s, self.restart_database)
            return
        link = rng.choice(self.links)
        label = f"link{link.index}"
        if kind == "black_hole_link":
            direction = rng.choice(["both", "upstream", "downstream"])
            hole_s = rng.uniform(0.2, 2 * ttl_s)
            self.record(kind, label, hole_s, direction=direction)
            link.proxy.black_hole(direction)
            self.later(hole_s, self.healer(link.proxy))
        elif kind == "delay_link":
            direction = rng.choice(["both", "upstream", "downstream"])
            delay_s, lasting_s = rng.uniform(0.05, ttl_s), rng.uniform(0.5, 2 * ttl_s)
            self.record(kind, label, lasting_s, direction=direction, delay_s=delay_s)
            link.proxy.delay(delay_s, direction)
            self.later(lasting_s, self.healer(link.proxy))
        elif kind == "reset_link":
            self.record(kind, label)
            link.proxy.reset()
        elif kind == "cut_database":
            cut_s = rng.uniform(0.2, 2.0)
            self.record(kind, label, cut_s)
            link.db_proxy.cut()
            self.later(cut_s, self.healer(link.db_proxy))
        elif kind == "kill_server":
            if link.index < self.config.spared_servers:
                return
            down_s = rng.uniform(0.1, 1.0)
            self.record(kind, label, down_s)
            assert link.server is not None
            await link.server.kill()
            await link.stack.aclose()

            async def restart() -> None:
                await self.restart_server(link)

            self.later(down_s, restart)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    @staticmethod
    def healer(proxy: TcpProxy) -> Callable[[], Coroutine[Any, Any, None]]:
        async def heal() -> None:
            proxy.restore()

        return heal

    # -- the run ----------------------------------------------------------------------

    async def run(self) -> Report:
        cfg = self.config
        self.workdir.mkdir(parents=True, exist_ok=True)
        if any(self.workdir.glob("w*.jsonl")):
            raise ValueError(f"{self.workdir} holds an earlier run's history; use a new folder")
        conn = await asyncpg.connect(cfg.database_url)
        try:
            await ensure_schema(conn)
        finally:
            await conn.close()
        started = time.monotonic()
        operator: asyncio.Task[None] | None = None
        try:
            await self.start_links()
            for _ in range(cfg.workers):
                await self.start_worker()
            if cfg.operator:
                operator = asyncio.get_running_loop().create_task(self.operate())
            end = started + cfg.duration_s
            while (now := time.monotonic()) < end:
                await asyncio.sleep(min(self.rng.expovariate(1 / cfg.fault_interval_s), end - now))
                if time.monotonic() < end:
                    await self.inject(self.rng.choice(cfg.faults))
        finally:
            if operator is not None:  # a call in flight is cancelled: its answer stays unknown
                operator.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await operator
            await self.heal_all()
            await self.stop_workers()
            for link in self.links:
                await link.stack.aclose()
                await link.proxy.close()
                await link.db_proxy.close()
        verdict = await self.judge()
        # A worker that exited by itself (not killed by a fault, not 0 after SIGTERM)
        # is a bug of the workload or the client; its log says which. -SIGTERM: the
        # stop reached a worker still starting, before it installed its handler.
        benign = (0, -signal.SIGTERM)
        crashed = [
            n
            for n, p in self.workers.items()
            if n not in self.killed and p.returncode not in benign
        ]
        verdict.counts["workers.crashed"] = len(crashed)
        verdict.counts["workers.started"] = len(self.workers)
        elapsed_s = time.monotonic() - started
        return Report(cfg, self.namespace, verdict, elapsed_s, self.clock_offsets)

    async def operate(self) -> None:
        """Runs the operator until cancelled."""
        operator = Operator(
            self.target(0),
            self.namespace,
            self.config.tasks,
            History(str(self.workdir / "op.jsonl"), "op"),
            # Its own random choices: the workload's (its faults) stay those of the seed.
            self.config.seed * 1_000_003 + 1,
        )
        await operator.run()

    async def heal_all(self) -> None:
        # Let every pending heal run (a cancelled restart could leave a half-started
        # server or database behind); each waits a few seconds at most.
        if self.healing:
            await asyncio.wait(set(self.healing), timeout=30)
        for task in list(self.healing):
            task.cancel()
        await asyncio.gather(*self.healing, return_exceptions=True)
        cluster = self.config.cluster
        if cluster is not None and not cluster.running:
            await cluster.start()
        for link in self.links:
            link.proxy.restore()
            link.db_proxy.restore()
            if link.server is None or link.server.proc.returncode is not None:
                await link.stack.aclose()
                await self.restart_server(link)
        for name in self.workers:
            self.signal_worker(name, signal.SIGCONT)

    async def stop_workers(self) -> None:
        for name in self.workers:
            self.signal_worker(name, signal.SIGTERM)
        for name, proc in self.workers.items():
            try:
                await asyncio.wait_for(proc.wait(), 3 * self.config.ttl_s + 5)
            except TimeoutError:
                self.signal_worker(name, signal.SIGKILL)
                await proc.wait()

    async def judge(self) -> Verdict:
        events: list[dict[str, Any]] = []
        for path in sorted([*self.workdir.glob("w*.jsonl"), *self.workdir.glob("op.jsonl")]):
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # a line cut by SIGKILL
                    events.append(json.loads(line))
        (self.workdir / "faults.json").write_text(json.dumps(self.faults, indent=1))
        conn = await asyncpg.connect(self.config.database_url)
        try:
            ns = self.namespace
            versions = await conn.fetch(
                "SELECT * FROM history_task_versions WHERE namespace = $1 ORDER BY version_id", ns
            )
            tasks = await conn.fetch("SELECT * FROM leasekeeper_tasks WHERE namespace = $1", ns)
            history = await conn.fetch(
                "SELECT * FROM leasekeeper_task_history WHERE namespace = $1 ORDER BY sequence", ns
            )
            applies = await conn.fetch(
                "SELECT * FROM history_applies WHERE namespace = $1 ORDER BY apply_id", ns
            )
            effects = await conn.fetch("SELECT * FROM leasekeeper_effects WHERE namespace = $1", ns)
        finally:
            await conn.close()
        return check(
            events,
            self.faults,
            [_microsecond_row(r) for r in versions],
            [_microsecond_row(r) for r in tasks],
            [dict(r) for r in applies],
            [_effect_row(r) for r in effects],
            task_history=[_microsecond_row(r) for r in history],
        )


def _microsecond_row(row: asyncpg.Record) -> dict[str, Any]:
    """A row as the checker reads it: instants as microseconds (``*_us``), data as text."""
    out = dict(row)
    for name in ("expire_time", "claim_time", "update_time", "checkpoint_time", "event_time"):
        if name in out:
            value = out.pop(name)
            us = micros(value) if isinstance(value, datetime) else None
            out[name.replace("_time", "_us")] = us
    data = out.get("checkpoint_data")
    if data is not None:
        out["checkpoint_data"] = bytes(data).decode(errors="replace")
    return out


def _effect_row(row: asyncpg.Record) -> dict[str, Any]:
    out = dict(row)
    out["policy"] = out["policy"].upper()
    result = out.get("result")
    out["result"] = bytes(result).decode(errors="replace") if result is not None else None
    return out


async def run_workload(config: WorkloadConfig) -> Report:
    """Runs one seeded workload and checks its history; see the module docstring."""
    return await Workload(config).run()
