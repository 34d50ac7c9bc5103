"""ListLeases pages: a bounded read per call, and tokens only for the listing that issued them.

A page of a rare filter (an owner's few leases among thousands of tasks) may
come back short, even empty, with a next_page_token; reading on until the
token is empty finds every match, in task_id order.

A page token is signed with the database's key and bound to its listing's
namespace and filters (server/leasekeeper_server/rpc/paging.py): a tampered or
forged token, or one sent with another namespace or filters, is refused with
INVALID_ARGUMENT naming page_token; every replica, before and after a
restart, accepts the tokens of every other.
"""

from __future__ import annotations

import base64

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import running_server
from tests.helpers import bad_request_fields, error_info
from tests.integration.contract_helpers import failure, grant, snapshot
from tests.integration.effect_helpers import begin

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


async def _insert_released(db, namespace: str, count: int, owner_id: str = "o") -> list[str]:
    """Inserts ``count`` FREE tasks of ``owner_id`` directly; returns their ids in byte order."""
    await db.execute(
        "INSERT INTO leasekeeper_tasks (namespace, task_id, owner_id, fence, state,"
        " expire_time, runtime_deadline, claim_time, update_time, end_reason)"
        " SELECT $1, 't' || lpad(i::text, 3, '0'), $3, 1, 'released', clock_timestamp(),"
        " clock_timestamp(), clock_timestamp(), clock_timestamp(), 'LEASE_RELEASED'"
        " FROM generate_series(1, $2) i",
        namespace,
        count,
        owner_id,
    )
    return [f"t{i:03d}" for i in range(1, count + 1)]


def _tampered(token: str) -> str:
    body = bytearray(base64.urlsafe_b64decode(token))
    body[-1] ^= 0x01  # the last byte of the task_id: "t005" becomes "t004"
    return base64.urlsafe_b64encode(bytes(body)).decode()


def _forged(task_id: str) -> str:
    """A token of the old format: base64 of the last task_id."""
    return base64.urlsafe_b64encode(task_id.encode()).decode()


async def _refused_token(call) -> None:
    exc = await failure(call)
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(exc).metadata["field"] == "page_token"
    assert bad_request_fields(exc) == ["page_token"]
    assert "page_token" in (exc.details() or "")


@pytest.mark.parametrize(
    ("change", "token_of"),
    [
        pytest.param({}, _tampered, id="tampered"),
        pytest.param({}, lambda _: _forged("t005"), id="forged-old-format"),
        pytest.param({"namespace": "other"}, None, id="another-namespace"),
        pytest.param({"state": pb.TASK_STATE_FREE}, None, id="another-state"),
        pytest.param({"owner_id": "o"}, None, id="another-owner"),
    ],
)
async def test_list_leases_token_not_of_this_listing_invalid_argument_names_page_token(
    stub, namespace, db, change, token_of
):
    await _insert_released(db, namespace, 12)
    first = await stub.ListLeases(pb.ListLeasesRequest(namespace=namespace, page_size=5))
    assert first.leases[-1].task_id == "t005" and first.next_page_token
    token = token_of(first.next_page_token) if token_of else first.next_page_token
    request = pb.ListLeasesRequest(namespace=namespace, page_size=5, page_token=token)
    if "namespace" in change:  # the other namespace has tasks too: no empty "last" page
        change = {"namespace": namespace + "-" + change["namespace"]}
        await _insert_released(db, change["namespace"], 12)
    for field, value in change.items():
        setattr(request, field, value)
    before = await snapshot(db, namespace)

    await _refused_token(stub.ListLeases(request))

    assert await snapshot(db, namespace) == before


async def test_list_leases_token_of_a_filtered_listing_refused_without_its_filter(
    stub, namespace, db
):
    await _insert_released(db, namespace, 12)
    filtered = pb.ListLeasesRequest(namespace=namespace, owner_id="o", page_size=5)
    first = await stub.ListLeases(filtered)
    assert first.next_page_token

    await _refused_token(
        stub.ListLeases(
            pb.ListLeasesRequest(namespace=namespace, page_size=5, page_token=first.next_page_token)
        )
    )


async def test_list_leases_pages_every_task_once_whatever_the_page_sizes(stub, namespace, db):
    ids = await _insert_released(db, namespace, 23)
    found: list[str] = []
    token = ""
    for size in (1, 7, 2, 1000):  # the page size is not bound to the token
        reply = await stub.ListLeases(
            pb.ListLeasesRequest(
                namespace=namespace, state=pb.TASK_STATE_FREE, page_size=size, page_token=token
            )
        )
        found += [lease.task_id for lease in reply.leases]
        token = reply.next_page_token
    assert found == ids and token == ""


async def test_list_leases_token_holds_on_another_replica_and_after_a_restart(
    database_url, namespace, db
):
    ids = await _insert_released(db, namespace, 9)

    async def page(target: str, token: str) -> pb.ListLeasesResponse:
        async with grpc.aio.insecure_channel(target) as channel:
            return await rpc.LeaseServiceStub(channel).ListLeases(
                pb.ListLeasesRequest(
                    namespace=namespace, owner_id="o", page_size=3, page_token=token
                )
            )

    async with running_server(database_url) as one:
        first = await page(one.target, "")
        async with running_server(database_url) as replica:
            second = await page(replica.target, first.next_page_token)
    async with running_server(database_url) as restarted:
        third = await page(restarted.target, second.next_page_token)
    found = [lease.task_id for reply in (first, second, third) for lease in reply.leases]
    assert found == ids


async def test_list_effects_token_of_another_task_invalid_argument_names_page_token(
    stub, namespace
):
    for task_id in ("t", "u"):
        lease = await grant(stub, namespace, task_id, "a", ttl_s=30.0)
        for key in ("k1", "k2", "k3"):
            await begin(stub, namespace, lease.fence, effect_key=key, task_id=task_id)
    first = await stub.ListEffects(
        pb.ListEffectsRequest(namespace=namespace, task_id="t", page_size=2)
    )
    assert first.next_page_token
    second = await stub.ListEffects(
        pb.ListEffectsRequest(
            namespace=namespace, task_id="t", page_size=2, page_token=first.next_page_token
        )
    )
    assert [e.effect_key for e in second.effects] == ["k3"]

    await _refused_token(
        stub.ListEffects(
            pb.ListEffectsRequest(
                namespace=namespace, task_id="u", page_size=2, page_token=first.next_page_token
            )
        )
    )
