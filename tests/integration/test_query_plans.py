"""The statements of the request path, the sweeper and the pruner read indexes, never a table.

A fresh database is seeded with 20,000 task rows (``bench.scale.seed``: mostly
completed and released tasks, live leases, expired ones announced or not, an
effect for one task in ten) and, here, with what runs leave behind where the
seed did not write it: checkpoints, a few quarantined tasks, each task's
history (its grant and how its lease ended, its effects), a backlog of
entries past their age, a busy task with more checkpoint entries than a task
keeps, and the entries written since the pruner's last pass; then analyzed.
Every statement of ``queries.sql`` that a call, the sweeper or the history
pruner runs is explained with realistic values (``bench.scale.probes``, and
``run_probes`` here for the statements of migrations/0008_runs.sql), batch
statements with one task and with ``bench.scale.BATCH``, twice: the custom
plan made for those values (what a prepared statement runs for its first five
executions) and the generic plan (what it may keep from then on). Neither may
scan ``leasekeeper_tasks``, ``leasekeeper_effects`` or
``leasekeeper_task_history`` sequentially, each must read its index, and
executed (then rolled back) each must stay within bounds that do not depend
on the tables' size, of shared buffers touched and of rows its scans read
(kept or filtered out: an index walked whole with a filter reads every row,
though its buffers stay few when the heap is in the index's order): one
task's statements a few index pages and rows, a page of ``list_leases`` or
``list_history`` about a page (``list_leases`` reads up to its scan budget),
``list_namespaces`` a descent per namespace and at most its count limit
(plus one) of index entries of each, however many tasks a namespace holds,
``namespace_stats`` at most its count limit (plus one) of rows per count
(probed with a limit far below what the namespace holds), the sweeper's
statements about one visit per live lease, the pruner's a few per entry it
is about (past its age, or written since its last pass). At its real limit,
``namespace_stats`` reads no more rows than the figures it counts, and counts
them right.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from bench.scale import (
    BATCH,
    EFFECT_KEY,
    EFFECTS_PKEY,
    PAGE,
    TASKS_PKEY,
    TTL,
    Probe,
    buffers,
    explain,
    live_leases,
    namespaces,
    plan_nodes,
    probes,
    run_admin,
    seed,
    unannounced_leases,
)
from leasekeeper_server.core.model import (
    LIST_SCAN_BUDGET,
    NAMESPACE_COUNT_LIMIT,
    STATS_COUNT_LIMIT,
    STATS_WINDOW,
)
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage import queries
from leasekeeper_server.storage.migrate import migrate
from leasekeeper_server.storage.pruner import PRUNE_BATCH

ROWS = 20_000
# A GetNamespaceStats limit above any namespace's size here: every figure exact.
EXACT_STATS_LIMIT = ROWS
TABLES = ("leasekeeper_tasks", "leasekeeper_effects", "leasekeeper_task_history")
HISTORY_PKEY = "leasekeeper_task_history_pkey"
HISTORY_TASK = "leasekeeper_task_history_task"
HISTORY_AGE = "leasekeeper_task_history_age"
# The indexes namespace_stats counts from (migrations 0005_operations, 0009_namespace_stats).
STATS_INDEXES = (
    "leasekeeper_tasks_unswept",
    "leasekeeper_tasks_expired",
    "leasekeeper_tasks_quarantined",
    "leasekeeper_task_history_recent",
    "leasekeeper_effects_reserved",
    TASKS_PKEY,
)
DEFAULTS = Settings.model_fields
MAX_AGE = timedelta(seconds=DEFAULTS["history_max_age_s"].default)
MAX_PER_TASK: int = DEFAULTS["history_max_per_task"].default
# What the history holds besides each task's own entries: entries past their
# age that the pruner has not reached yet; a busy task's checkpoint entries,
# more than a task keeps; the entries of the other tasks written since the
# pruner's last pass (its watermark is before them and the busy task's).
AGED = 500
BUSY_ENTRIES = MAX_PER_TASK + 200
RECENT = 300
QUARANTINED = 5
CHECKPOINT_BYTES = 200
# Shared buffers one execution may touch. One task: an index descent or two
# and the rows they find, on each table. A batch: that for each of its tasks.
# A page: its rows' heap pages and index leaves. The sweeper: about a visit to
# the heap page of every live or unannounced lease (at most two). The pruner:
# a few per entry it reads (an index entry, its heap tuple, a descent of the
# task's index for each task it names) or deletes.
ONE_TASK_BUFFERS = 60
BATCH_BUFFERS = 20 * BATCH + 60
PAGE_BUFFERS = 2 * PAGE + 40
SWEEP_BUFFERS = 2 * (live_leases(ROWS) + unannounced_leases(ROWS)) + 100
# The pruner's statements, by name (what their cost grows with is the same
# whoever names the probe).
PRUNE_BUFFERS = {
    # Per entry past its age: its index entry and heap tuple, the descent that deletes it.
    "prune_history_age": 8 * AGED + 100,
    # Per entry since the last pass: its index entry and heap tuple, a share of the
    # descent of its task's index; per entry deleted, the descent that deletes it.
    "prune_history_count": 3 * (BUSY_ENTRIES + RECENT) + 100,
}
# ListNamespaces over the seeded namespaces (a few, each with more tasks than a
# count reads): per namespace, a descent to it and the index entries its count
# reads (the limit and one more), their index leaves and, where the visibility
# map is not set (a transaction elsewhere holds it back), the heap page of each.
LISTED_NAMESPACES = len(namespaces())
NAMESPACES_ROWS = LISTED_NAMESPACES * (NAMESPACE_COUNT_LIMIT + 3) + 10
NAMESPACES_BUFFERS = LISTED_NAMESPACES * (NAMESPACE_COUNT_LIMIT + 1 + 30) + 40
# namespace_stats probed with a count limit far below what the seeded namespace
# holds of each (its live leases, announced expiries, reserved effects): its
# scans (the unswept leases, the announced expiries, the quarantines, four
# kinds of history entries, the reserved effects and their tasks' rows) each
# read at most that limit and one more; per row read, its index entry and at
# most its heap page, and a descent per scan and per task looked up.
STATS_PROBE_LIMIT = 50
STATS_SCANS = 9
STATS_ROWS = STATS_SCANS * (STATS_PROBE_LIMIT + 1) + 10
STATS_BUFFERS = STATS_SCANS * 2 * (STATS_PROBE_LIMIT + 1) + 3 * (STATS_PROBE_LIMIT + 1) + 60
# Rows one execution's scans may read (returned or filtered out), on the same
# grounds: a task's row and its effect's; each task of a batch; a page, or a
# listing's scan budget; each live or unannounced lease twice; each entry past
# its age twice (found, deleted); each entry since the last pass, its task's
# entries, and each entry deleted.
ONE_TASK_ROWS = 10
BATCH_ROWS = 2 * BATCH + 10
# The effect ledger's batches read three rows an element: its task's row, its
# record (locked), and the record again where the statement writes it.
LEDGER = ("begin_effect", "complete_effect")
LEDGER_BATCH_ROWS = 3 * BATCH + 10
PAGE_ROWS = LIST_SCAN_BUDGET + PAGE + 10
SWEEP_ROWS = 2 * (live_leases(ROWS) + unannounced_leases(ROWS)) + 100
TASK_ENTRIES = 10  # an ordinary task's history: a few grants, expiries, checkpoints, effects
PRUNE_ROWS = {
    "prune_history_age": 2 * AGED + 100,
    "prune_history_count": 2 * BUSY_ENTRIES + (1 + TASK_ENTRIES) * RECENT + 100,
}

# Trailing parameters the statements gained in migrations/0008_runs.sql, for
# probes of bench.scale written before them (a probe that has them is left as
# it is): one call's values, the neutral ones (no attempt limit, no
# checkpoint, not failed, no operation id).
NEWER_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "claim": (None,),
    "renew": (None, None, None),
    "release": (False, ""),
}

# Each task's own history, as the triggers would have written it (when the
# seed wrote none): its grant, how its lease ended, its effect.
_HISTORY = """
INSERT INTO leasekeeper_task_history
    (namespace, task_id, event_time, kind, fence, owner_id, attempt, effect_key,
     effect_outcome, reason)
