"""What runs make visible: lost leases, time in recovery, quarantines, cancellations, checkpoints.

Every count here comes from real calls on a real server, read back from a
real scrape of its ``/metrics``. The task-event metrics are counted by the
elected expiry sweeper from the database's notifications, so those tests run
a server that is the sweeper's leader, sweeping every 0.1 s; they wait on the
scrape, never on a sleep. The leader counts events in commit order, so a
later event seen counted proves an earlier one was counted or left out.
Cancel and Retry write audit records like Revoke.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.observability.audit import AUDIT_LOGGER
from leasekeeper_server.security import tokens
from tests.conftest import RunningServer, running_server
from tests.helpers import dur, error_info, poll
from tests.integration.contract_helpers import failure, grant
from tests.integration.effect_helpers import begin
from tests.integration.test_expiry_announced import sweeper_lock_free
from tests.integration.test_metrics_http import Samples, until_scraped, value

pytestmark = pytest.mark.timeout(60)

Stub = rpc.LeaseServiceStub
LOST = "leasekeeper_leases_lost_total"
EXPIRED = "leasekeeper_leases_expired_total"
QUARANTINED = "leasekeeper_tasks_quarantined_total"
CANCELLED = "leasekeeper_tasks_cancelled_total"
RECOVERY = "leasekeeper_recovery_seconds"
WRITES = "leasekeeper_checkpoint_writes_total"
BYTES = "leasekeeper_checkpoint_bytes_total"


def count(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 when the series does not exist (nothing counted yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
async def leader(database_url: str, db: asyncpg.Connection) -> AsyncIterator[RunningServer]:
    """A server with a metrics endpoint that is the database's elected sweeper."""
    await poll(lambda: sweeper_lock_free(db), "the sweeper lock released")
    async with running_server(
        database_url, metrics_listen="127.0.0.1:0", sweep_interval_s=0.1
    ) as running:

        async def elected() -> bool:
            return running.server.sweeper.is_leader

        await poll(elected, "this server elected sweeper")
        yield running


def port_of(running: RunningServer) -> int:
    port = running.server.metrics_port
    assert port
    return port


async def claim(stub: Stub, namespace: str, task_id: str, ttl_s: float, **kw: Any) -> pb.Lease:
    """Claims for owner-a with this ttl (and any other ClaimRequest field); asserts a grant."""
    request = pb.ClaimRequest(
        namespace=namespace, task_id=task_id, owner_id="owner-a", ttl=dur(ttl_s), **kw
    )
    reply = await stub.Claim(request)
    assert reply.acquired, reply
    return reply.lease


async def revoke(stub: Stub, namespace: str, task_id: str) -> pb.RevokeResponse:
    return await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id=task_id, reason="ops"))


async def cancel(stub: Stub, namespace: str, task_id: str, **kw: Any) -> pb.CancelResponse:
    return await stub.Cancel(
        pb.CancelRequest(namespace=namespace, task_id=task_id, reason="not needed"), **kw
    )


def seconds_between(later: Any, earlier: Any) -> float:
    """Two Timestamps' difference, seconds."""
    return (later.ToDatetime() - earlier.ToDatetime()).total_seconds()


async def test_an_expiry_is_a_lost_lease_and_the_next_grant_observes_time_in_recovery(
    leader: RunningServer, namespace: str
) -> None:
    port = port_of(leader)
    async with grpc.aio.insecure_channel(leader.target) as channel:
        stub = Stub(channel)
        first = await claim(stub, namespace, "t", ttl_s=0.2)
        s = await until_scraped(port, LOST, 1, namespace=namespace, reason="LEASE_EXPIRED")
        assert value(s, EXPIRED, namespace=namespace) == 1
        assert count(s, RECOVERY + "_count", namespace=namespace) == 0  # a first grant
        second = await grant(stub, namespace, "t", "owner-b")
        s = await until_scraped(port, RECOVERY + "_count", 1, namespace=namespace)

    # From the first lease's end to the second grant, on the database clock.
    recovery_s = value(s, RECOVERY + "_sum", namespace=namespace)
    assert recovery_s == pytest.approx(seconds_between(second.claim_time, first.expire_time))
    assert recovery_s > 0
    assert count(s, LOST, namespace=namespace, reason="RUNTIME_EXCEEDED") == 0


async def test_an_expiry_at_the_runtime_budget_is_lost_as_runtime_exceeded(
    leader: RunningServer, namespace: str
) -> None:
    port = port_of(leader)
    async with grpc.aio.insecure_channel(leader.target) as channel:
        lease = await claim(Stub(channel), namespace, "t", ttl_s=30, max_runtime=dur(0.2))
        assert lease.expire_time == lease.runtime_deadline
        s = await until_scraped(port, LOST, 1, namespace=namespace, reason="RUNTIME_EXCEEDED")
    assert count(s, LOST, namespace=namespace, reason="LEASE_EXPIRED") == 0
    assert value(s, EXPIRED, namespace=namespace) == 1


