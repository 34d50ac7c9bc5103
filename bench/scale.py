"""Task tables of 10^3 to 10^7 rows, and what the hot path's statements cost over them.

    .venv/bin/python -m bench.scale [--rows 1000 100000 10000000] [--admin-url URL] [--keep]

``seed`` fills ``leasekeeper_tasks`` (and a ledger of effects, checkpoints,
and each task's history, about 4 entries a task) with a realistic history in
a few set-based statements. ``table_stats`` reads the table's scan and update
counters, so a measured window (``stats_delta``) can show that it ran no
sequential scan and how many of its updates were HOT. ``probes`` names, for
every statement of ``server/leasekeeper_server/storage/sql/queries.sql`` that
a call or the sweeper runs, realistic parameters on a seeded table
(``probes_of_runs`` for the statements of checkpoints, the history and its
pruner); ``explain`` shows a statement's
custom plan (the values known, as in a prepared statement's first five
executions) or its generic plan (what a prepared statement may keep after
that), ``prepared_plan`` the plan a prepared statement really settles on, and
``measure_probe`` the shared buffers each touched.

Run as a command, it makes one database per size on the PostgreSQL of
``--admin-url`` (default the local one; seeding needs a superuser), seeds it,
and prints Markdown: the seeding time, the buffers each statement touched at
each size, and the HOT share of renewals at the largest size (seeded leases,
and freshly claimed ones whose pages hold nothing but live leases). The
databases are dropped afterwards unless ``--keep`` (kept ones are reused when
their rows are there).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import astuple, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from leasekeeper_server.core.model import LIST_SCAN_BUDGET  # noqa: E402
from leasekeeper_server.settings import Settings  # noqa: E402
from leasekeeper_server.storage import queries  # noqa: E402
from leasekeeper_server.storage.migrate import migrate  # noqa: E402
from leasekeeper_server.storage.pruner import PRUNE_BATCH  # noqa: E402
from leasekeeper_server.storage.statements import ClaimParams, RenewParams  # noqa: E402

LOCAL_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
# Rows per INSERT (one transaction each): keeps memory and WAL per commit bounded.
CHUNK_ROWS = 1_000_000
# How the rows spread over the namespaces "<prefix>-0" .. "<prefix>-4", in 16ths.
NAMESPACE_SIXTEENTHS = (8, 4, 2, 1, 1)
# Live leases: the workers running now, which a deployment's history does not
# multiply; 1 row in 20 up to this many.
MAX_LIVE_LEASES = 5_000
# Expired leases the sweeper has not announced yet: a few (it comes by every second).
MAX_UNANNOUNCED = 20
# Of the other rows, per thousand: expired and announced (a worker died and the
# task was never claimed again), revoked, released; the rest completed.
ANNOUNCED_PER_MILLE = 70
REVOKED_PER_MILLE = 5
RELEASED_PER_MILLE = 225
# One task in ten (task_id ending in 0) has one effect in the ledger, "effect-1":
# reserved while its lease is held, succeeded otherwise.
EFFECT_KEY = "effect-1"
LIVE_TTL = timedelta(days=1)
# One task in four (hashed) has a checkpoint: a worker's small JSON cursor
# (``{"offset": N}``), at version 1 to 3, each version an entry in its history.
CHECKPOINT_EVERY = 4
# Each task's history: a grant per fence, the expiry of every earlier grant
# (taken over, so attempts = fence - 1), how the current lease ended (none for
# a lease still held or not yet announced), its checkpoint writes, its
# effect's reservation and outcome: about 4 entries a task. Earlier grants
# came an hour apart. Entry times are kept within this age (less than the
# server's history_max_age_s, 30 days by default, by a day), so the pruner
# finds nothing past its age while a benchmark runs, as in a deployment
# whose pruner keeps up.
HISTORY_SPAN = timedelta(days=29)
_ANNOUNCED_BELOW = ANNOUNCED_PER_MILLE
_REVOKED_BELOW = _ANNOUNCED_BELOW + REVOKED_PER_MILLE
_RELEASED_BELOW = _REVOKED_BELOW + RELEASED_PER_MILLE

# $1, $2: the chunk's row numbers [lo, hi); $3 the namespace prefix; $4 every
# $4th row is a live lease (0: none); $5 every $5th row (offset 1) is expired
# and unannounced (0: none); $6 the live leases' ttl; $7 HISTORY_SPAN. Rows
# are numbered, hashed (hashint8) for the pseudo-random parts, so a seed is
# the same every time. A task's history entries are inserted together (written
# over time, they would lie apart in the table: a few more heap pages for a
# listing to read, at any size; sorting them by time adds half again to the seed's
# time).
_SEED_CHUNK = f"""
WITH t AS (
    INSERT INTO leasekeeper_tasks
        (namespace, task_id, owner_id, fence, state, expire_time, runtime_deadline,
         claim_time, update_time, end_reason, claim_request_id, revoke_reason,
         expiry_announced_fence, attempts, checkpoint_version, checkpoint_data,
         checkpoint_content_type, checkpoint_fence, checkpoint_time)
    SELECT $3::text || '-' || CASE WHEN sixteenth < 8 THEN 0 WHEN sixteenth < 12 THEN 1
                                   WHEN sixteenth < 14 THEN 2 WHEN sixteenth < 15 THEN 3
                                   ELSE 4 END,
           'task-' || lpad(i::text, 10, '0'),
           'worker-' || (i % 997),
           fence,
           CASE WHEN kind IN ('live', 'unannounced', 'announced') THEN 'held' ELSE kind END,
           expires,
           CASE kind WHEN 'live' THEN now() + 7 * $6::interval
                     ELSE claimed + interval '1 hour' END,
           claimed,
           CASE WHEN kind IN ('live', 'unannounced', 'announced') THEN claimed
                ELSE expires END,
           CASE kind WHEN 'released' THEN 'LEASE_RELEASED'
                     WHEN 'completed' THEN 'TASK_COMPLETED'
                     WHEN 'revoked' THEN 'LEASE_REVOKED' END,
           CASE WHEN h % 2 = 0 THEN 'req-' || to_hex(h) END,
           CASE WHEN kind = 'revoked' THEN 'drained by an operator' END,
           CASE WHEN kind = 'announced' THEN fence WHEN fence > 1 THEN fence - 1 END,
           fence - 1,
           saved,
           CASE WHEN saved IS NOT NULL THEN convert_to('{{"offset": ' || h || '}}', 'UTF8') END,
           CASE WHEN saved IS NOT NULL THEN 'application/json' END,
           CASE WHEN saved IS NOT NULL THEN fence END,
           CASE WHEN saved IS NOT NULL THEN least(claimed + saved * interval '1 second', now())
           END
    FROM (
        SELECT k.*,
               CASE WHEN h % {CHECKPOINT_EVERY} = 0 THEN 1 + (h / 5) % 3 END AS saved,
               CASE kind WHEN 'live' THEN now() - (h % 600) * interval '1 second'
                         WHEN 'unannounced' THEN now() - interval '10 minutes'
                         ELSE past END AS claimed,
               CASE kind WHEN 'live' THEN now() + $6::interval
                         WHEN 'unannounced' THEN now() - (1 + h % 60) * interval '1 second'
                         WHEN 'announced' THEN past + interval '30 seconds'
                         ELSE past + (1 + h % 120) * interval '1 second' END AS expires
        FROM (
            SELECT i, h,
                   CASE WHEN $4::bigint > 0 AND i % $4::bigint = 0 THEN 'live'
                        WHEN $5::bigint > 0 AND i % $5::bigint = 1 THEN 'unannounced'
                        WHEN h % 1000 < {_ANNOUNCED_BELOW} THEN 'announced'
                        WHEN h % 1000 < {_REVOKED_BELOW} THEN 'revoked'
                        WHEN h % 1000 < {_RELEASED_BELOW} THEN 'released'
                        ELSE 'completed'
                   END AS kind,
                   1 + (h / 1000) % 3 AS fence,
                   (h / 3000) % 16 AS sixteenth,
                   now() - (600 + (h / 7) % 2592000) * interval '1 second' AS past
            FROM (
                SELECT i, hashint8(i) & 2147483647 AS h
                FROM generate_series($1::bigint, $2::bigint - 1) AS i
                OFFSET 0
            ) g
            OFFSET 0
        ) k
        OFFSET 0
    ) r
    RETURNING namespace, task_id, owner_id, fence, state, expire_time, claim_time, update_time,
              revoke_reason, expiry_announced_fence, checkpoint_version, checkpoint_data,
              checkpoint_time
), e AS (
    INSERT INTO leasekeeper_effects
        (namespace, task_id, effect_key, policy, request_digest, state, fence,
         complete_fence, result, attempts, begin_time, complete_time)
    SELECT namespace, task_id, '{EFFECT_KEY}', 'once', decode(md5(task_id), 'hex'),
           CASE WHEN state = 'held' THEN 'reserved' ELSE 'succeeded' END, fence,
           CASE WHEN state = 'held' THEN NULL ELSE fence END,
           CASE WHEN state = 'held' THEN ''::bytea ELSE 'ok'::bytea END,
           1, claim_time + interval '1 second',
           CASE WHEN state = 'held' THEN NULL ELSE claim_time + interval '2 seconds' END
    FROM t
    WHERE right(task_id, 1) = '0'
    RETURNING namespace, task_id, effect_key, state, fence, complete_fence, attempts,
              begin_time, complete_time
)
INSERT INTO leasekeeper_task_history
    (namespace, task_id, event_time, kind, fence, owner_id, attempt, checkpoint_version,
     checkpoint_size, effect_key, effect_outcome, reason)
