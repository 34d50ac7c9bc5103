"""Revoke: an operator ends a lease at once, and the holder is told."""

from __future__ import annotations

import asyncio
import time

import grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import error_info
from tests.integration.contract_helpers import (
    LEASE_ROWS,
    expect_error,
    get_lease,
    grant,
    heartbeat_on,
    release,
    validate,
)


def revoke(stub, namespace, task_id, reason="operator says stop", fence=0):
    return stub.Revoke(
        pb.RevokeRequest(namespace=namespace, task_id=task_id, reason=reason, fence=fence)
    )


async def test_revoke_stops_the_fence_and_ends_the_live_stream_within_a_second(stub, namespace):
    lease = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    call, _ = await heartbeat_on(stub, lease)

    sent = time.monotonic()
    reply = await revoke(stub, namespace, "t", reason="runaway agent")
    assert reply.revoked
    assert reply.lease.state == pb.TASK_STATE_FREE
    assert reply.lease.end_reason == pb.LOSS_REASON_LEASE_REVOKED
    assert reply.lease.revoke_reason == "runaway agent"
    assert reply.lease.fence == lease.fence

    # The stream ends ABORTED LEASE_REVOKED without another beat from the holder.
    try:
        message = await asyncio.wait_for(call.read(), 1.0)
        raise AssertionError(f"the stream answered {message!r} after the revoke")
    except grpc.aio.AioRpcError as exc:
        told_s = time.monotonic() - sent
        assert exc.code() == grpc.StatusCode.ABORTED
        assert error_info(exc).reason == "LEASE_REVOKED"
    assert told_s < 1.0

    check = await validate(stub, namespace, "t", lease.fence)
    assert not check.valid
    assert check.reason == pb.LOSS_REASON_LEASE_REVOKED
    await expect_error(
        release(stub, namespace, "t", "a", lease.fence), grpc.StatusCode.ABORTED, "LEASE_REVOKED"
    )

    # The next claim gets a new fence, and the reason is gone with the new lease.
    again = await grant(stub, namespace, "t", "b")
    assert again.fence == lease.fence + 1
    assert again.revoke_reason == ""


async def test_revoke_of_a_superseded_fence_or_a_free_task_changes_nothing(stub, namespace, db):
    first = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    await release(stub, namespace, "t", "a", first.fence)
    second = await grant(stub, namespace, "t", "b", ttl_s=30.0)
    before = await db.fetch(LEASE_ROWS, namespace)

    stale = await revoke(stub, namespace, "t", fence=first.fence)
    assert not stale.revoked
    assert stale.lease.fence == second.fence
    assert stale.lease.state == pb.TASK_STATE_HELD
    assert await db.fetch(LEASE_ROWS, namespace) == before

    await release(stub, namespace, "t", "b", second.fence)
    free = await revoke(stub, namespace, "t")
    assert not free.revoked
    assert free.lease.state == pb.TASK_STATE_FREE
    assert (await get_lease(stub, namespace, "t")).end_reason == pb.LOSS_REASON_LEASE_RELEASED


async def test_revoke_errors_name_the_problem(stub, namespace):
    await expect_error(
        revoke(stub, namespace, "never"), grpc.StatusCode.NOT_FOUND, "TASK_NOT_FOUND"
    )
    lease = await grant(stub, namespace, "done", "a")
    await release(stub, namespace, "done", "a", lease.fence, complete=True)
    await expect_error(
        revoke(stub, namespace, "done"), grpc.StatusCode.FAILED_PRECONDITION, "TASK_COMPLETED"
    )
    for request, field in (
        (pb.RevokeRequest(namespace=namespace, task_id="done"), "reason"),
        (pb.RevokeRequest(namespace=namespace, task_id="done", reason="x" * 1025), "reason"),
        (pb.RevokeRequest(namespace=namespace, task_id="done", reason="a\x00b"), "reason"),
        (pb.RevokeRequest(namespace=namespace, task_id="done", reason="r", fence=-1), "fence"),
        (pb.RevokeRequest(namespace="", task_id="done", reason="r"), "namespace"),
    ):
        try:
            await stub.Revoke(request)
            raise AssertionError(f"{request} was accepted")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_info(exc).metadata["field"] == field