async def test_a_revoke_loses_a_live_lease_and_an_expired_one_counts_once(
    leader: RunningServer, namespace: str
) -> None:
    port = port_of(leader)
    async with grpc.aio.insecure_channel(leader.target) as channel:
        stub = Stub(channel)
        await claim(stub, namespace, "live", ttl_s=30)
        assert (await revoke(stub, namespace, "live")).revoked
        await until_scraped(port, LOST, 1, namespace=namespace, reason="LEASE_REVOKED")

        # An expired lease revoked: lost to its expiry (announced by a sweep, events
        # ago), not to the revoke.
        await claim(stub, namespace, "late", ttl_s=0.2)
        await until_scraped(port, EXPIRED, 1, namespace=namespace)
        await claim(stub, namespace, "last", ttl_s=30, max_attempts=1)
        assert (await revoke(stub, namespace, "late")).revoked
        # The last attempt used up by a revoke: revoked, then quarantined.
        assert (await revoke(stub, namespace, "last")).lease.state == pb.TASK_STATE_QUARANTINED
        s = await until_scraped(port, QUARANTINED, 1, namespace=namespace)

    assert value(s, LOST, namespace=namespace, reason="LEASE_REVOKED") == 2  # live, last
    assert value(s, LOST, namespace=namespace, reason="LEASE_EXPIRED") == 1  # late


async def test_attempts_used_up_by_an_expiry_quarantine_and_cancel_counts_cancellations(
    leader: RunningServer, namespace: str
) -> None:
    port = port_of(leader)
    async with grpc.aio.insecure_channel(leader.target) as channel:
        stub = Stub(channel)
        await claim(stub, namespace, "q", ttl_s=0.2, max_attempts=1)
        s = await until_scraped(port, QUARANTINED, 1, namespace=namespace)
        assert value(s, LOST, namespace=namespace, reason="LEASE_EXPIRED") == 1

        # Cancelling a quarantined task takes no lease from anyone; a live one does.
        assert (await cancel(stub, namespace, "q")).lease.state == pb.TASK_STATE_CANCELLED
        await claim(stub, namespace, "live", ttl_s=30)
        await cancel(stub, namespace, "live")
        s = await until_scraped(port, CANCELLED, 2, namespace=namespace)
        assert value(s, LOST, namespace=namespace, reason="TASK_CANCELLED") == 1
        assert value(s, LOST, namespace=namespace, reason="LEASE_EXPIRED") == 1

        # A claim of a quarantined task is refused and counted as such.
        await claim(stub, namespace, "r", ttl_s=0.2, max_attempts=1)
        await until_scraped(port, QUARANTINED, 2, namespace=namespace)
        refused = await failure(
            stub.Claim(pb.ClaimRequest(namespace=namespace, task_id="r", owner_id="owner-b"))
        )
        assert error_info(refused).reason == "TASK_QUARANTINED"
        # Retried by an operator, then granted: its time in recovery runs from the lease's end.
        first = (await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id="r"))).lease
        await stub.Retry(pb.RetryRequest(namespace=namespace, task_id="r", reason="fixed"))
        second = await grant(stub, namespace, "r", "owner-b")
        s = await until_scraped(port, RECOVERY + "_count", 1, namespace=namespace)

    assert value(s, RECOVERY + "_sum", namespace=namespace) == pytest.approx(
        seconds_between(second.claim_time, first.expire_time)
    )
    assert value(s, "leasekeeper_claims_total", namespace=namespace, result="quarantined") == 1