SELECT namespace, task_id, greatest(event_time, now() - $7::interval), kind, fence, owner_id,
       attempt, checkpoint_version, checkpoint_size, effect_key, effect_outcome, reason
FROM (
    SELECT t.namespace, t.task_id, t.claim_time - (t.fence - f) * interval '1 hour'
               AS event_time,
           'granted' AS kind, f AS fence, t.owner_id, f::integer AS attempt,
           0::bigint AS checkpoint_version, 0::bigint AS checkpoint_size,
           '' AS effect_key, '' AS effect_outcome, '' AS reason
    FROM t, generate_series(1::bigint, t.fence) AS f
    UNION ALL
    SELECT t.namespace, t.task_id,
           t.claim_time - (t.fence - f) * interval '1 hour' + interval '30 seconds',
           'expired', f, t.owner_id, 0, 0, 0, '', '', 'LEASE_EXPIRED'
    FROM t, generate_series(1::bigint, t.fence - 1) AS f
    UNION ALL
    SELECT t.namespace, t.task_id,
           CASE WHEN t.state = 'held' THEN t.expire_time ELSE t.update_time END,
           CASE WHEN t.state = 'held' THEN 'expired' ELSE t.state END,
           t.fence, t.owner_id, 0, 0, 0, '', '',
           CASE t.state WHEN 'held' THEN 'LEASE_EXPIRED' WHEN 'revoked' THEN t.revoke_reason
                        ELSE '' END
    FROM t
    WHERE t.state <> 'held' OR t.expiry_announced_fence = t.fence
    UNION ALL
    SELECT t.namespace, t.task_id, t.checkpoint_time - (t.checkpoint_version - v) * interval
               '1 second',
           'checkpoint_saved', t.fence, t.owner_id, 0, v, octet_length(t.checkpoint_data), '', '',
           ''
    FROM t, generate_series(1::bigint, coalesce(t.checkpoint_version, 0)) AS v
    UNION ALL
    SELECT e.namespace, e.task_id, e.begin_time, 'effect_reserved', e.fence, '', e.attempts,
           0, 0, e.effect_key, '', ''
    FROM e
    UNION ALL
    SELECT e.namespace, e.task_id, e.complete_time, 'effect_completed', e.complete_fence, '',
           e.attempts, 0, 0, e.effect_key, e.state, ''
    FROM e
    WHERE e.complete_time IS NOT NULL
) x
"""
# The history's indexes besides its primary key, as the migrations made them:
# dropped while a seed writes (one sort each afterwards instead of an insert
# per entry at a random place) and made again from these definitions.
_HISTORY_INDEXES = """
SELECT indexname, indexdef FROM pg_indexes
WHERE schemaname = current_schema() AND tablename = 'leasekeeper_task_history'
  AND indexname <> 'leasekeeper_task_history_pkey'
