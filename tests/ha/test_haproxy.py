"""The HAProxy layout (deploy/haproxy/haproxy.cfg): HAProxy accepts it, and it finds the primary.

HAProxy asks each node's Patroni REST API ``GET /primary`` (200 on the leader
only) and sends connections to the node that answers 200. The deploy file is
checked as shipped (``haproxy -c -f``), then run against the test's Patroni
cluster with only its ``bind`` and ``server`` lines replaced (loopback ports),
through a switchover: connections land on the leader before, and on the new
leader after.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from tests.ha.cluster import PatroniCluster
from tests.ha.conftest import ROOT, Results
from tests.helpers import poll

pytestmark = [pytest.mark.timeout(180)]

HAPROXY = Path("/usr/sbin/haproxy")
CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
ROUTED_WITHIN_S = 30.0


def haproxy() -> Path:
    if not HAPROXY.exists():
        raise FileNotFoundError(f"{HAPROXY} is missing: apt-get install haproxy")
    return HAPROXY


def test_the_deploy_configuration_is_valid() -> None:
    done = subprocess.run(
        [str(haproxy()), "-c", "-f", str(CONFIG)], capture_output=True, text=True, timeout=30
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Configuration file is valid" in output, output
    # The only warnings: the example host names do not resolve here.
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert all("could not resolve address" in line for line in warnings), output
    servers = re.findall(r"^\s*server (\S+) \S+ check port 8008$", CONFIG.read_text(), re.M)
    assert servers == ["pg1", "pg2", "pg3"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def local_config(cluster: PatroniCluster, port: int) -> str:
    """The deploy file with its bind on ``port`` and a server line per node of ``cluster``."""
    lines = []
    for line in CONFIG.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("bind "):
            lines.append(f"    bind 127.0.0.1:{port}")
        elif stripped.startswith("server "):
            continue
        else:
            lines.append(line)
    lines += [
        f"    server {node.name} 127.0.0.1:{node.pg_port} check port {node.rest_port}"
        for node in cluster.nodes
    ]
    return "\n".join(lines) + "\n"


@contextlib.asynccontextmanager
async def running_haproxy(config: Path, log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            str(haproxy()), "-db", "-f", str(config),
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
        )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def reached_port(port: int) -> int | None:
    """The PostgreSQL port a new connection through HAProxy lands on, if it is a primary."""
    try:
        conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", timeout=2)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
        return None
    try:
        row = await conn.fetchrow("SELECT inet_server_port() AS port, pg_is_in_recovery() AS ro")
    finally:
        await conn.close()
    return None if row["ro"] else int(row["port"])


@pytest.mark.asyncio(loop_scope="session")
async def test_haproxy_sends_connections_to_the_primary_across_a_switchover(
    cluster: PatroniCluster, ha_results: Results, tmp_path: Path
) -> None:
    leader = await cluster.wait_healthy()
    port = _free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(local_config(cluster, port))
    async with running_haproxy(config, tmp_path / "haproxy.log"):

        async def on(expected: int) -> bool:
            return await reached_port(port) == expected

        await poll(lambda: on(leader.pg_port), "HAProxy to route to the leader", ROUTED_WITHIN_S,
                   0.1, details=lambda: (tmp_path / "haproxy.log").read_text())  # fmt: skip
        members = await cluster.members()
        roles = {m.name: m.role for m in members}
        candidate = next(
            (n for n in cluster.nodes if roles.get(n.name) == "sync_standby"),
            next(n for n in cluster.nodes if roles.get(n.name) == "replica"),
        )
        started = time.monotonic()
        await cluster.switchover(leader, candidate)
        await poll(lambda: on(candidate.pg_port), "HAProxy to route to the new leader",
                   ROUTED_WITHIN_S, 0.1,
                   details=lambda: (tmp_path / "haproxy.log").read_text())  # fmt: skip
        routed_s = time.monotonic() - started
    ha_results.note("haproxy_switchover_routed_s", round(routed_s, 2))
    assert (await cluster.wait_healthy()).name == candidate.name
