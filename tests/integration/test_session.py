"""Session: many leases on one stream, renewed per beat, each loss pushed with its reason.

Against a real server and PostgreSQL: the raw stream (adds, drops, beats,
pushed losses, refusals naming the field, the token's namespaces), a paused
worker process whose leases all expire, and the Python client, whose
``hold()`` blocks share one Session stream while it keeps more than one
lease. Every wait polls real state (the stream's next message, a row, the
server's counters); none sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from leasekeeper import LeaseClient, LeaseLost
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.security import tokens
from tests.conftest import RunningServer, running_server
from tests.fault.proxy import TcpProxy, tcp_proxy
from tests.helpers import STEP_S, bad_request_fields, dur, error_info, poll
from tests.integration.contract_helpers import backdate, get_lease, grant, row, secs
from tests.unit.test_client_hold import TTL_S, FakeChannel, FakeLeaseServer

pytestmark = pytest.mark.timeout(60)

LOSS_PUSH_S = 1.0  # as Heartbeat's contract test: a loss is pushed within a second
WORKER = Path(__file__).with_name("session_worker.py")


def add(
    namespace: str, lease_id: int, task_id: str, owner_id: str = "a", fence: int = 1, ttl_s=30.0
):
    request = pb.SessionRequest.Add(
        id=lease_id, namespace=namespace, task_id=task_id, owner_id=owner_id, fence=fence
    )
    if ttl_s is not None:
        request.ttl.CopyFrom(dur(ttl_s))
    return request


class Session:
    """A raw Session stream: each ``send`` returns its answer; pushed messages are kept aside."""

    def __init__(self, stub: rpc.LeaseServiceStub, metadata: Any = None) -> None:
        self.call = stub.Session(metadata=metadata)
        self.sequence = 0
        self.pushed: list[pb.SessionResponse] = []

    async def send(self, *, adds=(), drop=(), beat=False) -> pb.SessionResponse:
        self.sequence += 1
        await self.call.write(
            pb.SessionRequest(sequence=self.sequence, add=list(adds), drop=list(drop), beat=beat)
        )
        while True:
            reply = await asyncio.wait_for(self.call.read(), STEP_S)
            assert reply is not grpc.aio.EOF
            if reply.sequence == 0:
                self.pushed.append(reply)
                continue
            assert reply.sequence == self.sequence, reply
            return reply

    async def push(self, within_s: float = STEP_S) -> pb.SessionResponse:
        """The next message the server sends on its own."""
        if self.pushed:
            return self.pushed.pop(0)
        reply = await asyncio.wait_for(self.call.read(), within_s)
        assert reply is not grpc.aio.EOF and reply.sequence == 0, reply
        return reply

    async def end(self) -> grpc.aio.AioRpcError | None:
        """Reads to the stream's end: its error, or None when it ended OK."""
        try:
            while await asyncio.wait_for(self.call.read(), STEP_S) is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as error:
            return error
        return None

    def close(self) -> None:
        self.call.cancel()


@contextlib.asynccontextmanager
async def session(stub: rpc.LeaseServiceStub, metadata: Any = None) -> AsyncIterator[Session]:
    opened = Session(stub, metadata)
    try:
        yield opened
    finally:
        opened.close()


def held_ids(reply: pb.SessionResponse) -> set[int]:
    return {held.id for held in reply.held}


def reason_name(value: int) -> str:
    return pb.LossReason.Name(value).removeprefix("LOSS_REASON_")


def refusal(error: bytes) -> tuple[str, str | None, list[str]]:
    """(code name, ErrorInfo reason, BadRequest fields) of a refused add's status."""
    status = status_pb2.Status.FromString(error)
    reason, fields = None, []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields = [v.field for v in bad.field_violations]
    code = next(code for code in grpc.StatusCode if code.value[0] == status.code)
    return code.name, reason, fields


def statements(server: RunningServer) -> float:
    return server.server.metrics.db_statements._value.get()


def sample_sum(server: RunningServer, name: str, **labels: str) -> float:
    total = 0.0
    for family in server.server.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


