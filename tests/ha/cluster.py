"""A Patroni cluster of the test's own: etcd, three PostgreSQL nodes, every link through a proxy.

:func:`patroni_cluster` starts, on loopback and in a temporary folder:

* one etcd (Debian's ``etcd-server``, :func:`bench.etcd.etcd_server`): Patroni's
  store (DCS, the etcd v3 API);
* three Patroni nodes (Debian's ``patroni``), ``n1``, ``n2``, ``n3``, each
  running a PostgreSQL (the newest ``/usr/lib/postgresql/<major>/bin``) on a
  free loopback port. ``n1`` bootstraps the cluster (initdb), the others copy
  it (``pg_basebackup``) and stream from the leader.

Each node is reached only through :class:`~tests.fault.proxy.TcpProxy` proxies
run in the test's event loop, one per kind of link, so a node can be cut off
from everyone (:meth:`PatroniCluster.partition`) while it keeps running:

* ``clients``: leasekeeper servers and workers to the node's PostgreSQL (the
  hosts of :attr:`PatroniCluster.url`);
* ``peers``: the other nodes to its PostgreSQL (Patroni's
  ``postgresql.connect_address``: streaming replication, ``pg_rewind``,
  ``pg_basebackup``);
* ``rest``: the other nodes (and ``patronictl``) to its REST API
  (``restapi.connect_address``; Patroni asks the other members whether they are
  alive and how far their WAL goes before it promotes one);
* ``dcs``: the node to etcd (``use_proxies``: Patroni talks to that address
  only, it does not discover etcd's own).

The settings that decide how fast a failure is acted on (the ``bootstrap.dcs``
section, Patroni's dynamic configuration): ``ttl`` 10 s (the leader key's
lease: a dead Patroni's leadership ends at most this long after its last
renewal), ``loop_wait`` 1 s (each node's cycle), ``retry_timeout`` 4 s (how long
etcd or PostgreSQL may not answer before Patroni gives up: a leader cut off
from etcd demotes itself then), ``primary_start_timeout`` 0 (a leader whose
PostgreSQL crashed fails over at once to a healthy standby rather than
restarting in place), ``maximum_lag_on_failover`` 16 MiB (how far behind a
standby may be and still be promoted, with asynchronous replication),
``synchronous_mode`` and ``synchronous_mode_strict`` (each commit waits for one
standby's flush; without a standby, writes wait), ``use_pg_rewind`` (a
deposed leader rejoins by rewinding its diverged WAL; failing that, it copies
the leader again).

Use :func:`patroni_cluster`: whatever happens in the test, every process is
killed on exit, and an ``atexit`` hook kills what is left if the test
process ends inside the block.

PostgreSQL refuses to run as root: as root, Patroni (and so PostgreSQL) runs
as the ``postgres`` system user (created if missing), and the cluster's files
live in a private folder under the system's temporary directory owned by it,
as :mod:`tests.fault.cluster` does for its clusters; each node's log (Patroni's
and PostgreSQL's, one file) is copied into the test's folder on close.

Timings on a 2-core machine: the cluster is up, with two streaming standbys,
in about 8 s.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil
import yaml

from bench.etcd import etcd_server
from tests.fault.cluster import _kill_tree
from tests.fault.proxy import TcpProxy
from tests.helpers import poll

PATRONI = Path("/usr/bin/patroni")
PATRONICTL = Path("/usr/bin/patronictl")
POSTGRES_ROOT = Path("/usr/lib/postgresql")
RUN_AS = "postgres"
SUPERUSER = "postgres"
DATABASE = "postgres"
SCOPE = "leasekeeper-ha"
NODE_NAMES = ("n1", "n2", "n3")
# Patroni's dynamic configuration (bootstrap.dcs); see the module docstring.
TTL_S = 10
LOOP_WAIT_S = 1
RETRY_TIMEOUT_S = 4
MAXIMUM_LAG_ON_FAILOVER = 16 * 1024 * 1024
START_TIMEOUT_S = 90.0
HEALTHY_TIMEOUT_S = 90.0
REST_TIMEOUT_S = 2.0
CAUGHT_UP_BYTES = 1024 * 1024


_LIVE: set[PatroniCluster] = set()


class PatroniError(RuntimeError):
    """A Patroni command failed or the cluster did not reach a state; with the logs' tails."""


