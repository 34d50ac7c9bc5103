"""GetLease and ListLeases: the current state, never a cached one; pages of a namespace."""

from __future__ import annotations

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import error_info
from tests.integration.contract_helpers import (
    backdate,
    failure,
    get_lease,
    grant,
    release,
    secs,
)

pytestmark = pytest.mark.timeout(30)


async def test_get_lease_unknown_task_not_found_task_not_found(stub, namespace):
    exc = await failure(stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id="nope")))

    assert exc.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(exc).reason == "TASK_NOT_FOUND"


async def test_get_lease_follows_every_transition(stub, namespace, db):
    lease = await grant(stub, namespace, "t", "a", ttl_s=3.0)

    held = await get_lease(stub, namespace, "t")
    assert (held.state, held.fence, held.owner_id) == (pb.TASK_STATE_HELD, 1, "a")
    assert held.expire_time == lease.expire_time
    assert held.claim_time == lease.claim_time
    assert held.runtime_deadline == lease.runtime_deadline
    assert 2.0 < secs(held.remaining_ttl) <= 3.0
    assert held.end_reason == pb.LOSS_REASON_UNSPECIFIED

    await backdate(db, namespace, "t")  # behind the server's back: no cache may hide it
    expired = await get_lease(stub, namespace, "t")
    assert expired.state == pb.TASK_STATE_EXPIRED
    assert secs(expired.remaining_ttl) == 0
    assert expired.end_reason == pb.LOSS_REASON_LEASE_EXPIRED

    await release(stub, namespace, "t", "a", 1)
    free = await get_lease(stub, namespace, "t")
    assert (free.state, free.fence, free.owner_id) == (pb.TASK_STATE_FREE, 1, "a")
    assert free.end_reason == pb.LOSS_REASON_LEASE_RELEASED
    assert not free.HasField("expire_time")

    await grant(stub, namespace, "t", "b")
    await release(stub, namespace, "t", "b", 2, complete=True)
    done = await get_lease(stub, namespace, "t")
    assert (done.state, done.fence, done.owner_id) == (pb.TASK_STATE_COMPLETED, 2, "b")
    assert done.end_reason == pb.LOSS_REASON_TASK_COMPLETED


async def _insert_tasks(db, namespace: str, count: int) -> list[str]:
    """Inserts ``count`` HELD tasks directly (fast); returns their ids in byte order."""
    await db.execute(
        """
        INSERT INTO leasekeeper_tasks
            (namespace, task_id, owner_id, fence, state,
             expire_time, runtime_deadline, claim_time, update_time)
        SELECT $1, 'task-' || lpad(i::text, 5, '0'), 'o', 1, 'held',
               clock_timestamp() + interval '1 hour', clock_timestamp() + interval '1 day',
               clock_timestamp(), clock_timestamp()
        FROM generate_series(1, $2::int) AS i
        """,
        namespace,
        count,
    )
    return [f"task-{i:05d}" for i in range(1, count + 1)]


async def _list(stub, namespace, **kw) -> pb.ListLeasesResponse:
    return await stub.ListLeases(pb.ListLeasesRequest(namespace=namespace, **kw))


async def test_list_leases_unset_page_size_answers_100(stub, namespace, db):
    ids = await _insert_tasks(db, namespace, 150)

    page = await _list(stub, namespace)

    assert [lease.task_id for lease in page.leases] == ids[:100]
    assert page.next_page_token


async def test_list_leases_page_size_1000_answers_1000_then_rest(stub, namespace, db):
    ids = await _insert_tasks(db, namespace, 1005)

    first = await _list(stub, namespace, page_size=1000)
    second = await _list(stub, namespace, page_size=1000, page_token=first.next_page_token)

    assert len(first.leases) == 1000
    assert first.next_page_token
    assert [lease.task_id for lease in second.leases] == ids[1000:]
    assert second.next_page_token == ""


@pytest.mark.parametrize("page_size", [1, 7, 10, 23, 24])
async def test_list_leases_page_token_walks_every_task_once_in_byte_order(
    stub, namespace, page_size
):
    ids = [f"t{i:02d}" for i in range(20)] + ["B", "a", "\u00e9", "~"]
    for task_id in ids:
        await grant(stub, namespace, task_id, "o")

    seen: list[str] = []
    token = ""
    for _ in range(100):
        page = await _list(stub, namespace, page_size=page_size, page_token=token)
        assert len(page.leases) <= page_size
        seen.extend(lease.task_id for lease in page.leases)
        token = page.next_page_token
        if not token:
            break

    assert seen == sorted(ids, key=lambda s: s.encode())


async def test_list_leases_other_namespace_not_listed(stub, namespace):
    await grant(stub, namespace, "t", "o")
    await grant(stub, namespace + "-other", "u", "o")

    page = await _list(stub, namespace)

    assert [(lease.namespace, lease.task_id) for lease in page.leases] == [(namespace, "t")]


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (pb.TASK_STATE_UNSPECIFIED, ["completed", "expired", "free", "held"]),
        (pb.TASK_STATE_HELD, ["held"]),
        (pb.TASK_STATE_EXPIRED, ["expired"]),
        (pb.TASK_STATE_FREE, ["free"]),
        (pb.TASK_STATE_COMPLETED, ["completed"]),
    ],
    ids=lambda v: pb.TaskState.Name(v) if isinstance(v, int) else None,
)
async def test_list_leases_state_filter_answers_tasks_in_that_state(
    stub, namespace, db, state, expected
):
    await grant(stub, namespace, "held", "o")
    await grant(stub, namespace, "expired", "o")
    await backdate(db, namespace, "expired")
    await grant(stub, namespace, "free", "o")
    await release(stub, namespace, "free", "o", 1)
    await grant(stub, namespace, "completed", "o")
    await release(stub, namespace, "completed", "o", 1, complete=True)

    page = await _list(stub, namespace, state=state)

    assert [lease.task_id for lease in page.leases] == expected
    for lease in page.leases:
        assert pb.TaskState.Name(lease.state) == "TASK_STATE_" + lease.task_id.upper()


async def test_list_leases_state_filter_pages_skip_other_states(stub, namespace, db):
    for i in range(10):
        await grant(stub, namespace, f"t{i}", "o")
        if i % 2:
            await release(stub, namespace, f"t{i}", "o", 1)

    seen: list[str] = []
    token = ""
    while True:
        page = await _list(stub, namespace, state=pb.TASK_STATE_FREE, page_size=2, page_token=token)
        seen.extend(lease.task_id for lease in page.leases)
        token = page.next_page_token
        if not token:
            break

    assert seen == ["t1", "t3", "t5", "t7", "t9"]


async def test_list_leases_empty_namespace_answers_no_leases(stub, namespace):
    page = await _list(stub, namespace)

    assert list(page.leases) == []
    assert page.next_page_token == ""


async def test_list_leases_filters_by_owner_across_pages(stub, namespace):
    for i in range(5):
        await grant(stub, namespace, f"t{i}", "a" if i % 2 == 0 else "b")
    seen, token = [], ""
    while True:
        reply = await stub.ListLeases(
            pb.ListLeasesRequest(namespace=namespace, owner_id="a", page_size=2, page_token=token)
        )
        seen += [(lease.task_id, lease.owner_id) for lease in reply.leases]
        token = reply.next_page_token
        if not token:
            break
    assert seen == [("t0", "a"), ("t2", "a"), ("t4", "a")]