async def test_checkpoint_writes_and_bytes_are_counted_by_method(
    database_url: str, namespace: str
) -> None:
    async with running_server(database_url, metrics_listen="127.0.0.1:0") as running:
        port = port_of(running)
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = Stub(channel)
            lease = await grant(stub, namespace, "t", "owner-a", ttl_s=30.0)
            names = {"namespace": namespace, "task_id": "t", "owner_id": "owner-a"}

            def save(version: int, data: bytes) -> Any:
                checkpoint = pb.Checkpoint(version=version, data=data)
                return stub.SaveCheckpoint(
                    pb.SaveCheckpointRequest(**names, fence=lease.fence, checkpoint=checkpoint)
                )

            await save(1, b"x" * 100)
            stale = await failure(save(1, b"y" * 7))  # not newer: nothing stored
            assert error_info(stale).reason == "CHECKPOINT_NOT_NEWER"

            await begin(stub, namespace, lease.fence)
            await stub.CompleteEffect(
                pb.CompleteEffectRequest(
                    namespace=namespace,
                    task_id="t",
                    fence=lease.fence,
                    effect_key="send",
                    outcome=pb.EFFECT_STATE_SUCCEEDED,
                    external_operation_id="pay-1",
                    next_checkpoint=pb.Checkpoint(version=2, data=b"z" * 50),
                )
            )

            call = stub.Heartbeat()
            await call.write(
                pb.HeartbeatRequest(
                    **names, fence=lease.fence, checkpoint=pb.Checkpoint(version=3, data=b"h" * 30)
                )
            )
            assert (await call.read()).checkpoint_version == 3
            # A version that does not move forward is not stored: the answer says 3.
            await call.write(pb.HeartbeatRequest(checkpoint=pb.Checkpoint(version=2, data=b"s")))
            assert (await call.read()).checkpoint_version == 3
            await call.write(pb.HeartbeatRequest())  # a beat without a checkpoint
            await call.read()
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK

        s = await until_scraped(port, "leasekeeper_heartbeat_streams_open", 0)
    for method, writes, size in (("SaveCheckpoint", 1, 100), ("CompleteEffect", 1, 50)):
        assert value(s, WRITES, namespace=namespace, method=method) == writes
        assert value(s, BYTES, namespace=namespace, method=method) == size
    assert value(s, WRITES, namespace=namespace, method="Heartbeat") == 1
    assert value(s, BYTES, namespace=namespace, method="Heartbeat") == 30


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.fields: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.fields.append(dict(getattr(record, "audit_fields", {})))


@pytest.fixture
def audited() -> Iterator[_Records]:
    """The audit records written meanwhile (their fields), the audit logger on."""
    logger = logging.getLogger(AUDIT_LOGGER)
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_cancel_and_retry_are_audited_with_the_operator_and_reason(
    database_url: str, namespace: str, db: asyncpg.Connection, audited: _Records
) -> None:
    _record, token = await tokens.create_token(db, f"ops-{namespace}", "admin", [namespace])
    metadata = (("authorization", f"Bearer {token}"),)
    async with running_server(database_url, auth="on") as running:
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = Stub(channel)
            q = await stub.Claim(
                pb.ClaimRequest(
                    namespace=namespace, task_id="q", owner_id="a", ttl=dur(30), max_attempts=1
                ),
                metadata=metadata,
            )
            await stub.Revoke(
                pb.RevokeRequest(namespace=namespace, task_id="q", reason="stuck"),
                metadata=metadata,
            )
            await stub.Retry(
                pb.RetryRequest(namespace=namespace, task_id="q", reason="input fixed"),
                metadata=metadata,
            )
            await cancel(stub, namespace, "q", metadata=metadata)
            again = await stub.Cancel(
                pb.CancelRequest(namespace=namespace, task_id="q", reason="twice"),
                metadata=metadata,
            )
            assert again.cancelled is False

    cancels = [
        r for r in audited.fields if r.get("namespace") == namespace and r["event"] == "cancel"
    ]
    # The second cancel changed nothing, and its record says so.
    assert [(r["cancelled"], r["reason"]) for r in cancels] == [
        (True, "not needed"),
        (False, "twice"),
    ]
    mine = {
        r["event"]: r
        for r in audited.fields
        if r.get("namespace") == namespace and r.get("cancelled") is not False
    }
    assert mine["retry"] == {
        "event": "retry",
        "namespace": namespace,
        "task_id": "q",
        "fence": q.lease.fence,
        "reason": "input fixed",
        "principal": f"ops-{namespace}",
    }
    assert mine["cancel"] == {
        "event": "cancel",
        "namespace": namespace,
        "task_id": "q",
        "fence": q.lease.fence,
        "cancelled": True,
        "reason": "not needed",
        "principal": f"ops-{namespace}",
    }


async def test_a_failed_release_is_audited_as_failed(
    server: RunningServer, namespace: str, audited: _Records
) -> None:
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = Stub(channel)
        lease = await grant(stub, namespace, "t", "owner-a")
        await stub.Release(
            pb.ReleaseRequest(
                namespace=namespace,
                task_id="t",
                owner_id="owner-a",
                fence=lease.fence,
                fail=True,
                fail_reason="bad input",
            )
        )
    release = next(
        r for r in audited.fields if r.get("namespace") == namespace and r["event"] == "release"
    )
    assert (release["complete"], release["fail"], release["fail_reason"]) == (
        False,
        True,
        "bad input",
    )
