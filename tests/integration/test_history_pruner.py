"""The history pruner keeps each task's history within its count and every entry within its age."""

from __future__ import annotations

import grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import running_server
from tests.helpers import poll
from tests.integration.contract_helpers import grant, release


async def _history_rows(db, namespace: str, task_id: str) -> list[tuple[str, int]]:
    rows = await db.fetch(
        "SELECT kind, fence FROM leasekeeper_task_history"
        " WHERE namespace = $1 AND task_id = $2 ORDER BY sequence",
        namespace,
        task_id,
    )
    return [(r["kind"], r["fence"]) for r in rows]


async def _grant_and_release(stub, namespace: str, task_id: str, times: int) -> None:
    for n in range(times):
        lease = await grant(stub, namespace, task_id, f"w{n}", ttl_s=30.0)
        await release(stub, namespace, task_id, f"w{n}", lease.fence)


async def test_count_pass_keeps_the_newest_entries_of_each_task(database_url, db, namespace):
    async with running_server(
        database_url, history_max_per_task=4, history_prune_interval_s=3600.0
    ) as running:
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            await _grant_and_release(stub, namespace, "busy", 5)  # 10 entries
            await _grant_and_release(stub, namespace, "quiet", 1)  # 2 entries
            pruner = running.server.pruner
            assert pruner is not None
            result = await pruner.prune_once()

    assert result.by_count >= 6
    assert await _history_rows(db, namespace, "busy") == [
        ("granted", 4),
        ("released", 4),
        ("granted", 5),
        ("released", 5),
    ]
    assert await _history_rows(db, namespace, "quiet") == [("granted", 1), ("released", 1)]


async def test_age_pass_deletes_old_entries_in_the_background(database_url, db, namespace):
    async with running_server(
        database_url, history_max_age_s=3600.0, history_prune_interval_s=0.05
    ) as running:
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            await _grant_and_release(stub, namespace, "old", 1)
            await _grant_and_release(stub, namespace, "new", 1)
            # the "old" task's entries age past the retention on the database clock
            await db.execute(
                "UPDATE leasekeeper_task_history SET event_time = event_time - interval '2 hours'"
                " WHERE namespace = $1 AND task_id = 'old'",
                namespace,
            )

            async def old_gone() -> bool:
                return not await _history_rows(db, namespace, "old")

            await poll(old_gone, "old history entries pruned", within_s=10.0)
            listed = await stub.ListTaskHistory(
                pb.ListTaskHistoryRequest(namespace=namespace, task_id="new")
            )
    assert [e.kind for e in listed.entries] == [pb.HISTORY_KIND_GRANTED, pb.HISTORY_KIND_RELEASED]
