"""Concurrency: one grant per fence, fences 1..n per task with no gap or repeat."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.helpers import error_info
from tests.integration.contract_helpers import claim, release, secs

pytestmark = pytest.mark.timeout(60)


async def test_claim_50_concurrent_claimers_exactly_one_acquires(server, namespace, db):
    channels = [grpc.aio.insecure_channel(server.target) for _ in range(50)]
    try:
        await asyncio.gather(*(ch.channel_ready() for ch in channels))
        stubs = [rpc.LeaseServiceStub(ch) for ch in channels]

        replies = await asyncio.gather(
            *(claim(s, namespace, "t", f"owner-{i}", ttl_s=5.0) for i, s in enumerate(stubs))
        )
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))

    winners = [(i, r) for i, r in enumerate(replies) if r.acquired]
    assert len(winners) == 1, [r.lease.owner_id for _, r in winners]
    index, winner = winners[0]
    assert (winner.lease.fence, winner.lease.owner_id) == (1, f"owner-{index}")
    for reply in replies:
        if not reply.acquired:
            assert 0 < secs(reply.holder_remaining_ttl) <= 5.0
            assert reply.holder_expire_time == winner.lease.expire_time
    stored = await db.fetchrow(
        "SELECT owner_id, fence FROM leasekeeper_tasks WHERE namespace = $1", namespace
    )
    assert tuple(stored) == (f"owner-{index}", 1)


async def test_claim_2000_racing_claims_grant_fences_without_gap_or_repeat(server, namespace, db):
    """20 clients, 100 tasks, 2,000 claims with 0.1-0.2 s ttls: released, expired, completed.

    Every claim attempt uses a fresh owner id, so every acquired reply is a new
    grant: per task the granted fences must be exactly 1..n, and no grant may
    follow a completion.
    """
    clients, claims_per_client, tasks = 20, 100, 100
    grants: defaultdict[str, list[int]] = defaultdict(list)
    completed: dict[str, int] = {}
    refused_completed: list[str] = []
    outcomes: defaultdict[str, int] = defaultdict(int)

    async def client(number: int) -> None:
        rng = random.Random(number)
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            for attempt in range(claims_per_client):
                task_id = f"task-{rng.randrange(tasks):03d}"
                owner = f"client-{number}-{attempt}"
                try:
                    reply = await claim(
                        stub, namespace, task_id, owner, ttl_s=rng.uniform(0.1, 0.2)
                    )
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc.details()
                    assert error_info(exc).reason == "TASK_COMPLETED"
                    refused_completed.append(task_id)
                    continue
                if not reply.acquired:
                    outcomes["refused"] += 1
                    continue
                assert reply.lease.owner_id == owner
                grants[task_id].append(reply.lease.fence)
                choice = rng.random()
                if choice < 0.5:
                    complete = choice < 0.02
                    try:
                        await release(
                            stub, namespace, task_id, owner, reply.lease.fence, complete=complete
                        )
                    except grpc.aio.AioRpcError as exc:  # it expired and was claimed again
                        assert exc.code() == grpc.StatusCode.ABORTED
                        assert error_info(exc).reason == "LEASE_SUPERSEDED"
                        outcomes["release-superseded"] += 1
                        continue
                    if complete:
                        completed[task_id] = reply.lease.fence
                    outcomes["completed" if complete else "released"] += 1
                else:
                    outcomes["left-to-expire"] += 1

    started = time.monotonic()
    await asyncio.gather(*(client(n) for n in range(clients)))
    elapsed = time.monotonic() - started

    stored = {
        r["task_id"]: (r["fence"], r["state"])
        for r in await db.fetch(
            "SELECT task_id, fence, state FROM leasekeeper_tasks WHERE namespace = $1", namespace
        )
    }
    assert sum(len(f) for f in grants.values()) > tasks, (dict(outcomes), elapsed)
    for task_id, fences in grants.items():
        assert sorted(fences) == list(range(1, len(fences) + 1)), (task_id, sorted(fences))
        assert stored[task_id][0] == len(fences)
    for task_id, fence in completed.items():
        assert max(grants[task_id]) == fence, f"{task_id} granted after its completion"
        assert stored[task_id] == (fence, "completed")
    assert set(refused_completed) <= set(completed)
    assert set(stored) == set(grants)
