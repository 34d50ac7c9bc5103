"""An embedded PostgreSQL (the ``pgserver`` package) for running with no database configured.

The data directory survives restarts; the PostgreSQL process stops when the
service exits. Nothing here is used when ``database_url`` is set.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EmbeddedPostgres:
    """Starts PostgreSQL in ``data_dir`` and hands out its URL."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.expanduser().resolve()
        self._server: Any = None

    def start(self) -> str:
        """Starts (or reuses) the server; returns a URL for asyncpg."""
        import pgserver  # imported late: it is only needed here

        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        forget_dead_handles(self.data_dir)
        self._server = pgserver.get_server(self.data_dir, cleanup_mode="stop")
        url = str(self._server.get_uri())
        # The URL is logged so that tools that talk to the database (leasekeeper tokens,
        # an effect service's fence table in the docs) can be pointed at it.
        log.info("embedded PostgreSQL running at %s; data directory %s", url, self.data_dir)
        return url

    def stop(self) -> None:
        """Stops the server; the data directory stays."""
        if self._server is not None:
            self._server.cleanup()
            self._server = None


# pgserver's list of the processes using a data directory: the last one to leave stops PostgreSQL.
HANDLES_FILE = ".handle_pids.json"


def forget_dead_handles(data_dir: Path) -> list[int]:
    """Removes the processes that no longer run from pgserver's list of ``data_dir``'s users.

    A service killed with SIGKILL never takes its pid off the list, and while a dead pid is
    on it every later clean shutdown believes another process still uses PostgreSQL and
    leaves it running. Returns the pids removed.
    """
    from pgserver.utils import DiskList  # pgserver's own reader and writer of the list

    handles = DiskList(data_dir / HANDLES_FILE)
    dead = [pid for pid in handles.get() if not _running(pid)]
    for pid in dead:
        handles.get_and_remove(pid)
    if dead:
        log.info("embedded PostgreSQL: forgot the handles of exited processes %s", dead)
    return dead


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
