"""Small helpers shared by the contract tests (tests/integration/test_contract_*.py).

They speak the raw gRPC stubs only: the contract is tested at the wire, not
through the client library.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any

import asyncpg
import grpc
from google.protobuf import duration_pb2

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.helpers import dur, error_info, poll

Stub = rpc.LeaseServiceStub

# A namespace's task rows as the lease contract sees them: every column but
# expiry_announced_fence, the expiry sweeper's bookkeeping, which it may write
# at any moment for a lease that has expired (migrations/0005_operations.sql).
LEASE_ROWS = (
    "SELECT to_jsonb(t) - 'expiry_announced_fence' AS row FROM leasekeeper_tasks t"
    " WHERE namespace = $1 ORDER BY task_id"
)


def secs(value: duration_pb2.Duration) -> float:
    """A Duration in seconds."""
    return value.ToTimedelta().total_seconds()


async def claim(
    stub: Stub,
    namespace: str,
    task_id: str,
    owner_id: str,
    ttl_s: float | None = 5.0,
    max_runtime_s: float | None = None,
) -> pb.ClaimResponse:
    request = pb.ClaimRequest(namespace=namespace, task_id=task_id, owner_id=owner_id)
    if ttl_s is not None:
        request.ttl.CopyFrom(dur(ttl_s))
    if max_runtime_s is not None:
        request.max_runtime.CopyFrom(dur(max_runtime_s))
    return await stub.Claim(request)


async def grant(stub: Stub, namespace: str, task_id: str, owner_id: str, **kw: Any) -> pb.Lease:
    """Claims and asserts the claim was granted; returns the lease."""
    reply = await claim(stub, namespace, task_id, owner_id, **kw)
    assert reply.acquired, reply
    return reply.lease


async def renew(
    stub: Stub, namespace: str, task_id: str, owner_id: str, fence: int, ttl_s: float | None = None
) -> pb.RenewResponse:
    request = pb.RenewRequest(namespace=namespace, task_id=task_id, owner_id=owner_id, fence=fence)
    if ttl_s is not None:
        request.ttl.CopyFrom(dur(ttl_s))
    return await stub.Renew(request)


async def release(
    stub: Stub, namespace: str, task_id: str, owner_id: str, fence: int, complete: bool = False
) -> pb.ReleaseResponse:
    return await stub.Release(
        pb.ReleaseRequest(
            namespace=namespace,
            task_id=task_id,
            owner_id=owner_id,
            fence=fence,
            complete=complete,
        )
    )


async def validate(
    stub: Stub, namespace: str, task_id: str, fence: int
) -> pb.ValidateFenceResponse:
    return await stub.ValidateFence(
        pb.ValidateFenceRequest(namespace=namespace, task_id=task_id, fence=fence)
    )


async def get_lease(stub: Stub, namespace: str, task_id: str) -> pb.Lease:
    reply = await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id=task_id))
    return reply.lease


async def failure(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """Awaits a call that must fail; returns its error."""
    try:
        reply = await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError(f"expected the call to fail, it answered {reply!r}")


async def expect_error(call: Awaitable[Any], code: grpc.StatusCode, reason: str) -> None:
    """Awaits a call that must fail with ``code`` and ErrorInfo ``reason``."""
    exc = await failure(call)
    assert (exc.code(), error_info(exc).reason) == (code, reason), exc.details()


async def wait_for_state(
    stub: Stub, namespace: str, task_id: str, state: int, timeout_s: float = 5.0
) -> pb.Lease:
    """Polls GetLease until the task is in ``state`` (database clock); returns the lease."""

    async def in_state() -> pb.Lease | None:
        lease = await get_lease(stub, namespace, task_id)
        return lease if lease.state == state else None

    found: pb.Lease = await poll(in_state, f"{task_id} {pb.TaskState.Name(state)}", timeout_s)
    return found


async def lock_waiters(monitor: asyncpg.Connection) -> int:
    """How many of the service's statements are waiting for a lock now.

    ``monitor`` must be a connection outside any transaction: pg_stat_activity
    is a snapshot taken once per transaction.
    """
    return await monitor.fetchval(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'leasekeeper'"
        " AND wait_event_type = 'Lock'"
    )


async def wait_for_lock_waiters(monitor: asyncpg.Connection, count: int) -> None:
    """Polls until at least ``count`` of the service's statements wait for a lock (5 s at most)."""

    async def waiting() -> bool:
        return await lock_waiters(monitor) >= count

    await poll(waiting, f"{count} statements waiting on a lock", within_s=5.0)


async def wait_past_expiry(db: asyncpg.Connection, namespace: str, task_id: str) -> None:
    """Polls the database clock until the task's expire_time has passed (5 s at most).

    Reads the row without locking it, so ``db`` may be the connection holding
    the row's lock.
    """

    async def expired() -> bool:
        return bool(
            await db.fetchval(
                "SELECT expire_time <= clock_timestamp() FROM leasekeeper_tasks"
                " WHERE namespace = $1 AND task_id = $2",
                namespace,
                task_id,
            )
        )

    await poll(expired, "the lease expired on the database clock", within_s=5.0)


