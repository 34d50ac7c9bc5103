"""The side-by-side comparisons' parts: CPU accounting, their ops, the baseline's files, the report.

No speed is judged: the ops are run against a real server and database to
show they do what the comparison says it measures, and the accounting is fed
known amounts of CPU.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import pytest

from bench import scale
from bench.checkout import NoSourceTree, source_tree
from bench.loadgen import Op
from bench.paired import Side, compare, rotate
from bench.report import side_by_side, targets_table
from bench.runs import UsedUp, claim_op, prepare_released
from bench.scenarios import CHECKPOINT_DATA
from leasekeeper_server.storage.migrate import migrate
from tests.conftest import RunningServer

pytestmark = pytest.mark.process

BURN_A_S = 0.004
BURN_B_S = 0.002


def _burning(seconds: float) -> Op:
    """An op that spends ``seconds`` of this process's CPU per call."""

    async def op(worker: int, call: int) -> object:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
        return None

    return op


def _side(label: str, seconds: float, database_url: str) -> Side:
    @contextlib.asynccontextmanager
    async def made() -> AsyncIterator[Op]:
        yield _burning(seconds)

    return Side(label, os.getpid(), database_url, made)


async def test_compare_divides_a_sides_cpu_per_call_by_the_others(database_url: str) -> None:
    # This process is both sides' "server": A spends twice B's CPU per call.
    result = await compare(
        "burn",
        "A / B",
        1.5,
        _side("A", BURN_A_S, database_url),
        _side("B", BURN_B_S, database_url),
        rounds=2,
        concurrency=1,
        duration_s=0.4,
        warmup_s=0.0,
    )
    assert result.a.calls > 0 and result.b.calls > 0
    assert result.ratio is not None and 1.6 < result.ratio < 2.5
    assert len(result.rounds) == 2 and all(1.4 < r < 2.8 for r in result.rounds)
    assert result.met is False  # 2 > 1.5
    assert result.as_dict()["a"]["label"] == "A"


async def test_rotate_takes_the_sides_forwards_then_backwards(database_url: str) -> None:
    entered: list[str] = []

    def side(label: str) -> Side:
        @contextlib.asynccontextmanager
        async def made() -> AsyncIterator[Op]:
            entered.append(label)
            yield _burning(0.0)

        return Side(label, os.getpid(), database_url, made)

    tallies, costs = await rotate(
        [side("a"), side("b"), side("c")],
        rounds=3,
        concurrency=1,
        duration_s=0.05,
        warmup_s=0.0,
    )
    assert "".join(entered) == "abccbaabc"
    assert [t.label for t in tallies] == ["a", "b", "c"]
    assert len(costs) == 3 and all(len(cost) == 3 for cost in costs)
    assert all(len(t.p50_ms) == 3 and t.calls > 0 for t in tallies)


async def test_released_tasks_are_claimed_with_their_checkpoint_or_without(
    server: RunningServer, database_url: str, namespace: str
) -> None:
    with_data = await prepare_released(database_url, namespace, "with", 2, CHECKPOINT_DATA)
    without = await prepare_released(database_url, namespace, "without", 1, None)
    async with claim_op(server.target, namespace, 1, with_data, checkpoint=True) as claim:
        replies = [await claim(0, c) for c in range(2)]
        with pytest.raises(UsedUp):
            await claim(0, 2)
    assert [r.lease.task_id for r in replies] == with_data
    assert all(r.lease.fence == 2 for r in replies)  # prepared at fence 1, released
    assert all(r.checkpoint.data == CHECKPOINT_DATA for r in replies)
    async with claim_op(server.target, namespace, 1, without, checkpoint=False) as claim:
        reply = await claim(0, 0)
    assert reply.acquired and not reply.HasField("checkpoint")
    # A claim expected to carry a checkpoint that does not is an error, not a faster call.
    async with claim_op(server.target, namespace, 1, checkpoint=True) as claim:
        with pytest.raises(AssertionError):
            await claim(0, 0)


