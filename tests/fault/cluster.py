"""Private PostgreSQL clusters for fault tests: crash, restart, replicate, promote.

A :class:`PgCluster` is a PostgreSQL cluster of the test's own, run from the
binaries the ``pgserver`` package ships (PostgreSQL 16, in every environment
that installs the server), so tests that crash or fail over a database need no
system PostgreSQL and never touch one. It listens on ``127.0.0.1`` on a free
port (TCP, so a :class:`~tests.fault.proxy.TcpProxy` can stand in the way) and
on a Unix socket in its own folder. The durability settings are PostgreSQL's
defaults, written out (``fsync``, ``synchronous_commit``, ``full_page_writes``
on): the tests measure what a crash keeps.

Running as root, the cluster runs as the ``pgserver`` system user, as
``pgserver`` itself does (PostgreSQL refuses to run as root). That user cannot
enter pytest's base temporary folder (mode 0700, and pytest sets it back to
0700 at the start of every session, so loosening it would break a cluster of
a concurrent session), so the cluster's files then live in a private folder
under the system's temporary directory; the server log is copied into the
test's folder when the cluster is closed.

The postmaster is a child of the test process (not ``pg_ctl start``'s
daemon), so a killed postmaster is reaped at once; ``stop``, ``crash`` and
``promote`` use ``pg_ctl``. Two ways to crash, both leaving the files as a
crash leaves them:

* ``crash("immediate")``: ``pg_ctl stop -m immediate``. The postmaster sends
  SIGQUIT to every process and exits: no checkpoint, no shared buffer written,
  clients see their connections drop. The next start runs crash recovery.
* ``crash("kill")``: SIGKILL to the postmaster and every one of its children
  (stopped first, so it forks no new backend while they are listed), and wait
  until they are dead.

Neither loses the operating system's page cache, so a commit can only be lost
if PostgreSQL acknowledged it before its WAL was written, which ``fsync`` and
``synchronous_commit`` forbid; an operating system crash is out of reach here.

Timings on a 2-core machine: ``init()`` 0.6-1.5 s (initdb; up to 2.5 s under
load), ``start()`` 0.04 s, ``crash()`` 0.1 s (``"kill"``: 0.01 s), a start
after a crash (with recovery) 0.1 s, ``make_standby()`` 0.4-0.9 s, a
standby's start until it streams 0.15 s, ``promote()`` 0.1 s
(``start_times_s`` keeps each start's duration).

Use it as an async context manager: whatever happens in the test, every
process the cluster started is stopped (killed if need be) on exit, and an
``atexit`` hook kills what is left if the test process ends without exiting
the block.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import asyncpg
import psutil
from pgserver._commands import POSTGRES_BIN_PATH

from tests.helpers import poll

CLUSTER_USER = "pgserver"
SUPERUSER = "postgres"
# sun_path holds 108 bytes on Linux; the socket's own name takes up to 16.
_SOCKET_DIR_MAX = 90
_CONF = """
# leasekeeper fault tests: production durability, a small footprint.
listen_addresses = '127.0.0.1'
fsync = on
synchronous_commit = on
full_page_writes = on
wal_level = replica
max_wal_senders = 4
hot_standby = on
max_connections = 60
shared_buffers = 32MB
"""

# What postmaster.pid's status line says once connections are accepted.
_READY = ("ready", "standby")

_LIVE: set[PgCluster] = set()


class ClusterError(RuntimeError):
    """A PostgreSQL command failed; the message carries its output and the server log's tail."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@functools.cache
def _run_as() -> tuple[dict[str, Any], tuple[int, int] | None]:
    """Subprocess arguments that run a command as the cluster user, and its (uid, gid).

    Not root: nothing to change. Root: the ``pgserver`` user (created if
    missing), after making the binaries readable to it, as pgserver does.
    """
    if os.geteuid() != 0:
        return {}, None
    from pgserver.utils import (
        ensure_folder_permissions,
        ensure_prefix_permissions,
        ensure_user_exists,
    )

    entry = ensure_user_exists(CLUSTER_USER)
    assert entry is not None
    ensure_prefix_permissions(POSTGRES_BIN_PATH)
    read_execute = 0o055
    ensure_folder_permissions(POSTGRES_BIN_PATH, read_execute)
    ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", 0o044)
    ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "share", 0o044)
    ids = (entry.pw_uid, entry.pw_gid)
    return {"user": ids[0], "group": ids[1], "extra_groups": []}, ids


