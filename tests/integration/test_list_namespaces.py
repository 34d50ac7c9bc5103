"""ListNamespaces on a real server: names in order, task counts, pages, and tokens.

The namespaces that hold tasks come back by name (byte for byte), each with
its count of tasks in every state, counted up to 1000. The test database is
shared with other tests, so each test looks at its own namespaces
(``{namespace}/...``) within the whole listing. With tokens required, an
admin token sees only the namespaces its patterns cover; other roles may not
call it.
"""

from __future__ import annotations

import grpc
import pytest

from leasekeeper import LeaseClient, NamespaceInfo
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.core.model import NAMESPACE_COUNT_LIMIT
from leasekeeper_server.security import tokens
from tests.conftest import running_server
from tests.helpers import bad_request_fields
from tests.integration.contract_helpers import failure, grant

pytestmark = pytest.mark.timeout(60)


async def every_namespace(
    stub: rpc.LeaseServiceStub, page_size: int = 1000, metadata=None
) -> list[pb.NamespaceSummary]:
    """Every page of ListNamespaces, read until the token is empty."""
    found: list[pb.NamespaceSummary] = []
    token = ""
    while True:
        reply = await stub.ListNamespaces(
            pb.ListNamespacesRequest(page_size=page_size, page_token=token), metadata=metadata
        )
        assert len(reply.namespaces) <= page_size
        found += reply.namespaces
        token = reply.next_page_token
        if not token:
            return found


def mine(found: list[pb.NamespaceSummary], namespace: str) -> list[tuple[str, int, bool]]:
    """This test's namespaces of a listing, as (suffix, task_count, task_count_capped)."""
    prefix = f"{namespace}/"
    return [
        (s.namespace.removeprefix(prefix), s.task_count, s.task_count_capped)
        for s in found
        if s.namespace.startswith(prefix)
    ]


async def test_namespaces_come_by_name_with_their_task_counts(stub, namespace):
    for suffix, count in (("b", 1), ("a", 3), ("B", 2)):
        for n in range(count):
            await grant(stub, f"{namespace}/{suffix}", f"t{n}", "w")
    # Every state counts: a released and a completed task are tasks.
    for task_id, complete in (("t0", False), ("t1", True)):
        await stub.Release(
            pb.ReleaseRequest(
                namespace=f"{namespace}/a",
                task_id=task_id,
                owner_id="w",
                fence=1,
                complete=complete,
            )
        )
    found = await every_namespace(stub)
    names = [s.namespace for s in found]
    assert names == sorted(names, key=lambda name: name.encode("utf-8"))
    assert len(set(names)) == len(names)
    assert mine(found, namespace) == [("B", 2, False), ("a", 3, False), ("b", 1, False)]
    assert namespace not in names  # its own name holds no task


async def test_small_pages_list_what_one_page_lists(stub, namespace):
    for suffix in ("a", "b", "c", "d", "e"):
        await grant(stub, f"{namespace}/{suffix}", "t", "w")
    whole = [s.namespace for s in await every_namespace(stub)]
    paged: list[str] = []
    token = ""
    for _ in range(12):  # the first pages are enough to compare
        reply = await stub.ListNamespaces(pb.ListNamespacesRequest(page_size=3, page_token=token))
        paged += [s.namespace for s in reply.namespaces]
        token = reply.next_page_token
        assert len(reply.namespaces) == 3 or not token
        if not token:
            break
    assert paged == whole[: len(paged)]


async def test_a_count_stops_at_the_limit(stub, db, namespace):
    big = f"{namespace}/big"
    await db.execute(
        "INSERT INTO leasekeeper_tasks (namespace, task_id, owner_id, fence, state,"
        " expire_time, runtime_deadline, claim_time, update_time, end_reason)"
        " SELECT $1, 't' || lpad(i::text, 6, '0'), 'w', 1, 'released', clock_timestamp(),"
        " clock_timestamp(), clock_timestamp(), clock_timestamp(), 'LEASE_RELEASED'"
        " FROM generate_series(1, $2) i",
        big,
        NAMESPACE_COUNT_LIMIT + 500,
    )
    await grant(stub, f"{namespace}/small", "t", "w")
    assert mine(await every_namespace(stub), namespace) == [
        ("big", NAMESPACE_COUNT_LIMIT, True),
        ("small", 1, False),
    ]


async def test_the_client_lists_namespaces_page_by_page(server, stub, namespace):
    for suffix in ("x", "y"):
        await grant(stub, f"{namespace}/{suffix}", "t", "w")
    async with LeaseClient(server.target, namespace=namespace) as client:
        page, token = await client.list_namespaces(page_size=1)
        assert len(page) == 1 and token
        listed = [info async for info in client.iter_namespaces(page_size=2)]
    ours = [info for info in listed if info.namespace.startswith(f"{namespace}/")]
    assert ours == [
        NamespaceInfo(f"{namespace}/x", 1, False),
        NamespaceInfo(f"{namespace}/y", 1, False),
    ]


async def test_a_page_token_of_another_listing_is_refused(stub, namespace):
    for task_id in ("a", "b"):
        await grant(stub, namespace, task_id, "w")
    leases = await stub.ListLeases(pb.ListLeasesRequest(namespace=namespace, page_size=1))
    assert leases.next_page_token
    error = await failure(
        stub.ListNamespaces(pb.ListNamespacesRequest(page_token=leases.next_page_token))
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(error) == ["page_token"]


async def test_a_token_lists_only_the_namespaces_it_covers(database_url, db, namespace):
    narrow = (f"{namespace}/a*", f"{namespace}/c")
    _, admin_narrow = await tokens.create_token(db, "narrow", "admin", narrow)
    _, admin_all = await tokens.create_token(db, "all", "admin", ["*"])
    _, worker = await tokens.create_token(db, "worker", "worker", ["*"])

    def bearer(token: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token}"),)

    async with running_server(database_url, auth="on") as running:
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            for suffix in ("a1", "a2", "b", "c"):
                request = pb.ClaimRequest(
                    namespace=f"{namespace}/{suffix}", task_id="t", owner_id="w"
                )
                assert (await stub.Claim(request, metadata=bearer(admin_all))).acquired
            found = await every_namespace(stub, page_size=2, metadata=bearer(admin_narrow))
            assert [s.namespace for s in found] == [
                f"{namespace}/a1",
                f"{namespace}/a2",
                f"{namespace}/c",
            ]
            everything = await every_namespace(stub, metadata=bearer(admin_all))
            assert [suffix for suffix, _, _ in mine(everything, namespace)] == [
                "a1",
                "a2",
                "b",
                "c",
            ]
            refused = await failure(
                stub.ListNamespaces(pb.ListNamespacesRequest(), metadata=bearer(worker))
            )
            assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
            anonymous = await failure(stub.ListNamespaces(pb.ListNamespacesRequest()))
            assert anonymous.code() == grpc.StatusCode.UNAUTHENTICATED
