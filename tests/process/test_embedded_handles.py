"""The embedded PostgreSQL stops with the service even after an earlier run was SIGKILLed.

pgserver keeps the pids of the processes using a data directory in a file and stops
PostgreSQL when the last one leaves. A run killed with SIGKILL leaves its pid there; the
service forgets pids of exited processes before it starts (storage/embedded.py), so its
clean shutdown stops PostgreSQL again.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from leasekeeper_server.storage.embedded import HANDLES_FILE, EmbeddedPostgres, forget_dead_handles
from tests.conftest import embedded_data_dir

pytestmark = [pytest.mark.timeout(120), pytest.mark.process]


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _postmaster_running(data_dir: Path) -> bool:
    pid_file = data_dir / "postmaster.pid"
    if not pid_file.exists():
        return False
    return psutil.pid_exists(int(pid_file.read_text().split()[0]))


def test_forget_dead_handles_keeps_live_pids(tmp_path: Path) -> None:
    dead = _exited_pid()
    (tmp_path / HANDLES_FILE).write_text(json.dumps([dead, 1]))
    assert forget_dead_handles(tmp_path) == [dead]
    assert json.loads((tmp_path / HANDLES_FILE).read_text()) == [1]


def test_stop_stops_postgres_after_a_killed_run_left_its_pid() -> None:
    data_dir = embedded_data_dir() / "pgdata"
    first = EmbeddedPostgres(data_dir)
    first.start()
    first.stop()
    # What a SIGKILLed earlier run leaves: its pid still on the list.
    (data_dir / HANDLES_FILE).write_text(json.dumps([_exited_pid()]))
    second = EmbeddedPostgres(data_dir)
    second.start()
    try:
        assert _postmaster_running(data_dir)
        second.stop()
        assert not _postmaster_running(data_dir)
    finally:  # never leave a PostgreSQL behind, whatever failed
        if _postmaster_running(data_dir):
            psutil.Process(int((data_dir / "postmaster.pid").read_text().split()[0])).kill()
        shutil.rmtree(data_dir.parent, ignore_errors=True)