SELECT namespace, task_id, event_time, kind, fence, owner_id, attempt, effect_key,
       effect_outcome, reason
FROM (
    SELECT t.namespace, t.task_id, e.event_time, e.kind, t.fence, t.owner_id,
           e.attempt, '' AS effect_key, '' AS effect_outcome, e.reason
    FROM leasekeeper_tasks t,
         LATERAL (VALUES
             (t.claim_time, 'granted', 1, ''),
             (t.update_time,
              CASE t.state WHEN 'released' THEN 'released' WHEN 'completed' THEN 'completed'
                           WHEN 'revoked' THEN 'revoked' END,
              0, coalesce(t.revoke_reason, '')),
             (t.expire_time,
              CASE WHEN t.expiry_announced_fence = t.fence THEN 'expired' END,
              0, 'LEASE_EXPIRED')
         ) AS e(event_time, kind, attempt, reason)
    WHERE e.kind IS NOT NULL
    UNION ALL
    SELECT f.namespace, f.task_id, f.begin_time, 'effect_reserved', f.fence, '', f.attempts,
           f.effect_key, '', ''
    FROM leasekeeper_effects f
    UNION ALL
    SELECT f.namespace, f.task_id, f.complete_time, 'effect_completed', f.complete_fence, '',
           f.attempts, f.effect_key, f.state, ''
    FROM leasekeeper_effects f WHERE f.complete_time IS NOT NULL
) h
ORDER BY event_time
"""
# Entries past their age were written first: their sequences are below every
# other entry's.
_AGED = """
INSERT INTO leasekeeper_task_history
    (sequence, namespace, task_id, event_time, kind, fence, owner_id, attempt)