def _stopped_or_gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _dead(proc: psutil.Process) -> bool:
    """Gone, or a zombie: a process that holds nothing any more (no shared memory)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(done: Callable[[], bool], timeout_s: float) -> None:
    """Polls ``done()`` (blocking: run it in a worker thread) until true or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.005)


def _kill_tree(postmaster: psutil.Process) -> None:
    """SIGKILL to a postmaster and all its children; waits until each is dead.

    The postmaster is stopped (SIGSTOP) before its children are listed, so it
    cannot fork a backend that the list would miss. Each child is its own
    session leader, so a process-group kill would miss them. psutil checks the
    process's start time, so a reused pid is never signalled.
    """
    if not postmaster.is_running() or _dead(postmaster):
        return
    with contextlib.suppress(psutil.Error):
        postmaster.send_signal(signal.SIGSTOP)
    _wait_for(functools.partial(_stopped_or_gone, postmaster), 5)
    victims = [postmaster]
    with contextlib.suppress(psutil.Error):
        victims.extend(postmaster.children(recursive=True))
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    _wait_for(lambda: all(_dead(proc) for proc in victims), 10)


def _environment() -> dict[str, str]:
    """This environment without libpq's variables, in the C locale."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(LC_ALL="C", LANG="C")
    return env


class PgCluster:
    """One private PostgreSQL cluster: its files, its postmaster, its port.

    Args:
        folder: The test's folder for this cluster (created if missing); holds
            the cluster's files (or, as root, the server log once closed).
        bin_dir: PostgreSQL binaries; the ones ``pgserver`` ships by default.
    """

    def __init__(self, folder: Path, bin_dir: Path = POSTGRES_BIN_PATH) -> None:
        self.folder = folder
        self.bin_dir = bin_dir
        self.port = 0
        self.start_times_s: list[float] = []
        self._run_kwargs, self._ids = _run_as()
        self._base: Path | None = None
        self._private = False
        # Every postmaster started, as an asyncio child and as a psutil handle.
        self._postmasters: list[tuple[asyncio.subprocess.Process, psutil.Process]] = []

    # -- files -----------------------------------------------------------------

    @property
    def base(self) -> Path:
        """The folder holding ``data/``, ``run/`` (the socket) and ``postgres.log``."""
        if self._base is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            if self._ids is None:
                self._base = self.folder
            else:
                self._base = Path(tempfile.mkdtemp(prefix="leasekeeper-pg-"))
                self._private = True
                os.chown(self._base, *self._ids)
            _LIVE.add(self)
        return self._base

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (PGDATA)."""
        return self.base / "data"

    @property
    def log_path(self) -> Path:
        """The server log (appended to across restarts)."""
        return self.base / "postgres.log"

    @property
    def socket_dir(self) -> Path | None:
        """The Unix socket folder, or None when its path would be too long for a socket."""
        path = self.base / "run"
        return path if len(str(path)) <= _SOCKET_DIR_MAX else None

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- commands --------------------------------------------------------------

    async def _pg(self, program: str, *args: str, timeout_s: float = 60.0) -> str:
        """Runs a PostgreSQL program as the cluster user; returns its output.

        Output goes to a file, not a pipe: a process the program leaves behind
        could hold the pipe open and keep it from ever reaching end-of-file.

        Raises:
            ClusterError: the program failed or outlived ``timeout_s``.
        """
        with tempfile.TemporaryFile() as out:
            proc = await asyncio.create_subprocess_exec(
                str(self.bin_dir / program),
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                cwd=self.base,
                env=_environment(),
                **self._run_kwargs,
            )
            try:
                code = await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                code = None
            out.seek(0)
            output = out.read().decode(errors="replace")
        if code != 0:
            raise ClusterError(
                f"{program} {' '.join(args)} ended with {code}:\n{output}\n"
                f"--- server log ({self.log_path}) ---\n{self.log_tail()}"
            )
        return output

    async def init(self) -> None:
        """Creates the cluster (initdb; superuser ``postgres``, trust authentication)."""
        await self._pg(
            "initdb",
            "-D",
            str(self.data_dir),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            # Durability of the freshly made files against an operating system
            # crash is not under test; the server's own fsync stays on.
            "--no-sync",
        )
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(_CONF)

    async def start(self, timeout_s: float = 30.0) -> None:
        """Starts the postmaster and waits until it accepts connections.

        The first start picks a free port (trying another if it was taken in
        between); later starts reuse it, so URLs stay valid across restarts.
        A standby is ready once it accepts read-only connections.

        Raises:
            ClusterError: the server did not start (with its log).
        """
        first = self.port == 0
        for attempt in range(3 if first else 1):
            if first:
                self.port = _free_port()
            try:
                await self._spawn_postmaster(timeout_s)
                return
            except ClusterError:
                if first and attempt < 2 and "could not bind" in self.log_tail(5):
                    continue
                raise

    async def _spawn_postmaster(self, timeout_s: float) -> None:
        """Runs ``postgres`` as this process's child and waits until it is ready.

        A child of ours rather than ``pg_ctl start``'s daemon, so that a
        killed postmaster is reaped at once: a zombie would keep its pid in
        ``postmaster.pid`` alive in PostgreSQL's eyes and block the restart.
        Ready means what ``pg_ctl -w`` waits for: ``postmaster.pid`` says
        ``ready`` (or ``standby``, read-only connections accepted).
        """
        sockets = self.socket_dir
        if sockets is not None:
            sockets.mkdir(exist_ok=True)
            if self._ids is not None:
                os.chown(sockets, *self._ids)
        started = time.monotonic()
        with self.log_path.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                str(self.bin_dir / "postgres"),
                "-D",
                str(self.data_dir),
                "-p",
                str(self.port),
                "-c",
                f"unix_socket_directories={sockets or ''}",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=self.base,
                env=_environment(),
                start_new_session=True,
                **self._run_kwargs,
            )
        self._postmasters.append((proc, psutil.Process(proc.pid)))
        while not self._ready(proc.pid):
            if proc.returncode is not None:
                raise ClusterError(
                    f"postgres exited with {proc.returncode} before it was ready:\n"
                    f"--- server log ({self.log_path}) ---\n{self.log_tail()}"
                )
            if time.monotonic() - started > timeout_s:
                await self._kill_all()
                raise ClusterError(f"postgres not ready after {timeout_s} s:\n{self.log_tail()}")
            await asyncio.sleep(0.01)
        self.start_times_s.append(time.monotonic() - started)

    def _ready(self, pid: int) -> bool:
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        return len(lines) >= 8 and lines[0] == str(pid) and lines[7].strip() in _READY

    @property
    def running(self) -> bool:
        """Whether a postmaster this cluster started is alive."""
        return any(proc.returncode is None for proc, _ in self._postmasters)

    async def _pg_ctl_stop(self, mode: str, timeout_s: float) -> None:
        await self._pg(
            "pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "-t", str(int(timeout_s)),
            "stop", timeout_s=timeout_s + 5,
        )  # fmt: skip
        for proc, _ in self._postmasters:
            await proc.wait()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the server cleanly (``pg_ctl stop -m fast``: disconnect clients, checkpoint)."""
        await self._pg_ctl_stop("fast", timeout_s)

    async def crash(self, how: Literal["immediate", "kill"] = "immediate") -> None:
        """Crashes the server; returns once no process of it is left.

        Args:
            how: ``"immediate"``: ``pg_ctl stop -m immediate`` (SIGQUIT: every
                process exits at once, nothing is flushed or checkpointed).
                ``"kill"``: SIGKILL to the postmaster and each of its children.
        """
        if how == "immediate":
            await self._pg_ctl_stop("immediate", 30.0)
        else:
            await self._kill_all()

    async def restart(self, timeout_s: float = 30.0) -> None:
        """Starts the server again on the same port, stopping it first if it runs.

        After a crash the start runs crash recovery before accepting connections.
        """
        if self.running:
            await self.stop(timeout_s)
        await self.start(timeout_s)

    async def _kill_all(self) -> None:
        """SIGKILL to every postmaster this cluster started and to its children."""
        await asyncio.to_thread(self._kill_sync)
        for proc, _ in self._postmasters:
            await proc.wait()

    def _kill_sync(self) -> None:
        for _, ps in self._postmasters:
            _kill_tree(ps)

    # -- replication -----------------------------------------------------------

    async def make_standby(self, primary: PgCluster, via_port: int | None = None) -> None:
        """Makes this (not yet initialised) cluster a streaming standby of ``primary``.

        ``pg_basebackup -R -X stream`` copies the primary and writes
        ``standby.signal`` and a ``primary_conninfo`` naming
        ``127.0.0.1:via_port``, so the standby keeps streaming through that
        port (a TcpProxy to the primary, whose ``black_hole()`` stops
        replication without a reset). Asynchronous: the primary never waits
        for it. Start it with :meth:`start`, then :meth:`wait_streaming`.

        Args:
            primary: A running cluster.
            via_port: The port to stream from; the primary's own by default.
        """
        await self._pg(
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(via_port or primary.port),
            "-U",
            SUPERUSER,
            "-D",
            str(self.data_dir),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        )

    async def wait_streaming(self, timeout_s: float = 20.0) -> None:
        """Waits until this standby's WAL receiver streams from its primary."""
        await self.poll(
            "SELECT coalesce((SELECT status = 'streaming' FROM pg_stat_wal_receiver), false)",
            timeout_s,
            "the standby is not streaming",
        )

    async def wait_replayed(self, lsn: str, timeout_s: float = 20.0) -> None:
        """Waits until this standby has replayed the WAL up to ``lsn`` (``'0/3000148'``)."""
        await self.poll(
            f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn",
            timeout_s,
            f"the standby has not replayed up to {lsn}",
        )

    async def flush_lsn(self) -> str:
        """A primary's WAL flush position: every commit so far lies before it."""
        return str(await self.fetchval("SELECT pg_current_wal_flush_lsn()::text"))

    async def promote(self, timeout_s: float = 30.0) -> None:
        """Promotes this standby (``pg_ctl promote -w``); returns once it accepts writes.

        PostgreSQL switches to a new timeline on promotion.
        """
        await self._pg(
            "pg_ctl", "-D", str(self.data_dir), "-w", "-t", str(int(timeout_s)), "promote",
            timeout_s=timeout_s + 5,
        )  # fmt: skip

    # -- SQL -------------------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        """A libpq URL for ``dbname`` over TCP, as the superuser."""
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    async def connect(self, dbname: str = "postgres") -> asyncpg.Connection:
        """A new connection to ``dbname``."""
        return await asyncpg.connect(self.url(dbname), timeout=10)

    async def fetchval(self, sql: str, *args: Any, dbname: str = "postgres") -> Any:
        """Runs one statement on a connection of its own; its first value."""
        conn = await self.connect(dbname)
        try:
            return await conn.fetchval(sql, *args, timeout=10)
        finally:
            await conn.close()

    async def poll(self, sql: str, timeout_s: float, message: str) -> None:
        """Runs ``sql`` until it returns true.

        Raises:
            AssertionError: it did not within ``timeout_s`` (``message``).
        """
        await poll(lambda: self.fetchval(sql), message, timeout_s)

    async def timeline(self) -> int:
        """The timeline a primary (or a promoted standby) writes its WAL on.

        Read from the name of the current WAL file, whose first 8 hex digits
        are the WAL insertion timeline: exact from the moment the server
        accepts writes, while ``pg_control_checkpoint()`` shows the timeline
        of the last checkpoint, still the old one right after a promotion.
        A standby answers with an error (recovery in progress).
        """
        return int(
            await self.fetchval(
                "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))"
                "::bit(32)::bigint"
            )
        )

    # -- lifetime --------------------------------------------------------------

    async def close(self) -> None:
        """Stops every process of the cluster (immediately) and removes its files.

        The server log stays in :attr:`folder` (it is copied there when the
        files lived elsewhere). Safe to call more than once.
        """
        if self._base is None:
            return
        if self.running:
            with contextlib.suppress(ClusterError, OSError):
                await self._pg_ctl_stop("immediate", 10)
        await self._kill_all()
        await asyncio.to_thread(self._cleanup_files)

    def _cleanup_files(self) -> None:
        """Kills what is left (synchronously: also for the atexit hook), removes the files."""
        self._kill_sync()
        base = self._base
        if base is None:
            return
        if self._private:
            with contextlib.suppress(OSError):
                shutil.copyfile(self.log_path, self.folder / "postgres.log")
            shutil.rmtree(base, ignore_errors=True)
        else:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        _LIVE.discard(self)
        self._base = None

    async def __aenter__(self) -> PgCluster:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


@atexit.register
def _kill_leftovers() -> None:
    """Kills clusters a test left running (the process ended inside the block)."""
    for cluster in list(_LIVE):
        cluster._cleanup_files()