async def expire_time(db: asyncpg.Connection, namespace: str, task_id: str) -> Any:
    return (await row(db, namespace, task_id))["expire_time"]


# --- many leases, one stream ----------------------------------------------------------


async def test_one_beat_renews_every_lease_of_the_session_in_one_statement(
    database_url, namespace, db
):
    leases = 100
    async with (
        running_server(database_url, min_renew_interval_s=0) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        granted = await asyncio.gather(
            *(grant(stub, namespace, f"t{i}", "a", ttl_s=5) for i in range(leases))
        )
        async with session(stub) as s:
            added = await s.send(adds=[add(namespace, i + 1, f"t{i}") for i in range(leases)])
            assert held_ids(added) == set(range(1, leases + 1))
            assert all(h.renewed and 29 < secs(h.remaining_ttl) <= 30 for h in added.held)
            assert {h.fence for h in added.held} == {lease.fence for lease in granted} == {1}
            first = {i: await expire_time(db, namespace, f"t{i}") for i in (0, leases - 1)}

            renewals = sample_sum(server, "leasekeeper_renewals_total", method="Session")
            before = statements(server)
            beaten = await s.send(beat=True)
            sent = statements(server) - before

            assert held_ids(beaten) == set(range(1, leases + 1))
            assert all(h.renewed for h in beaten.held)
            # One statement for the hundred renewals (a few more may be the
            # server's own background reads running meanwhile).
            assert sent <= 3, f"{sent} statements for {leases} renewals in one beat"
            for i in (0, leases - 1):
                assert await expire_time(db, namespace, f"t{i}") > first[i]
            counted = sample_sum(server, "leasekeeper_renewals_total", method="Session")
            assert counted - renewals == leases
            assert server.server.sessions.leases == leases


async def test_a_beat_sooner_than_the_renew_interval_is_answered_without_a_write(
    database_url, namespace, db
):
    async with (
        running_server(database_url, min_renew_interval_s=30) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        await grant(stub, namespace, "t", "a", ttl_s=5)
        async with session(stub) as s:
            added = await s.send(adds=[add(namespace, 7, "t", ttl_s=60)])
            written = await expire_time(db, namespace, "t")
            beaten = await s.send(beat=True)
            [held] = beaten.held
            assert (held.id, held.renewed) == (7, False)
            assert secs(held.remaining_ttl) <= secs(added.held[0].remaining_ttl)
            assert await expire_time(db, namespace, "t") == written


async def test_a_dropped_lease_is_no_longer_renewed_or_watched(server, stub, namespace, db):
    for task in ("kept", "dropped"):
        await grant(stub, namespace, task, "a", ttl_s=5)
    async with session(stub) as s:
        await s.send(adds=[add(namespace, 1, "kept"), add(namespace, 2, "dropped")])
        dropped_at = await expire_time(db, namespace, "dropped")
        answer = await s.send(drop=[2, 99], beat=True)  # 99: never added, ignored
        assert held_ids(answer) == {1}
        assert await expire_time(db, namespace, "dropped") == dropped_at
        # Its release is no loss of the session's: nothing is pushed for it.
        await stub.Release(
            pb.ReleaseRequest(namespace=namespace, task_id="dropped", owner_id="a", fence=1)
        )
        await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id="kept", reason="test"))
        pushed = await s.push()
        assert [(lost.id, reason_name(lost.reason)) for lost in pushed.lost] == [
            (1, "LEASE_REVOKED")
        ]
    assert server.server.sessions.leases == 0 or await poll(
        lambda: server.server.sessions.leases == 0, "the session's leases left with it"
    )


# --- a loss is pushed; the others stay held -------------------------------------------


async def _revoke(stub, db, namespace, task):
    await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id=task, reason="test"))


async def _cancel(stub, db, namespace, task):
    await stub.Cancel(pb.CancelRequest(namespace=namespace, task_id=task, reason="test"))


async def _complete(stub, db, namespace, task):
    await stub.Release(
        pb.ReleaseRequest(namespace=namespace, task_id=task, owner_id="a", fence=1, complete=True)
    )


async def _supersede(stub, db, namespace, task):
    await backdate(db, namespace, task)
    await grant(stub, namespace, task, "other", ttl_s=30)


