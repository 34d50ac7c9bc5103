"""The high-availability tier: leasekeeper on a real Patroni cluster (``make test-ha``).

Every test here is marked ``ha`` (``pytest_collection_modifyitems`` below) and
``process``; pyproject's ``addopts`` deselect ``ha``: ``make test`` runs none
of them, ``make test-ha`` runs them (``pytest -m ha tests/ha``). What they
need is Debian's: ``patroni``, ``etcd-server``, ``haproxy`` and a PostgreSQL
(``.ci/run`` installs them); a missing one fails the tests, naming the
package, it does not skip them.

The cluster (:func:`tests.ha.cluster.patroni_cluster`) is started once per
session and migrated; each test leaves it whole for the next one.
Every fault's figures are added to ``build/ha/results.json`` and
``build/ha/results.md`` as soon as it is measured (the files are started
afresh by each session), and the table is printed at the end of the run.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from leasekeeper_server.storage.migrate import migrate
from tests.ha.cluster import PatroniCluster, patroni_cluster, postgres_bin_dir

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS_DIR = ROOT / "build" / "ha"

# What the table shows, in order: (figure in results.json, column heading).
COLUMNS = [
    ("fault", "fault"),
    ("replication", "replication"),
    ("primary", "primary"),
    ("unavailable_s", "UNAVAILABLE (s)"),
    ("first_grant_s", "first grant after the fault (s)"),
    ("recovered_s", "both servers granting (s)"),
    ("whole_again_s", "cluster whole again (s)"),
    ("checker_violations", "checker violations"),
    ("acknowledged_grants", "grants acknowledged"),
    ("acknowledged_grants_lost", "grants lost"),
    ("acknowledged_releases_lost", "releases lost"),
    ("acknowledged_checkpoints_lost", "checkpoints lost"),
    ("acknowledged_effects_lost", "effects lost"),
    ("acknowledged_fences_reused", "fences reused"),
]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.ha)
            item.add_marker(pytest.mark.process)


def _version(*command: str) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    except OSError:
        return "missing"
    return (done.stdout or done.stderr).strip().splitlines()[0] if done.returncode == 0 else "?"


def machine() -> dict[str, Any]:
    """Where the figures were measured: CPU, cores, memory, the versions of what ran."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_gib, 1),
        "os": platform.platform(),
        "postgresql": _version(str(postgres_bin_dir() / "postgres"), "--version"),
        "patroni": _version("/usr/bin/patroni", "--version"),
        "etcd": _version("/usr/bin/etcd", "--version"),
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The figures as a markdown table (one row per fault)."""
    lines = [
        "| " + " | ".join(heading for _, heading in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for row in rows:
        cells = []
        for key, _ in COLUMNS:
            value = row.get(key, "")
            cells.append(f"{value:.1f}" if isinstance(value, float) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


class Results:
    """The tier's figures: kept in build/ha/results.{json,md} as each fault is measured."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.rows: list[dict[str, Any]] = []
        self.notes: dict[str, Any] = {}
        self.machine = machine()
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("results.json", "results.md"):
            (folder / name).unlink(missing_ok=True)

    def add(self, figures: dict[str, Any]) -> None:
        """Adds one fault's figures (a row of the table)."""
        self.rows.append(figures)
        self._write()

    def note(self, name: str, value: Any) -> None:
        """Adds a figure that is not a fault's (listed under the table)."""
        self.notes[name] = value
        self._write()

    def _write(self) -> None:
        document = {"machine": self.machine, "faults": self.rows, "notes": self.notes}
        (self.folder / "results.json").write_text(json.dumps(document, indent=2) + "\n")
        (self.folder / "results.md").write_text(self.markdown())

    def markdown(self) -> str:
        m = self.machine
        notes = "".join(f"\n- {name}: {value}" for name, value in self.notes.items())
        return (
            f"Measured by `make test-ha` on {m['cores']} cores ({m['cpu']}), "
            f"{m['memory_gib']} GiB; {m['postgresql']}, Patroni {m['patroni'].split()[-1]}, "
            f"etcd {m['etcd'].split()[-1]}.\n\n"
            + markdown_table(self.rows)
            + notes
            + ("\n" if notes else "")
        )


_RESULTS: list[Results] = []


@pytest.fixture(scope="session")
def ha_results() -> Iterator[Results]:
    """Where each fault test adds its figures."""
    results = Results(RESULTS_DIR)
    _RESULTS.append(results)
    yield results


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for results in _RESULTS:
        if results.rows or results.notes:
            terminalreporter.section("high availability: figures (build/ha/results.md)")
            terminalreporter.write(results.markdown())


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PatroniCluster]:
    """A whole three-node Patroni cluster in synchronous mode, migrated, for the session.

    Its proxies run in the session's event loop: the tests using it are marked
    ``pytest.mark.asyncio(loop_scope="session")``.
    """
    async with patroni_cluster(tmp_path_factory.mktemp("patroni"), synchronous=True) as running:
        await migrate(running.url)
        yield running