OVERRIDING SYSTEM VALUE
SELECT (SELECT coalesce(min(sequence), 1) FROM leasekeeper_task_history) - t.rn,
       t.namespace, t.task_id, now() - $1::interval - t.rn * interval '1 second', 'granted',
       t.fence, t.owner_id, 1
FROM (SELECT *, row_number() OVER (ORDER BY namespace, task_id) AS rn
      FROM leasekeeper_tasks WHERE state = 'completed'
      ORDER BY namespace, task_id LIMIT $2::int) t
"""
_BUSY = """
INSERT INTO leasekeeper_task_history
    (namespace, task_id, event_time, kind, fence, owner_id, checkpoint_version,
     checkpoint_size)
SELECT $1::text, $2::text, now() - ($4::int - i) * interval '10 milliseconds',
       'checkpoint_saved', $3::bigint, '', i, $5::bigint
FROM generate_series(1, $4::int) AS i
"""
_WATERMARK = """
UPDATE leasekeeper_history_pruning
SET watermark = (SELECT max(sequence) FROM leasekeeper_task_history) - $1::bigint
"""


def budget(probe: Probe) -> int:
    """The most shared buffers the probe's statement may touch at any table size."""
    if probe.statement == "list_namespaces":
        return NAMESPACES_BUFFERS
    if probe.statement == "namespace_stats":
        return STATS_BUFFERS
    if probe.grows_with == "the page":
        return PAGE_BUFFERS
    if probe.grows_with == "the batch":
        return BATCH_BUFFERS
    if probe.statement in PRUNE_BUFFERS:
        return PRUNE_BUFFERS[probe.statement]
    if probe.grows_with:
        return SWEEP_BUFFERS
    return ONE_TASK_BUFFERS


def row_budget(probe: Probe) -> int:
    """The most rows the probe's statement's scans may read at any table size."""
    if probe.statement == "list_namespaces":
        return NAMESPACES_ROWS
    if probe.statement == "namespace_stats":
        return STATS_ROWS
    if probe.grows_with == "the page":
        return PAGE_ROWS
    if probe.grows_with == "the batch":
        return LEDGER_BATCH_ROWS if probe.statement in LEDGER else BATCH_ROWS
    if probe.statement in PRUNE_ROWS:
        return PRUNE_ROWS[probe.statement]
    if probe.grows_with:
        return SWEEP_ROWS
    return ONE_TASK_ROWS


def rows_read(plan: dict[str, Any], tables: tuple[str, ...] = TABLES) -> int:
    """Rows the scans of an executed plan read from ``tables``: kept or filtered out."""
    total = 0.0
    for node in plan_nodes(plan):
        if node.get("Relation Name") in tables and node["Node Type"].endswith("Scan"):
            read = (
                node["Actual Rows"]
                + node.get("Rows Removed by Filter", 0)
                + node.get("Rows Removed by Index Recheck", 0)
            )
            total += read * node["Actual Loops"]
    return round(total)


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


