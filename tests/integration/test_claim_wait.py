"""Claim with a wait: woken by the database's announcement, not by polling."""

from __future__ import annotations

import asyncio
import time

import grpc
from google.protobuf import duration_pb2

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.conftest import running_server
from tests.helpers import dur, error_info
from tests.integration.contract_helpers import grant, release


def waiting_claim(stub, namespace, task_id, owner_id, wait_s, ttl_s=5.0):
    return stub.Claim(
        pb.ClaimRequest(
            namespace=namespace,
            task_id=task_id,
            owner_id=owner_id,
            ttl=dur(ttl_s),
            wait=dur(wait_s),
        )
    )


async def test_a_waiting_claim_is_granted_when_the_holder_releases(stub, namespace, db):
    held = await grant(stub, namespace, "t", "a", ttl_s=30.0)
    waiting = asyncio.ensure_future(waiting_claim(stub, namespace, "t", "b", wait_s=20.0))
    # It waits (the holder has 30 s left) ...
    done, _ = await asyncio.wait({waiting}, timeout=0.5)
    assert not done
    released_at = time.monotonic()
    await release(stub, namespace, "t", "a", held.fence)
    reply = await asyncio.wait_for(waiting, 5.0)
    # ... and is granted once the release is announced, long before the ttl.
    assert reply.acquired
    assert reply.lease.owner_id == "b"
    assert reply.lease.fence == held.fence + 1
    assert time.monotonic() - released_at < 5.0


async def test_a_waiting_claim_is_granted_at_the_holders_expiry(stub, namespace):
    held = await grant(stub, namespace, "t", "a", ttl_s=1.0)
    reply = await waiting_claim(stub, namespace, "t", "b", wait_s=10.0)
    assert reply.acquired
    assert reply.lease.fence == held.fence + 1
    # Granted after the old lease's expire_time on the database clock.
    assert reply.lease.claim_time.ToDatetime() >= held.expire_time.ToDatetime()


async def test_a_wait_that_runs_out_answers_not_acquired_with_retry_after(stub, namespace):
    await grant(stub, namespace, "t", "a", ttl_s=30.0)
    started = time.monotonic()
    reply = await waiting_claim(stub, namespace, "t", "b", wait_s=0.3)
    assert time.monotonic() - started >= 0.3
    assert not reply.acquired
    assert 0 < reply.retry_after.ToTimedelta().total_seconds() <= 30.0
    assert reply.holder_remaining_ttl.ToTimedelta() <= reply.retry_after.ToTimedelta()


async def test_wait_beyond_the_servers_bound_is_refused(database_url, namespace):
    async with running_server(database_url, max_claim_wait_s=2.0) as server:
        async with grpc.aio.insecure_channel(server.target) as ch:
            from leasekeeper.v1 import lease_service_pb2_grpc as rpc

            stub = rpc.LeaseServiceStub(ch)
            try:
                await waiting_claim(stub, namespace, "t", "a", wait_s=2.5)
                raise AssertionError("a wait above max_claim_wait_s was accepted")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error_info(exc).metadata["field"] == "wait"


async def test_a_zero_wait_answers_at_once(stub, namespace):
    await grant(stub, namespace, "t", "a", ttl_s=30.0)
    for wait in (duration_pb2.Duration(), duration_pb2.Duration(nanos=1)):
        reply = await stub.Claim(
            pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="b", wait=wait)
        )
        assert not reply.acquired
    for bad in (duration_pb2.Duration(seconds=-1), duration_pb2.Duration(nanos=-1)):
        try:
            await stub.Claim(
                pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="b", wait=bad)
            )
            raise AssertionError(f"wait {bad} was accepted")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_info(exc).metadata["field"] == "wait"


async def test_a_wait_cut_short_by_shutdown_is_unavailable(database_url, namespace):
    from leasekeeper.v1 import lease_service_pb2_grpc as rpc

    async with running_server(database_url) as running:
        async with grpc.aio.insecure_channel(running.target) as ch:
            stub = rpc.LeaseServiceStub(ch)
            await grant(stub, namespace, "t", "a", ttl_s=30.0)
            waiting = asyncio.ensure_future(waiting_claim(stub, namespace, "t", "b", wait_s=20.0))
            done, _ = await asyncio.wait({waiting}, timeout=0.3)
            assert not done
            await running.server.stop(1.0)
            try:
                await asyncio.wait_for(waiting, 5.0)
                raise AssertionError("the wait outlived the server")
            except grpc.aio.AioRpcError as exc:
                # Not "held by another": the client should claim again elsewhere now.
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                assert error_info(exc).reason == "SHUTTING_DOWN"
