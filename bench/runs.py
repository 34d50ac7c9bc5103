"""Checkpoints and the task history side by side: three ratios of server CPU per call.

Each comparison runs its two sides in alternating windows in one run
(``bench/paired.py``) and divides their server CPU per call (the database
backends' CPU per call is reported beside it):

* ``timeline_claim``: Claim of a new task on this tree's server, whose
  database writes each task's history from triggers, over the same Claim on
  a server of ``TIMELINE_BASELINE``, the last commit before the history
  (migrations/0008_runs.sql), run from that commit's own files
  (``bench/checkout.py``) on a database its own migrations made; target
  <= 1.15. It runs first, while both databases are new.
* ``checkpoint_vs_renew``: SaveCheckpoint of 4 KiB (versions 1, 2, 3, ... on
  one lease per load worker) over Renew of such a lease, on one server;
  target <= 1.5.
* ``claim_checkpoint``: Claim of a released task with a 4 KiB checkpoint
  stored (the grant hands it back) over Claim of a released task without
  one, on one server; target <= 1.2. The released tasks are made before each
  window, in one statement (``prepare_released``), as many as the window
  can claim.

The measured claims go through the generated stub (the same request to
either version of the server) with a ttl of an hour, so none of their leases
expires, and no expiry is swept, while the suite runs. SaveCheckpoint and
Renew are the suite's own scenarios (``bench/scenarios.py``: a lease per load
worker, claimed before each window).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import grpc
from google.protobuf import duration_pb2

from bench import scenarios
from bench.checkout import NoSourceTree, source_tree
from bench.loadgen import Op
from bench.paired import Comparison, Side, compare, skipped
from bench.servers import ServerTarget, leasekeeper_server, sibling_database
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as pb_grpc

# The last commit without the task history: its claims write no history entry.
TIMELINE_BASELINE = "5b9eb52"
NAMESPACE = "bench-runs"
TARGETS = {"timeline_claim": 1.15, "checkpoint_vs_renew": 1.5, "claim_checkpoint": 1.2}
CLAIM_TTL = duration_pb2.Duration(seconds=3600)
# Claims a window is first prepared for, per second of the window (more than
# this machine answers); later windows get 1.5 times the most one used.
FIRST_CLAIM_RATE = 4000


@dataclass(frozen=True)
class PairedPlan:
    """How long the side-by-side comparisons run.

    Attributes:
        rounds: windows per side.
        duration_s: each window's measured length, seconds.
        warmup_s: calls before each window's measured part, seconds.
        concurrency: load workers of every window.
    """

    rounds: int
    duration_s: float
    warmup_s: float
    concurrency: int = 64

    @classmethod
    def of(cls, quick: bool, rounds: int | None = None) -> PairedPlan:
        plan = cls(2, 0.8, 0.2) if quick else cls(6, 3.0, 0.5)
        return dataclasses.replace(plan, rounds=rounds) if rounds else plan


_PREPARE = """
INSERT INTO leasekeeper_tasks
    (namespace, task_id, owner_id, fence, state, expire_time, runtime_deadline, claim_time,
     update_time, end_reason, checkpoint_version, checkpoint_data, checkpoint_content_type,
     checkpoint_fence, checkpoint_time)
SELECT $1::text, $2::text || '-' || lpad(i::text, 8, '0'), $2::text || '-owner', 1, 'released',
       now(), now() + interval '1 hour', now(), now(), 'LEASE_RELEASED',
       CASE WHEN $4::bytea IS NOT NULL THEN 1 END, $4::bytea,
       CASE WHEN $4::bytea IS NOT NULL THEN $5::text END,
       CASE WHEN $4::bytea IS NOT NULL THEN 1 END,
       CASE WHEN $4::bytea IS NOT NULL THEN now() END
