"""``leasekeeper serve --workers N``: N server processes on one port and one database.

The ``serve`` process becomes a supervisor. Having checked its listen
addresses are free (as a lone ``serve`` does), it resolves the database once
(starting the embedded PostgreSQL when no URL is set), refuses a pooler that
cannot work and applies the migrations once (a refusal for good exits 2 in
one line, as a lone ``serve`` does), reserves the listen port, and starts N
workers: fresh interpreters (``python -m leasekeeper_server.cli.supervisor``, never
a fork) that each run the normal ``LeaseServer`` with ``grpc.so_reuseport`` 1, so the kernel spreads
new connections over them. They share the database; the elected sweeper (an
advisory lock) keeps expiry announcements to one of them.

Addresses of worker k (0-based):

- ``listen`` and ``health_listen``: shared by all. Port 0 becomes one free
  port, picked by the supervisor; it holds the ports (bound with
  SO_REUSEPORT, never listening, so it takes no connections) until it exits,
  so a restarted worker finds them again and nothing else takes them.
- ``metrics_listen``: port + k, one HTTP endpoint per worker (port 0: any
  free port per worker, each logged).

Between supervisor and worker, two pipes: the worker writes one line,
``ready`` once it serves or ``failed REASON``; the supervisor writes nothing
to the other, whose end of file tells the worker the supervisor is gone (it
drains and exits, so no worker outlives it).

The operator console (``console_listen``) is served by the supervisor
itself, not by a worker: one console whatever N, started once all N
serve, calling the shared port on loopback (so any worker answers it, and
it outlives a worker's restart), stopped on SIGTERM or SIGINT while the
workers drain. The workers serve none.

Lifecycle: when all N serve, the supervisor logs ``leasekeeper serving on
HOST:PORT (port PORT) with N workers`` and prints ``leasekeeper listening on
HOST:PORT``. A worker that fails before that stops the start: the others are
stopped and ``serve`` exits 1 with its reason. A worker that dies later is
logged and restarted after a backoff (1 s, doubling to 30 s while restarts
keep failing; 1 s again once one served 30 s); its clients reconnect to the
others meanwhile. SIGTERM or SIGINT is forwarded (as SIGTERM) to every
worker, which drains as a lone server does; ``serve`` exits 0 when every
worker exited 0, 1 otherwise (a worker still running ``shutdown_grace_s`` +
10 s later is killed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from leasekeeper_server.console.serving import ConsoleServer
    from leasekeeper_server.settings import Settings

log = logging.getLogger("leasekeeper_server.cli.supervisor")  # the same name in a worker (__main__)

RESTART_INITIAL_S = 1.0
RESTART_MAX_S = 30.0
STABLE_S = 30.0  # a worker that served this long restarts after RESTART_INITIAL_S again
STOP_MARGIN_S = 10.0  # beyond shutdown_grace_s, before workers still running are killed
_RESERVE_ATTEMPTS = 5


# --- addresses -------------------------------------------------------------------------


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host, int(port)


def _socket_addresses(host: str) -> list[tuple[socket.AddressFamily, str]]:
    """Every (family, address) ``host`` binds to, as gRPC binds them all (``localhost``: two).

    Raises:
        OSError: the host does not resolve.
    """
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        raise OSError(exc.errno, f"cannot resolve {host}: {exc.strerror}") from exc
    found: list[tuple[socket.AddressFamily, str]] = []
    for family, _, _, _, sockaddr in infos:
        entry = (family, str(sockaddr[0]))
        if family in (socket.AF_INET, socket.AF_INET6) and entry not in found:
            found.append(entry)
    return found


def _bind(family: socket.AddressFamily, address: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to (address, port), not listening.

    SO_REUSEADDR is set (as gRPC and http.server set it), so connections of an
    earlier process in TIME_WAIT do not count; a listening socket does, unless
    both sides set SO_REUSEPORT.

    Raises:
        OSError: the address cannot be bound.
    """
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((address, port))
    except OSError:
        sock.close()
        raise
    return sock