ORDER BY indexname
"""
# The count pruner's watermark past every seeded entry: a deployment's pruner
# has checked its history up to the last pass.
_WATERMARK = """
UPDATE leasekeeper_history_pruning
SET watermark = greatest(watermark, (SELECT coalesce(max(sequence), 0)
                                     FROM leasekeeper_task_history))
"""


def namespaces(prefix: str = "bench-scale") -> list[str]:
    """The namespaces ``seed`` spreads its rows over, the most populous (half the rows) first."""
    return [f"{prefix}-{k}" for k in range(len(NAMESPACE_SIXTEENTHS))]


def live_leases(rows: int) -> int:
    """How many of ``rows`` seeded rows are live leases."""
    return min(rows // 20, MAX_LIVE_LEASES)


def unannounced_leases(rows: int) -> int:
    """How many of ``rows`` seeded rows are expired leases not yet announced."""
    return min(max(rows // 1000, 1), MAX_UNANNOUNCED) if rows else 0


async def seed(dsn: str, rows: int, namespace: str = "bench-scale") -> None:
    """Fills ``leasekeeper_tasks`` (migrated) with ``rows`` task rows and their history.

    The rows spread over ``namespaces(namespace)`` (half in the first) with
    ids ``task-0000000000`` upwards: ``live_leases(rows)`` held with live
    leases (expiring in a day: they stay live through a benchmark),
    ``unannounced_leases(rows)`` held and expired with the expiry not yet
    announced, and of the rest about 7% held, expired and announced
    (``expiry_announced_fence = fence``), 0.5% revoked, 22.5% released and 70%
    completed. Every tenth task has one effect (``EFFECT_KEY``) in
    ``leasekeeper_effects``; one in ``CHECKPOINT_EVERY`` a checkpoint. Owners
    are ``worker-0`` .. ``worker-996``. ``leasekeeper_task_history`` gets what
    the triggers would have written for them (about 4 entries a task, see
    ``HISTORY_SPAN``), and the history pruner's watermark moves past them.
    Then VACUUM ANALYZE.

    Set-based (INSERT ... SELECT over generate_series, ``CHUNK_ROWS`` rows per
    transaction) in a session with ``synchronous_commit`` off and
    ``session_replication_role = replica``, so no trigger fires: nothing is
    announced on channel ``leasekeeper_lease`` and no foreign key is checked
    (the rows are consistent by construction). The latter needs a superuser.

    Raises:
        ValueError: ``rows`` is negative, or these namespaces already have rows.
        asyncpg.PostgresError: the database refused (not migrated, not a superuser).
    """
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    live = live_leases(rows)
    unannounced = unannounced_leases(rows)
    live_every = rows // live if live else 0
    unannounced_every = rows // unannounced if unannounced else 0
    conn = await asyncpg.connect(dsn)
    try:
        taken = await conn.fetchval(
            "SELECT 1 FROM leasekeeper_tasks WHERE namespace = ANY($1::text[]) LIMIT 1",
            namespaces(namespace),
        )
        if taken:
            raise ValueError(f"namespaces {namespace}-* already have rows")
        await conn.execute(
            "SET synchronous_commit = off; SET session_replication_role = replica;"
            " SET maintenance_work_mem = '512MB'; SET work_mem = '256MB'"
        )
        indexes = await conn.fetch(_HISTORY_INDEXES)
        for index in indexes:
            await conn.execute(f'DROP INDEX "{index["indexname"]}"')
        for lo in range(0, rows, CHUNK_ROWS):
            hi = min(rows, lo + CHUNK_ROWS)
            await conn.execute(
                _SEED_CHUNK,
                lo,
                hi,
                namespace,
                live_every,
                unannounced_every,
                LIVE_TTL,
                HISTORY_SPAN,
            )
        for index in indexes:
            await conn.execute(index["indexdef"])
        await conn.execute(_WATERMARK)
        await conn.execute(
            "VACUUM ANALYZE leasekeeper_tasks, leasekeeper_effects, leasekeeper_task_history,"
            " leasekeeper_history_pruning"
        )
    finally:
        await conn.close()


_STATS = """
SELECT s.seq_scan, coalesce(s.idx_scan, 0) AS idx_scan, s.n_tup_ins, s.n_tup_upd,
       s.n_tup_hot_upd, s.n_live_tup, s.n_dead_tup,
       pg_relation_size(s.relid) AS heap_bytes,
       pg_total_relation_size(s.relid) AS total_bytes,
       (SELECT json_object_agg(i.indexrelname, i.idx_scan)
        FROM pg_stat_user_indexes i WHERE i.relid = s.relid)::text AS index_scans
