"""ValidateFences, the streamed ValidateFence, against a real server and PostgreSQL.

At the wire (raw stubs): each check's answer is the unary ValidateFence's for the same
request, in every state of a task; bad input and a namespace the token does not cover
answer that check only, and the stream goes on; a message that does not parse ends it,
naming the field; a revoked token and the server's shutdown end it. Through the client
(``LeaseClient.validate_fence``, which uses one such stream): a revoke or a supersede is
seen by every check sent after it; a broken stream fails the checks in flight
UNAVAILABLE and the next check opens a new stream; a server without ValidateFences is
asked with the unary call; FenceInterceptor's checks ride the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from leasekeeper import (
    AccessDenied,
    FenceCheck,
    FenceChecker,
    FenceInterceptor,
    InvalidArgument,
    LeaseClient,
    LeaseError,
    LeaseUnavailable,
)
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.app import LeaseServer
from leasekeeper_server.rpc.validate_stream import MAX_CHECKS_PER_MESSAGE, MAX_DECIDING
from leasekeeper_server.security import tokens
from tests.conftest import RunningServer, make_settings, running_server
from tests.fault.proxy import TcpProxy, tcp_proxy
from tests.helpers import STEP_S, claim_held, dur, error_info, poll, tag, varint
from tests.integration.contract_helpers import claim, failure

pytestmark = pytest.mark.timeout(120)

Check = pb.ValidateFencesRequest.Check
Answer = pb.ValidateFencesResponse.Answer


def check(check_id: int, namespace: str, task_id: str, fence: int) -> Any:
    request = pb.ValidateFenceRequest(namespace=namespace, task_id=task_id, fence=fence)
    return Check(id=check_id, request=request)


class Stream:
    """A raw ValidateFences call: writes messages of checks, collects the answers by id."""

    def __init__(self, stub: rpc.LeaseServiceStub, metadata: Any = None) -> None:
        self.call = stub.ValidateFences(metadata=metadata)
        self.answers: dict[int, Any] = {}
        self.messages = 0
        self.largest = 0  # the most answers one message carried

    async def ask(self, *checks: Any) -> dict[int, Any]:
        """Sends the checks in one message; returns their answers (read until all came)."""
        await self.call.write(pb.ValidateFencesRequest(checks=list(checks)))
        wanted = {c.id for c in checks}
        while not wanted <= self.answers.keys():
            await self.read()
        return {i: self.answers[i] for i in wanted}

    async def read(self) -> None:
        """Reads one message of answers into ``answers``."""
        message = await asyncio.wait_for(self.call.read(), STEP_S)
        assert message is not grpc.aio.EOF, "the stream ended before every check was answered"
        self.messages += 1
        self.largest = max(self.largest, len(message.answers))
        for answer in message.answers:
            assert answer.id not in self.answers, f"check {answer.id} answered twice"
            self.answers[answer.id] = answer

    async def one(self, *args: Any) -> Any:
        (answer,) = (await self.ask(check(*args))).values()
        return answer

    async def end(self) -> grpc.aio.AioRpcError:
        """Reads until the server ends the stream with an error; returns it."""
        while True:
            try:
                message = await asyncio.wait_for(self.call.read(), STEP_S)
            except grpc.aio.AioRpcError as exc:
                return exc
            assert message is not grpc.aio.EOF, "the stream ended OK"


def refusal(answer: Any) -> tuple[grpc.StatusCode, str, list[str], str]:
    """(code, ErrorInfo reason, BadRequest fields, message) of an answer that is an error."""
    assert answer.WhichOneof("result") == "error", answer
    st = status_pb2.Status.FromString(answer.error)
    code = next(c for c in grpc.StatusCode if c.value[0] == st.code)
    reasons, fields = [], []
    for detail in st.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            assert info.domain == "leasekeeper"
            reasons.append(info.reason)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    assert len(reasons) == 1, st
    return code, reasons[0], fields, st.message


def same_answer(unary: pb.ValidateFenceResponse, streamed: Any) -> None:
    assert streamed.WhichOneof("result") == "response", streamed
    got = streamed.response
    assert (got.valid, got.current_fence, got.reason) == (
        unary.valid,
        unary.current_fence,
        unary.reason,
    )
    assert got.HasField("expire_time") == unary.HasField("expire_time")
    assert got.expire_time == unary.expire_time  # no renewal in between: the same instant


@pytest.fixture
async def stream(stub: rpc.LeaseServiceStub) -> AsyncIterator[Stream]:
    opened = Stream(stub)
    yield opened
    opened.call.cancel()


# --- the answers are ValidateFence's ------------------------------------------------------


async def tasks_in_every_state(stub: rpc.LeaseServiceStub, ns: str) -> dict[str, tuple[str, int]]:
    """A task and the fence to check, per case: valid, stale, expired, unknown, ended."""
    held = await claim_held(stub, ns, "held", "a")
    cases = {"valid": ("held", held), "unknown fence": ("held", held + 10), "never": ("never", 1)}
    first = await claim_held(stub, ns, "sup", "a")
    restart = pb.ClaimRequest(namespace=ns, task_id="sup", owner_id="a", request_id="r2")
    assert (await stub.Claim(restart)).lease.fence == first + 1  # a new incarnation
    cases["superseded"] = ("sup", first)
    cases["expired"] = ("exp", (await claim(stub, ns, "exp", "a", ttl_s=0.1)).lease.fence)
    ends = {
        "cancelled": lambda f: stub.Cancel(
            pb.CancelRequest(namespace=ns, task_id="cancelled", reason="x")
        ),
        "released": lambda f: stub.Release(
            pb.ReleaseRequest(namespace=ns, task_id="released", owner_id="a", fence=f)
        ),
        "completed": lambda f: stub.Release(
            pb.ReleaseRequest(
                namespace=ns, task_id="completed", owner_id="a", fence=f, complete=True
            )
        ),
        "revoked": lambda f: stub.Revoke(
            pb.RevokeRequest(namespace=ns, task_id="revoked", reason="x")
        ),
    }
    for task_id, end in ends.items():
        fence = await claim_held(stub, ns, task_id, "a")
        await end(fence)
        cases[task_id] = (task_id, fence)

    async def expired() -> bool:
        lease = (await stub.GetLease(pb.GetLeaseRequest(namespace=ns, task_id="exp"))).lease
        return lease.state == pb.TASK_STATE_EXPIRED

    await poll(expired, "the short lease expired (database clock)")
    return cases


async def test_every_answer_is_the_unary_answer_in_every_state(stub, stream, namespace, db):
    cases = await tasks_in_every_state(stub, namespace)
    names = list(cases)
    # All in one message (they share a statement), then one message per check.
    together = await stream.ask(*(check(i, namespace, *cases[n]) for i, n in enumerate(names)))
    alone = [await stream.one(100 + i, namespace, *cases[n]) for i, n in enumerate(names)]
    for i, name in enumerate(names):
        task_id, fence = cases[name]
        unary = await stub.ValidateFence(
            pb.ValidateFenceRequest(namespace=namespace, task_id=task_id, fence=fence)
        )
        same_answer(unary, together[i])
        same_answer(unary, alone[i])
    reasons = {n: pb.LossReason.Name(together[i].response.reason) for i, n in enumerate(names)}
    assert reasons == {
        "valid": "LOSS_REASON_UNSPECIFIED",
        "unknown fence": "LOSS_REASON_FENCE_UNKNOWN",
        "never": "LOSS_REASON_FENCE_UNKNOWN",
        "superseded": "LOSS_REASON_LEASE_SUPERSEDED",
        "expired": "LOSS_REASON_LEASE_EXPIRED",
        "cancelled": "LOSS_REASON_TASK_CANCELLED",
        "released": "LOSS_REASON_LEASE_RELEASED",
        "completed": "LOSS_REASON_TASK_COMPLETED",
        "revoked": "LOSS_REASON_LEASE_REVOKED",
    }
    assert together[0].response.valid and together[0].response.remaining_ttl.seconds > 0
    # The same decision: the stale fence refused by both paths is one history entry.
    refused = await db.fetch(
        "SELECT fence, reason, method FROM leasekeeper_task_history"
        " WHERE namespace = $1 AND task_id = 'sup' AND kind = 'fence_refused'",
        namespace,
    )
    assert [tuple(r) for r in refused] == [
        (cases["superseded"][1], "LEASE_SUPERSEDED", "ValidateFence")
    ]


async def test_answers_carry_their_ids_whatever_the_order(stub, stream, namespace):
    fence = await claim_held(stub, namespace, "t")
    ids = [2**64 - 1, 0, 7, 3]  # any uint64, in any order
    fences = [fence, fence + 1, fence, fence + 2]
    answers = await stream.ask(
        *(check(i, namespace, "t", f) for i, f in zip(ids, fences, strict=True))
    )
    assert {i: a.response.valid for i, a in answers.items()} == {
        2**64 - 1: True,
        0: False,
        7: True,
        3: False,
    }


async def test_more_checks_than_a_stream_decides_at_once_are_each_answered_once(
    stub, stream, namespace
):
    fence = await claim_held(stub, namespace, "t")
    for first in range(0, 6000, 1000):  # six messages at once: past the 4000 decided at a time
        checks = [check(i, namespace, "t", fence + i % 2) for i in range(first, first + 1000)]
        await stream.call.write(pb.ValidateFencesRequest(checks=checks))
    await stream.ask(check(6000, namespace, "t", fence))  # this one may come before others
    while len(stream.answers) < 6001:
        message = await asyncio.wait_for(stream.call.read(), STEP_S)
        for answer in message.answers:
            assert answer.id not in stream.answers, f"check {answer.id} answered twice"
            stream.answers[answer.id] = answer
    assert sorted(stream.answers) == list(range(6001))
    assert all(a.response.valid == (i % 2 == 0) for i, a in stream.answers.items())


# --- freshness ----------------------------------------------------------------------------


@pytest.mark.parametrize("change", ["revoke", "supersede"])
async def test_a_change_just_before_a_check_is_seen_by_it(worker, stub, namespace, change):
    gateway = worker()  # validate_fence on the client's one ValidateFences stream
    fence = await claim_held(stub, namespace, "t", "a")
    assert (await gateway.validate_fence("t", fence)).valid
    changed = False
    answered: list[FenceCheck] = []
    after: list[FenceCheck] = []
    stop = False

    async def keep_checking() -> None:
        while not stop:
            sent_after_change = changed
            answer = await gateway.validate_fence("t", fence)
            (after if sent_after_change else answered).append(answer)

    checkers = [asyncio.create_task(keep_checking()) for _ in range(8)]
    try:
        await poll(lambda: len(answered) >= 20, "checks answered before the change")
        if change == "revoke":
            await stub.Revoke(pb.RevokeRequest(namespace=namespace, task_id="t", reason="test"))
        else:
            restart = pb.ClaimRequest(
                namespace=namespace, task_id="t", owner_id="a", request_id="2"
            )
            assert (await stub.Claim(restart)).lease.fence == fence + 1
        changed = True
        await poll(lambda: len(after) >= 50, "checks sent after the change answered")
    finally:
        stop = True
        await asyncio.gather(*checkers)
    reason = "LEASE_REVOKED" if change == "revoke" else "LEASE_SUPERSEDED"
    assert {(a.valid, a.reason) for a in after} == {(False, reason)}
    assert any(a.valid for a in answered)


# --- bad input ----------------------------------------------------------------------------


async def test_bad_input_answers_that_check_and_the_stream_goes_on(stub, stream, namespace, db):
    fence = await claim_held(stub, namespace, "t")
    before = await db.fetchval("SELECT count(*) FROM leasekeeper_task_history")
    answers = await stream.ask(
        check(1, "", "t", fence),
        check(2, namespace, "bad\x00id", fence),
        check(3, namespace, "t", 0),
        check(4, namespace, "t", fence),
        check(5, namespace, " ", fence),
    )
    for check_id, field in ((1, "namespace"), (2, "task_id"), (3, "fence"), (5, "task_id")):
        code, reason, fields, message = refusal(answers[check_id])
        assert (code, reason, fields) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            [field],
        )
        assert message.startswith(f"{field}:"), message
    assert answers[4].response.valid
    assert (await stream.one(6, namespace, "t", fence)).response.valid  # still open
    assert await db.fetchval("SELECT count(*) FROM leasekeeper_task_history") == before


async def test_a_message_of_more_than_1000_checks_answers_each_invalid(stub, stream, namespace):
    fence = await claim_held(stub, namespace, "t")
    answers = await stream.ask(*(check(i, namespace, "t", fence) for i in range(1001)))
    assert len(answers) == 1001
    for answer in answers.values():
        code, _, fields, _ = refusal(answer)
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["checks"])
    assert (await stream.one(5000, namespace, "t", fence)).response.valid


async def test_a_message_of_many_thousand_checks_is_answered_in_messages_a_client_can_read(
    stub, stream, namespace
):
    # 20,000 refusals of about 260 bytes: in one message, past a client's 4 MiB limit.
    fence = await claim_held(stub, namespace, "t")
    answers = await stream.ask(*(check(i, namespace, "t", fence) for i in range(20_000)))
    assert len(answers) == 20_000
    assert all(refusal(answer)[2] == ["checks"] for answer in answers.values())
    assert stream.largest <= MAX_CHECKS_PER_MESSAGE
    assert (await stream.one(50_000, namespace, "t", fence)).response.valid


async def test_a_client_that_stops_reading_holds_the_server_back_and_loses_no_answer(
    server, stream, namespace
):
    validations = server.server.validations
    bad = pb.ValidateFenceRequest(namespace=namespace, task_id="", fence=1)  # ~260-byte answers
    total = 100 * MAX_CHECKS_PER_MESSAGE  # about 26 MB of answers: more than gRPC buffers

    async def send_all() -> None:
        for first in range(0, total, MAX_CHECKS_PER_MESSAGE):
            ids = range(first, first + MAX_CHECKS_PER_MESSAGE)
            await stream.call.write(
                pb.ValidateFencesRequest(checks=[Check(id=i, request=bad) for i in ids])
            )
        await stream.call.done_writing()

    sending = asyncio.create_task(send_all())
    try:
        # The client reads nothing: the server's writes stall, and it stops reading checks
        # instead of keeping their answers in memory.
        await poll(lambda: validations.held_back == 1, "the server stopped reading the stream")
        assert validations.unwritten <= MAX_DECIDING
        while len(stream.answers) < total:
            await stream.read()
        await asyncio.wait_for(sending, STEP_S)
    finally:
        sending.cancel()
    assert sorted(stream.answers) == list(range(total))
    assert stream.largest <= MAX_CHECKS_PER_MESSAGE
    assert await asyncio.wait_for(stream.call.read(), STEP_S) is grpc.aio.EOF
    assert await stream.call.code() is grpc.StatusCode.OK
    assert validations.unwritten == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (tag(1, 0) + varint(5), "checks"),  # checks sent as a varint
        # checks[0].request.fence sent length-delimited
        (
            tag(1, 2) + varint(6) + tag(2, 2) + varint(4) + tag(3, 2) + varint(2) + b"ab",
            "checks.request.fence",
        ),
    ],
)
async def test_a_message_that_does_not_parse_ends_the_stream_naming_the_field(channel, body, field):
    call = channel.stream_stream(
        "/leasekeeper.v1.LeaseService/ValidateFences",
        request_serializer=None,
        response_deserializer=None,
    )()
    await call.write(body)
    error = await failure(call.read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(error)
    assert (info.reason, info.metadata["field"]) == ("INVALID_ARGUMENT", field)


async def test_client_bad_input_raises_invalid_argument_naming_the_field(worker, stub, namespace):
    client = worker()
    fence = await claim_held(stub, namespace, "t")
    with pytest.raises(InvalidArgument) as caught:
        await client.validate_fence("", fence)
    assert caught.value.field == "task_id"
    assert (await client.validate_fence("t", fence)).valid  # the same stream goes on


# --- tokens -------------------------------------------------------------------------------


@pytest.fixture
async def secured(database_url: str) -> AsyncIterator[RunningServer]:
    async with running_server(database_url, auth="on") as running:
        yield running


@pytest.fixture
async def secured_stub(secured: RunningServer) -> AsyncIterator[rpc.LeaseServiceStub]:
    async with grpc.aio.insecure_channel(secured.target) as ch:
        yield rpc.LeaseServiceStub(ch)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def token(db: asyncpg.Connection, role: str, *namespaces: str) -> tuple[str, str]:
    record, text = await tokens.create_token(db, f"{role}-validate-stream", role, namespaces)
    return record.token_id, text


async def test_each_check_is_refused_a_namespace_its_token_does_not_cover(
    secured, secured_stub, db, namespace
):
    other = f"{namespace}-other"
    _, admin = await token(db, "admin", "*")
    fences = {}
    for ns in (namespace, other):
        reply = await secured_stub.Claim(
            pb.ClaimRequest(namespace=ns, task_id="t", owner_id="a", ttl=dur(30)),
            metadata=bearer(admin),
        )
        fences[ns] = reply.lease.fence
    _, effect = await token(db, "effect", namespace)
    stream = Stream(secured_stub, bearer(effect))
    try:
        answers = await stream.ask(
            check(1, namespace, "t", fences[namespace]), check(2, other, "t", fences[other])
        )
        assert answers[1].response.valid
        code, reason, _, message = refusal(answers[2])
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
        assert other in message
        assert (await stream.one(3, namespace, "t", fences[namespace])).response.valid
    finally:
        stream.call.cancel()
    # The client raises the check's refusal and goes on.
    async with LeaseClient(secured.target, namespace=namespace, token=effect) as c:
        with pytest.raises(AccessDenied):
            await c.validate_fence("t", fences[other], namespace=other)
        assert (await c.validate_fence("t", fences[namespace])).valid


@pytest.mark.parametrize(
    ("role", "code"),
    [("worker", grpc.StatusCode.PERMISSION_DENIED), (None, grpc.StatusCode.UNAUTHENTICATED)],
)
async def test_the_stream_is_refused_without_an_effect_token(
    secured_stub, db, namespace, role, code
):
    metadata = bearer((await token(db, role, namespace))[1]) if role else None
    stream = Stream(secured_stub, metadata)
    with contextlib.suppress(grpc.aio.AioRpcError):  # refused before the write, perhaps
        await stream.call.write(pb.ValidateFencesRequest(checks=[check(1, namespace, "t", 1)]))
    error = await stream.end()
    assert (error.code(), error_info(error).reason) == (code, code.name)


async def test_a_token_revoked_while_the_stream_runs_ends_it(secured_stub, db, namespace):
    _, admin = await token(db, "admin", "*")
    reply = await secured_stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(30)),
        metadata=bearer(admin),
    )
    token_id, effect = await token(db, "effect", namespace)
    stream = Stream(secured_stub, bearer(effect))
    assert (await stream.one(1, namespace, "t", reply.lease.fence)).response.valid
    assert await tokens.revoke_token(db, token_id)
    error = await stream.end()
    assert (error.code(), error_info(error).reason) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "UNAUTHENTICATED",
    )


# --- the stream's end: shutdown, a broken connection, an older server ---------------------


async def test_shutdown_ends_the_stream_unavailable(database_url, namespace):
    server = LeaseServer(make_settings(database_url), database_url)
    port = await server.start()
    stopping = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rpc.LeaseServiceStub(ch)
            fence = await claim_held(stub, namespace, "t")
            stream = Stream(stub)
            assert (await stream.one(1, namespace, "t", fence)).response.valid
            stopping = asyncio.create_task(server.stop(1.0))
            error = await stream.end()
    finally:
        await (stopping if stopping is not None else server.stop(0))
    assert (error.code(), error_info(error).reason) == (
        grpc.StatusCode.UNAVAILABLE,
        "SHUTTING_DOWN",
    )


@pytest.fixture
async def proxy(server: RunningServer) -> AsyncIterator[TcpProxy]:
    async with tcp_proxy("127.0.0.1", server.port) as running:
        yield running


async def test_a_broken_stream_fails_checks_in_flight_unavailable_then_reopens(
    proxy, stub, namespace
):
    fence = await claim_held(stub, namespace, "t")
    async with LeaseClient(f"127.0.0.1:{proxy.port}", namespace=namespace) as gateway:
        assert (await gateway.validate_fence("t", fence)).valid  # the stream is open
        proxy.black_hole("downstream")  # the answers are lost on the way back
        in_flight = asyncio.create_task(gateway.validate_fence("t", fence))
        await poll(lambda: proxy.stats["chunks_dropped"] > 0, "the answer swallowed")
        assert not in_flight.done()
        proxy.reset()  # the connection breaks with the check unanswered
        with pytest.raises(LeaseUnavailable) as caught:
            await in_flight
        assert caught.value.retryable
        assert "not validated" in str(caught.value)
        proxy.restore()

        async def answered() -> FenceCheck | None:
            try:
                return await gateway.validate_fence("t", fence)
            except LeaseUnavailable:  # the channel is still reconnecting
                return None

        again = await poll(answered, "a check answered on a new stream")
        assert again.valid


async def test_a_check_unanswered_within_the_call_timeout_raises_deadline_exceeded(
    proxy, stub, namespace
):
    fence = await claim_held(stub, namespace, "t")
    target = f"127.0.0.1:{proxy.port}"
    async with LeaseClient(target, namespace=namespace, call_timeout=0.5) as gateway:

        async def answered() -> bool:  # the stream open (a loaded machine may take 0.5 s)
            try:
                return (await gateway.validate_fence("t", fence)).valid
            except LeaseError:
                return False

        await poll(answered, "a check answered within the call timeout")
        proxy.black_hole("downstream")  # no answer can ever come back
        with pytest.raises(LeaseError) as caught:
            await gateway.validate_fence("t", fence)
        assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


class _OlderServer(rpc.LeaseServiceServicer):
    """A server of a version without ValidateFences (UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.calls: list[pb.ValidateFenceRequest] = []

    async def ValidateFence(self, request: pb.ValidateFenceRequest, context: Any) -> Any:
        self.calls.append(request)
        return pb.ValidateFenceResponse(valid=True, current_fence=request.fence)


async def test_a_server_without_the_stream_is_asked_with_the_unary_call() -> None:
    older = _OlderServer()
    server = grpc.aio.server()
    rpc.add_LeaseServiceServicer_to_server(older, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with LeaseClient(f"127.0.0.1:{port}", namespace="ns") as client:
            for fence in (3, 4):
                answer = await client.validate_fence("t", fence)
                assert (answer.valid, answer.current_fence) == (True, fence)
    finally:
        await server.stop(0)
    assert [r.fence for r in older.calls] == [3, 4]


# --- the effect side: FenceInterceptor rides the stream ---------------------------------------

SEND = "/demo.v1.Gateway/Send"


async def test_fence_interceptor_checks_on_the_stream(server, stub, namespace):
    fence = await claim_held(stub, namespace, "t", "a")
    restart = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", request_id="2")
    current = (await stub.Claim(restart)).lease.fence
    registry = server.server.metrics.registry
    sent: list[bytes] = []

    async def send(request: bytes, context: Any) -> bytes:
        sent.append(request)
        return b"sent"

    async with LeaseClient(server.target, namespace=namespace) as leases:
        gateway = grpc.aio.server(interceptors=[FenceInterceptor(FenceChecker(leases))])
        handlers = {"Send": grpc.unary_unary_rpc_method_handler(send)}
        gateway.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("demo.v1.Gateway", handlers),)
        )
        port = gateway.add_insecure_port("127.0.0.1:0")
        await gateway.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_unary(SEND)
                metadata: Sequence[tuple[str, str]] = (
                    ("leasekeeper-namespace", namespace),
                    ("leasekeeper-task-id", "t"),
                )
                assert await call(b"new", metadata=(*metadata, ("leasekeeper-fence", str(current))))
                error = await failure(
                    call(b"old", metadata=(*metadata, ("leasekeeper-fence", str(fence))))
                )
                assert (error.code(), error_info(error).reason) == (
                    grpc.StatusCode.ABORTED,
                    "LEASE_SUPERSEDED",
                )
        finally:
            await gateway.stop(0)
    assert sent == [b"new"]
    unary = registry.get_sample_value(
        "leasekeeper_rpc_duration_seconds_count", {"method": "ValidateFence", "code": "OK"}
    )
    assert unary == 0  # both checks went on the stream

    def stale_counted() -> bool:
        labels = {"method": "ValidateFence", "reason": "LEASE_SUPERSEDED"}
        return registry.get_sample_value("leasekeeper_stale_fence_rejections_total", labels) == 1

    await poll(stale_counted, "the stale fence counted as ValidateFence's")

    def stream_ended() -> bool:
        labels = {"method": "ValidateFences", "code": "CANCELLED"}
        return (registry.get_sample_value("leasekeeper_streams_total", labels) or 0) >= 1

    await poll(stream_ended, "the client's closed stream counted")