def test_source_tree_lays_out_a_commits_own_files() -> None:
    with source_tree("HEAD") as folder:
        assert (folder / "pyproject.toml").is_file()
        assert (folder / "migrations" / "0001_tasks.sql").is_file()
    assert not folder.exists()
    with pytest.raises(NoSourceTree), source_tree("0" * 40):
        pass


@pytest.fixture
async def fresh_url(database_url: str) -> AsyncIterator[str]:
    """An empty database beside the session's, migrated; dropped afterwards."""
    name = f"leasekeeper_seed_{uuid.uuid4().hex[:10]}"
    await scale.run_admin(database_url, f'CREATE DATABASE "{name}"')
    url = urlsplit(database_url)._replace(path=f"/{name}").geturl()
    try:
        await migrate(url)
        yield url
    finally:
        await scale.run_admin(database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_INDEXES = "SELECT indexdef FROM pg_indexes WHERE tablename = 'leasekeeper_task_history'"


async def test_seed_writes_each_tasks_history_as_the_triggers_would(fresh_url: str) -> None:
    rows = 2000
    conn = await asyncpg.connect(fresh_url)
    try:
        migrated = {r["indexdef"] for r in await conn.fetch(_INDEXES)}
        await scale.seed(fresh_url, rows)
        entries = await conn.fetchval("SELECT count(*) FROM leasekeeper_task_history")
        assert 3 * rows <= entries <= 6 * rows
        # One grant per fence; as many checkpoint entries as the stored version.
        wrong = await conn.fetchval(
            "SELECT count(*) FROM leasekeeper_tasks t WHERE"
            " t.fence <> (SELECT count(*) FROM leasekeeper_task_history h WHERE"
            "   (h.namespace, h.task_id, h.kind) = (t.namespace, t.task_id, 'granted'))"
            " OR coalesce(t.checkpoint_version, 0) <> (SELECT count(*)"
            "   FROM leasekeeper_task_history h WHERE"
            "   (h.namespace, h.task_id, h.kind) = (t.namespace, t.task_id, 'checkpoint_saved'))"
        )
        assert wrong == 0
        within_age = await conn.fetchval(
            "SELECT min(event_time) > now() - $1::interval FROM leasekeeper_task_history",
            scale.HISTORY_MAX_AGE,
        )
        assert within_age  # nothing for the pruner to find past its age
        watermark = await conn.fetchval("SELECT watermark FROM leasekeeper_history_pruning")
        last = await conn.fetchval("SELECT max(sequence) FROM leasekeeper_task_history")
        assert watermark == last
        # The indexes the seed dropped while it wrote are back as the migrations made them.
        assert {r["indexdef"] for r in await conn.fetch(_INDEXES)} == migrated
    finally:
        await conn.close()


def _comparison(name: str, ratio: float | None, target: float, note: str = "") -> dict:
    side = {"label": "x", "rate": 1000.0, "cpu_ms_per_call": 0.3, "db_cpu_ms_per_call": 0.1}
    return {
        "name": name,
        "title": f"{name} title",
        "target": target,
        "concurrency": 64,
        "ratio": ratio,
        "db_ratio": 1.5 if ratio else None,
        "met": None if ratio is None else ratio <= target,
        "rounds": [ratio, ratio] if ratio else [],
        "note": note,
        "a": side,
        "b": side,
    }


def test_report_judges_each_comparison_against_its_target() -> None:
    comparisons = [
        _comparison("within", 1.10, 1.15),
        _comparison("over", 1.60, 1.5),
        _comparison("skipped", None, 1.2, "not run: no baseline"),
    ]
    results = {"points": [], "comparisons": comparisons}
    rows = [line for line in targets_table(results) if "title" in line]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == ["yes", "no", "-"]
    assert "not run: no baseline" in rows[2]
    table = side_by_side(comparisons)
    assert any("| within title |" in line and "| 1.10 |" in line for line in table)
