"""The effect side: fence metadata, FenceChecker and FenceInterceptor (in-process server)."""

import asyncio
from datetime import timedelta

import grpc
import pytest
from grpc_status import rpc_status

from leasekeeper import (
    METADATA_FENCE,
    METADATA_NAMESPACE,
    METADATA_TASK_ID,
    FenceCheck,
    FenceChecker,
    FenceInterceptor,
    FenceRef,
    LeaseUnavailable,
    MissingFence,
    StaleFence,
    fence_from_metadata,
)
from leasekeeper.errors import error_details


def test_metadata_round_trip_through_fence_ref():
    ref = FenceRef("billing", "invoice-42", 17)
    assert ref.metadata() == (
        ("leasekeeper-namespace", "billing"),
        ("leasekeeper-task-id", "invoice-42"),
        ("leasekeeper-fence", "17"),
    )
    assert fence_from_metadata(ref.metadata()) == ref
    assert fence_from_metadata(dict(ref.metadata())) == ref


def test_fence_from_metadata_ignores_other_keys_and_accepts_bytes():
    metadata = (
        ("user-agent", "x"),
        (METADATA_NAMESPACE, b"ns"),
        (METADATA_TASK_ID, "t"),
        (METADATA_FENCE, "3"),
    )
    assert fence_from_metadata(metadata) == FenceRef("ns", "t", 3)


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ((), METADATA_NAMESPACE),
        (None, METADATA_NAMESPACE),
        (((METADATA_NAMESPACE, "ns"), (METADATA_FENCE, "3")), METADATA_TASK_ID),
        (((METADATA_NAMESPACE, "ns"), (METADATA_TASK_ID, "t")), METADATA_FENCE),
        (
            ((METADATA_NAMESPACE, ""), (METADATA_TASK_ID, "t"), (METADATA_FENCE, "1")),
            METADATA_NAMESPACE,
        ),
        (
            ((METADATA_NAMESPACE, "ns"), (METADATA_TASK_ID, "t"), (METADATA_FENCE, "x")),
            METADATA_FENCE,
        ),
        (
            ((METADATA_NAMESPACE, "ns"), (METADATA_TASK_ID, "t"), (METADATA_FENCE, "0")),
            METADATA_FENCE,
        ),
        (
            ((METADATA_NAMESPACE, "ns"), (METADATA_TASK_ID, "t"), (METADATA_FENCE, "-2")),
            METADATA_FENCE,
        ),
        (
            ((METADATA_NAMESPACE, "ns"), (METADATA_TASK_ID, "t"), (METADATA_FENCE, "1.5")),
            METADATA_FENCE,
        ),
        (
            (
                (METADATA_NAMESPACE, "ns"),
                (METADATA_TASK_ID, "t"),
                (METADATA_FENCE, "1"),
                (METADATA_FENCE, "2"),
            ),
            METADATA_FENCE,
        ),
    ],
)
def test_fence_from_metadata_missing_or_malformed_raises_missing_fence(metadata, key):
    with pytest.raises(MissingFence) as caught:
        fence_from_metadata(metadata)
    assert caught.value.key == key
    assert key in str(caught.value)
    assert isinstance(caught.value, ValueError)


class FakeValidator:
    """Stands in for LeaseClient.validate_fence: the current fence is `current`."""

    def __init__(self, current: int = 5, reason: str = "LEASE_SUPERSEDED") -> None:
        self.current = current
        self.reason = reason
        self.calls: list[tuple[str, int, str | None]] = []
        self.error: Exception | None = None

    async def validate_fence(self, task_id, fence, namespace=None):
        self.calls.append((task_id, fence, namespace))
        if self.error is not None:
            raise self.error
        if fence == self.current:
            return FenceCheck(True, self.current, None, 12.5)
        return FenceCheck(False, self.current, self.reason, None)


async def test_checker_check_current_fence_returns_valid_answer():
    fake = FakeValidator(current=5)
    answer = await FenceChecker(fake).check("ns", "t", 5)
    assert answer.valid and answer.remaining_ttl == 12.5
    assert fake.calls == [("t", 5, "ns")]


async def test_checker_check_old_fence_raises_stale_fence():
    with pytest.raises(StaleFence) as caught:
        await FenceChecker(FakeValidator(current=5)).check("ns", "t", 4)
    assert (caught.value.reason, caught.value.current_fence) == ("LEASE_SUPERSEDED", 5)
    assert caught.value.metadata["current_fence"] == "5"


