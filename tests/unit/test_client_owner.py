"""Owner ids: unique per process incarnation, regenerated in a forked child."""

import os
import re
import socket

import pytest

from leasekeeper import LeaseClient, _owner, new_owner_id


def test_new_owner_id_has_host_pid_and_random_part():
    owner_id = new_owner_id()
    host = socket.gethostname().split(".", 1)[0]
    assert owner_id.startswith(f"{host[:64]}-{os.getpid()}-")
    assert re.fullmatch(r"[0-9a-f]{16}", owner_id.rsplit("-", 1)[1])
    assert len(owner_id.encode()) <= 256


def test_new_owner_id_is_unique_per_call():
    assert len({new_owner_id() for _ in range(1000)}) == 1000


def test_client_default_owner_ids_differ_between_clients():
    assert LeaseClient().owner_id != LeaseClient().owner_id


def test_client_explicit_owner_id_is_kept():
    assert LeaseClient(owner_id="worker-a").owner_id == "worker-a"


def test_after_fork_hook_regenerates_default_ids_only():
    default, explicit = LeaseClient(), LeaseClient(owner_id="worker-a")
    before = default.owner_id
    _owner._after_fork_in_child()
    assert default.owner_id != before
    assert explicit.owner_id == "worker-a"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_gets_new_owner_id():
    client = LeaseClient()
    parent_id = client.owner_id
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report and leave without running pytest's teardown
        try:
            os.write(write_fd, client.owner_id.encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        child_id = pipe.read().decode()
    os.waitpid(pid, 0)
    assert child_id
    assert child_id != parent_id
    assert f"-{pid}-" in child_id
    assert client.owner_id == parent_id
