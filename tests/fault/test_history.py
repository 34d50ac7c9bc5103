"""A bounded set of seeds of the history workload, each checked whole (see tests/fault/history).

Each seed runs real worker processes against two real servers for
``DURATION_S`` seconds of random faults (pauses, kills, partitions, delays,
resets, database cuts, server kills, one server under a shifted clock), with
runs resumed from checkpoints, attempt limits, and an operator that retries
quarantined tasks and cancels some; then the checker judges the whole
history: fences, one holder per instant, ValidateFence, ONCE effects,
acknowledged grants, losses within the trust window, checkpoints (written
only by the live current fence, handed out as stored, acknowledged ones
kept), ended tasks never granted again, quarantine and attempts, and the
service's task history. One more seed runs on a private PostgreSQL cluster
that the workload also crashes (``immediate``) and restarts under the load.
``bench/soak.py`` runs the same workload for as long as asked.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from leasekeeper_server.storage.migrate import migrate
from tests.fault.cluster import PgCluster
from tests.fault.history.workload import WorkloadConfig, run_workload

SEEDS = [101, 202, 303, 404]
CRASH_SEED = 505
DURATION_S = 15.0

pytestmark = [pytest.mark.timeout(120)]


@pytest.mark.parametrize("seed", SEEDS)
async def test_history_of_seed_has_no_violation(
    seed: int, database_url: str, tmp_path: Path
) -> None:
    config = WorkloadConfig(
        database_url=database_url, workdir=tmp_path, seed=seed, duration_s=DURATION_S
    )
    report = await run_workload(config)
    counts = report.verdict.counts
    assert report.verdict.violations == [], report.summary()
    # The run did what it is for: leases granted and lost, effects applied, faults
    # injected, checkpoints saved and resumed from, tasks read by the operator.
    assert counts["grants.database"] >= 10, report.summary()
    assert counts["event.applied"] >= 5, report.summary()
    assert sum(v for k, v in counts.items() if k.startswith("fault.")) >= 5, report.summary()
    assert_runs_exercised(counts, report.summary())
    assert counts["workers.crashed"] == 0, report.summary()


def assert_runs_exercised(counts: Counter[str], summary: str) -> None:
    """Checkpoints were written and resumed from, and the operator read the tasks.

    Quarantines, retries and cancels depend on the seed's faults; the unit
    tests of the checker hold that each of their violations would be found.
    """
    assert counts["checkpoints.written"] >= 5, summary
    assert counts["checkpoints.resumed"] >= 1, summary
    assert counts["event.observed"] >= 5, summary


async def test_history_with_database_crashes_has_no_violation(tmp_path: Path) -> None:
    """One seed on a private PostgreSQL that the workload also crashes and restarts."""
    async with PgCluster(tmp_path / "pg") as cluster:
        await cluster.init()
        await cluster.start()
        url = cluster.url("postgres")
        await migrate(url)
        config = WorkloadConfig(
            database_url=url,
            workdir=tmp_path / "run",
            seed=CRASH_SEED,
            duration_s=DURATION_S,
            cluster=cluster,
        )
        report = await run_workload(config)
    counts = report.verdict.counts
    assert report.verdict.violations == [], report.summary()
    assert counts["fault.crash_database"] >= 1, report.summary()
    assert counts["workers.crashed"] == 0, report.summary()
    assert counts["grants.database"] >= 10, report.summary()
    assert counts["event.applied"] >= 5, report.summary()
    assert_runs_exercised(counts, report.summary())