LOSSES: dict[str, tuple[Callable[..., Awaitable[None]], str, int]] = {
    "revoked": (_revoke, "LEASE_REVOKED", 1),
    "cancelled": (_cancel, "TASK_CANCELLED", 1),
    "completed": (_complete, "TASK_COMPLETED", 1),
    "superseded": (_supersede, "LEASE_SUPERSEDED", 2),
}


@pytest.mark.parametrize("cause", sorted(LOSSES))
async def test_a_loss_is_pushed_with_its_reason_and_the_other_leases_stay_held(
    server, stub, namespace, db, cause
):
    act, reason, current_fence = LOSSES[cause]
    for task in ("a", "b", "c"):
        await grant(stub, namespace, task, "a", ttl_s=5)
    async with session(stub) as s:
        await s.send(adds=[add(namespace, i, task) for i, task in enumerate("abc", 1)])
        acted = time.monotonic()
        await act(stub, db, namespace, "b")
        pushed = await s.push()
        told_s = time.monotonic() - acted
        assert [
            (lost.id, reason_name(lost.reason), lost.current_fence) for lost in pushed.lost
        ] == [(2, reason, current_fence)]
        assert told_s < LOSS_PUSH_S + 0.5, told_s  # the act's own call included
        answer = await s.send(beat=True)
        assert held_ids(answer) == {1, 3} and not answer.lost
        for task in ("a", "c"):
            assert (await get_lease(stub, namespace, task)).state == pb.TASK_STATE_HELD
        failures = sample_sum(
            server, "leasekeeper_renewal_failures_total", method="Session", reason=reason
        )
        assert failures == 1


async def test_an_expiry_is_pushed_while_the_other_leases_stay_held(server, stub, namespace):
    for task in ("short", "long"):
        await grant(stub, namespace, task, "a", ttl_s=5)
    async with session(stub) as s:
        sent = time.monotonic()
        answer = await s.send(
            adds=[add(namespace, 1, "short", ttl_s=0.3), add(namespace, 2, "long")]
        )
        remaining_s = secs(next(h for h in answer.held if h.id == 1).remaining_ttl)
        pushed = await s.push()  # no beat: "short" runs out its ttl
        at = time.monotonic()
        assert [(lost.id, reason_name(lost.reason)) for lost in pushed.lost] == [
            (1, "LEASE_EXPIRED")
        ]
        assert sent + remaining_s - 0.01 <= at <= sent + remaining_s + LOSS_PUSH_S + 0.5
        assert held_ids(await s.send(beat=True)) == {2}
        assert (await get_lease(stub, namespace, "long")).state == pb.TASK_STATE_HELD


async def test_an_add_whose_lease_is_already_lost_is_answered_lost(server, stub, namespace, db):
    await grant(stub, namespace, "t", "a", ttl_s=5)
    await backdate(db, namespace, "t")
    await grant(stub, namespace, "ok", "a", ttl_s=5)
    async with session(stub) as s:
        answer = await s.send(adds=[add(namespace, 1, "t"), add(namespace, 2, "ok")])
        # In the answer, or pushed just before it: the expiry sweeper may announce the
        # expiry while the add's renewal runs, and the session's watchdog reads it first.
        told = [*s.pushed, answer]
        assert [(lost.id, reason_name(lost.reason)) for m in told for lost in m.lost] == [
            (1, "LEASE_EXPIRED")
        ]
        assert held_ids(answer) == {2}


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("namespace", {"namespace": ""}),
        ("task_id", {"task_id": ""}),
        ("owner_id", {"owner_id": ""}),
        ("fence", {"fence": 0}),
        ("ttl", {"ttl_s": 0.01}),  # below the server's minimum ttl
    ],
)
async def test_a_bad_add_is_refused_naming_the_field_and_the_stream_goes_on(
    server, stub, namespace, field, changes
):
    await grant(stub, namespace, "good", "a", ttl_s=5)
    values = {"namespace": namespace, "task_id": "t", "owner_id": "a", "fence": 1, "ttl_s": 30.0}
    values.update(changes)
    bad = add(
        values["namespace"],
        1,
        values["task_id"],
        values["owner_id"],
        values["fence"],
        values["ttl_s"],
    )
    async with session(stub) as s:
        answer = await s.send(adds=[bad, add(namespace, 2, "good")])
        [refused] = answer.refused
        assert refused.id == 1
        assert refusal(refused.error) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT", [field])
        assert held_ids(answer) == {2}
        assert held_ids(await s.send(beat=True)) == {2}