def reserve(listen: str) -> tuple[str, list[socket.socket]]:
    """Checks that nothing listens on ``listen`` and holds its port for the workers.

    Each address is first bound without SO_REUSEPORT (so a server already
    there, even one sharing its port, is found), then held with it (so the
    workers can bind it too).

    Args:
        listen: ``host:port``; port 0 picks a free port.

    Returns:
        ``host:port`` with the concrete port, and the sockets holding it (the
        caller closes them when the workers are done).

    Raises:
        OSError: the port is taken, or the host cannot be bound.
    """
    host, port = _split(listen)
    addresses = _socket_addresses(host)
    for _ in range(_RESERVE_ATTEMPTS):
        held: list[socket.socket] = []
        chosen = port
        try:
            for family, address in addresses:
                probe = _bind(family, address, chosen, reuse_port=False)
                chosen = probe.getsockname()[1]
                probe.close()
                held.append(_bind(family, address, chosen, reuse_port=True))
            return f"{host}:{chosen}", held
        except OSError as exc:
            for sock in held:
                sock.close()
            if port != 0 or exc.errno != errno.EADDRINUSE:
                raise OSError(exc.errno, f"cannot listen on {listen}: {exc.strerror}") from exc
    raise OSError(errno.EADDRINUSE, f"cannot listen on {listen}: no port free on every address")


def check_free(listen: str) -> None:
    """Checks that ``listen`` can be bound now (port 0: always).

    Raises:
        OSError: the port is taken, or the host cannot be bound.
    """
    host, port = _split(listen)
    if port == 0:
        return
    for family, address in _socket_addresses(host):
        try:
            _bind(family, address, port, reuse_port=False).close()
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {listen}: {exc.strerror}") from exc


def metrics_listen(listen: str, index: int) -> str:
    """Worker ``index``'s metrics address: port + index (port 0 stays 0: any free port)."""
    host, port = _split(listen)
    return f"{host}:{port + index if port else 0}"


@dataclass(frozen=True)
class Plan:
    """What every worker is told: the database and the concrete shared addresses."""

    settings: Settings
    database_url: str
    listen: str
    health_listen: str | None

    def env(self, index: int) -> dict[str, str]:
        """The environment of worker ``index``: this process's plus its ``LEASEKEEPER_*``."""
        env = dict(os.environ)
        env["LEASEKEEPER_DATABASE_URL"] = self.database_url
        env["LEASEKEEPER_LISTEN"] = self.listen
        env["LEASEKEEPER_WORKERS"] = str(self.settings.workers)
        if self.health_listen:
            env["LEASEKEEPER_HEALTH_LISTEN"] = self.health_listen
        if self.settings.metrics_listen:
            env["LEASEKEEPER_METRICS_LISTEN"] = metrics_listen(self.settings.metrics_listen, index)
        return env


# --- the supervisor --------------------------------------------------------------------