async def test_checker_check_metadata_reads_fence_ref():
    fake = FakeValidator(current=2)
    await FenceChecker(fake).check_metadata(FenceRef("ns", "t", 2).metadata())
    assert fake.calls == [("t", 2, "ns")]


# --- FenceInterceptor on a real in-process grpc.aio server --------------------------------

SEND = "/demo.Gateway/Send"
STATUS = "/demo.Gateway/Status"
WATCH = "/demo.Gateway/Watch"


class DemoGateway(grpc.GenericRpcHandler):
    def __init__(self) -> None:
        self.effects: list[bytes] = []

    def service(self, handler_call_details):
        async def send(request: bytes, context) -> bytes:
            self.effects.append(request)
            return b"sent:" + request

        async def watch(request: bytes, context):
            self.effects.append(request)
            yield b"w1"

        if handler_call_details.method in (SEND, STATUS):
            return grpc.unary_unary_rpc_method_handler(send)
        if handler_call_details.method == WATCH:
            return grpc.unary_stream_rpc_method_handler(watch)
        return None


@pytest.fixture
async def gateway():
    validator = FakeValidator(current=5)
    demo = DemoGateway()
    interceptor = FenceInterceptor(FenceChecker(validator), methods={SEND, WATCH})
    server = grpc.aio.server(interceptors=[interceptor])
    server.add_generic_rpc_handlers((demo,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield validator, demo, channel
    finally:
        await channel.close()
        await server.stop(None)


def _reason(error: grpc.aio.AioRpcError) -> tuple[str | None, dict[str, str]]:
    reason, metadata, _ = error_details(rpc_status.from_call(error))
    return reason, metadata


async def test_interceptor_current_fence_runs_handler(gateway):
    _, demo, channel = gateway
    reply = await channel.unary_unary(SEND)(b"x", metadata=FenceRef("ns", "t", 5).metadata())
    assert reply == b"sent:x"
    assert demo.effects == [b"x"]


async def test_interceptor_stale_fence_aborts_before_handler(gateway):
    _, demo, channel = gateway
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(SEND)(b"x", metadata=FenceRef("ns", "t", 4).metadata())
    assert caught.value.code() is grpc.StatusCode.ABORTED
    assert _reason(caught.value) == (
        "LEASE_SUPERSEDED",
        {"current_fence": "5", "fence": "4", "namespace": "ns", "task_id": "t"},
    )
    assert demo.effects == []


async def test_interceptor_missing_fence_aborts_with_fence_missing(gateway):
    _, demo, channel = gateway
    metadata = ((METADATA_NAMESPACE, "ns"), (METADATA_TASK_ID, "t"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(SEND)(b"x", metadata=metadata)
    assert caught.value.code() is grpc.StatusCode.ABORTED
    assert _reason(caught.value) == ("FENCE_MISSING", {"key": METADATA_FENCE})
    assert demo.effects == []


async def test_interceptor_stale_fence_on_stream_method_aborts(gateway):
    _, demo, channel = gateway
    call = channel.unary_stream(WATCH)(b"x", metadata=FenceRef("ns", "t", 1).metadata())
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() is grpc.StatusCode.ABORTED
    assert demo.effects == []


async def test_interceptor_unprotected_method_needs_no_fence(gateway):
    validator, _demo, channel = gateway
    assert await channel.unary_unary(STATUS)(b"y") == b"sent:y"
    assert validator.calls == []


async def test_interceptor_lease_service_down_fails_closed_with_unavailable(gateway):
    validator, demo, channel = gateway
    validator.error = LeaseUnavailable("db down", code=grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(SEND)(b"x", metadata=FenceRef("ns", "t", 5).metadata())
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    assert _reason(caught.value)[0] == "FENCE_CHECK_FAILED"
    assert demo.effects == []


async def test_interceptor_rejection_decodes_to_client_errors(gateway):
    from leasekeeper.errors import LeaseLost, from_rpc_error

    _, _, channel = gateway
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(
            channel.unary_unary(SEND)(b"x", metadata=FenceRef("ns", "t", 3).metadata()),
            timedelta(seconds=5).total_seconds(),
        )
    error = from_rpc_error(caught.value)
    assert isinstance(error, LeaseLost)
    assert error.current_fence == 5