async def test_the_same_task_twice_in_a_session_is_refused(server, stub, namespace):
    await grant(stub, namespace, "t", "a", ttl_s=5)
    async with session(stub) as s:
        await s.send(adds=[add(namespace, 1, "t")])
        answer = await s.send(adds=[add(namespace, 2, "t")])
        [refused] = answer.refused
        assert refusal(refused.error)[2] == ["task_id"]
        assert held_ids(await s.send(beat=True)) == {1}


async def test_an_id_dropped_by_a_message_may_name_an_add_of_the_same_message(
    server, stub, namespace
):
    await grant(stub, namespace, "t", "a", ttl_s=5)
    await grant(stub, namespace, "u", "a", ttl_s=5)
    async with session(stub) as s:
        await s.send(adds=[add(namespace, 1, "t")])
        answer = await s.send(drop=[1], adds=[add(namespace, 1, "u")])  # drops first, then adds
        assert [(h.id, h.renewed) for h in answer.held] == [(1, True)]
        assert not answer.refused and not answer.lost
        assert held_ids(await s.send(beat=True)) == {1}
        # The id now names "u": "t" was dropped and may join again under another id.
        assert held_ids(await s.send(adds=[add(namespace, 2, "t")])) == {2}


@pytest.mark.parametrize(
    ("field", "request_of"),
    [
        ("sequence", lambda ns: pb.SessionRequest(sequence=0, beat=True)),
        ("add.id", lambda ns: pb.SessionRequest(sequence=1, add=[add(ns, 0, "t")])),
        (
            "add.id",
            lambda ns: pb.SessionRequest(sequence=1, add=[add(ns, 5, "t"), add(ns, 5, "u")]),
        ),
        (  # the refusal of the first and the answer of the second would carry one id
            "add.id",
            lambda ns: pb.SessionRequest(
                sequence=1, add=[add(ns, 5, "t", fence=0), add(ns, 5, "u")]
            ),
        ),
        (
            "add",
            lambda ns: pb.SessionRequest(
                sequence=1, add=[add(ns, i + 1, f"t{i}") for i in range(1001)]
            ),
        ),
    ],
    ids=["sequence-0", "add-id-0", "add-id-twice", "add-id-twice-first-refused", "too-many-adds"],
)
async def test_a_message_whose_answers_cannot_be_matched_ends_the_stream_naming_the_field(
    server, stub, namespace, field, request_of
):
    async with session(stub) as s:
        await s.call.write(request_of(namespace))
        error = await s.end()
    assert error is not None and error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(error) == [field]


async def test_a_malformed_message_ends_the_stream_invalid_argument(server, channel):
    call = channel.stream_stream(
        "/leasekeeper.v1.LeaseService/Session", request_serializer=None, response_deserializer=None
    )()
    await call.write(b"\xff\xff\xff")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(call.read(), STEP_S)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(caught.value) == ["request"]


