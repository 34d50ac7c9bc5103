"""The statements of the request path and the sweeper read indexes, never the whole table.

A fresh database is seeded with 20,000 task rows (``bench.scale.seed``: mostly
completed and released tasks, live leases, expired ones announced or not, an
effect for one task in ten) and analyzed. Every statement of ``queries.sql``
that a call or the sweeper runs is explained with realistic values
(``bench.scale.probes``), batch statements with one task and with
``bench.scale.BATCH``, twice: the custom plan made for those values (what a
prepared statement runs for its first five executions) and the generic plan
(what it may keep from then on). Neither may scan ``leasekeeper_tasks`` or
``leasekeeper_effects`` sequentially, each must read its index, and executed
(then rolled back) each must stay within a bound of shared buffers that does
not depend on the table's size: one task's statements a few index pages, a
page of ``list_leases`` about a page of rows, the sweeper's statements about
one buffer per live lease.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from bench.scale import (
    BATCH,
    PAGE,
    Probe,
    buffers,
    explain,
    live_leases,
    plan_nodes,
    probes,
    run_admin,
    seed,
    unannounced_leases,
)
from leasekeeper_server.storage import queries
from leasekeeper_server.storage.migrate import migrate

ROWS = 20_000
TABLES = ("leasekeeper_tasks", "leasekeeper_effects")
# Shared buffers one execution may touch. One task: an index descent or two
# and the rows they find, on each table. A batch: that for each of its tasks.
# A page: its rows' heap pages and index leaves. The sweeper: about a visit to
# the heap page of every live or unannounced lease (at most two).
ONE_TASK_BUFFERS = 60
BATCH_BUFFERS = 20 * BATCH + 60
PAGE_BUFFERS = 2 * PAGE + 40
SWEEP_BUFFERS = 2 * (live_leases(ROWS) + unannounced_leases(ROWS)) + 100


def budget(probe: Probe) -> int:
    """The most shared buffers the probe's statement may touch at any table size."""
    if probe.grows_with == "the page":
        return PAGE_BUFFERS
    if probe.grows_with == "the batch":
        return BATCH_BUFFERS
    if probe.grows_with:
        return SWEEP_BUFFERS
    return ONE_TASK_BUFFERS


def plan_problems(plan: dict[str, Any], probe: Probe) -> list[str]:
    """What is wrong with a plan (an ``EXPLAIN (FORMAT JSON)`` ``Plan``); empty when nothing."""
    nodes = list(plan_nodes(plan))
    problems = [
        f"Seq Scan on {node['Relation Name']}"
        for node in nodes
        if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in TABLES
    ]
    read = {node["Index Name"] for node in nodes if "Index Name" in node}
    for node in nodes:
        read.update(node.get("Conflict Arbiter Indexes", ()))
    problems += [f"does not read {index}" for index in probe.indexes if index not in read]
    return problems


@pytest.fixture(scope="module")
def seeded_url(database_url: str) -> Iterator[str]:
    """A fresh database on the session's server, migrated and seeded with ROWS task rows."""
    name = f"leasekeeper_plans_{uuid.uuid4().hex[:10]}"
    asyncio.run(run_admin(database_url, f'CREATE DATABASE "{name}"'))
    url = urlsplit(database_url)._replace(path=f"/{name}").geturl()
    try:
        asyncio.run(migrate(url))
        asyncio.run(seed(url, ROWS))
        yield url
    finally:
        asyncio.run(run_admin(database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def conn(seeded_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(seeded_url)
    try:
        yield connection
    finally:
        await connection.close()


async def _problems(conn: asyncpg.Connection, generic: bool) -> dict[str, list[str]]:
    """Every probe's problems with one kind of plan, by probe label (only those with some)."""
    sql = queries.load()
    found: dict[str, list[str]] = {}
    for probe in await probes(conn):
        result = await explain(
            conn, sql[probe.statement], probe.args, analyze=True, generic=generic
        )
        problems = plan_problems(result["Plan"], probe)
        touched = buffers(result)
        if touched > budget(probe):
            problems.append(f"touched {touched} shared buffers (at most {budget(probe)})")
        if problems:
            found[probe.label] = problems
    return found


def _report(problems: dict[str, list[str]]) -> str:
    return "\n".join(f"{label}: {'; '.join(found)}" for label, found in problems.items())


async def test_custom_plans_read_indexes_only(conn):
    problems = await _problems(conn, generic=False)
    assert not problems, _report(problems)


async def test_generic_plans_read_indexes_only(conn):
    problems = await _problems(conn, generic=True)
    assert not problems, _report(problems)


async def test_every_statement_of_the_request_path_and_sweeper_is_checked(conn):
    checked = {probe.statement for probe in await probes(conn)}
    not_on_the_path = {"lock_limits", "take_claim_token", "load_limits", "ping", "page_token_key"}
    assert set(queries.load()) - not_on_the_path <= checked


async def test_a_dropped_index_is_noticed(conn):
    sweep = next(p for p in await probes(conn) if p.statement == "sweep_expired")
    transaction = conn.transaction()
    await transaction.start()
    try:
        await conn.execute("DROP INDEX leasekeeper_tasks_unswept")
        plan = await conn.fetchval(
            f"EXPLAIN (FORMAT JSON) {queries.load()['sweep_expired']}", *sweep.args
        )
    finally:
        await transaction.rollback()
    problems = plan_problems(json.loads(plan)[0]["Plan"], sweep)
    assert "does not read leasekeeper_tasks_unswept" in problems
    assert "Seq Scan on leasekeeper_tasks" in problems