FROM generate_series(0, $3::int - 1) AS i
"""


async def prepare_released(
    database_url: str, namespace: str, prefix: str, count: int, checkpoint: bytes | None
) -> list[str]:
    """Makes ``count`` released tasks (fence 1), each with ``checkpoint`` stored (or none).

    One statement, in a session where no trigger fires (as ``bench.scale.seed``
    writes): nothing is announced and no history is written for them. Needs a
    superuser (``session_replication_role``).

    Returns:
        Their task ids, ``{prefix}-00000000`` upwards.
    """
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("SET synchronous_commit = off; SET session_replication_role = replica")
        await conn.execute(
            _PREPARE, namespace, prefix, count, checkpoint, scenarios.CHECKPOINT_TYPE
        )
    finally:
        await conn.close()
    return [f"{prefix}-{i:08d}" for i in range(count)]


class UsedUp(RuntimeError):
    """A window claimed every task prepared for it (the next window gets more)."""


@contextlib.asynccontextmanager
async def claim_op(
    address: str,
    namespace: str,
    concurrency: int,
    tasks: list[str] | None = None,
    checkpoint: bool | None = None,
) -> AsyncIterator[Op]:
    """Claims through the generated stub: of new tasks, or of ``tasks`` one after the other.

    Args:
        address: the server's ``host:port``.
        namespace: the tasks' namespace.
        concurrency: load workers (one owner each).
        tasks: task ids to claim, each once (:class:`UsedUp` past the last);
            None: a new task each call.
        checkpoint: whether a grant must hand a checkpoint back (None: not checked).

    Yields:
        ``op(worker, call)``; it raises when the claim was not granted as expected.
    """
    tag = uuid.uuid4().hex[:10]
    owners = [f"{tag}-w{w}" for w in range(concurrency)]
    taken = itertools.count()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.LeaseServiceStub(channel)

        async def claim(w: int, c: int) -> object:
            if tasks is None:
                task_id = f"{tag}-{w}-{c}"
            else:
                i = next(taken)
                if i >= len(tasks):
                    raise UsedUp(f"{len(tasks)} prepared tasks claimed")
                task_id = tasks[i]
            reply = await stub.Claim(
                pb.ClaimRequest(
                    namespace=namespace,
                    task_id=task_id,
                    owner_id=owners[w],
                    ttl=CLAIM_TTL,
                    request_id=f"{task_id}-{w}",
                )
            )
            if not reply.acquired:
                raise AssertionError(f"{task_id} not granted: {reply}")
            if checkpoint is not None and reply.HasField("checkpoint") != checkpoint:
                raise AssertionError(
                    f"{task_id}: checkpoint {reply.checkpoint}, expected {checkpoint}"
                )
            return reply

        yield claim


class ReleasedClaims:
    """Windows of claims of released tasks, each window's tasks prepared before it."""

    def __init__(
        self, server: ServerTarget, database_url: str, plan: PairedPlan, checkpoint: bool
    ) -> None:
        self._server = server
        self._database_url = database_url
        self._concurrency = plan.concurrency
        self._checkpoint = checkpoint
        self._count = int(FIRST_CLAIM_RATE * (plan.duration_s + plan.warmup_s)) + plan.concurrency

    @contextlib.asynccontextmanager
    async def op(self) -> AsyncIterator[Op]:
        """One window's op, its tasks made; sizes the next window's from what this one used."""
        prefix = f"released-{uuid.uuid4().hex[:8]}"
        data = scenarios.CHECKPOINT_DATA if self._checkpoint else None
        tasks = await prepare_released(self._database_url, NAMESPACE, prefix, self._count, data)
        used = 0
        async with claim_op(
            self._server.address,
            NAMESPACE,
            self._concurrency,
            tasks,
            self._checkpoint,
        ) as claim:

            async def counted(w: int, c: int) -> object:
                nonlocal used
                used += 1
                return await claim(w, c)

            yield counted
        self._count = max(self._count, int(min(used, len(tasks)) * 1.5) + self._concurrency)


async def checkpoint_vs_renew(
    server: ServerTarget, database_url: str, plan: PairedPlan
) -> Comparison:
    """SaveCheckpoint (4 KiB, versions rising) over Renew, on one server."""

    def side(scenario: str) -> Side:
        return Side(
            scenarios.TITLES[scenario],
            server.pid,
            database_url,
            lambda: scenarios.scenario_op(
                scenario,
                server.address,
                NAMESPACE,
                plan.concurrency,
                uuid.uuid4().hex[:8],
            ),
        )

    return await _compare(
        "checkpoint_vs_renew",
        "SaveCheckpoint (4 KiB) / Renew",
        side("checkpoint"),
        side("renew"),
        plan,
    )