async def backdate(db: asyncpg.Connection, namespace: str, task_id: str) -> None:
    """Makes a HELD lease EXPIRED now, without touching its fence, owner or state.

    Changes only expire_time, which sends no notification: the servers learn of
    it only by asking the database.
    """
    status = await db.execute(
        "UPDATE leasekeeper_tasks SET expire_time = clock_timestamp() - interval '1 second'"
        " WHERE namespace = $1 AND task_id = $2",
        namespace,
        task_id,
    )
    assert status == "UPDATE 1"


async def row(db: asyncpg.Connection, namespace: str, task_id: str) -> asyncpg.Record:
    """The task's row, as stored."""
    record = await db.fetchrow(
        "SELECT * FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = $2",
        namespace,
        task_id,
    )
    assert record is not None
    return record


async def snapshot(
    db: asyncpg.Connection, namespace_prefix: str = "", namespaces: Sequence[str] = ()
) -> list[tuple[Any, ...]]:
    """Rows of the task table and of the effect ledger, in a stable order.

    Args:
        db: a direct connection.
        namespace_prefix: only namespaces that start with it ("": every row).
        namespaces: namespaces to include as well, whatever their prefix (none
            may contain NUL, which no text value can hold).
    """
    tasks = await db.fetch(
        "SELECT to_jsonb(t) - 'expiry_announced_fence' FROM leasekeeper_tasks t"
        " WHERE starts_with(namespace, $1) OR namespace = ANY($2::text[])"
        " ORDER BY namespace, task_id",
        namespace_prefix,
        list(namespaces),
    )
    effects = await db.fetch(
        "SELECT * FROM leasekeeper_effects"
        " WHERE starts_with(namespace, $1) OR namespace = ANY($2::text[])"
        " ORDER BY namespace, task_id, effect_key",
        namespace_prefix,
        list(namespaces),
    )
    return [tuple(r) for r in tasks] + [tuple(r) for r in effects]


# Ways an owner ("a" unless said) with a fence can have lost its lease, for the
# tables of tests that check each reason. Each returns (owner_id, fence) of the
# lost lease on task "t".


async def lost_by_expiry(stub: Stub, namespace: str, db: asyncpg.Connection) -> tuple[str, int]:
    await grant(stub, namespace, "t", "a")
    await backdate(db, namespace, "t")
    return "a", 1


async def lost_to_newer_claim(
    stub: Stub, namespace: str, db: asyncpg.Connection
) -> tuple[str, int]:
    await lost_by_expiry(stub, namespace, db)
    await grant(stub, namespace, "t", "b")
    return "a", 1


async def held_by_other_owner(
    stub: Stub, namespace: str, db: asyncpg.Connection
) -> tuple[str, int]:
    await grant(stub, namespace, "t", "a")
    return "b", 1


async def fence_above_issued(stub: Stub, namespace: str, db: asyncpg.Connection) -> tuple[str, int]:
    await grant(stub, namespace, "t", "a")
    return "a", 2


async def unknown_task(stub: Stub, namespace: str, db: asyncpg.Connection) -> tuple[str, int]:
    return "a", 1


async def released(stub: Stub, namespace: str, db: asyncpg.Connection) -> tuple[str, int]:
    await grant(stub, namespace, "t", "a")
    await release(stub, namespace, "t", "a", 1)
    return "a", 1


async def completed(stub: Stub, namespace: str, db: asyncpg.Connection) -> tuple[str, int]:
    await grant(stub, namespace, "t", "a")
    await release(stub, namespace, "t", "a", 1, complete=True)
    return "a", 1


async def revoked(stub: Stub, namespace: str, db: asyncpg.Connection) -> tuple[str, int]:
    await grant(stub, namespace, "t", "a")
    await revoke_in_database(db, namespace, "t")
    return "a", 1


async def superseded_then_completed(
    stub: Stub, namespace: str, db: asyncpg.Connection
) -> tuple[str, int]:
    await lost_to_newer_claim(stub, namespace, db)
    await release(stub, namespace, "t", "b", 2, complete=True)
    return "a", 1


async def revoke_in_database(db: asyncpg.Connection, namespace: str, task_id: str) -> None:
    """Revokes a task's lease as an operator will: no RPC does it yet (issue 5's Revoke)."""
    status = await db.execute(
        "UPDATE leasekeeper_tasks SET state = 'revoked', end_reason = 'LEASE_REVOKED'"
        " WHERE namespace = $1 AND task_id = $2",
        namespace,
        task_id,
    )
    assert status == "UPDATE 1"


async def limits_loaded(server: Any, namespace: str) -> None:
    """Polls until the running server has loaded limits for ``namespace`` (notified)."""

    async def loaded() -> bool:
        limits = server.server.limits.get(namespace)
        return bool(limits.needs_lock or limits.lock_delay)

    await poll(loaded, f"limits of {namespace} loaded by the server")


async def heartbeat_on(
    stub: Stub, lease: pb.Lease, metadata: Any = None
) -> tuple[Any, pb.HeartbeatResponse]:
    """Opens a Heartbeat stream for a granted lease; returns the call and its first reply."""
    call = stub.Heartbeat(metadata=metadata)
    await call.write(
        pb.HeartbeatRequest(
            namespace=lease.namespace,
            task_id=lease.task_id,
            owner_id=lease.owner_id,
            fence=lease.fence,
        )
    )
    reply = await call.read()
    assert reply is not grpc.aio.EOF and reply.fence == lease.fence
    return call, reply