async def _seed_runs(url: str) -> None:
    """What runs leave behind (see the module docstring), on a table ``seed`` filled."""
    conn = await asyncpg.connect(url)
    try:
        lease = next(p for p in await probes(conn) if p.statement == "begin_effect")
        (ns,), (task,) = lease.args[:2]
        fence = await conn.fetchval(
            "SELECT fence FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = $2", ns, task
        )
        # As seed does: no trigger fires (the history is written here, once).
        await conn.execute("SET session_replication_role = replica")
        if not await conn.fetchval(
            "SELECT EXISTS (SELECT FROM leasekeeper_tasks WHERE checkpoint_version IS NOT NULL)"
        ):
            await conn.execute(
                "UPDATE leasekeeper_tasks SET checkpoint_version = 1 + fence,"
                " checkpoint_data = decode(repeat(md5(task_id), $1::int / 32), 'hex'),"
                " checkpoint_content_type = 'application/json', checkpoint_fence = fence,"
                " checkpoint_time = claim_time WHERE state = 'held' AND expire_time > now()",
                CHECKPOINT_BYTES * 2,
            )
        await conn.execute(
            "UPDATE leasekeeper_tasks SET state = 'quarantined', attempts = 3, max_attempts = 3,"
            " end_reason = 'LEASE_EXPIRED' WHERE (namespace, task_id) IN ("
            "  SELECT namespace, task_id FROM leasekeeper_tasks"
            "  WHERE namespace = $1 AND state = 'revoked' ORDER BY task_id LIMIT $2)",
            ns,
            QUARANTINED,
        )
        if not await conn.fetchval("SELECT EXISTS (SELECT FROM leasekeeper_task_history)"):
            await conn.execute(_HISTORY)
        await conn.execute(_AGED, MAX_AGE, AGED)
        await conn.execute(_BUSY, ns, task, fence, BUSY_ENTRIES, CHECKPOINT_BYTES)
        await conn.execute(_WATERMARK, BUSY_ENTRIES + RECENT)
        await conn.execute(
            "VACUUM ANALYZE leasekeeper_tasks, leasekeeper_task_history,"
            " leasekeeper_history_pruning"
        )
    finally:
        await conn.close()


def _with_newer_parameters(probe: Probe, parameters: int) -> Probe:
    """The probe with the trailing parameters its statement gained since it was written."""
    count = parameters - len(probe.args)
    newer = NEWER_PARAMETERS.get(probe.statement, ())
    if count <= 0 or count > len(newer):  # up to date (or beyond repair: explain will say)
        return probe
    extra: tuple[Any, ...] = newer[len(newer) - count :]
    if isinstance(probe.args[0], list):  # a batch statement: one array per parameter
        extra = tuple([value] * len(probe.args[0]) for value in extra)
    return Probe(
        probe.label, probe.statement, (*probe.args, *extra), probe.indexes, probe.grows_with
    )