# --- the token's namespaces -----------------------------------------------------------


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def test_the_token_must_cover_each_lease_added(database_url, namespace, db):
    other = f"{namespace}-other"
    async with (
        running_server(database_url, auth="on") as secured,
        grpc.aio.insecure_channel(secured.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        _, admin = await tokens.create_token(db, "admin-test", "admin", ["*"])
        worker_record, worker = await tokens.create_token(db, "worker-test", "worker", [namespace])
        _, effect = await tokens.create_token(db, "effect-test", "effect", [namespace])
        for ns in (namespace, other):
            await stub.Claim(
                pb.ClaimRequest(namespace=ns, task_id="t", owner_id="a", ttl=dur(30)),
                metadata=bearer(admin),
            )
        before = await row(db, other, "t")
        async with session(stub, bearer(worker)) as s:
            answer = await s.send(adds=[add(namespace, 1, "t"), add(other, 2, "t")])
            assert held_ids(answer) == {1}
            [refused] = answer.refused
            code, reason, _ = refusal(refused.error)
            assert (refused.id, code, reason) == (2, "PERMISSION_DENIED", "PERMISSION_DENIED")
            assert held_ids(await s.send(beat=True)) == {1}
            # The token revoked: the open session ends, without another message from it.
            assert await tokens.revoke_token(db, worker_record.token_id)
            revoked = await s.end()
            assert revoked is not None and revoked.code() is grpc.StatusCode.UNAUTHENTICATED
        for metadata, code in (
            (bearer(effect), grpc.StatusCode.PERMISSION_DENIED),
            (None, grpc.StatusCode.UNAUTHENTICATED),
        ):
            async with session(stub, metadata) as s:
                await s.call.write(pb.SessionRequest(sequence=1, add=[add(namespace, 1, "t")]))
                error = await s.end()
            assert error is not None and error.code() is code
            assert error_info(error).reason == code.name
        assert await row(db, other, "t") == before


async def test_the_servers_shutdown_ends_a_session_unavailable_and_the_leases_live_on(
    database_url, namespace, db
):
    async with (
        running_server(database_url) as stopping,
        grpc.aio.insecure_channel(stopping.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        await grant(stub, namespace, "t", "a", ttl_s=30)
        async with session(stub) as s:
            await s.send(adds=[add(namespace, 1, "t")])
            stopped = asyncio.create_task(stopping.server.stop(0.5))
            error = await s.end()
            await stopped
    assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
    assert error_info(error).reason == "SHUTTING_DOWN"
    assert (await row(db, namespace, "t"))["state"] == "held"


# --- a paused worker process ----------------------------------------------------------


async def test_a_paused_worker_loses_every_lease_of_its_session_after_their_ttl(
    server, namespace, caplog
):
    caplog.set_level(logging.INFO, logger="leasekeeper_server.rpc.session")
    tasks = [f"job-{i}" for i in range(5)]
    ttl_s = 1.0
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WORKER),
        server.target,
        namespace,
        str(ttl_s),
        *tasks,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), STEP_S)
        assert line.decode().strip() == f"holding {len(tasks)}"
        sessions = server.server.sessions
        # Frozen only once its session renews every lease (the first lease moved off its heartbeat).
        await poll(
            lambda: sessions.leases == len(tasks) and server.server.heartbeats.open_streams == 0,
            "every lease on the worker's one session",
        )
        assert sessions.open_streams == 1
        process.send_signal(signal.SIGSTOP)

        async with LeaseClient(server.target, namespace=namespace) as observer:

            async def all_expired() -> bool:
                states = [(await observer.get_lease(t)).state for t in tasks]
                return all(state == "EXPIRED" for state in states)

            await poll(all_expired, "every lease of the frozen worker expired")
        # The server learned of each expiry and took the lease out of the session.
        await poll(lambda: sessions.leases == 0, "the session's leases lost")
        lost = [
            r.getMessage()
            for r in caplog.records
            if r.getMessage().startswith("session lease lost: LEASE_EXPIRED")
            and repr(namespace) in r.getMessage()
        ]
        assert len(lost) == len(tasks), lost

        process.send_signal(signal.SIGCONT)
        out, _ = await asyncio.wait_for(process.communicate(), STEP_S)
        reported = sorted(out.decode().split("\n"))
        assert [line for line in reported if line] == [
            f"lost {t} LEASE_EXPIRED" for t in sorted(tasks)
        ]
        assert process.returncode == 0
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
            await process.wait()


# --- the Python client ----------------------------------------------------------------


async def _holding(
    client: LeaseClient, task_id: str, ttl_s: float, entered: list, stop: asyncio.Event
):
    async with client.hold(task_id, ttl=ttl_s) as lease:
        entered.append(lease)
        await stop.wait()
    return lease


async def test_several_holds_of_one_client_share_one_session_stream(server, worker, namespace, db):
    client = worker()
    tasks = [f"t{i}" for i in range(5)]
    entered: list = []
    stop = asyncio.Event()
    blocks = [asyncio.create_task(_holding(client, t, 1.0, entered, stop)) for t in tasks]
    try:
        await poll(lambda: len(entered) == len(tasks), "every block entered")
        sessions, heartbeats = server.server.sessions, server.server.heartbeats
        await poll(
            lambda: sessions.leases == len(tasks) and heartbeats.open_streams == 0,
            "all five leases on the session, the first one's heartbeat retired",
        )
        assert sessions.open_streams == 1
        assert client._sessions is not None and client._sessions.streams_opened == 1
        renewals = sample_sum(server, "leasekeeper_renewals_total", method="Session", result="ok")
        await poll(
            lambda: (
                sample_sum(server, "leasekeeper_renewals_total", method="Session", result="ok")
                >= renewals + 2 * len(tasks)
            ),
            "two more beats of the session renewed every lease",
        )
        assert all(not lease.lost and lease.renewal_error is None for lease in entered)
    finally:
        stop.set()
        done = await asyncio.gather(*blocks, return_exceptions=True)
    assert not [d for d in done if isinstance(d, BaseException)], done
    for task in tasks:
        assert (await row(db, namespace, task))["state"] == "released"
    await poll(lambda: server.server.sessions.open_streams == 0, "the idle session half-closed")


async def test_a_pushed_loss_cancels_only_its_own_hold(server, worker, stub, namespace):
    client = worker()
    entered: list = []
    stop = asyncio.Event()
    blocks = {t: asyncio.create_task(_holding(client, t, 30.0, entered, stop)) for t in "abc"}
    try:
        await poll(lambda: server.server.sessions.leases == 3, "three leases on the session")
        revoked_at = time.monotonic()
        await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id="b", reason="test"))
        with pytest.raises(LeaseLost) as caught:
            await asyncio.wait_for(blocks["b"], LOSS_PUSH_S + 2.0)
        assert caught.value.reason == "LEASE_REVOKED"
        assert time.monotonic() - revoked_at < LOSS_PUSH_S + 2.0
        assert not blocks["a"].done() and not blocks["c"].done()
        assert server.server.sessions.leases == 2
    finally:
        stop.set()
        others = await asyncio.gather(blocks["a"], blocks["c"], return_exceptions=True)
    assert all(not isinstance(o, BaseException) for o in others), others


