"""ListLeases reads a bounded number of tasks per call, whatever its filter matches.

A page of a rare filter (an owner's few leases among thousands of tasks) may
come back short, even empty, with a next_page_token; reading on until the
token is empty finds every match, in task_id order.
"""

from __future__ import annotations

import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.integration.contract_helpers import grant

pytestmark = pytest.mark.timeout(30)

OTHERS = 2_500  # more than one call's scan budget (1000 tasks)


async def test_a_rare_filter_pages_through_short_pages_to_every_match(stub, namespace, db):
    await db.execute(
        "INSERT INTO leasekeeper_tasks (namespace, task_id, owner_id, fence, state,"
        " expire_time, runtime_deadline, claim_time, update_time, end_reason)"
        " SELECT $1, 'm' || lpad(i::text, 6, '0'), 'other', 1, 'released', clock_timestamp(),"
        " clock_timestamp(), clock_timestamp(), clock_timestamp(), 'LEASE_RELEASED'"
        " FROM generate_series(1, $2) i",
        namespace,
        OTHERS,
    )
    # m001200 was released by another owner: claimed now, it is rare-owner's.
    mine = [
        await grant(stub, namespace, task_id, "rare-owner") for task_id in ("a", "m001200", "z")
    ]
    found: list[str] = []
    pages = 0
    token = ""
    while True:
        reply = await stub.ListLeases(
            pb.ListLeasesRequest(
                namespace=namespace, owner_id="rare-owner", page_size=10, page_token=token
            )
        )
        pages += 1
        assert len(reply.leases) <= 10
        found += [lease.task_id for lease in reply.leases]
        token = reply.next_page_token
        if not token:
            break
        assert pages < 10, "paging does not end"
    assert found == [lease.task_id for lease in mine] == ["a", "m001200", "z"]
    # 2,503 tasks read at most 1000 per call: at least three calls, some pages short.
    assert pages >= 3


async def test_an_unfiltered_page_is_full_while_tasks_remain(stub, namespace, db):
    await db.execute(
        "INSERT INTO leasekeeper_tasks (namespace, task_id, owner_id, fence, state,"
        " expire_time, runtime_deadline, claim_time, update_time, end_reason)"
        " SELECT $1, 't' || lpad(i::text, 6, '0'), 'other', 1, 'released', clock_timestamp(),"
        " clock_timestamp(), clock_timestamp(), clock_timestamp(), 'LEASE_RELEASED'"
        " FROM generate_series(1, 1500) i",
        namespace,
    )
    first = await stub.ListLeases(pb.ListLeasesRequest(namespace=namespace, page_size=1000))
    assert len(first.leases) == 1000 and first.next_page_token
    second = await stub.ListLeases(
        pb.ListLeasesRequest(namespace=namespace, page_size=1000, page_token=first.next_page_token)
    )
    assert len(second.leases) == 500 and not second.next_page_token
    assert second.leases[0].task_id == "t001001"