FROM pg_stat_user_tables s
WHERE s.relname = $1
"""
_COUNTERS = ("seq_scan", "idx_scan", "n_tup_ins", "n_tup_upd", "n_tup_hot_upd")


async def table_stats(dsn: str, table: str = "leasekeeper_tasks") -> dict[str, Any]:
    """The table's counters from ``pg_stat_user_tables``, read now.

    Returns:
        ``seq_scan``, ``idx_scan`` (scans started), ``n_tup_ins``,
        ``n_tup_upd``, ``n_tup_hot_upd`` (rows; since the statistics were
        reset), ``n_live_tup``, ``n_dead_tup`` (estimates), ``heap_bytes``,
        ``total_bytes`` (``pg_total_relation_size``: heap, indexes and TOAST)
        and ``index_scans`` ({index name: scans}). A session's counts reach
        these views when it commits at most once a second, and at the latest
        when it ends: read them after the measured sessions have closed (see
        ``wait_sessions_gone``).

    Raises:
        LookupError: the database has no such table.
    """
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        row = await conn.fetchrow(_STATS, table)
    finally:
        await conn.close()
    if row is None:
        raise LookupError(f"no table {table!r}")
    stats = dict(row)
    stats["index_scans"] = json.loads(stats["index_scans"] or "{}")
    return stats


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What happened between two ``table_stats`` readings.

    Returns:
        The growth of each counter (``seq_scan``, ``idx_scan``, ``n_tup_ins``,
        ``n_tup_upd``, ``n_tup_hot_upd``), ``index_scans`` by index, and
        ``hot_share``: HOT updates over all updates in the window (nan without
        updates).
    """
    delta: dict[str, Any] = {name: after[name] - before[name] for name in _COUNTERS}
    delta["index_scans"] = {
        name: (scans or 0) - (before["index_scans"].get(name) or 0)
        for name, scans in after["index_scans"].items()
    }
    updates = delta["n_tup_upd"]
    delta["hot_share"] = delta["n_tup_hot_upd"] / updates if updates else float("nan")
    return delta


async def wait_sessions_gone(dsn: str, application_name: str, timeout_s: float = 10.0) -> None:
    """Waits until no session named ``application_name`` is left (their statistics are in).

    Raises:
        TimeoutError: some are still there after ``timeout_s`` seconds.
    """
    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + timeout_s
        while await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", application_name
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"sessions {application_name!r} still open")
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


@dataclass(frozen=True)
class Probe:
    """One statement of ``queries.sql`` with realistic parameters.

    Attributes:
        label: what is measured, e.g. ``list_leases state=HELD``.
        statement: the statement's name in ``queries.sql``.
        args: its parameters, $1 first.
        indexes: the indexes its plan must read (for ``leasekeeper_tasks``
            and ``leasekeeper_effects``), by name; an ``INSERT ... ON
            CONFLICT`` reads its arbiter index.
        grows_with: what its result, and so its cost, grows with ("" for a
            statement about one task).
    """

    label: str
    statement: str
    args: tuple[Any, ...]
    indexes: tuple[str, ...]
    grows_with: str = ""


TASKS_PKEY = "leasekeeper_tasks_pkey"
HISTORY_PKEY = "leasekeeper_task_history_pkey"
HISTORY_TASK = "leasekeeper_task_history_task"
HISTORY_AGE = "leasekeeper_task_history_age"
# The history pruner's settings (their defaults) and the checkpoint SaveCheckpoint writes.
HISTORY_MAX_AGE = timedelta(seconds=Settings.model_fields["history_max_age_s"].default)
HISTORY_MAX_PER_TASK: int = Settings.model_fields["history_max_per_task"].default
CHECKPOINT = random.Random(4096).randbytes(4096)
CHECKPOINT_TYPE = "application/octet-stream"
UNSWEPT = "leasekeeper_tasks_unswept"
EFFECTS_PKEY = "leasekeeper_effects_pkey"
PAGE = 101  # a ListLeases page of 100 asks for one more row, to know whether a next page exists
TTL = timedelta(seconds=30)
BUDGET = timedelta(hours=1)
NO_DELAY = timedelta(0)

BATCH = 32  # claims, renewals or reads arriving together, sent as one statement
_LIVE_WITH_EFFECT = """
SELECT t.task_id, t.owner_id, t.fence FROM leasekeeper_tasks t
JOIN leasekeeper_effects e
  ON (e.namespace, e.task_id, e.effect_key, e.state) = (t.namespace, t.task_id, $2, 'reserved')
WHERE t.namespace = $1 AND t.state = 'held' AND t.expiry_announced_fence IS DISTINCT FROM t.fence
  AND t.expire_time > clock_timestamp()
ORDER BY t.task_id LIMIT 1
"""
_LIVE = """
SELECT namespace, task_id, owner_id, fence FROM leasekeeper_tasks
WHERE namespace = ANY($1::text[])
  AND state = 'held' AND expiry_announced_fence IS DISTINCT FROM fence
  AND expire_time > clock_timestamp()
ORDER BY namespace, task_id LIMIT $2
"""
_FREE = """
SELECT task_id FROM leasekeeper_tasks WHERE namespace = $1 AND state = 'released'
ORDER BY task_id LIMIT $2
"""


def _columns(rows: Sequence[Sequence[Any]]) -> tuple[list[Any], ...]:
    """Rows of values as one list per column (a batch statement's array parameters)."""
    return tuple(list(column) for column in zip(*rows, strict=True))


def _claim(namespace: str, task_id: str, owner_id: str, request_id: str | None) -> tuple[Any, ...]:
    """A claim's values in statement ``claim``'s order (``ClaimParams``): ttl ``TTL``,
    runtime budget ``BUDGET``, no lock delay, no attempt limit."""
    return astuple(
        ClaimParams(namespace, task_id, owner_id, TTL, BUDGET, request_id, NO_DELAY, None)
    )


def _renewal(
    lease: Sequence[Any], ttl: timedelta | None, version: int | None = None
) -> tuple[Any, ...]:
    """A renewal's values in statement ``renew``'s order (``RenewParams``) of ``lease``
    (namespace, task_id, owner_id, fence); with ``version``, it saves ``CHECKPOINT`` too."""
    namespace, task_id, owner_id, fence = lease
    if version is None:
        return astuple(RenewParams(namespace, task_id, owner_id, fence, ttl))
    params = RenewParams(
        namespace, task_id, owner_id, fence, ttl, version, CHECKPOINT, CHECKPOINT_TYPE
    )
    return astuple(params)


