"""Real ``leasekeeper serve`` processes for fault tests.

A server is started in a session (process group) of its own, so a signal
reaches every process a ``prefix`` command may have started, and so a kill in
a ``finally`` leaves nothing behind. It listens on
``127.0.0.1:0``; its port is read from its own log line ("serving on ...
(port N)"), so no port is ever guessed. Output goes to a file, read back by
``logs()`` for failure messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_PORT_LINE = re.compile(r"serving on \S+ \(port (\d+)\)")


def leasekeeper_command() -> list[str]:
    """The ``leasekeeper`` console script of this interpreter's environment."""
    script = Path(sys.executable).with_name("leasekeeper")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "leasekeeper_server.cli.main"]


# Settings for servers under database faults: small timeouts, so an outage is
# noticed in about a second (a statement or connection attempt gives up after
# 1 s, a lock wait after 0.5 s, health pings every 0.2 s). Durations in seconds.
QUICK_OUTAGE_SETTINGS: dict[str, float] = {
    "statement_timeout_s": 1.0,
    "connect_timeout_s": 1.0,
    "lock_timeout_s": 0.5,
    "health_interval_s": 0.2,
}


def faketime_library() -> Path:
    """libfaketime's preload library: the one the ``libfaketime`` package ships, else the system's.

    Raises:
        FileNotFoundError: neither is installed (``pip install libfaketime``).
    """
    try:
        import libfaketime
    except ImportError:
        shipped: list[Path] = []
    else:
        shipped = [Path(libfaketime.__file__).parent / "vendor/libfaketime/src/libfaketime.so.1"]
    system = sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))
    for library in [*shipped, *system]:
        if library.exists():
            return library
    raise FileNotFoundError("libfaketime not installed (pip install libfaketime)")


def faketime_env(offset: str | None) -> dict[str, str]:
    """Environment that runs a process under libfaketime with ``offset`` (e.g. ``'-90s'``).

    Empty for None (the real clock). Only the wall clock is shifted. The
    library is preloaded (``LD_PRELOAD``) rather than run through the
    ``faketime`` wrapper, which names a semaphore
    after its pid: one left behind by a SIGKILLed wrapper makes a later wrapper
    with the same pid fail ("sem_open: File exists").

    Raises:
        FileNotFoundError: libfaketime is not installed.
    """
    if offset is None:
        return {}
    return {
        "LD_PRELOAD": str(faketime_library()),
        "FAKETIME": offset,
        # Only the wall clock: a monotonic clock has no meaning across processes
        # (its origin is arbitrary), so an offset there tests nothing of ours.
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


class ServerProcess:
    """A ``leasekeeper serve`` subprocess, its port and its log."""

    def __init__(self, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def logs(self) -> str:
        """Everything the process wrote so far (stdout and stderr)."""
        return self.log_path.read_text(errors="replace")

    def send_signal(self, sig: int) -> None:
        """Sends ``sig`` to the server's process group."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    async def wait_exit(self, timeout_s: float) -> int:
        """The exit code, waiting at most ``timeout_s``.

        Raises:
            TimeoutError: the process is still running.
        """
        return await asyncio.wait_for(self.proc.wait(), timeout_s)

    async def kill(self) -> None:
        """SIGKILLs the whole process group and reaps it."""
        self.send_signal(signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5)

    async def wait_serving(self, timeout_s: float) -> None:
        """Waits until the log names the port and health says SERVING.

        Raises:
            AssertionError: the process exited or did not serve in time (with its log).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise AssertionError(
                    f"server exited with {self.proc.returncode} before serving:\n{self.logs()}"
                )
            if not self.port:
                match = _PORT_LINE.search(self.logs())
                if match:
                    self.port = int(match.group(1))
            if self.port and await health_status(self.target, 0.5) == SERVING:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"server not SERVING after {timeout_s} s:\n{self.logs()}")


async def health_status(target: str, timeout_s: float, service: str = "") -> int | None:
    """The health Check answer of ``target``, or None when it does not answer."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return None
        return reply.status


def server_env(database_url: str, **settings: object) -> dict[str, str]:
    """The environment for a server: this one plus ``LEASEKEEPER_<NAME>`` for each setting.

    Inherited ``LEASEKEEPER_*`` and ``FAKETIME*`` variables are dropped: a
    server's settings and clock are what the test says, nothing else. The
    operator console is off unless a test asks for it (``console_listen=...``):
    its default port is one fixed address that only one process can take.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEASEKEEPER_", "FAKETIME"))}
    env["LEASEKEEPER_DATABASE_URL"] = database_url
    env["LEASEKEEPER_LISTEN"] = "127.0.0.1:0"
    env["LEASEKEEPER_CONSOLE_LISTEN"] = "off"
    for name, value in settings.items():
        env[f"LEASEKEEPER_{name.upper()}"] = str(value)
    return env


def _new_log(log_dir: Path) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / f"server-{time.monotonic_ns()}.log"


async def spawn_server(
    log_dir: Path, env: Mapping[str, str], prefix: Sequence[str] = ()
) -> ServerProcess:
    """Starts ``[*prefix, leasekeeper, serve]`` without waiting for it to serve.

    Its working directory is ``log_dir``, so no ``.env`` file of the project is
    read. The caller kills it (``ServerProcess.kill``).
    """
    log_path = _new_log(log_dir)
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            *prefix,
            *leasekeeper_command(),
            "serve",
            env=dict(env),
            cwd=log_dir,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    return ServerProcess(proc, log_path)


@contextlib.asynccontextmanager
async def server_process(
    log_dir: Path,
    env: Mapping[str, str],
    prefix: Sequence[str] = (),
    startup_timeout_s: float = 20.0,
) -> AsyncIterator[ServerProcess]:
    """Starts ``[*prefix, leasekeeper, serve]`` and waits until it is SERVING.

    The process is killed (SIGKILL to its group) on exit unless it has
    already ended.
    """
    server = await spawn_server(log_dir, env, prefix)
    try:
        await server.wait_serving(startup_timeout_s)
        yield server
    finally:
        await server.kill()


async def run_python(
    script: Path,
    args: Sequence[str],
    prefix: Sequence[str] = (),
    timeout_s: float = 30.0,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str, str]:
    """Runs a Python script (under ``prefix``, if any); returns (code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        str(script),
        *args,
        env=dict(env) if env is not None else None,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
