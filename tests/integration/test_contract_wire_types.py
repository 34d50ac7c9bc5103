"""A declared field sent with the wrong wire type is bad input (guarantees.md: Bad input).

protobuf keeps such a field as an unknown field and leaves the declared one
unset: a Claim whose ttl (field 4) arrives as a varint would be granted with
the default ttl. The server refuses it with INVALID_ARGUMENT naming the field
(a dotted path inside a sub-message, e.g. ``ttl.seconds``) and changes
nothing. Field numbers the message does not declare stay accepted: a newer
client may send them.

Every request message of the service is covered, taken from the service's
descriptor, so a new RPC without a case here fails the coverage test.
Requests go over a real channel as raw bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
from google.protobuf import descriptor
from google.protobuf.message import Message

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import bad_request_fields, dur, error_info, tag, varint
from tests.integration.contract_helpers import failure, grant, row, snapshot

pytestmark = pytest.mark.timeout(30)

SERVICE = pb.DESCRIPTOR.services_by_name["LeaseService"]
VARINT, I64, LEN, I32 = 0, 1, 2, 5


def _field(number: int, wire_type: int) -> bytes:
    """One field with a small payload of ``wire_type``."""
    payload = {VARINT: b"\x05", I64: bytes(8), LEN: b"\x01x", I32: bytes(4)}[wire_type]
    return tag(number, wire_type) + payload


def _natural_wire_type(field: descriptor.FieldDescriptor) -> int:
    fd = descriptor.FieldDescriptor
    if field.type in (fd.TYPE_STRING, fd.TYPE_BYTES, fd.TYPE_MESSAGE):
        return LEN
    if field.type in (fd.TYPE_FIXED32, fd.TYPE_SFIXED32, fd.TYPE_FLOAT):
        return I32
    if field.type in (fd.TYPE_FIXED64, fd.TYPE_SFIXED64, fd.TYPE_DOUBLE):
        return I64
    return VARINT


def _wrong_wire_type(field: descriptor.FieldDescriptor) -> int:
    return VARINT if _natural_wire_type(field) == LEN else LEN


def _mistyped_copies(message: descriptor.Descriptor) -> Iterator[tuple[str, bytes]]:
    """(dotted path, bytes) for a wrong-wire-type copy of every declared field, nested too.

    A nested field travels inside its parent field, which protobuf merges with
    the parent already in the request.
    """
    for field in message.fields:
        yield field.name, _field(field.number, _wrong_wire_type(field))
        if field.message_type is not None:
            for path, inner in _mistyped_copies(field.message_type):
                parent = tag(field.number, LEN) + varint(len(inner)) + inner
                yield f"{field.name}.{path}", parent


def _checkpoint(version: int) -> pb.Checkpoint:
    """A checkpoint with every field set: fence and write_time too (the server ignores them)."""
    checkpoint = pb.Checkpoint(
        version=version, data=b"{}", content_type="application/json", fence=1
    )
    checkpoint.write_time.seconds = 1_700_000_000
    return checkpoint


# A request each RPC would carry out on a namespace holding task "t" leased by
# "a" with fence 1 and an effect "k" begun by it (Retry excepted: "t" is not
# quarantined, so it would be refused, after parsing). Duration and Checkpoint
# fields are set, so the nested fields are mistyped inside a message the
# request really carries (a Checkpoint's write_time, a Timestamp, as well).
REQUESTS: dict[str, Callable[[str], Message]] = {
    "Claim": lambda ns: pb.ClaimRequest(
        namespace=ns,
        task_id="new",
        owner_id="b",
        ttl=dur(5),
        max_runtime=dur(60),
        request_id="r",
        wait=dur(1),
        max_attempts=3,
    ),
    "Renew": lambda ns: pb.RenewRequest(
        namespace=ns, task_id="t", owner_id="a", fence=1, ttl=dur(7)
    ),
    "Release": lambda ns: pb.ReleaseRequest(
        namespace=ns, task_id="t", owner_id="a", fence=1, fail=True, fail_reason="oom"
    ),
    "ValidateFence": lambda ns: pb.ValidateFenceRequest(namespace=ns, task_id="t", fence=1),
    "Heartbeat": lambda ns: pb.HeartbeatRequest(
        namespace=ns, task_id="t", owner_id="a", fence=1, ttl=dur(7), checkpoint=_checkpoint(1)
    ),
    "GetLease": lambda ns: pb.GetLeaseRequest(namespace=ns, task_id="t"),
    "ListLeases": lambda ns: pb.ListLeasesRequest(
        namespace=ns, state=pb.TASK_STATE_HELD, page_size=10, owner_id="a"
    ),
    "ListNamespaces": lambda ns: pb.ListNamespacesRequest(page_size=10),
    "GetNamespaceStats": lambda ns: pb.GetNamespaceStatsRequest(namespace=ns),
    "BeginEffect": lambda ns: pb.BeginEffectRequest(
        namespace=ns,
        task_id="t",
        fence=1,
        effect_key="k2",
        policy=pb.EFFECT_POLICY_ONCE,
        request_digest=b"d",
    ),
    "CompleteEffect": lambda ns: pb.CompleteEffectRequest(
        namespace=ns,
        task_id="t",
        fence=1,
        effect_key="k",
        outcome=pb.EFFECT_STATE_FAILED,
        retryable=True,
        result=b"r",
        external_operation_id="op-1",
        next_checkpoint=_checkpoint(2),
    ),
    "ListEffects": lambda ns: pb.ListEffectsRequest(
        namespace=ns, task_id="t", state=pb.EFFECT_STATE_RESERVED, page_size=10
    ),
    "Revoke": lambda ns: pb.RevokeRequest(namespace=ns, task_id="t", reason="why", fence=1),
    "SaveCheckpoint": lambda ns: pb.SaveCheckpointRequest(
        namespace=ns, task_id="t", owner_id="a", fence=1, checkpoint=_checkpoint(3)
    ),
    "Cancel": lambda ns: pb.CancelRequest(namespace=ns, task_id="t", reason="why"),
    "Retry": lambda ns: pb.RetryRequest(namespace=ns, task_id="t", reason="why"),
    "ListTaskHistory": lambda ns: pb.ListTaskHistoryRequest(
        namespace=ns, task_id="t", page_size=10
    ),
    "Watch": lambda ns: pb.WatchRequest(namespace=ns, task_id="t"),
    "Session": lambda ns: pb.SessionRequest(
        sequence=1,
        add=[
            pb.SessionRequest.Add(
                id=1, namespace=ns, task_id="t", owner_id="a", fence=1, ttl=dur(7)
            )
        ],
        drop=[9],
        beat=True,
    ),
    "ValidateFences": lambda ns: pb.ValidateFencesRequest(
        checks=[
            pb.ValidateFencesRequest.Check(
                id=1, request=pb.ValidateFenceRequest(namespace=ns, task_id="t", fence=1)
            )
        ]
    ),
}

UNARY = [m.name for m in SERVICE.methods if not m.client_streaming and not m.server_streaming]


def _path(method: str) -> str:
    return f"/{SERVICE.full_name}/{method}"


async def _leased(stub, namespace: str) -> None:
    await grant(stub, namespace, "t", "a")
    await stub.BeginEffect(
        pb.BeginEffectRequest(
            namespace=namespace, task_id="t", fence=1, effect_key="k", policy=pb.EFFECT_POLICY_ONCE
        )
    )


def _assert_names(error: grpc.aio.AioRpcError, path: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, error.details())
    info = error_info(error)
    assert (info.reason, info.metadata["field"]) == ("INVALID_ARGUMENT", path), error.details()
    assert bad_request_fields(error) == [path]


def test_every_rpc_has_a_request_here():
    assert sorted(REQUESTS) == sorted(m.name for m in SERVICE.methods)
    for method in SERVICE.methods:
        assert REQUESTS[method.name]("ns").DESCRIPTOR is method.input_type, method.name


@pytest.mark.parametrize("method", UNARY)
async def test_unary_field_with_wrong_wire_type_invalid_argument_names_it(
    stub, channel, namespace, db, method
):
    await _leased(stub, namespace)
    before = await snapshot(db)
    request = REQUESTS[method](namespace)
    call = channel.unary_unary(_path(method), request_serializer=None, response_deserializer=None)

    named = []
    for path, mistyped in _mistyped_copies(request.DESCRIPTOR):
        error = await failure(call(request.SerializeToString() + mistyped))
        _assert_names(error, path)
        named.append(path)

    assert await snapshot(db) == before
    assert named  # every request message declares fields


async def test_claim_ttl_sent_as_varint_invalid_argument_names_ttl(channel, namespace, db):
    request = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a")
    call = channel.unary_unary(_path("Claim"), request_serializer=None, response_deserializer=None)

    error = await failure(call(request.SerializeToString() + b"\x20\x05"))  # field 4, varint 5

    _assert_names(error, "ttl")
    assert "wire type" in error.details()
    assert (
        await db.fetchval("SELECT count(*) FROM leasekeeper_tasks WHERE namespace = $1", namespace)
        == 0
    )


async def test_undeclared_field_numbers_accepted_top_level_and_nested(channel, namespace):
    request = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(7))
    ttl_with_field_15 = b"\x22" + varint(2) + _field(15, VARINT)  # merged into ttl
    body = request.SerializeToString() + _field(999, VARINT) + _field(998, LEN) + ttl_with_field_15
    call = channel.unary_unary(_path("Claim"), request_serializer=None, response_deserializer=None)

    reply = pb.ClaimResponse.FromString(await call(body))

    assert reply.acquired
    assert 6.0 < reply.lease.remaining_ttl.ToTimedelta().total_seconds() <= 7.0


async def _stream_error(call) -> grpc.aio.AioRpcError:
    while True:
        try:
            reply = await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc
        assert reply is not grpc.aio.EOF, "the stream ended OK"


async def test_watch_field_with_wrong_wire_type_invalid_argument_names_it(channel, namespace):
    request = REQUESTS["Watch"](namespace)
    watch = channel.unary_stream(
        _path("Watch"), request_serializer=None, response_deserializer=None
    )

    for path, mistyped in _mistyped_copies(request.DESCRIPTOR):
        error = await _stream_error(watch(request.SerializeToString() + mistyped))
        _assert_names(error, path)


async def test_validate_fences_message_with_wrong_wire_type_invalid_argument_names_it(
    channel, namespace
):
    request = REQUESTS["ValidateFences"](namespace)
    open_stream = channel.stream_stream(
        _path("ValidateFences"), request_serializer=None, response_deserializer=None
    )

    named = []
    for path, mistyped in _mistyped_copies(request.DESCRIPTOR):
        call = open_stream()
        await call.write(request.SerializeToString() + mistyped)
        _assert_names(await _stream_error(call), path)  # the checks cannot be told apart
        named.append(path)
    assert "checks.request.fence" in named


async def test_session_message_with_wrong_wire_type_invalid_argument_names_it(
    stub, channel, namespace, db
):
    await _leased(stub, namespace)
    before = await row(db, namespace, "t")
    request = REQUESTS["Session"](namespace)
    open_stream = channel.stream_stream(
        _path("Session"), request_serializer=None, response_deserializer=None
    )

    named = []
    for path, mistyped in _mistyped_copies(request.DESCRIPTOR):
        if path == "drop":  # a repeated varint sent length-delimited is its packed form: valid
            continue
        call = open_stream()
        await call.write(request.SerializeToString() + mistyped)
        _assert_names(await _stream_error(call), path)  # the answers could not be matched
        named.append(path)
    assert {"sequence", "add.fence", "add.ttl.seconds", "beat"} <= set(named)
    assert await row(db, namespace, "t") == before  # no add of a mistyped message renewed


def _heartbeat(channel):
    return channel.stream_stream(
        _path("Heartbeat"), request_serializer=None, response_deserializer=None
    )()


@pytest.mark.parametrize("position", ["first", "later"])
async def test_heartbeat_message_with_wrong_wire_type_invalid_argument_names_it(
    stub, channel, namespace, db, position
):
    await _leased(stub, namespace)
    before = await row(db, namespace, "t")
    first = REQUESTS["Heartbeat"](namespace)
    later = pb.HeartbeatRequest(ttl=dur(9))  # a later message may leave the lease unnamed

    for path, mistyped in _mistyped_copies(first.DESCRIPTOR):
        call = _heartbeat(channel)
        if position == "later":
            await call.write(first.SerializeToString())
            assert pb.HeartbeatResponse.FromString(await call.read()).fence == 1
            before = await row(db, namespace, "t")
            await call.write(later.SerializeToString() + mistyped)
        else:
            await call.write(first.SerializeToString() + mistyped)
        _assert_names(await _stream_error(call), path)
        assert await row(db, namespace, "t") == before  # the mistyped beat renewed nothing