def _describe(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


class _Worker:
    """One worker process, its status pipe (read) and lifeline (held open)."""

    def __init__(
        self,
        index: int,
        proc: asyncio.subprocess.Process,
        status: asyncio.StreamReader,
        transport: asyncio.ReadTransport,
        lifeline_fd: int,
    ) -> None:
        self.index = index
        self.proc = proc
        self._status = status
        self._transport = transport
        self._lifeline_fd: int | None = lifeline_fd

    @property
    def name(self) -> str:
        return f"worker {self.index} (pid {self.proc.pid})"

    async def wait_ready(self) -> str | None:
        """None once the worker serves; else why it never will (it failed or exited)."""
        line = (await self._status.readline()).decode(errors="replace").strip()
        if line == "ready":
            return None
        if line.startswith("failed"):
            reason = line.removeprefix("failed").strip().removeprefix("cannot start: ")
            return f"failed: {reason or 'no reason given'}"
        return _describe(await self.proc.wait())

    def send(self, sig: int) -> None:
        """Sends ``sig`` if the worker still runs."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def close(self) -> None:
        """Closes both pipes (the worker has exited)."""
        self._transport.close()
        if self._lifeline_fd is not None:
            os.close(self._lifeline_fd)
            self._lifeline_fd = None


async def _spawn(plan: Plan, index: int) -> _Worker:
    """Starts worker ``index`` (a fresh interpreter) without waiting for it to serve.

    Raises:
        OSError: the interpreter cannot be started.
    """
    status_r, status_w = os.pipe()
    lifeline_r, lifeline_w = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-P",  # the working directory is not an import path
            "-m",
            __name__,
            "--index",
            str(index),
            "--status-fd",
            str(status_w),
            "--lifeline-fd",
            str(lifeline_r),
            env=plan.env(index),
            stdin=asyncio.subprocess.DEVNULL,
            pass_fds=(status_w, lifeline_r),
        )
    except OSError:
        os.close(status_r)
        os.close(lifeline_w)
        raise
    finally:
        os.close(status_w)
        os.close(lifeline_r)
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(status_r, "rb", buffering=0)
    )
    return _Worker(index, proc, reader, transport, lifeline_w)


class Supervisor:
    """Starts N workers, restarts the ones that die, and stops them all on a signal."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.count = plan.settings.workers
        self._workers: dict[int, _Worker] = {}
        self._ready: set[int] = set()
        self._announced = False
        self._stop = asyncio.Event()  # set by SIGTERM/SIGINT, or by a worker that cannot start
        self._failure: str | None = None
        self._serving = asyncio.Event()  # set once all N serve
        self._console: ConsoleServer | None = None

    async def run(self) -> int:
        """Serves until SIGTERM/SIGINT or a worker that cannot start; returns the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        slots = [
            asyncio.create_task(self._slot(k), name=f"leasekeeper-worker-{k}")
            for k in range(self.count)
        ]
        console = asyncio.create_task(self._run_console(), name="leasekeeper-console-start")
        await self._stop.wait()
        if self._failure is None:
            log.info("signal received: stopping %d workers", self.count)
        for worker in self._workers.values():
            worker.send(signal.SIGTERM)
        console.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await console
        if self._console is not None:
            await self._console.stop()
        deadline_s = self.plan.settings.shutdown_grace_s + STOP_MARGIN_S
        done, pending = await asyncio.wait(slots, timeout=deadline_s)
        if pending:
            log.error("workers still running %.1f s after SIGTERM: killing them", deadline_s)
            for worker in self._workers.values():
                worker.send(signal.SIGKILL)
            await asyncio.wait(pending)
        if self._failure is not None:
            log.error("cannot start: %s", self._failure)
            return 1
        clean = not pending and all(slot.result() for slot in done)
        log.info("all workers stopped" if clean else "workers stopped, not all cleanly")
        return 0 if clean else 1

    async def _slot(self, index: int) -> bool:
        """Keeps worker ``index`` running until the stop; True if it then stopped cleanly."""
        delay_s = RESTART_INITIAL_S
        loop = asyncio.get_running_loop()
        while True:
            try:
                worker = await _spawn(self.plan, index)
            except OSError as exc:  # no process to wait for: fails like a worker that exits
                name, why, served_s = f"worker {index}", f"cannot be started: {exc}", 0.0
            else:
                self._workers[index] = worker
                if self._stop.is_set():
                    worker.send(signal.SIGTERM)
                reason = await worker.wait_ready()
                served_at = loop.time()
                if reason is None:
                    self._on_ready(worker)
                code = await worker.proc.wait()
                worker.close()
                self._ready.discard(index)
                if self._stop.is_set():
                    # A worker still starting when told to stop may die of the signal.
                    stopped = code == 0 or (
                        reason is not None and -code in (signal.SIGTERM, signal.SIGINT)
                    )
                    level = logging.INFO if stopped else logging.ERROR
                    log.log(level, "%s %s", worker.name, _describe(code))
                    return stopped
                served_s = loop.time() - served_at if reason is None else 0.0
                name, why = worker.name, reason or _describe(code)
            if self._stop.is_set():
                return True
            if not self._announced:
                self._fail(f"{name} {why}")
                return False
            if served_s >= STABLE_S:
                delay_s = RESTART_INITIAL_S
            log.warning("%s %s; restarting it in %.1f s", name, why, delay_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay_s)
            if self._stop.is_set():
                return True
            delay_s = min(delay_s * 2, RESTART_MAX_S)

    async def _run_console(self) -> None:
        """Starts the console once all workers serve (none when it is off or cannot start)."""
        from leasekeeper_server.console.serving import serve_beside

        await self._serving.wait()
        try:
            self._console = await serve_beside(
                self.plan.settings, self.plan.listen, _split(self.plan.listen)[1]
            )
        except ValueError as exc:  # checked before start (cli/main.py): a file changed since
            log.error("no console: %s", exc)

    def _on_ready(self, worker: _Worker) -> None:
        self._ready.add(worker.index)
        if self._announced:
            log.info("%s serving again", worker.name)
            return
        if len(self._ready) < self.count:
            return
        self._announced = True
        port = _split(self.plan.listen)[1]
        pids = ", ".join(str(self._workers[k].proc.pid) for k in sorted(self._workers))
        log.info(
            "leasekeeper serving on %s (port %d) with %d workers (pids %s)",
            self.plan.listen,
            port,
            self.count,
            pids,
        )
        print(f"leasekeeper listening on {self.plan.listen}", flush=True)
        self._serving.set()

    def _fail(self, reason: str) -> None:
        if self._failure is None and not self._stop.is_set():
            self._failure = reason
        self._stop.set()


async def supervise(settings: Settings) -> int:
    """``serve`` with ``settings.workers`` (> 1) worker processes; returns the exit status.

    The caller has checked the listen addresses are free (cli/main.py). Resolves
    the database (the embedded one is started here, once, and stopped last),
    refuses a pooler that cannot work and migrates it (``prepare_database``,
    as a lone server does), reserves the shared ports, checks the metrics
    ports, then runs a ``Supervisor``.

    Raises:
        DatabaseRefused: the database refuses for good (a pooler in
            transaction or statement mode included): said once, here, not by
            each worker.
    """
    from leasekeeper_server.app import prepare_database, resolve_database
    from leasekeeper_server.cli.startup import when_database_answers

    dsn, embedded = resolve_database(settings)
    held: list[socket.socket] = []
    try:
        if not await when_database_answers(settings, lambda: prepare_database(dsn, settings)):
            return 1
        try:
            listen, sockets = reserve(settings.listen)
            held += sockets
            health_listen = None
            if settings.health_listen:
                health_listen, sockets = reserve(settings.health_listen)
                held += sockets
            if settings.metrics_listen:
                _check_metrics(settings.metrics_listen, settings.workers)
        except OSError as exc:
            log.error("cannot start: %s", exc.strerror or exc)
            return 1
        log.info("starting %d workers on %s", settings.workers, listen)
        return await Supervisor(Plan(settings, dsn, listen, health_listen)).run()
    finally:
        for sock in held:
            sock.close()
        if embedded is not None:
            embedded.stop()


def _check_metrics(listen: str, count: int) -> None:
    """Checks the metrics ports port..port+count-1 are in range and free.

    Raises:
        OSError: one is out of range or taken.
    """
    last = metrics_listen(listen, count - 1)
    if _split(last)[1] > 65535:
        raise OSError(errno.EINVAL, f"metrics ports of {count} workers from {listen} pass 65535")
    for index in range(count):
        check_free(metrics_listen(listen, index))


# --- a worker --------------------------------------------------------------------------


class _LastError(logging.Handler):
    """Remembers the last ERROR logged: the reason a failed start gives the supervisor."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


def _report(status_fd: int, line: str) -> None:
    """Writes one status line to the supervisor (gone: nothing to tell)."""
    with contextlib.suppress(OSError):
        os.write(status_fd, (" ".join(line.split()) + "\n").encode())


def _watch_lifeline(loop: asyncio.AbstractEventLoop, fd: int, stop: asyncio.Event) -> None:
    """Sets ``stop`` when the supervisor's end of the lifeline closes (it exited)."""

    def readable() -> None:
        if not os.read(fd, 64):
            loop.remove_reader(fd)
            log.warning("supervisor gone: draining")
            stop.set()

    loop.add_reader(fd, readable)


async def _serve_worker(settings: Settings, args: argparse.Namespace, errors: _LastError) -> int:
    """One worker: serves until SIGTERM/SIGINT or the supervisor's end; returns the exit status."""
    from leasekeeper_server.cli.startup import start_when_database_answers

    assert settings.database_url, "the supervisor always names the database"
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _watch_lifeline(loop, args.lifeline_fd, stop)
    starting = asyncio.create_task(start_when_database_answers(settings, settings.database_url))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # told to stop while starting: nothing to drain
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return 0
    try:
        server = starting.result()
    except Exception as exc:  # cannot listen (gRPC, metrics), ...: the supervisor says why
        log.error("cannot start: %s", exc)
        _report(args.status_fd, f"failed {exc}")
        return 1
    if server is None:
        _report(args.status_fd, f"failed {errors.message or 'cannot start'}")
        return 1
    _report(args.status_fd, "ready")
    await stopped
    log.info(
        "worker %d: signal received: draining (grace %.1f s)", args.index, settings.shutdown_grace_s
    )
    await server.stop()
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    """Entry point of a worker process (started by ``supervise``, not by hand)."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    parser = argparse.ArgumentParser(prog="leasekeeper-worker")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--status-fd", type=int, required=True)
    parser.add_argument("--lifeline-fd", type=int, required=True)
    args = parser.parse_args(None if argv is None else list(argv))

    from leasekeeper_server.cli.startup import configure_logging, run_service, settings_errors
    from leasekeeper_server.settings import Settings

    try:
        settings = Settings()
    except ValueError as exc:
        _report(args.status_fd, f"failed invalid settings: {settings_errors(exc)}")
        return 2
    configure_logging(settings)
    errors = _LastError()
    logging.getLogger().addHandler(errors)
    return run_service(_serve_worker(settings, args, errors))


if __name__ == "__main__":
    sys.exit(main())