async def probes(conn: asyncpg.Connection, namespace: str = "bench-scale") -> list[Probe]:
    """The statements the request path and the sweeper run, on rows of a seeded table.

    They read the first namespace of ``namespaces(namespace)`` (half the
    table): a live lease that has a reserved effect, and released tasks; the
    batch statements take ``BATCH`` (or one) tasks at once from every namespace.

    Raises:
        LookupError: the table holds no such rows (not seeded, or too few rows).
    """
    ns = namespaces(namespace)[0]
    live = await conn.fetchrow(_LIVE_WITH_EFFECT, ns, EFFECT_KEY)
    free = [r["task_id"] for r in await conn.fetch(_FREE, ns, BATCH // 2)]
    leases = [tuple(r) for r in await conn.fetch(_LIVE, namespaces(namespace), BATCH)]
    if live is None or len(free) < BATCH // 2 or len(leases) < BATCH:
        raise LookupError(f"namespace {ns!r} has too few live leases or free tasks")
    task, owner, fence = live["task_id"], live["owner_id"], live["fence"]
    lease = (ns, task, owner, fence)
    effect = (ns, task, EFFECT_KEY)
    digest = bytes(32)
    one = (TASKS_PKEY,)
    ledger = (EFFECTS_PKEY, TASKS_PKEY)
    listed = "the page"
    batched = "the batch"
    new_claims = [_claim(ns, f"probe-new-{i}", "w", None) for i in range(BATCH)]
    free_claims = [_claim(ns, t, "w", "r") for t in free]
    claims = _columns(new_claims[: BATCH // 2] + free_claims)
    renewals = _columns([_renewal(lease_, TTL) for lease_ in leases])
    reads = _columns([(lease_[0], lease_[1]) for lease_ in leases])
    found = [
        Probe("claim (1 new task)", "claim", _columns(new_claims[:1]), one),
        Probe("claim (1 free task)", "claim", _columns(free_claims[:1]), one),
        Probe(
            "claim (1 held: refused)",
            "claim",
            _columns([_claim(ns, task, "w", "r")]),
            one,
        ),
        Probe(f"claim ({BATCH}: new and free)", "claim", claims, one, batched),
        Probe("renew (1)", "renew", _columns([_renewal(lease, TTL)]), one),
        Probe(f"renew ({BATCH})", "renew", renewals, one, batched),
        Probe("release", "release", (*lease, False, False, ""), one),
        Probe("get_leases (1)", "get_leases", ([ns], [task]), one),
        Probe(f"get_leases ({BATCH})", "get_leases", reads, one, batched),
        Probe("revoke", "revoke", (ns, task, "probe", 0), one),
        Probe(
            "begin_effect (1 new key)",
            "begin_effect",
            _columns([(ns, task, "probe", "once", digest, fence)]),
            ledger,
        ),
        Probe(
            "begin_effect (1 reserved key)",
            "begin_effect",
            _columns([(*effect, "once", digest, fence)]),
            ledger,
        ),
        Probe(
            f"begin_effect ({BATCH} new keys)",
            "begin_effect",
            _columns([(n, t, "probe", "once", digest, f) for n, t, _, f in leases]),
            ledger,
            batched,
        ),
        Probe(
            "complete_effect (1)",
            "complete_effect",
            _columns([(*effect, fence, "succeeded", False, b"", "", None, None, None)]),
            ledger,
        ),
        Probe(
            f"complete_effect ({BATCH})",
            "complete_effect",
            _columns(
                [
                    (n, t, EFFECT_KEY, f, "succeeded", False, b"", "", None, None, None)
                    for n, t, _, f in leases
                ]
            ),
            ledger,
            batched,
        ),
        Probe("list_effects", "list_effects", (ns, task, "", PAGE, None), (EFFECTS_PKEY,), listed),
        Probe(
            "list_leases", "list_leases", (ns, "", PAGE, None, None, LIST_SCAN_BUDGET), one, listed
        ),
    ]
    for state in ("HELD", "EXPIRED", "FREE", "COMPLETED"):
        args = (ns, "", PAGE, state, None, LIST_SCAN_BUDGET)
        found.append(Probe(f"list_leases state={state}", "list_leases", args, one, listed))
    found += [
        Probe(
            "list_leases owner=",
            "list_leases",
            (ns, "", PAGE, None, owner, LIST_SCAN_BUDGET),
            one,
            listed,
        ),
        Probe(
            "count_live_leases (limit 100)",
            "count_live_leases",
            (ns, task, 100),
            (UNSWEPT,),
            "live leases",
        ),
        Probe("sweep_expired", "sweep_expired", (1000,), (UNSWEPT,), "live + expired leases"),
        Probe("held_by_namespace", "held_by_namespace", (), (UNSWEPT,), "live + expired leases"),
    ]
    return found


async def probes_of_runs(conn: asyncpg.Connection, namespace: str = "bench-scale") -> list[Probe]:
    """The statements of runs (migrations/0008_runs.sql) on a seeded table: checkpoints,
    the task history and its pruner.

    They take the live lease ``probes`` takes (its task's history as ``seed``
    wrote it) and the pruner's own parameters (its batch, the settings'
    defaults).

    Raises:
        LookupError: the table holds no such rows (not seeded, or too few rows).
    """
    ns = namespaces(namespace)[0]
    live = await conn.fetchrow(_LIVE_WITH_EFFECT, ns, EFFECT_KEY)
    if live is None:
        raise LookupError(f"namespace {ns!r} has no live lease")
    task, owner, fence = live["task_id"], live["owner_id"], live["fence"]
    lease = (ns, task, owner, fence)
    one = (TASKS_PKEY,)
    return [
        Probe(
            "renew (a 4 KiB checkpoint alone: SaveCheckpoint)",
            "renew",
            _columns([_renewal(lease, None, 1_000_000)]),
            one,
        ),
        Probe(
            "renew (1, with a 4 KiB checkpoint)",
            "renew",
            _columns([_renewal(lease, TTL, 1_000_000)]),
            one,
        ),
        Probe("get_checkpoint", "get_checkpoint", (ns, task), one),
        Probe(
            "list_history (one task)",
            "list_history",
            (ns, task, 0, PAGE),
            (HISTORY_TASK,),
            "the task's entries",
        ),
        Probe(
            "record_refusal",
            "record_refusal",
            (ns, task, fence - 1, "LEASE_SUPERSEDED", "ValidateFence"),
            one,
        ),
        Probe(
            "prune_history_age",
            "prune_history_age",
            (HISTORY_MAX_AGE, PRUNE_BATCH),
            (HISTORY_AGE,),
            "history entries past their age",
        ),
        Probe(
            "prune_history_count",
            "prune_history_count",
            (HISTORY_MAX_PER_TASK, PRUNE_BATCH),
            (HISTORY_PKEY,),
            "history entries since the pruner's last pass",
        ),
    ]


def plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A plan node of ``EXPLAIN (FORMAT JSON)`` and every node under it, depth first."""
    yield node
    for child in node.get("Plans", ()):
        yield from plan_nodes(child)


def _array_element(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, timedelta):
        value = f"{value.total_seconds()} seconds"
    if isinstance(value, bytes):
        value = "\\x" + value.hex()  # bytea's hex input
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def sql_literal(value: Any) -> str:
    """``value`` as an SQL literal: None, bool, number, str, bytes, timedelta, or a list of them.

    A list becomes an array literal of unknown type (``'{"a",NULL}'``), which
    takes the type of the parameter it is given for.

    Raises:
        TypeError: another type.
    """
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, bytes):
        return f"'\\x{value.hex()}'"
    if isinstance(value, timedelta):
        return f"'{value.total_seconds()} seconds'"
    if isinstance(value, list | tuple):
        return sql_literal("{" + ",".join(_array_element(v) for v in value) + "}")
    raise TypeError(f"no SQL literal for {type(value).__name__}")


async def explain(
    conn: asyncpg.Connection,
    sql: str,
    args: Sequence[Any],
    *,
    analyze: bool = False,
    generic: bool = False,
) -> dict[str, Any]:
    """``EXPLAIN (FORMAT JSON)`` of one statement with parameters ``args``.

    Args:
        conn: a connection outside any transaction.
        sql: the statement, with $n parameters.
        args: the parameters' values.
        analyze: also run it (``ANALYZE, BUFFERS``), in a transaction that is
            rolled back: nothing it writes stays.
        generic: the plan a prepared statement uses without looking at the
            values (``PREPARE``, ``plan_cache_mode = force_generic_plan``,
            ``EXPLAIN EXECUTE``); else the custom plan made for these values,
            which a prepared statement uses for its first five executions.

    Returns:
        The top object of the JSON plan (``Plan``, ``Execution Time``, ...).
    """
    options = "FORMAT JSON, ANALYZE, BUFFERS" if analyze else "FORMAT JSON"
    transaction = conn.transaction()
    await transaction.start()
    try:
        if generic:
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            await conn.execute(f"PREPARE leasekeeper_probe AS {sql}")
            try:
                values = ", ".join(sql_literal(a) for a in args)
                text = await conn.fetchval(
                    f"EXPLAIN ({options}) EXECUTE leasekeeper_probe"
                    + (f"({values})" if args else "")
                )
            finally:
                await conn.execute("DEALLOCATE leasekeeper_probe")
        else:
            text = await conn.fetchval(f"EXPLAIN ({options}) {sql}", *args)
    finally:
        await transaction.rollback()
    result: dict[str, Any] = json.loads(text)[0]
    return result


def buffers(result: dict[str, Any]) -> int:
    """Shared buffers an ``explain(..., analyze=True)`` result's execution touched (hit + read)."""
    top = result["Plan"]
    return int(top["Shared Hit Blocks"] + top["Shared Read Blocks"])


@dataclass
class Measured:
    """A probe's plans and costs at one table size.

    Attributes:
        probe: what ran.
        custom_buffers: buffers touched with the custom plan (median of runs).
        generic_buffers: buffers touched with the generic plan (median of runs).
        prepared_buffers: buffers touched by the plan a prepared statement
            settles on after ``PREPARED_EXECUTIONS`` executions (what a
            long-lived server connection runs), measured when the custom and
            generic plans differ, else the custom plan's.
        rows: rows the statement returned.
        scans: the scan nodes of the custom plan, "Node Type on relation (index)".
        prepared_scans: the scan nodes of the prepared statement's plan.
    """

    probe: Probe
    custom_buffers: int
    generic_buffers: int
    prepared_buffers: int
    rows: int
    scans: list[str] = field(default_factory=list)
    prepared_scans: list[str] = field(default_factory=list)


def scan_nodes(plan: dict[str, Any]) -> list[str]:
    """The scans of a plan, as "Node Type on relation (index)"."""
    found = []
    for node in plan_nodes(plan):
        if "Relation Name" in node or "Index Name" in node:
            text = node["Node Type"]
            if "Relation Name" in node:
                text += f" on {node['Relation Name']}"
            if "Index Name" in node:
                text += f" ({node['Index Name']})"
            found.append(text)
    return found


# PostgreSQL's plan cache tries custom plans for a prepared statement's first
# five executions, then may keep a generic one: the eighth shows the choice.
PREPARED_EXECUTIONS = 8
# A plan touching more buffers than this is a scan: one run of each plan is enough.
SCAN_BUFFERS = 10_000


async def prepared_plan(
    conn: asyncpg.Connection, sql: str, args: Sequence[Any], executions: int = PREPARED_EXECUTIONS
) -> dict[str, Any]:
    """The plan a prepared statement runs at its ``executions``-th execution (each rolled back).

    The statement runs as the server runs it (asyncpg's prepared statement);
    ``auto_explain`` (loaded into this session: needs a superuser) sends the
    executed plan back as a notice.

    Returns:
        The ``Plan`` object of the last execution, with its buffers.
    """
    plans: list[str] = []

    def listen(_conn: Any, message: Any) -> None:
        plans.append(message.message)

    conn.add_log_listener(listen)
    try:
        await conn.execute(
            "LOAD 'auto_explain'; SET auto_explain.log_level = notice;"
            " SET auto_explain.log_format = json; SET auto_explain.log_analyze = on;"
            " SET auto_explain.log_buffers = on; SET auto_explain.log_min_duration = 0"
        )
        statement = await conn.prepare(sql)
        for _ in range(executions):
            transaction = conn.transaction()
            await transaction.start()
            try:
                await statement.fetch(*args)
            finally:
                await transaction.rollback()
    finally:
        await conn.execute("SET auto_explain.log_min_duration = -1")
        conn.remove_log_listener(listen)
    last = plans[-1]
    plan: dict[str, Any] = json.loads(last[last.index("{") :])["Plan"]
    return plan


async def measure_probe(conn: asyncpg.Connection, probe: Probe, runs: int = 3) -> Measured:
    """Runs a probe with each plan (rolled back), keeping the median buffers of ``runs`` runs."""
    sql = queries.load()[probe.statement]
    custom: list[int] = []
    generic: list[int] = []
    result: dict[str, Any] = {}
    generic_result: dict[str, Any] = {}
    for _ in range(runs):
        result = await explain(conn, sql, probe.args, analyze=True)
        generic_result = await explain(conn, sql, probe.args, analyze=True, generic=True)
        custom.append(buffers(result))
        generic.append(buffers(generic_result))
        if max(custom[-1], generic[-1]) > SCAN_BUFFERS:
            break
    prepared = result["Plan"]
    if scan_nodes(prepared) != scan_nodes(generic_result["Plan"]):
        prepared = await prepared_plan(conn, sql, probe.args)
    return Measured(
        probe,
        int(statistics.median(custom)),
        int(statistics.median(generic)),
        buffers({"Plan": prepared}),
        int(result["Plan"]["Actual Rows"]),
        scan_nodes(result["Plan"]),
        scan_nodes(prepared),
    )


APPLICATION_NAME = "leasekeeper-scale"


async def seeded_live_leases(dsn: str, namespace: str = "bench-scale") -> list[tuple[Any, ...]]:
    """The live leases of a seeded table, as (namespace, task_id, owner_id, fence)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(_LIVE, namespaces(namespace), None)
    finally:
        await conn.close()
    return [tuple(r) for r in rows]


@contextlib.asynccontextmanager
async def _pool(dsn: str, concurrency: int) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(
        dsn,
        min_size=concurrency,
        max_size=concurrency,
        server_settings={"application_name": APPLICATION_NAME},
    )
    try:
        yield pool
    finally:
        await pool.close()
    await wait_sessions_gone(dsn, APPLICATION_NAME)


async def _run_all(pool: asyncpg.Pool, sql: str, calls: Sequence[tuple[Any, ...]]) -> int:
    """Runs batched statement ``sql`` once per call, as a batch of one; the rows returned."""
    queue = [_columns([call]) for call in reversed(calls)]

    async def worker() -> int:
        returned = 0
        async with pool.acquire() as conn:
            while queue:
                returned += len(await conn.fetch(sql, *queue.pop()))
        return returned

    return sum(await asyncio.gather(*(worker() for _ in range(pool.get_max_size()))))


async def claim_fresh(dsn: str, count: int, concurrency: int = 16) -> list[tuple[Any, ...]]:
    """Claims ``count`` new tasks in a namespace of their own, through the claim statement.

    Rows inserted together fill pages together, so every row of those pages
    holds a live lease: the densest case for renewals' HOT updates.

    Returns:
        The leases, as (namespace, task_id, owner_id, fence).
    """
    namespace = f"fresh-{uuid.uuid4().hex[:8]}"
    calls = [_claim(namespace, f"task-{i:08d}", f"worker-{i % 64}", None) for i in range(count)]
    async with _pool(dsn, concurrency) as pool:
        await _run_all(pool, queries.load()["claim"], calls)
    return [(ns, task, owner, 1) for ns, task, owner, *_ in calls]


async def renewal_window(
    dsn: str, leases: Sequence[tuple[Any, ...]], rounds: int, concurrency: int = 16
) -> dict[str, Any]:
    """Renews every lease ``rounds`` times through the renew statement; what the table saw.

    Each renewal asks for ``LIVE_TTL`` (capped by the runtime budget), so
    seeded leases stay live for a later run.

    Returns:
        ``stats_delta`` of the window, with ``renewals`` (calls that renewed)
        and ``elapsed_s``.

    Raises:
        RuntimeError: a renewal found its lease gone (the measurement would
            count no update for it).
    """
    calls = [_renewal(lease, LIVE_TTL) for _ in range(rounds) for lease in leases]
    before = await table_stats(dsn)
    started = time.perf_counter()
    async with _pool(dsn, concurrency) as pool:
        renewed = await _run_all(pool, queries.load()["renew"], calls)
    elapsed = time.perf_counter() - started
    delta = stats_delta(before, await table_stats(dsn))
    if renewed != len(calls):
        raise RuntimeError(f"{len(calls) - renewed} of {len(calls)} renewals found no live lease")
    delta.update(renewals=renewed, elapsed_s=elapsed)
    return delta


async def run_admin(admin_url: str, sql: str) -> Any:
    """Runs one statement on its own connection (CREATE/DROP DATABASE); returns its value."""
    conn = await asyncpg.connect(admin_url)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


@dataclass
class SizeResult:
    """What one table size showed."""

    rows: int
    seed_s: float | None
    stats: dict[str, Any]
    measured: list[Measured]


async def measure_size(admin_url: str, rows: int, keep: bool, runs: int) -> tuple[SizeResult, str]:
    """Makes (or reuses, with ``keep``) the database of ``rows`` rows and measures every probe.

    Returns:
        The result and the database's URL.
    """
    name = f"leasekeeper_scale_{rows}"
    url = urlsplit(admin_url)._replace(path=f"/{name}").geturl()
    exists = await run_admin(admin_url, f"SELECT 1 FROM pg_database WHERE datname = '{name}'")
    seed_s: float | None = None
    if exists and keep:
        conn = await asyncpg.connect(url)
        try:
            seeded = await conn.fetchval(
                "SELECT count(*) FROM leasekeeper_tasks WHERE task_id = $1",
                f"task-{rows - 1:010d}",
            )
        finally:
            await conn.close()
        exists = bool(seeded)
    if not (exists and keep):
        await run_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await run_admin(admin_url, f'CREATE DATABASE "{name}"')
        await migrate(url)
        started = time.perf_counter()
        await seed(url, rows)
        seed_s = time.perf_counter() - started
    conn = await asyncpg.connect(url)
    try:
        found = await probes(conn) + await probes_of_runs(conn)
        measured = [await measure_probe(conn, p, runs) for p in found]
    finally:
        await conn.close()
    return SizeResult(rows, seed_s, await table_stats(url), measured), url


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _cell(m: Measured) -> str:
    """Buffers of the plan a server's prepared statement runs, then the other plans' if apart."""
    text = f"{m.prepared_buffers:,}"
    if any("Seq Scan" in s for s in m.prepared_scans):
        text += " (seq scan)"
    others = {m.custom_buffers, m.generic_buffers} - {m.prepared_buffers}
    if any(abs(o - m.prepared_buffers) > max(5, m.prepared_buffers // 5) for o in others):
        text += f" [custom {m.custom_buffers:,}, generic {m.generic_buffers:,}]"
    return text


def report(results: list[SizeResult], hot: dict[str, dict[str, Any]]) -> str:
    """The Markdown report: seeding, buffers per statement per size, HOT share."""
    out = ["## Task table sizes", "", "| rows | live leases | seeded in | table + indexes |"]
    out.append("|---:|---:|---:|---:|")
    for r in results:
        seeded = f"{r.seed_s:.1f} s" if r.seed_s is not None else "reused"
        size = _mib(r.stats["total_bytes"])
        out.append(f"| {r.rows:,} | {live_leases(r.rows):,} | {seeded} | {size} |")
    out += [
        "",
        "## Shared buffers touched per call",
        "",
        "The plan a prepared statement settles on (as in the server); in brackets the custom",
        "plan (its first five executions) and the generic plan, where they differ.",
        "",
        "| statement | grows with | " + " | ".join(f"{r.rows:,} rows" for r in results) + " |",
        "|---|---|" + "---:|" * len(results),
    ]
    for i, m in enumerate(results[0].measured):
        cells = " | ".join(_cell(r.measured[i]) for r in results)
        out.append(f"| {m.probe.label} | {m.probe.grows_with or '-'} | {cells} |")
    if hot:
        out += ["", "## Renewals: HOT updates", ""]
        out += [
            "| leases | renewals | HOT share | seq scans | index scans |",
            "|---|---:|---:|---:|---|",
        ]
        for label, d in hot.items():
            scans = ", ".join(f"{k} {v:,}" for k, v in d["index_scans"].items() if v)
            out.append(
                f"| {label} | {d['renewals']:,} | {d['hot_share']:.1%} | {d['seq_scan']} "
                f"| {scans} |"
            )
    return "\n".join(out) + "\n"


def _figures(results: list[SizeResult], hot: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "sizes": [
            {
                "rows": r.rows,
                "seed_s": r.seed_s,
                "stats": r.stats,
                "buffers": {
                    m.probe.label: {
                        "custom": m.custom_buffers,
                        "generic": m.generic_buffers,
                        "prepared": m.prepared_buffers,
                        "rows": m.rows,
                        "scans": m.prepared_scans,
                    }
                    for m in r.measured
                },
            }
            for r in results
        ],
        "hot": hot,
    }


async def run(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """Measures every size (and the HOT share at the largest); the report and its figures."""
    results = []
    hot: dict[str, dict[str, Any]] = {}
    urls = []
    try:
        for rows in sorted(args.rows):
            result, url = await measure_size(args.admin_url, rows, args.keep, args.runs)
            results.append(result)
            urls.append(url)
            print(f"measured {rows:,} rows", file=sys.stderr)
        url = urls[-1]
        sparse = await seeded_live_leases(url)
        hot["seeded live leases (sparse pages)"] = await renewal_window(url, sparse, args.rounds)
        dense = await claim_fresh(url, len(sparse))
        hot["freshly claimed tasks (dense pages)"] = await renewal_window(url, dense, args.rounds)
    finally:
        if not args.keep:
            for url in urls:
                name = urlsplit(url).path.lstrip("/")
                await run_admin(args.admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return report(results, hot), _figures(results, hot)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000, 100_000, 10_000_000])
    parser.add_argument("--admin-url", default=LOCAL_ADMIN_URL)
    parser.add_argument("--keep", action="store_true", help="keep (and reuse) the databases")
    parser.add_argument("--runs", type=int, default=3, help="runs per statement and plan")
    parser.add_argument("--rounds", type=int, default=5, help="renewals of each lease")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    text, figures = asyncio.run(run(args))
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