async def run_probes(conn: asyncpg.Connection) -> list[Probe]:
    """``bench.scale.probes`` (with today's parameters) and the statements of runs.

    The runs' statements take the same live lease as bench.scale's (the one
    ``begin_effect`` reserves for), a quarantined task of its namespace, and the
    pruner's own parameters (its batch, the settings' defaults).
    """
    sql = queries.load()
    found = []
    for probe in await probes(conn):
        parameters = len((await conn.prepare(sql[probe.statement])).get_parameters())
        found.append(_with_newer_parameters(probe, parameters))
    (ns,), (task,) = next(p for p in found if p.statement == "begin_effect").args[:2]
    lease = await conn.fetchrow(
        "SELECT owner_id, fence FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = $2",
        ns,
        task,
    )
    owner, fence = lease["owner_id"], lease["fence"]
    quarantined = await conn.fetchval(
        "SELECT task_id FROM leasekeeper_tasks WHERE namespace = $1 AND state = 'quarantined'"
        " ORDER BY task_id LIMIT 1",
        ns,
    )
    if quarantined is None:
        raise LookupError(f"namespace {ns!r} has no quarantined task")
    one = (TASKS_PKEY,)
    # Printable: older bench.scale.sql_literal writes a bytea array element as its repr.
    data = b"x" * CHECKPOINT_BYTES
    saved = ([ns], [task], [owner], [fence], [TTL], [fence + 100], [data], ["application/json"])
    alone = (*saved[:4], [None], *saved[5:])
    # CompleteEffect saving the next checkpoint: a call alone (a batch of one).
    completed = (ns, task, EFFECT_KEY, fence, "succeeded", False, b"", "")
    completed += (fence + 100, data, "application/json")
    runs = [
        Probe("renew (1, with a checkpoint)", "renew", saved, one),
        Probe("renew (a checkpoint alone: SaveCheckpoint)", "renew", alone, one),
        Probe("release (fail)", "release", (ns, task, owner, fence, False, True, "oom"), one),
        Probe("get_checkpoint", "get_checkpoint", (ns, task), one),
        Probe(
            "complete_effect (with a checkpoint)",
            "complete_effect",
            tuple([value] for value in completed),
            (EFFECTS_PKEY, TASKS_PKEY),
        ),
        Probe("cancel", "cancel", (ns, task, "probe"), one),
        Probe("retry", "retry", (ns, quarantined, "probe"), one),
        Probe("retry (not quarantined: refused)", "retry", (ns, task, "probe"), one),
        Probe(
            "record_refusal",
            "record_refusal",
            (ns, task, fence - 1, "LEASE_SUPERSEDED", "ValidateFence"),
            one,
        ),
        Probe("list_history", "list_history", (ns, task, 0, PAGE), (HISTORY_TASK,), "the page"),
        Probe(
            "list_namespaces",
            "list_namespaces",
            ("", PAGE, NAMESPACE_COUNT_LIMIT + 1),
            one,
            "the namespaces and the tasks each count reads",
        ),
        Probe(
            "list_namespaces (a later page)",
            "list_namespaces",
            (namespaces()[1], PAGE, NAMESPACE_COUNT_LIMIT + 1),
            one,
            "the namespaces and the tasks each count reads",
        ),
        Probe(
            "namespace_stats",
            "namespace_stats",
            (ns, STATS_PROBE_LIMIT + 1, STATS_WINDOW),
            STATS_INDEXES,
            "the rows each count reads, at most its limit",
        ),
        Probe(
            "list_history (a later page)",
            "list_history",
            (ns, task, await _sequence_at(conn, ns, task, PAGE), PAGE),
            (HISTORY_TASK,),
            "the page",
        ),
        Probe(
            "prune_history_age",
            "prune_history_age",
            (MAX_AGE, PRUNE_BATCH),
            (HISTORY_AGE, HISTORY_PKEY),
            "history entries past their age",
        ),
        Probe(
            "prune_history_count",
            "prune_history_count",
            (MAX_PER_TASK, PRUNE_BATCH),
            (HISTORY_PKEY, HISTORY_TASK),
            "history entries since the pruner's last pass",
        ),
    ]
    # A probe of the same name in bench.scale gives way to this one (its indexes).
    labels = {probe.label for probe in runs}
    return [probe for probe in found if probe.label not in labels] + runs


async def _sequence_at(conn: asyncpg.Connection, namespace: str, task_id: str, at: int) -> int:
    """The sequence of the task's ``at``-th history entry (a page token's position)."""
    sequence: int = await conn.fetchval(
        "SELECT sequence FROM leasekeeper_task_history WHERE namespace = $1 AND task_id = $2"
        " ORDER BY sequence OFFSET $3 LIMIT 1",
        namespace,
        task_id,
        at - 1,
    )
    return sequence


@pytest.fixture(scope="module")
def seeded_url(database_url: str) -> Iterator[str]:
    """A fresh database on the session's server, migrated and seeded with ROWS task rows."""
    name = f"leasekeeper_plans_{uuid.uuid4().hex[:10]}"
    asyncio.run(run_admin(database_url, f'CREATE DATABASE "{name}"'))
    url = urlsplit(database_url)._replace(path=f"/{name}").geturl()
    try:
        asyncio.run(migrate(url))
        asyncio.run(seed(url, ROWS))
        asyncio.run(_seed_runs(url))
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
    for probe in await run_probes(conn):
        result = await explain(
            conn, sql[probe.statement], probe.args, analyze=True, generic=generic
        )
        problems = plan_problems(result["Plan"], probe)
        touched = buffers(result)
        if touched > budget(probe):
            problems.append(f"touched {touched} shared buffers (at most {budget(probe)})")
        read = rows_read(result["Plan"])
        if read > row_budget(probe):
            problems.append(f"read {read} rows (at most {row_budget(probe)})")
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