async def test_in_a_session_a_checkpoint_is_saved_by_save_checkpoint_and_complete_ends_alone(
    server, worker, namespace, db
):
    client = worker()
    entered: list = []
    stop = asyncio.Event()
    other = asyncio.create_task(_holding(client, "other", 30.0, entered, stop))
    try:
        await poll(lambda: len(entered) == 1, "the other block entered")
        async with client.hold("run", ttl=30.0) as lease:
            await poll(lambda: server.server.sessions.leases == 2, "both leases on the session")
            saves = sample_sum(
                server, "leasekeeper_checkpoint_writes_total", method="SaveCheckpoint"
            )
            saved = await lease.save_checkpoint(1, b"step 1")
            assert saved.write_time is not None  # SaveCheckpoint's answer, not a beat's
            assert (
                sample_sum(server, "leasekeeper_checkpoint_writes_total", method="SaveCheckpoint")
                == saves + 1
            )
            assert lease.checkpoint_version == 1
            completed = await lease.complete()
            assert completed.state == "COMPLETED"
        assert not other.done() and not entered[0].lost
    finally:
        stop.set()
        await other
    assert (await row(db, namespace, "run"))["state"] == "completed"
    assert (await row(db, namespace, "other"))["state"] == "released"


async def test_one_hold_keeps_its_own_heartbeat(server, worker):
    client = worker()
    async with client.hold("t", ttl=1.0):
        await poll(lambda: server.server.heartbeats.open_streams == 1, "the hold's heartbeat")
        assert server.server.sessions.open_streams == 0
    assert client._sessions is None or client._sessions.streams_opened == 0