def postgres_bin_dir() -> Path:
    """The newest Debian PostgreSQL's binaries (``/usr/lib/postgresql/<major>/bin``).

    Raises:
        FileNotFoundError: none is installed (``apt-get install postgresql``).
    """
    found = sorted(
        (p for p in POSTGRES_ROOT.glob("*/bin") if (p / "postgres").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if not found:
        raise FileNotFoundError(
            f"no PostgreSQL under {POSTGRES_ROOT}/<major>/bin (apt-get install postgresql)"
        )
    return found[-1]


def _require(path: Path, package: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: apt-get install {package}")
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_as() -> tuple[dict[str, Any], tuple[int, int] | None]:
    """Subprocess arguments that run a command as ``postgres``, and (uid, gid); none if not root."""
    if os.geteuid() != 0:
        return {}, None
    from pgserver.utils import ensure_user_exists

    entry = ensure_user_exists(RUN_AS)
    assert entry is not None
    ids = (entry.pw_uid, entry.pw_gid)
    return {"user": ids[0], "group": ids[1], "extra_groups": []}, ids


def _environment() -> dict[str, str]:
    """This environment without libpq's and Patroni's variables, in the C locale."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PATRONI"))}
    env.update(LC_ALL="C", LANG="C", PYTHONUNBUFFERED="1")
    return env


@dataclasses.dataclass
class Member:
    """One member as Patroni's ``GET /cluster`` describes it."""

    name: str
    role: str  # "leader", "sync_standby" or "replica"
    state: str  # "running", "streaming", "starting", "stopped", ...
    timeline: int | None
    lag: int | str | None  # bytes behind the leader's last reported WAL position; None for it


@dataclasses.dataclass
class Node:
    """One Patroni node: its ports, its proxies, its process and files."""

    name: str
    base: Path
    pg_port: int
    rest_port: int
    clients: TcpProxy
    peers: TcpProxy
    rest: TcpProxy
    dcs: TcpProxy
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0

    @property
    def proxies(self) -> tuple[TcpProxy, ...]:
        return (self.clients, self.peers, self.rest, self.dcs)

    @property
    def data_dir(self) -> Path:
        return self.base / "data"

    @property
    def config_path(self) -> Path:
        return self.base / "patroni.yml"

    @property
    def log_path(self) -> Path:
        return self.base / "node.log"

    @property
    def running(self) -> bool:
        """Whether this node's Patroni process is alive."""
        return self.proc is not None and self.proc.returncode is None

    def postmaster(self) -> psutil.Process | None:
        """The node's running postmaster (from ``postmaster.pid``), or None."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE or "postgres" not in proc.name():
                return None
            return proc
        except (OSError, ValueError, IndexError, psutil.Error):
            return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class PatroniCluster:
    """Three Patroni nodes on one etcd; see the module docstring.

    Args:
        folder: The test's folder (node logs are copied there on close).
        etcd_address: etcd's client address (``127.0.0.1:PORT``).
        synchronous: ``synchronous_mode`` and ``synchronous_mode_strict`` at bootstrap.
    """

    def __init__(self, folder: Path, etcd_address: str, synchronous: bool) -> None:
        self.folder = folder
        self.etcd_address = etcd_address
        self.synchronous = synchronous
        self.bin_dir = postgres_bin_dir()
        self._run_kwargs, self._ids = _run_as()
        self.base = Path(tempfile.mkdtemp(prefix="lk-ha-"))
        if self._ids is not None:
            os.chown(self.base, *self._ids)
        self.nodes: list[Node] = []
        self._http = httpx.AsyncClient(timeout=REST_TIMEOUT_S)
        _LIVE.add(self)

    # -- the nodes -----------------------------------------------------------------

    async def create_nodes(self) -> None:
        """Makes each node's folder, ports and proxies (nothing runs yet)."""
        etcd_host, etcd_port = self.etcd_address.rsplit(":", 1)
        for name in NODE_NAMES:
            base = self.base / name
            base.mkdir()
            (base / "run").mkdir()
            if self._ids is not None:
                os.chown(base, *self._ids)
                os.chown(base / "run", *self._ids)
            pg_port, rest_port = _free_port(), _free_port()
            proxies = [
                TcpProxy("127.0.0.1", pg_port),
                TcpProxy("127.0.0.1", pg_port),
                TcpProxy("127.0.0.1", rest_port),
                TcpProxy(etcd_host, int(etcd_port)),
            ]
            for proxy in proxies:
                await proxy.start()
            node = Node(name, base, pg_port, rest_port, *proxies)
            self.nodes.append(node)
            node.config_path.write_text(yaml.safe_dump(self._config(node), sort_keys=False))

    def _config(self, node: Node) -> dict[str, Any]:
        """The node's Patroni configuration (see the module docstring for the settings)."""
        return {
            "scope": SCOPE,
            "namespace": "/leasekeeper/",
            "name": node.name,
            "log": {"level": "INFO", "format": "%(asctime)s %(levelname)s: %(message)s"},
            "restapi": {
                "listen": f"127.0.0.1:{node.rest_port}",
                "connect_address": f"127.0.0.1:{node.rest.port}",
            },
            "etcd3": {"host": f"127.0.0.1:{node.dcs.port}", "use_proxies": True},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL_S,
                    "loop_wait": LOOP_WAIT_S,
                    "retry_timeout": RETRY_TIMEOUT_S,
                    "maximum_lag_on_failover": MAXIMUM_LAG_ON_FAILOVER,
                    "primary_start_timeout": 0,
                    "synchronous_mode": self.synchronous,
                    "synchronous_mode_strict": self.synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "max_connections": 100,
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "256MB",
                            "shared_buffers": "32MB",
                            # Production durability, written out: the tier measures what
                            # a failover keeps.
                            "fsync": "on",
                            "synchronous_commit": "on",
                            "full_page_writes": "on",
                            "wal_receiver_status_interval": "1s",
                            "wal_sender_timeout": "10s",
                            "wal_receiver_timeout": "10s",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.peers.port}",
                "data_dir": str(node.data_dir),
                "bin_dir": str(self.bin_dir),
                "pgpass": str(node.base / "pgpass"),
                "authentication": {
                    "superuser": {"username": SUPERUSER, "password": "superuser"},
                    "replication": {"username": "replicator", "password": "replicator"},
                    "rewind": {"username": SUPERUSER, "password": "superuser"},
                },
                "parameters": {"unix_socket_directories": str(node.base / "run")},
                "basebackup": [{"checkpoint": "fast"}],
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
            },
            "watchdog": {"mode": "off"},
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }

    async def start_node(self, node: Node) -> None:
        """Starts the node's Patroni (which starts, or bootstraps, or copies its PostgreSQL)."""
        if node.running:
            raise PatroniError(f"{node.name} is already running")
        node.starts += 1
        with node.log_path.open("ab") as log:
            log.write(f"--- start {node.starts} of {node.name} ---\n".encode())
            log.flush()
            node.proc = await asyncio.create_subprocess_exec(
                str(_require(PATRONI, "patroni")),
                str(node.config_path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=node.base,
                env=_environment(),
                start_new_session=True,
                **self._run_kwargs,
            )

    async def kill_postmaster(self, node: Node) -> int:
        """SIGKILL to the node's postmaster only (its backends then exit by themselves); its pid.

        Raises:
            PatroniError: the node runs no PostgreSQL.
        """
        postmaster = node.postmaster()
        if postmaster is None:
            raise PatroniError(f"{node.name} runs no postmaster:\n{node.log_tail()}")
        postmaster.send_signal(signal.SIGKILL)
        await asyncio.to_thread(postmaster.wait, 10)
        return postmaster.pid

    async def kill_node(self, node: Node) -> None:
        """SIGKILL to the node's Patroni and to its postmaster and every child of it.

        The postmaster is found first (Patroni's death does not stop it), then
        Patroni is killed, then the postmaster's tree (``_kill_tree`` of the
        fault suite: stopped, listed, killed, waited for).
        """
        postmaster = node.postmaster()
        if node.proc is not None and node.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
            await node.proc.wait()
        if postmaster is not None:
            await asyncio.to_thread(_kill_tree, postmaster)

    def partition(self, node: Node) -> None:
        """Cuts the node off from leasekeeper, the other nodes and etcd (it keeps running)."""
        for proxy in node.proxies:
            proxy.cut()

    def heal(self, node: Node) -> None:
        """Ends a partition: every link of the node forwards again."""
        for proxy in node.proxies:
            proxy.restore()

    # -- state ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The multi-host URL leasekeeper uses: every node's ``clients`` proxy, the writable one.

        ``target_session_attrs=read-write``: a connection tries the hosts in
        order and keeps the first that accepts writes (the leader).
        """
        hosts = ",".join(f"127.0.0.1:{node.clients.port}" for node in self.nodes)
        return f"postgresql://{SUPERUSER}@{hosts}/{DATABASE}?target_session_attrs=read-write"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    async def rest(self, node: Node, path: str) -> httpx.Response | None:
        """GET on the node's REST API (its own port, not the proxy); None if it does not answer."""
        try:
            return await self._http.get(f"http://127.0.0.1:{node.rest_port}{path}")
        except httpx.HTTPError:
            return None

    async def members(self) -> list[Member]:
        """The members as the first node that answers sees them (``GET /cluster``); [] if none."""
        for node in self.nodes:
            if not node.running:
                continue
            answer = await self.rest(node, "/cluster")
            if answer is None or answer.status_code != 200:
                continue
            return [
                Member(m["name"], m["role"], m["state"], m.get("timeline"), m.get("lag"))
                for m in answer.json()["members"]
            ]
        return []

    async def leader(self) -> Node | None:
        """The node whose REST API answers ``GET /primary`` with 200 (the leader, running)."""
        for node in self.nodes:
            if node.running:
                answer = await self.rest(node, "/primary")
                if answer is not None and answer.status_code == 200:
                    return node
        return None

    async def healthy(self) -> Node | None:
        """The leader when the cluster is whole, else None.

        Whole: one leader running, every other member running (or streaming)
        on its timeline and at most ``CAUGHT_UP_BYTES`` behind (each member
        reports its position once a loop, so under load a replica that keeps
        up may show a little lag), and, in synchronous mode, one of them the
        synchronous standby.
        """
        members = await self.members()
        if len(members) != len(self.nodes):
            return None
        leaders = [m for m in members if m.role == "leader" and m.state == "running"]
        if len(leaders) != 1:
            return None
        others = [m for m in members if m is not leaders[0]]
        if not all(
            m.state in ("running", "streaming")
            and isinstance(m.lag, int)
            and m.lag <= CAUGHT_UP_BYTES
            and m.timeline == leaders[0].timeline
            for m in others
        ):
            return None
        if self.synchronous and not any(m.role == "sync_standby" for m in others):
            return None
        leader = await self.leader()
        return leader if leader is not None and leader.name == leaders[0].name else None

    async def wait_healthy(self, timeout_s: float = HEALTHY_TIMEOUT_S) -> Node:
        """Waits until the cluster is whole (:meth:`healthy`); returns its leader.

        Raises:
            AssertionError: not within ``timeout_s`` (with every node's log tail).
        """
        result = await poll(self.healthy, "the Patroni cluster to be whole", timeout_s, 0.2,
                            details=self.describe)  # fmt: skip
        assert isinstance(result, Node)
        return result

    async def set_synchronous(self, synchronous: bool) -> None:
        """Switches ``synchronous_mode`` and ``_strict`` (``PATCH /config``); waits until whole."""
        leader = await self.wait_healthy()
        body = {"synchronous_mode": synchronous, "synchronous_mode_strict": synchronous}
        answer = await self._http.patch(f"http://127.0.0.1:{leader.rest_port}/config", json=body)
        if answer.status_code != 200:
            raise PatroniError(f"PATCH /config answered {answer.status_code}: {answer.text}")
        self.synchronous = synchronous

        async def applied() -> bool:
            members = await self.members()
            has_sync = any(m.role == "sync_standby" for m in members)
            return has_sync == synchronous and await self.healthy() is not None

        await poll(applied, f"synchronous_mode {synchronous} in effect", HEALTHY_TIMEOUT_S, 0.2,
                   details=self.describe)  # fmt: skip

    async def commit_latency_ms(self, commits: int = 300) -> dict[str, float]:
        """Median and 95th percentile of one-row INSERT commits on the primary, milliseconds.

        Each INSERT is its own transaction, sent through the multi-host URL
        (the same path as leasekeeper's), one after the other on one
        connection: with synchronous replication each waits for the standby's
        flush.
        """
        conn = await asyncpg.connect(self.url, timeout=10)
        try:
            await conn.execute("CREATE TABLE IF NOT EXISTS ha_commit_probe (id bigserial)")
            took = []
            for _ in range(commits):
                started = time.perf_counter()
                await conn.execute("INSERT INTO ha_commit_probe DEFAULT VALUES")
                took.append((time.perf_counter() - started) * 1000)
        finally:
            await conn.close()
        took.sort()
        return {
            "p50": round(statistics.median(took), 2),
            "p95": round(took[int(len(took) * 0.95)], 2),
        }

    async def switchover(self, leader: Node, candidate: Node) -> str:
        """``patronictl switchover --leader L --candidate C --force``; its output.

        Raises:
            PatroniError: patronictl failed.
        """
        proc = await asyncio.create_subprocess_exec(
            str(_require(PATRONICTL, "patroni")),
            "-c", str(leader.config_path),
            "switchover", "--leader", leader.name, "--candidate", candidate.name, "--force",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=_environment(),
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        text = out.decode(errors="replace")
        if proc.returncode != 0:
            raise PatroniError(f"patronictl switchover ended with {proc.returncode}:\n{text}")
        return text

    def describe(self) -> str:
        """Every node's log tail, for failure messages."""
        return "\n".join(
            f"--- {node.name} (pg {node.pg_port}, rest {node.rest_port}, "
            f"running={node.running}) ---\n{node.log_tail()}"
            for node in self.nodes
        )

    # -- lifetime ------------------------------------------------------------------

    async def start(self) -> Node:
        """Creates the nodes, starts ``n1`` (it bootstraps), then the others; returns the leader."""
        await self.create_nodes()
        first = self.nodes[0]
        await self.start_node(first)
        await poll(self.leader, "n1 to bootstrap the cluster", START_TIMEOUT_S, 0.2,
                   details=self.describe)  # fmt: skip
        for node in self.nodes[1:]:
            await self.start_node(node)
        return await self.wait_healthy(START_TIMEOUT_S)

    async def close(self) -> None:
        """Kills every process, closes the proxies, keeps the logs, removes the files."""
        for node in self.nodes:
            await self.kill_node(node)
        for node in self.nodes:
            for proxy in node.proxies:
                await proxy.close()
        await self._http.aclose()
        self.folder.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            with contextlib.suppress(OSError):
                shutil.copyfile(node.log_path, self.folder / f"{node.name}.log")
        shutil.rmtree(self.base, ignore_errors=True)
        _LIVE.discard(self)

    def kill_sync(self) -> None:
        """Kills every node's Patroni and PostgreSQL, blocking (for the atexit hook)."""
        for node in self.nodes:
            postmaster = node.postmaster()
            if node.proc is not None and node.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.proc.pid, signal.SIGKILL)
            if postmaster is not None:
                _kill_tree(postmaster)
        shutil.rmtree(self.base, ignore_errors=True)


@atexit.register
def _kill_leftovers() -> None:
    """Kills clusters a test left running (the process ended inside the block)."""
    for cluster in list(_LIVE):
        cluster.kill_sync()


@contextlib.asynccontextmanager
async def patroni_cluster(folder: Path, synchronous: bool = True) -> AsyncIterator[PatroniCluster]:
    """etcd and a whole three-node Patroni cluster (see the module docstring); stopped on exit."""
    async with etcd_server(install=False) as etcd:
        cluster = PatroniCluster(folder, etcd.address, synchronous)
        try:
            await cluster.start()
            yield cluster
        finally:
            await cluster.close()
