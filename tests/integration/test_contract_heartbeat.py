"""Heartbeat: one stream per lease; loss is pushed by the server within a second.

Times are measured on the test's monotonic clock. A loss happens at a database
instant the test can only bracket: between sending the request that caused it
and receiving its reply (or, for expiry, between send + remaining_ttl and
receive + remaining_ttl). The stream must end no sooner than the loss could
have happened and within LOSS_PUSH_S of the latest instant it could have.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import grpc
import pytest

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import running_server
from tests.helpers import bad_request_fields, dur, error_info, poll
from tests.integration.contract_helpers import (
    LEASE_ROWS,
    backdate,
    claim,
    completed,
    fence_above_issued,
    get_lease,
    grant,
    held_by_other_owner,
    lost_by_expiry,
    lost_to_newer_claim,
    release,
    released,
    revoke_in_database,
    row,
    secs,
    unknown_task,
)

pytestmark = pytest.mark.timeout(30)

LOSS_PUSH_S = 1.0  # guarantees.md: the stream ends "as soon as ownership is lost"; we allow 1 s
EARLY_SLACK_S = 0.005  # rounding of timestamps to microseconds


def beat(namespace: str, task_id: str = "t", owner_id: str = "a", fence: int = 1, ttl_s=None):
    request = pb.HeartbeatRequest(
        namespace=namespace, task_id=task_id, owner_id=owner_id, fence=fence
    )
    if ttl_s is not None:
        request.ttl.CopyFrom(dur(ttl_s))
    return request


@dataclass
class StreamEnd:
    at: float  # monotonic
    code: grpc.StatusCode
    reason: str | None
    fields: list[str]
    replies: list[pb.HeartbeatResponse]


async def stream_end(call) -> StreamEnd:
    """Reads a heartbeat stream to its end."""
    replies = []
    while True:
        try:
            reply = await call.read()
        except grpc.aio.AioRpcError as exc:
            at = time.monotonic()
            return StreamEnd(
                at, exc.code(), error_info(exc).reason, bad_request_fields(exc), replies
            )
        if reply is grpc.aio.EOF:
            at = time.monotonic()
            return StreamEnd(at, await call.code(), None, [], replies)
        replies.append(reply)


async def open_stream(stub, first: pb.HeartbeatRequest):
    """Opens a stream and sends the first message; returns (call, reply, send, receive)."""
    call = stub.Heartbeat()
    sent = time.monotonic()
    await call.write(first)
    reply = await call.read()
    received = time.monotonic()
    assert reply is not grpc.aio.EOF
    return call, reply, sent, received


# --- the first message --------------------------------------------------------------


async def test_heartbeat_first_message_renews_lease(stub, namespace, db):
    await grant(stub, namespace, "t", "a", ttl_s=0.5)
    before = await row(db, namespace, "t")

    call, reply, _, _ = await open_stream(stub, beat(namespace, ttl_s=5.0))
    try:
        assert reply.renewed
        assert reply.fence == 1
        assert 4.5 < secs(reply.remaining_ttl) <= 5.0
        after = await row(db, namespace, "t")
        assert after["update_time"] > before["update_time"]
        assert after["expire_time"].replace(tzinfo=None) == reply.expire_time.ToDatetime()
        assert secs((await get_lease(stub, namespace, "t")).remaining_ttl) > 4.0
    finally:
        call.cancel()


async def test_heartbeat_unset_ttl_renews_for_server_default(stub, namespace):
    await grant(stub, namespace, "t", "a", ttl_s=0.5)

    call, reply, _, _ = await open_stream(stub, beat(namespace))
    call.cancel()

    assert reply.renewed
    assert 4.5 < secs(reply.remaining_ttl) <= 5.0


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (lost_by_expiry, "LEASE_EXPIRED"),
        (lost_to_newer_claim, "LEASE_SUPERSEDED"),
        (held_by_other_owner, "NOT_OWNER"),
        (fence_above_issued, "FENCE_UNKNOWN"),
        (unknown_task, "FENCE_UNKNOWN"),
        (released, "LEASE_RELEASED"),
        (completed, "TASK_COMPLETED"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
async def test_heartbeat_first_message_for_lost_lease_aborts_with_reason(
    stub, namespace, db, setup, reason
):
    owner, fence = await setup(stub, namespace, db)
    before = await db.fetch(LEASE_ROWS, namespace)

    call = stub.Heartbeat()
    await call.write(beat(namespace, owner_id=owner, fence=fence, ttl_s=5.0))
    end = await stream_end(call)

    assert (end.code, end.reason) == (grpc.StatusCode.ABORTED, reason)
    assert end.replies == []
    after = await db.fetch(LEASE_ROWS, namespace)
    assert after == before  # never revived


@pytest.mark.parametrize(
    ("first", "field"),
    [
        (dict(fence=0), "fence"),
        (dict(task_id=""), "task_id"),
        (dict(owner_id="a\x00"), "owner_id"),
        (dict(ttl_s=0.01), "ttl"),
    ],
    ids=["fence-zero", "empty-task-id", "nul-owner-id", "ttl-below-min"],
)
async def test_heartbeat_first_message_bad_input_invalid_argument(
    stub, namespace, db, first, field
):
    await grant(stub, namespace, "t", "a")
    before = await row(db, namespace, "t")

    call = stub.Heartbeat()
    await call.write(beat(namespace, **first))
    end = await stream_end(call)

    assert (end.code, end.reason, end.fields) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        [field],
    )
    assert await row(db, namespace, "t") == before


async def test_heartbeat_malformed_body_invalid_argument_names_request(channel, namespace):
    call = channel.stream_stream(
        "/leasekeeper.v1.LeaseService/Heartbeat",
        request_serializer=None,
        response_deserializer=None,
    )()
    await call.write(b"\x0a\x01\xff")  # namespace with invalid UTF-8
    end = await stream_end(call)

    assert (end.code, end.fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["request"])


# --- later messages -----------------------------------------------------------------


async def test_heartbeat_later_messages_renew_and_may_leave_lease_unnamed(
    database_url, namespace, db
):
    # A server without a minimum renew interval: every beat is a renewal, at once.
    async with (
        running_server(database_url, min_renew_interval_s=0.0) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        await grant(stub, namespace, "t", "a")
        call, _, _, _ = await open_stream(stub, beat(namespace, ttl_s=2.0))
        try:
            await call.write(pb.HeartbeatRequest(ttl=dur(4.0)))
            second = await call.read()
            await call.write(pb.HeartbeatRequest())  # the ttl from the earlier message stays
            third = await call.read()
        finally:
            call.cancel()

    assert second.renewed and third.renewed
    assert second.fence == third.fence == 1
    assert 3.5 < secs(second.remaining_ttl) <= 4.0
    assert 3.5 < secs(third.remaining_ttl) <= 4.0
    assert third.expire_time.ToDatetime() > second.expire_time.ToDatetime()
    stored = await row(db, namespace, "t")
    assert stored["expire_time"].replace(tzinfo=None) == third.expire_time.ToDatetime()


@pytest.mark.parametrize(
    ("later", "field"),
    [
        (dict(task_id="other"), "task_id"),
        (dict(fence=2), "fence"),
        (dict(owner_id="b"), "owner_id"),
        (dict(namespace="elsewhere"), "namespace"),
        (dict(ttl_s=0.01), "ttl"),
    ],
    ids=["other-task", "other-fence", "other-owner", "other-namespace", "ttl-below-min"],
)
async def test_heartbeat_later_message_naming_another_lease_invalid_argument(
    stub, namespace, db, later, field
):
    await grant(stub, namespace, "t", "a")
    call, _, _, _ = await open_stream(stub, beat(namespace, ttl_s=5.0))
    fields = dict(task_id="", owner_id="", fence=0)
    fields.update(later)
    ns = fields.pop("namespace", "")
    ttl_s = fields.pop("ttl_s", None)
    message = beat(ns, **fields, ttl_s=ttl_s)

    await call.write(message)
    end = await stream_end(call)

    assert (end.code, end.reason, end.fields) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
        [field],
    )
    lease = await get_lease(stub, namespace, "t")
    assert (lease.state, lease.fence, lease.owner_id) == (pb.TASK_STATE_HELD, 1, "a")


async def test_heartbeat_beat_flood_answered_without_write_storm(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    log_table = f"test_renew_log_{uuid.uuid4().hex[:10]}"
    # A trigger scoped to this test's namespace records every write to the row.
    await db.execute(f"CREATE TABLE {log_table} (update_time timestamptz NOT NULL)")
    await db.execute(
        f"""
        CREATE FUNCTION {log_table}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN INSERT INTO {log_table} VALUES (NEW.update_time); RETURN NULL; END $$;
        CREATE TRIGGER {log_table} AFTER UPDATE ON leasekeeper_tasks FOR EACH ROW
            WHEN (NEW.namespace = '{namespace}') EXECUTE FUNCTION {log_table}();
        """
    )
    try:
        call, first, _, _ = await open_stream(stub, beat(namespace, ttl_s=5.0))
        started = time.monotonic()

        async def flood() -> None:
            for _ in range(200):
                await call.write(pb.HeartbeatRequest())

        writer = asyncio.ensure_future(flood())
        replies = [await call.read() for _ in range(200)]
        await writer
        elapsed = time.monotonic() - started
        await call.done_writing()
        end = await stream_end(call)
        writes = await db.fetch(f"SELECT update_time FROM {log_table}")
    finally:
        await db.execute(
            f"DROP TRIGGER IF EXISTS {log_table} ON leasekeeper_tasks;"
            f" DROP FUNCTION IF EXISTS {log_table}(); DROP TABLE IF EXISTS {log_table}"
        )

    renewed = [r for r in replies if r.renewed]
    assert first.renewed
    assert end.code == grpc.StatusCode.OK
    assert all(r.fence == 1 for r in replies)
    assert all(secs(r.remaining_ttl) > 4.0 for r in replies)
    # Each renewal is one write, and renewals are at least min_renew_interval (0.05 s) apart.
    assert len(writes) == 1 + len(renewed), (len(writes), len(renewed))
    assert len(renewed) <= elapsed / 0.05 + 1, (len(renewed), elapsed)
    assert len(renewed) <= 20, f"{len(renewed)} of 200 beats written"


# --- the ends of a stream -----------------------------------------------------------


async def test_heartbeat_half_close_ends_ok_and_lease_stays_held(stub, namespace, db):
    await grant(stub, namespace, "t", "a")
    call, reply, _, _ = await open_stream(stub, beat(namespace, ttl_s=5.0))

    await call.done_writing()
    end = await stream_end(call)

    assert end.code == grpc.StatusCode.OK
    lease = await get_lease(stub, namespace, "t")
    assert (lease.state, lease.fence, lease.owner_id) == (pb.TASK_STATE_HELD, 1, "a")
    assert lease.expire_time == reply.expire_time
    assert (await row(db, namespace, "t"))["state"] == "held"


async def test_heartbeat_half_close_before_first_message_ends_ok(stub, namespace):
    call = stub.Heartbeat()
    await call.done_writing()

    end = await stream_end(call)

    assert end.code == grpc.StatusCode.OK


async def test_heartbeat_broken_connection_keeps_lease_held(server, stub, namespace):
    await grant(stub, namespace, "t", "a")
    channel = grpc.aio.insecure_channel(server.target)
    _, reply, _, _ = await open_stream(rpc.LeaseServiceStub(channel), beat(namespace, ttl_s=5.0))
    heartbeats = server.server.heartbeats
    assert heartbeats.open_streams == 1

    await channel.close()  # the client goes away without a word

    async def stream_gone() -> bool:
        return heartbeats.open_streams == 0

    await poll(stream_gone, "the server's stream ended", within_s=5.0)
    lease = await get_lease(stub, namespace, "t")
    assert (lease.state, lease.fence, lease.owner_id) == (pb.TASK_STATE_HELD, 1, "a")
    assert lease.expire_time == reply.expire_time


async def test_heartbeat_client_stops_beating_ends_lease_expired_at_expiry(stub, namespace):
    await grant(stub, namespace, "t", "a")
    call, reply, sent, received = await open_stream(stub, beat(namespace, ttl_s=0.3))
    remaining = secs(reply.remaining_ttl)

    end = await stream_end(call)

    assert (end.code, end.reason) == (grpc.StatusCode.ABORTED, "LEASE_EXPIRED")
    assert end.at >= sent + remaining - EARLY_SLACK_S, "stream ended before the lease expired"
    assert end.at - (received + remaining) < LOSS_PUSH_S


async def _newer_claim_after_expiry(stub, other, namespace, db):
    await backdate(db, namespace, "t")  # expired behind the stream's back: no notification
    assert (await claim(other, namespace, "t", "b")).acquired


async def _release_complete_elsewhere(stub, other, namespace, db):
    await release(other, namespace, "t", "a", 1, complete=True)


async def _release_elsewhere(stub, other, namespace, db):
    await release(other, namespace, "t", "a", 1)


async def _revoke_in_database(stub, other, namespace, db):
    await revoke_in_database(db, namespace, "t")


@pytest.mark.parametrize(
    ("lose", "reason"),
    [
        (_newer_claim_after_expiry, "LEASE_SUPERSEDED"),
        (_release_complete_elsewhere, "TASK_COMPLETED"),
        (_release_elsewhere, "LEASE_RELEASED"),
        (_revoke_in_database, "LEASE_REVOKED"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
async def test_heartbeat_loss_elsewhere_pushes_aborted_within_a_second(
    server, stub, namespace, db, lose, reason
):
    await grant(stub, namespace, "t", "a")
    call, _, _, _ = await open_stream(stub, beat(namespace, ttl_s=5.0))  # no beat needed for 5 s
    async with grpc.aio.insecure_channel(server.target) as channel:
        other = rpc.LeaseServiceStub(channel)
        ending = asyncio.ensure_future(stream_end(call))
        lost_from = time.monotonic()
        await lose(stub, other, namespace, db)
        lost_by = time.monotonic()
        end = await ending

    assert (end.code, end.reason) == (grpc.StatusCode.ABORTED, reason)
    assert end.at >= lost_from
    assert end.at - lost_by < LOSS_PUSH_S, f"pushed {end.at - lost_by:.3f} s after the loss"


async def test_heartbeat_runtime_budget_spent_without_beats_ends_runtime_exceeded(stub, namespace):
    sent_claim = time.monotonic()
    await grant(stub, namespace, "t", "a", ttl_s=5.0, max_runtime_s=0.5)
    claimed = time.monotonic()
    call, reply, _, _ = await open_stream(stub, beat(namespace, ttl_s=5.0))
    assert secs(reply.remaining_ttl) <= 0.5  # capped at the runtime deadline

    end = await stream_end(call)

    assert (end.code, end.reason) == (grpc.StatusCode.ABORTED, "RUNTIME_EXCEEDED")
    assert end.at >= sent_claim + 0.5 - EARLY_SLACK_S
    assert end.at - (claimed + 0.5) < LOSS_PUSH_S


async def test_heartbeat_runtime_budget_spent_while_beating_ends_runtime_exceeded(stub, namespace):
    # ttl 0.6 s, budget 1.5 s. Beats keep the lease alive until 1.0 s after the
    # claim; from then on every renewal reaches the runtime deadline (1.0 + 0.6
    # > 1.5), so the lease ends exactly at its budget, and the push must name it.
    # The beats stop before the end on purpose: a write racing the server's
    # status makes grpc.aio report INTERNAL instead of it (grpc/grpc#36066).
    sent_claim = time.monotonic()
    await grant(stub, namespace, "t", "a", ttl_s=0.6, max_runtime_s=1.5)
    claimed = time.monotonic()
    call, first, _, _ = await open_stream(stub, beat(namespace, ttl_s=0.6))
    replies = [first]
    while time.monotonic() - claimed < 1.0:
        await asyncio.sleep(0.2)
        await call.write(pb.HeartbeatRequest())
        replies.append(await call.read())
    end = await stream_end(call)

    assert (end.code, end.reason) == (grpc.StatusCode.ABORTED, "RUNTIME_EXCEEDED")
    assert sum(r.renewed for r in replies) >= 4  # it was kept alive until the budget ran out
    assert end.at >= sent_claim + 1.5 - EARLY_SLACK_S
    assert end.at - (claimed + 1.5) < LOSS_PUSH_S


async def test_heartbeat_stopped_beating_and_rival_claims_ends_within_a_second_of_expiry(
    server, stub, namespace
):
    """The natural race: whichever the server sees first, expiry or the newer fence."""
    await grant(stub, namespace, "t", "a")
    call, reply, _, received = await open_stream(stub, beat(namespace, ttl_s=0.3))
    expiry_by = received + secs(reply.remaining_ttl)
    ending = asyncio.ensure_future(stream_end(call))
    async with grpc.aio.insecure_channel(server.target) as channel:
        rival = rpc.LeaseServiceStub(channel)

        async def rival_granted() -> bool:  # once the database says the lease expired
            return bool((await claim(rival, namespace, "t", "b")).acquired)

        await poll(rival_granted, "the rival's grant", within_s=5.0, interval_s=0.01)
        end = await ending

    assert end.code == grpc.StatusCode.ABORTED
    assert end.reason in ("LEASE_EXPIRED", "LEASE_SUPERSEDED")
    assert end.at - expiry_by < LOSS_PUSH_S


async def test_heartbeat_server_shutdown_ends_unavailable_and_lease_lives_on(
    database_url, namespace, db
):
    async with running_server(database_url) as first:
        async with grpc.aio.insecure_channel(first.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            await grant(stub, namespace, "t", "a")
            call, _, _, _ = await open_stream(stub, beat(namespace, ttl_s=5.0))
            ending = asyncio.ensure_future(stream_end(call))
            await first.server.stop(0.5)
            end = await ending

    assert (end.code, end.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
    stored = await row(db, namespace, "t")
    assert (stored["state"], stored["fence"], stored["owner_id"]) == ("held", 1, "a")
    assert await db.fetchval(
        "SELECT expire_time > clock_timestamp() FROM leasekeeper_tasks"
        " WHERE namespace = $1 AND task_id = 't'",
        namespace,
    )
    # The client resumes on another replica with the same fence.
    async with running_server(database_url) as second:
        async with grpc.aio.insecure_channel(second.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            call, resumed, _, _ = await open_stream(stub, beat(namespace, ttl_s=5.0))
            call.cancel()
    assert resumed.renewed and resumed.fence == 1


async def test_heartbeat_ttl_shorter_than_renew_interval_kept_alive(database_url, namespace):
    # The server's minimum renew interval (60 s) is longer than the lease's ttl
    # (6 s): a beat ttl/3 after the last renewal must still renew it, or no such
    # lease could be kept alive. The gaps are measured on the test's clock from
    # the moment the renewal's reply arrived, which is after the server's own
    # renewal instant, so a slow scheduler only makes the gaps longer, never
    # shorter: the test asserts the rule without racing the machine.
    ttl_s = 6.0
    async with (
        running_server(database_url, min_renew_interval_s=60.0) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        await grant(stub, namespace, "t", "a", ttl_s=ttl_s)
        call, first, _, renewed_at = await open_stream(stub, beat(namespace, ttl_s=ttl_s))
        assert first.renewed
        expire_time = first.expire_time.ToDatetime()

        # A beat sooner than ttl/3 after the renewal is answered without a write.
        await call.write(pb.HeartbeatRequest())
        early = await call.read()
        if time.monotonic() - renewed_at < ttl_s / 3:
            assert not early.renewed
            assert early.expire_time.ToDatetime() == expire_time

        # Beats at least ttl/3 after the last renewal renew, though 60 s have not passed.
        for _ in range(2):
            await asyncio.sleep(max(0.0, renewed_at + ttl_s / 3 + 0.05 - time.monotonic()))
            await call.write(pb.HeartbeatRequest())
            reply = await call.read()
            assert reply != grpc.aio.EOF, "the stream ended while beating"
            renewed_at = time.monotonic()
            assert reply.renewed, "a beat ttl/3 after the last renewal was not written"
            assert reply.expire_time.ToDatetime() > expire_time
            expire_time = reply.expire_time.ToDatetime()

        lease = await get_lease(stub, namespace, "t")
        assert lease.state == pb.TASK_STATE_HELD and lease.fence == 1
        assert lease.expire_time.ToDatetime() == expire_time
        await call.done_writing()
        assert (await stream_end(call)).code == grpc.StatusCode.OK


async def test_heartbeat_many_streams_share_one_listening_connection(server, stub, namespace, db):
    count_listeners = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'leasekeeper-events'"
    )
    before = await db.fetchval(count_listeners)
    calls = []
    try:
        for i in range(5):
            await grant(stub, namespace, f"t{i}", "a")
            call, _, _, _ = await open_stream(stub, beat(namespace, task_id=f"t{i}", ttl_s=5.0))
            calls.append(call)
        assert server.server.heartbeats.open_streams == 5
        # The server's one LISTEN connection serves every stream: none is added per stream.
        assert before >= 1
        assert await db.fetchval(count_listeners) == before
    finally:
        for call in calls:
            call.cancel()