async def test_every_statement_of_the_request_path_sweeper_and_pruner_is_checked(conn):
    checked = {probe.statement for probe in await run_probes(conn)}
    not_on_the_path = {"lock_limits", "take_claim_token", "load_limits", "ping", "page_token_key"}
    assert set(queries.load()) - not_on_the_path <= checked


async def _rolled_back(conn: asyncpg.Connection, probe: Probe) -> list[asyncpg.Record]:
    """Runs a probe's statement in a transaction that is rolled back; its rows."""
    transaction = conn.transaction()
    await transaction.start()
    try:
        return await conn.fetch(queries.load()[probe.statement], *probe.args)
    finally:
        await transaction.rollback()


async def test_the_seeded_runs_give_the_pruner_work(conn):
    """The pruner's probes find what the seed left for them: their plans do real work."""
    by_name = {p.statement: p for p in await run_probes(conn)}
    counted = (await _rolled_back(conn, by_name["prune_history_count"]))[0]
    past_age = await conn.fetchval(
        "SELECT count(*) FROM leasekeeper_task_history"
        " WHERE event_time < clock_timestamp() - $1::interval",
        MAX_AGE,
    )

    assert past_age >= AGED
    assert counted["checked"] == BUSY_ENTRIES + RECENT
    assert counted["pruned"] >= BUSY_ENTRIES - MAX_PER_TASK


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


async def test_a_dropped_history_index_is_noticed(conn):
    prune = next(p for p in await run_probes(conn) if p.statement == "prune_history_age")
    transaction = conn.transaction()
    await transaction.start()
    try:
        await conn.execute(f"DROP INDEX {HISTORY_AGE}")
        plan = await conn.fetchval(
            f"EXPLAIN (FORMAT JSON) {queries.load()['prune_history_age']}", *prune.args
        )
    finally:
        await transaction.rollback()
    problems = plan_problems(json.loads(plan)[0]["Plan"], prune)
    assert f"does not read {HISTORY_AGE}" in problems
    assert "Seq Scan on leasekeeper_task_history" in problems


async def test_list_namespaces_walks_the_primary_key_namespace_by_namespace(conn):
    """A loose index scan: each namespace once, its tasks counted up to the limit, no sort."""
    probe = next(p for p in await run_probes(conn) if p.statement == "list_namespaces")
    rows = await _rolled_back(conn, probe)
    counted = {r["namespace"]: r["tasks"] for r in rows}
    seeded = await conn.fetch(
        "SELECT namespace, count(*) AS tasks FROM leasekeeper_tasks GROUP BY namespace"
        ' ORDER BY namespace COLLATE "C"'
    )
    assert list(counted) == [r["namespace"] for r in seeded]
    assert counted == {r["namespace"]: min(r["tasks"], NAMESPACE_COUNT_LIMIT + 1) for r in seeded}
    plan = (await explain(conn, queries.load()["list_namespaces"], probe.args))["Plan"]
    nodes = list(plan_nodes(plan))
    assert "Recursive Union" in {node["Node Type"] for node in nodes}
    # No sort, no grouping of the table: each count is a plain aggregate of one namespace.
    assert not [node for node in nodes if node["Node Type"] in ("Sort", "Seq Scan")]
    assert {node.get("Strategy") for node in nodes if node["Node Type"] == "Aggregate"} <= {"Plain"}


