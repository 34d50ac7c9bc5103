"""The etcd reference point: Debian's etcd doing the claim through a Python client.

:func:`etcd_server` runs a private single-member etcd on free loopback ports
with a temporary data directory (default durability: every write is fsynced).
:func:`etcd_claim` gives the load generator an op with leasekeeper's Claim
semantics the way etcd's lock and election recipes do it: grant a lease with
the ttl, then one transaction "if the key was never created (create_revision
== 0), put key=owner attached to the lease, else read the holder".

The client is ``aetcd``: a maintained asyncio etcd v3 client on grpc.aio (the
same gRPC stack as leasekeeper's client) whose generated code loads under
protobuf 7 and grpcio 1.85.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aetcd

from bench.loadgen import Op
from bench.reference_process import Target, log_tail, stop

INSTALL_HINT = "apt-get install etcd-server"
DEBIAN_BINARY = Path("/usr/bin/etcd")
START_TIMEOUT_S = 20.0


def etcd_binary() -> Path | None:
    """The ``etcd`` executable on PATH (or Debian's ``/usr/bin/etcd``), or None."""
    found = shutil.which("etcd")
    if found:
        return Path(found)
    return DEBIAN_BINARY if DEBIAN_BINARY.exists() else None


def ensure_etcd(install: bool = True) -> Path:
    """The etcd executable; installs Debian's ``etcd-server`` first when it is missing.

    Installs only when ``install`` and running as root (``apt-get install -y
    etcd-server``, after ``apt-get update`` if the first attempt fails), and
    says so on stdout. Blocks while apt runs.

    Raises:
        FileNotFoundError: etcd is missing and was not (or could not be) installed.
    """
    found = etcd_binary()
    if found is not None:
        return found
    if not install or os.geteuid() != 0:
        raise FileNotFoundError(f"etcd not found: install Debian's etcd-server ({INSTALL_HINT})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "etcd-server"]
    print(f"etcd not found; running: {' '.join(command)}", flush=True)
    if subprocess.run(command, env=env, check=False).returncode != 0:
        print("running: apt-get update, then the install again", flush=True)
        subprocess.run(["apt-get", "update"], env=env, check=False)
        subprocess.run(command, env=env, check=False)
    found = etcd_binary()
    if found is None:
        raise FileNotFoundError(f"etcd could not be installed ({INSTALL_HINT} failed)")
    return found


def _free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free at the time of asking."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _healthy(client_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=0.5) as answer:
            return b'"health":"true"' in answer.read()
    except OSError:
        return False


@contextlib.asynccontextmanager
async def etcd_server(install: bool = True) -> AsyncIterator[Target]:
    """A private single-member etcd on free loopback ports, stopped and deleted on exit.

    Args:
        install: install Debian's ``etcd-server`` when etcd is missing (as root only).

    Yields:
        Its client address (``127.0.0.1:PORT``) and process id, once it answers healthy.

    Raises:
        FileNotFoundError: etcd is not installed (see :func:`ensure_etcd`).
        RuntimeError: it exited or did not become healthy within 20 s (with its log's tail).
    """
    binary = await asyncio.to_thread(ensure_etcd, install)
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as tmp:
        log_path = Path(tmp) / "etcd.log"
        client_port, peer_port = _free_ports(2)
        client_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        command = [
            str(binary),
            "--name=bench",
            f"--data-dir={tmp}/data",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=bench={peer_url}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not await asyncio.to_thread(_healthy, client_url):
                if process.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"etcd did not become healthy on {client_url}:\n{log_tail(log_path)}"
                    )
                await asyncio.sleep(0.1)
            yield Target(f"127.0.0.1:{client_port}", process.pid)
        finally:
            await stop(process)


@contextlib.asynccontextmanager
async def etcd_claim(target: Target, ttl_s: int = 30, hot: bool = False) -> AsyncIterator[Op]:
    """An op claiming a task in etcd: lease grant with the ttl, then one transaction.

    The transaction: if the task key's ``create_revision`` is 0 (no holder),
    put ``key = owner`` attached to the new lease, else read the holder. Each
    call claims a key of its own (``.../{worker}-{call}``, under a prefix
    unique to this op) and must win; with ``hot`` every call claims one key
    (the first wins, the rest read the holder). A lease granted for a lost
    claim is left to expire after ``ttl_s``, as a crashed claimant's would.

    Args:
        target: a running etcd (:func:`etcd_server`).
        ttl_s: lease ttl, whole seconds.
        hot: all calls on one key (contention) instead of distinct keys.

    Yields:
        ``op(worker, call)``; it raises ``RuntimeError`` when a distinct key
        was found held, and aetcd's errors when etcd fails.
    """
    host, port = target.address.rsplit(":", 1)
    prefix = f"/bench/{uuid.uuid4().hex[:12]}"
    hot_key = f"{prefix}/hot".encode()
    async with aetcd.Client(host=host, port=int(port), timeout=10) as client:
        tx = client.transactions

        async def claim(worker: int, call: int) -> object:
            key = hot_key if hot else f"{prefix}/{worker}-{call}".encode()
            lease = await client.lease(ttl_s)
            succeeded, responses = await client.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, f"owner-{worker}".encode(), lease=lease)],
                failure=[tx.get(key)],
            )
            if not succeeded and not hot:
                raise RuntimeError(f"etcd key {key!r} was already held")
            return responses

        yield claim