async def test_with_sessions_off_each_hold_keeps_a_heartbeat(server, worker):
    client = worker(sessions=False)
    async with client.hold("a", ttl=1.0), client.hold("b", ttl=1.0):
        await poll(lambda: server.server.heartbeats.open_streams == 2, "two heartbeats")
        assert server.server.sessions.open_streams == 0


@pytest.fixture
async def proxy(server: RunningServer) -> AsyncIterator[TcpProxy]:
    async with tcp_proxy("127.0.0.1", server.port) as running:
        yield running


async def test_a_broken_session_resumes_on_a_new_stream_with_the_same_fences(
    server, proxy, namespace
):
    entered: list = []
    stop = asyncio.Event()
    async with LeaseClient(f"127.0.0.1:{proxy.port}", namespace=namespace) as client:
        blocks = [asyncio.create_task(_holding(client, t, 3.0, entered, stop)) for t in "abc"]
        try:
            sessions = server.server.sessions
            await poll(lambda: sessions.leases == 3, "three leases on the session")
            keeper = client._sessions
            assert keeper is not None and keeper.streams_opened == 1
            proxy.reset()  # the connection, and the stream on it, break
            await poll(lambda: keeper.streams_opened >= 2, "the session reopened")
            await poll(lambda: sessions.leases == 3, "every lease added to the new stream")
            assert not any(block.done() for block in blocks)
            assert [lease.fence for lease in entered] == [1, 1, 1]
            assert all(not lease.lost for lease in entered)
        finally:
            stop.set()
            done = await asyncio.gather(*blocks, return_exceptions=True)
    assert not [d for d in done if isinstance(d, BaseException)], done


async def test_a_black_holed_session_loses_each_lease_at_its_own_trust_deadline(
    server, proxy, namespace
):
    entered: list = []
    never = asyncio.Event()
    async with LeaseClient(f"127.0.0.1:{proxy.port}", namespace=namespace) as client:
        blocks = [asyncio.create_task(_holding(client, t, 1.0, entered, never)) for t in "ab"]
        await poll(lambda: server.server.sessions.leases == 2, "two leases on the session")
        proxy.black_hole()
        cut_at = time.monotonic()
        ended = await asyncio.wait_for(asyncio.gather(*blocks, return_exceptions=True), STEP_S)
        told_s = time.monotonic() - cut_at
    assert [type(e).__name__ for e in ended] == ["LeaseLost", "LeaseLost"], ended
    assert {e.reason for e in ended if isinstance(e, LeaseLost)} == {"LEASE_EXPIRED"}
    assert told_s < 3.0, f"LeaseLost {told_s:.1f} s after the network died (ttl 1 s)"


# --- a server without Session ---------------------------------------------------------


class _Unimplemented:
    """A Session call to a server that has no Session (an older version)."""

    async def write(self, request: Any) -> None:
        pass

    async def read(self) -> Any:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "no Session"
        )

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> bool:
        return True


class _NoSessionChannel(FakeChannel):
    def stream_stream(self, method, request_serializer=None, response_deserializer=None, **_):
        if method.endswith("/Session"):
            return lambda *args, **kwargs: _Unimplemented()
        return super().stream_stream(method)


async def test_against_a_server_without_session_every_lease_keeps_a_heartbeat():
    fake = FakeLeaseServer()
    client = LeaseClient(namespace="ns", owner_id="w", channel=_NoSessionChannel(fake))
    entered: list = []
    stop = asyncio.Event()
    blocks = [asyncio.create_task(_holding(client, t, TTL_S, entered, stop)) for t in "ab"]
    try:
        await poll(lambda: len(entered) == 2, "both blocks entered")
        keeper = client._sessions
        await poll(lambda: keeper is not None and keeper.unsupported, "Session found missing")
        await poll(lambda: len(fake.streams) == 2, "a heartbeat for each lease")
        third = asyncio.create_task(_holding(client, "c", TTL_S, entered, stop))
        await poll(lambda: len(fake.streams) == 3, "the third lease on a heartbeat at once")
        assert all(not lease.lost for lease in entered)
    finally:
        stop.set()
        done = await asyncio.gather(*blocks, third, return_exceptions=True)
        await client.close()
    assert not [d for d in done if isinstance(d, BaseException)], done