async def claim_checkpoint(server: ServerTarget, database_url: str, plan: PairedPlan) -> Comparison:
    """Claim of a released task with a 4 KiB checkpoint over Claim of one without."""
    with_checkpoint = ReleasedClaims(server, database_url, plan, checkpoint=True)
    without = ReleasedClaims(server, database_url, plan, checkpoint=False)
    return await _compare(
        "claim_checkpoint",
        "Claim returning a 4 KiB checkpoint / Claim without one",
        Side("Claim (released, 4 KiB checkpoint)", server.pid, database_url, with_checkpoint.op),
        Side("Claim (released, no checkpoint)", server.pid, database_url, without.op),
        plan,
    )


async def timeline_claim(
    server: ServerTarget,
    database_url: str,
    plan: PairedPlan,
    baseline: str,
    log_dir: Path,
    settings: dict[str, object],
) -> Comparison:
    """Claim (new tasks) on this tree's server over the same on ``baseline``'s server.

    Args:
        baseline: a commit of this repository, or a folder with a checkout.
        settings: the server settings both servers run with.
    """
    name, title = "timeline_claim", f"Claim with the task history / Claim at {baseline}"
    try:
        with source_tree(baseline) as source:
            async with (
                sibling_database(database_url, "base") as base_url,
                leasekeeper_server(base_url, log_dir, source=source, **settings) as base,
            ):
                print(f"baseline {baseline}: {source} (pid {base.pid})", flush=True)
                await _has_no_history(base_url, baseline)

                def side(label: str, target: ServerTarget, url: str) -> Side:
                    return Side(
                        label,
                        target.pid,
                        url,
                        lambda: claim_op(target.address, NAMESPACE, plan.concurrency),
                    )

                return await _compare(
                    name,
                    title,
                    side("Claim (new task), this tree", server, database_url),
                    side(f"Claim (new task), {baseline}", base, base_url),
                    plan,
                )
    except NoSourceTree as exc:
        return skipped(name, title, TARGETS[name], f"not run: {exc}")


async def _has_no_history(database_url: str, baseline: str) -> None:
    """Raises RuntimeError when the baseline's database has a task history table."""
    conn = await asyncpg.connect(database_url)
    try:
        table = await conn.fetchval("SELECT to_regclass('leasekeeper_task_history')")
    finally:
        await conn.close()
    if table is not None:
        raise RuntimeError(f"{baseline} already writes a task history: not a baseline without it")


async def _compare(name: str, title: str, a: Side, b: Side, plan: PairedPlan) -> Comparison:
    return await compare(
        name,
        title,
        TARGETS[name],
        a,
        b,
        rounds=plan.rounds,
        concurrency=plan.concurrency,
        duration_s=plan.duration_s,
        warmup_s=plan.warmup_s,
    )


async def run_comparisons(
    server: ServerTarget,
    database_url: str,
    plan: PairedPlan,
    baseline: str | None,
    log_dir: Path,
    settings: dict[str, object],
) -> list[Comparison]:
    """The three comparisons, the timeline's first (``baseline`` None: reported as not run)."""
    print(
        f"side by side: {plan.rounds} windows of {plan.duration_s} s per side, "
        f"{plan.concurrency} concurrent",
        flush=True,
    )
    results = []
    if baseline is None:
        results.append(
            skipped(
                "timeline_claim",
                "Claim with the task history / Claim before it",
                TARGETS["timeline_claim"],
                "not run: no baseline",
            )
        )
    else:
        results.append(
            await timeline_claim(server, database_url, plan, baseline, log_dir, settings)
        )
    results.append(await checkpoint_vs_renew(server, database_url, plan))
    results.append(await claim_checkpoint(server, database_url, plan))
    return results
