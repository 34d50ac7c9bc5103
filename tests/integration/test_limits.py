"""Per-namespace limits: live leases, claims per second, lock delay."""

from __future__ import annotations

from datetime import timedelta

import grpc

from leasekeeper import errors
from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import dur, error_info
from tests.integration.contract_helpers import (
    LEASE_ROWS,
    backdate,
    claim,
    failure,
    grant,
    limits_loaded,
    release,
)


def retry_delay_s(exc: grpc.aio.AioRpcError) -> float:
    delay = errors.retry_delay_s(errors.rich_status_of(exc))
    assert delay is not None, "no RetryInfo in the status"
    return delay


async def set_limits(server, db, namespace, **values) -> None:
    """Writes the namespace's limits and waits until the server has reloaded them."""
    columns = ", ".join(values)
    params = ", ".join(f"${i + 2}" for i in range(len(values)))
    await db.execute(
        f"INSERT INTO leasekeeper_namespace_limits (namespace, {columns}) VALUES ($1, {params})",
        namespace,
        *values.values(),
    )
    await limits_loaded(server, namespace)


async def test_max_leases_refuses_one_more_and_changes_nothing(server, stub, db, namespace):
    await set_limits(server, db, namespace, max_leases=2)
    one = await grant(stub, namespace, "t1", "a", ttl_s=20.0)
    await grant(stub, namespace, "t2", "a", ttl_s=20.0)
    before = await db.fetch(LEASE_ROWS, namespace)

    exc = await failure(claim(stub, namespace, "t3", "a"))
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(exc).reason == "LEASE_LIMIT"
    assert 0 < retry_delay_s(exc) <= 20.0  # when the first live lease ends
    assert await db.fetch(LEASE_ROWS, namespace) == before

    # At the limit, the holder's retried claim still gets its own lease back.
    again = await claim(stub, namespace, "t1", "a")
    assert again.acquired and again.lease.fence == one.fence

    await release(stub, namespace, "t1", "a", one.fence)
    assert (await claim(stub, namespace, "t3", "a")).acquired


async def test_claims_per_second_refuses_past_the_burst_with_retry_info(
    server, stub, db, namespace
):
    await set_limits(server, db, namespace, claims_per_second=0.5, claim_burst=2)
    assert (await claim(stub, namespace, "t1", "a")).acquired
    assert (await claim(stub, namespace, "t2", "a")).acquired
    exc = await failure(claim(stub, namespace, "t3", "a"))
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(exc).reason == "CLAIM_RATE_LIMIT"
    assert 0 < retry_delay_s(exc) <= 2.0  # one token at 0.5 per second
    rows = await db.fetch(LEASE_ROWS, namespace)
    assert len(rows) == 2  # t3 was never created

    # Other namespaces are not limited.
    assert (await claim(stub, namespace + "-other", "t3", "a")).acquired


async def test_lock_delay_keeps_an_expired_task_unclaimable(server, stub, db, namespace):
    await set_limits(server, db, namespace, lock_delay=timedelta(seconds=1.5))
    await grant(stub, namespace, "t", "a", ttl_s=30)

    # Expired (backdated: no waiting) but inside the delay: not granted, and
    # told how long is left.
    await backdate(db, namespace, "t")
    expire = (
        await db.fetchval(
            "SELECT expire_time FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = 't'",
            namespace,
        )
    ).replace(tzinfo=None)
    reply = await claim(stub, namespace, "t", "b")
    assert not reply.acquired, "granted inside the lock delay"
    assert reply.holder_remaining_ttl.ToTimedelta().total_seconds() == 0
    assert 0 < reply.retry_after.ToTimedelta().total_seconds() <= 1.5

    waited = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="b", wait=dur(5.0))
    )
    assert waited.acquired
    assert (waited.lease.claim_time.ToDatetime() - expire).total_seconds() >= 1.5

    # A released lease has no delay.
    await release(stub, namespace, "t", "b", waited.lease.fence)
    assert (await claim(stub, namespace, "t", "c")).acquired