# The figures of statement namespace_stats, counted here the plain way: every
# row of the namespace judged at the statement's own instant ($2), and the
# scans' row counts (which rows the statement may read). Nothing writes to the
# seeded database meanwhile, so both see the same rows.
_STATS_TRUTH = """
WITH t AS (SELECT *, state = 'held' AND expire_time > $2 AS live,
                  max_attempts IS NOT NULL AND attempts + 1 >= max_attempts AS used_up
           FROM leasekeeper_tasks WHERE namespace = $1),
     h AS (SELECT kind FROM leasekeeper_task_history
           WHERE namespace = $1 AND event_time > $2 - $3::interval),
     e AS (SELECT e.*, coalesce(t.fence = e.fence AND t.live, false) AS live
           FROM leasekeeper_effects e LEFT JOIN t ON t.task_id = e.task_id
           WHERE e.namespace = $1 AND e.state = 'reserved')
SELECT (SELECT count(*) FROM t WHERE live) AS leases_held,
       (SELECT count(*) FROM t WHERE state = 'held' AND NOT live AND NOT used_up)
           AS leases_expired,
       (SELECT count(*) FROM t WHERE state = 'quarantined'
                                  OR (state = 'held' AND NOT live AND used_up))
           AS tasks_quarantined,
       (SELECT count(*) FROM h WHERE kind = 'granted') AS claims_last_minute,
       (SELECT count(*) FROM h WHERE kind = 'fence_refused') AS stale_fences_last_minute,
       (SELECT count(*) FROM h WHERE kind IN ('expired', 'revoked'))
           AS leases_lost_last_minute,
       (SELECT count(*) FROM e WHERE NOT live) AS effects_in_doubt,
       (SELECT count(*) FROM t WHERE state = 'held' AND expiry_announced_fence IS DISTINCT
                                     FROM fence) AS unswept,
       (SELECT count(*) FROM t WHERE state = 'held' AND expiry_announced_fence = fence)
           AS announced,
       (SELECT count(*) FROM t WHERE state = 'quarantined') AS stored_quarantined,
       (SELECT count(*) FROM h WHERE kind IN ('granted', 'fence_refused', 'expired', 'revoked'))
           AS recent,
       (SELECT count(*) FROM e) AS reserved,
       (SELECT count(*) FROM t) AS tasks
"""


async def test_namespace_stats_counts_right_and_reads_only_what_it_counts(conn):
    """At the real limit, over the seeded namespace: the figures, and the rows read for them.

    Each scan reads only the rows of its index that it counts (and a task's
    row per reserved effect), so the rows read are the scans' rows, far fewer
    than the namespace's tasks. The effects table is seeded small (an effect
    for one task in ten) with a large share of this namespace's effects
    reserved: for values that count them all, the planner may rightly read
    it whole rather than its index (a custom plan); the generic plan, and the
    probe whose limit stops every scan, read the index.
    """
    ns = next(p for p in await run_probes(conn) if p.statement == "namespace_stats").args[0]
    sql = queries.load()["namespace_stats"]
    # A limit above the namespace's size, so that every figure is exact (none capped);
    # the probes with a small count limit (run_probes) check the cap.
    limit = max(STATS_COUNT_LIMIT, EXACT_STATS_LIMIT)
    args = (ns, limit + 1, STATS_WINDOW)
    row = await conn.fetchrow(sql, *args)
    truth = await conn.fetchrow(_STATS_TRUTH, ns, row["db_now"], STATS_WINDOW)
    assert truth["tasks"] < limit  # every figure is exact, none capped
    assert row["unswept_live"] == truth["leases_held"] > 0
    assert row["unswept_expired"] + row["announced_expired"] == truth["leases_expired"] > 0
    assert (
        row["unswept_quarantined"] + row["stored_quarantined"]
        == truth["tasks_quarantined"]
        == QUARANTINED
    )
    assert row["granted"] == truth["claims_last_minute"]
    assert row["refused"] == truth["stale_fences_last_minute"]
    assert row["expired"] + row["revoked"] == truth["leases_lost_last_minute"]
    assert row["in_doubt"] == truth["effects_in_doubt"]
    assert row["reserved"] == truth["reserved"] > 0

    # Per table: the rows its scans may read, counted or looked up.
    scanned = {
        "leasekeeper_tasks": truth["unswept"]
        + truth["announced"]
        + truth["stored_quarantined"]
        + truth["reserved"],
        "leasekeeper_task_history": truth["recent"],
        "leasekeeper_effects": truth["reserved"],
    }
    assert sum(scanned.values()) < truth["tasks"] / 4
    for generic in (False, True):
        plan = (await explain(conn, sql, args, analyze=True, generic=generic))["Plan"]
        checked = TABLES if generic else ("leasekeeper_tasks", "leasekeeper_task_history")
        for table in checked:
            read = rows_read(plan, (table,))
            assert read <= scanned[table] + 5, (generic, table, read, scanned[table])
