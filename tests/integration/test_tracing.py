"""OpenTelemetry tracing: a span per call with the task's fields, SQL spans as its children.

A real server is given an SDK tracer provider whose spans go to an in-memory
exporter; real calls over a loopback channel produce them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.app import LeaseServer
from tests.conftest import make_settings
from tests.helpers import poll
from tests.integration.contract_helpers import grant, heartbeat_on
from tests.integration.effect_helpers import begin

SERVICE = "leasekeeper.v1.LeaseService"


@contextlib.asynccontextmanager
async def traced_server(
    database_url: str,
) -> AsyncIterator[tuple[rpc.LeaseServiceStub, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = LeaseServer(make_settings(database_url), database_url, tracer_provider=provider)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield rpc.LeaseServiceStub(channel), exporter
    finally:
        await server.stop(0.5)
        provider.shutdown()


async def rpc_span(
    exporter: InMemorySpanExporter, method: str, task_id: str
) -> tuple[ReadableSpan, Sequence[ReadableSpan]]:
    """The span of the call to ``method`` for ``task_id`` (at most 10 s), and all spans."""

    async def finished() -> tuple[ReadableSpan, Sequence[ReadableSpan]] | None:
        spans = exporter.get_finished_spans()
        for span in spans:
            attrs = span.attributes or {}
            if span.name == f"{SERVICE}/{method}" and attrs.get("leasekeeper.task_id") == task_id:
                return span, spans
        return None

    found: tuple[ReadableSpan, Sequence[ReadableSpan]] = await poll(
        finished, f"a {method} span for {task_id}", within_s=10
    )
    return found


def children(parent: ReadableSpan, spans: Sequence[ReadableSpan]) -> list[ReadableSpan]:
    return [
        s
        for s in spans
        if s.parent is not None
        and parent.context is not None
        and s.parent.span_id == parent.context.span_id
    ]


async def test_claim_span_has_task_attributes_and_sql_children(
    database_url: str, namespace: str
) -> None:
    async with traced_server(database_url) as (stub, exporter):
        lease = await grant(stub, namespace, "t", "owner-a")
        span, spans = await rpc_span(exporter, "Claim", "t")

    assert span.kind == SpanKind.SERVER
    attrs = span.attributes or {}
    assert attrs["rpc.system"] == "grpc"
    assert attrs["rpc.service"] == SERVICE
    assert attrs["rpc.method"] == "Claim"
    assert attrs["rpc.grpc.status_code"] == 0
    assert attrs["leasekeeper.namespace"] == namespace
    assert attrs["leasekeeper.task_id"] == "t"
    assert attrs["leasekeeper.owner_id"] == "owner-a"
    assert attrs["leasekeeper.fence"] == lease.fence
    assert attrs["leasekeeper.expire_time"] == lease.expire_time.ToJsonString()
    assert attrs["leasekeeper.acquired"] is True

    sql = children(span, spans)
    assert sql, "the Claim span has no SQL child spans"
    for child in sql:
        assert child.kind == SpanKind.CLIENT
        assert child.context is not None and span.context is not None
        assert child.context.trace_id == span.context.trace_id
        child_attrs = child.attributes or {}
        assert child_attrs.get("db.system") == "postgresql" or (
            child_attrs.get("db.system.name") == "postgresql"
        )
    statements = " ".join(str((c.attributes or {}).get("db.statement", "")) for c in sql)
    assert "leasekeeper_tasks" in statements


async def test_aborted_renew_span_carries_code_and_reason(
    database_url: str, namespace: str
) -> None:
    async with traced_server(database_url) as (stub, exporter):
        lease = await grant(stub, namespace, "t", "owner-a")
        await stub.Release(
            pb.ReleaseRequest(
                namespace=namespace, task_id="t", owner_id="owner-a", fence=lease.fence
            )
        )
        try:
            await stub.Renew(
                pb.RenewRequest(
                    namespace=namespace, task_id="t", owner_id="owner-a", fence=lease.fence
                )
            )
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.ABORTED
        else:
            raise AssertionError("a renewal after release was answered OK")
        span, _ = await rpc_span(exporter, "Renew", "t")

    attrs = span.attributes or {}
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.ABORTED.value[0]
    assert attrs["leasekeeper.reason"] == "LEASE_RELEASED"
    assert attrs["leasekeeper.fence"] == lease.fence
    assert attrs["leasekeeper.owner_id"] == "owner-a"
    assert span.status.is_unset  # a lost lease is the caller's outcome, not a server fault


async def test_heartbeat_span_names_the_lease_from_its_first_message(
    database_url: str, namespace: str
) -> None:
    async with traced_server(database_url) as (stub, exporter):
        lease = await grant(stub, namespace, "t", "owner-a")
        call, beat = await heartbeat_on(stub, lease)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        span, spans = await rpc_span(exporter, "Heartbeat", "t")

    attrs = span.attributes or {}
    assert attrs["leasekeeper.namespace"] == namespace
    assert attrs["leasekeeper.owner_id"] == "owner-a"
    assert attrs["leasekeeper.fence"] == lease.fence
    assert attrs["leasekeeper.expire_time"] == beat.expire_time.ToJsonString()
    assert attrs["rpc.grpc.status_code"] == 0
    assert children(span, spans), "the renewal's SQL is not under the Heartbeat span"


async def test_span_continues_the_callers_trace(database_url: str, namespace: str) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_id = "00f067aa0ba902b7"
    async with traced_server(database_url) as (stub, exporter):
        await stub.Claim(
            pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="owner-a"),
            metadata=(("traceparent", f"00-{trace_id}-{parent_id}-01"),),
        )
        span, _ = await rpc_span(exporter, "Claim", "t")
    assert span.context is not None and span.parent is not None
    assert f"{span.context.trace_id:032x}" == trace_id
    assert f"{span.parent.span_id:016x}" == parent_id


async def test_no_spans_without_a_tracer_provider(database_url: str, namespace: str) -> None:
    # A traced server in the same process patches asyncpg; an untraced one must
    # still make no spans, not even into another server's provider.
    async with traced_server(database_url) as (_, exporter):
        exporter.clear()
        untraced = LeaseServer(make_settings(database_url), database_url)
        port = await untraced.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await grant(rpc.LeaseServiceStub(channel), namespace, "t", "owner-a")
        finally:
            await untraced.stop(0.5)
        assert [s.name for s in exporter.get_finished_spans()] == []


async def test_run_spans_carry_checkpoint_effect_attempts_and_disposition(
    database_url: str, namespace: str
) -> None:
    async with traced_server(database_url) as (stub, exporter):
        claimed = await stub.Claim(
            pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="owner-a", max_attempts=3)
        )
        lease = claimed.lease
        names = {"namespace": namespace, "task_id": "t", "owner_id": "owner-a"}
        saved = await stub.SaveCheckpoint(
            pb.SaveCheckpointRequest(
                **names, fence=lease.fence, checkpoint=pb.Checkpoint(version=4, data=b"step 4")
            )
        )
        await begin(stub, namespace, lease.fence)
        await stub.CompleteEffect(
            pb.CompleteEffectRequest(
                namespace=namespace,
                task_id="t",
                fence=lease.fence,
                effect_key="send",
                outcome=pb.EFFECT_STATE_SUCCEEDED,
                external_operation_id="pay-42",
                next_checkpoint=pb.Checkpoint(version=5, data=b"step 5"),
            )
        )
        call = stub.Heartbeat()
        await call.write(
            pb.HeartbeatRequest(
                **names, fence=lease.fence, checkpoint=pb.Checkpoint(version=6, data=b"step 6")
            )
        )
        await call.read()
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        await stub.Release(
            pb.ReleaseRequest(**names, fence=lease.fence, fail=True, fail_reason="bad input")
        )
        claim_span, _ = await rpc_span(exporter, "Claim", "t")
        save_span, _ = await rpc_span(exporter, "SaveCheckpoint", "t")
        effect_span, _ = await rpc_span(exporter, "CompleteEffect", "t")
        beat_span, _ = await rpc_span(exporter, "Heartbeat", "t")
        release_span, _ = await rpc_span(exporter, "Release", "t")

    claim_attrs = claim_span.attributes or {}
    assert (claim_attrs["leasekeeper.attempts"], claim_attrs["leasekeeper.max_attempts"]) == (0, 3)
    save = save_span.attributes or {}
    assert save["leasekeeper.checkpoint_version"] == 4
    assert save["leasekeeper.fence"] == lease.fence
    assert save["leasekeeper.owner_id"] == "owner-a"
    assert save["leasekeeper.expire_time"] == saved.lease.expire_time.ToJsonString()
    assert save["leasekeeper.attempts"] == 0
    effect = effect_span.attributes or {}
    assert effect["leasekeeper.external_operation_id"] == "pay-42"
    assert effect["leasekeeper.effect_key"] == "send"
    assert effect["leasekeeper.checkpoint_version"] == 5
    assert (beat_span.attributes or {})["leasekeeper.checkpoint_version"] == 6
    release = release_span.attributes or {}
    assert release["leasekeeper.disposition"] == "failed"
    assert release["leasekeeper.checkpoint_version"] == 6


async def test_release_and_cancel_spans_name_the_disposition(
    database_url: str, namespace: str
) -> None:
    async with traced_server(database_url) as (stub, exporter):
        for task_id, complete in (("free", False), ("done", True)):
            lease = await grant(stub, namespace, task_id, "owner-a")
            await stub.Release(
                pb.ReleaseRequest(
                    namespace=namespace,
                    task_id=task_id,
                    owner_id="owner-a",
                    fence=lease.fence,
                    complete=complete,
                )
            )
        await grant(stub, namespace, "gone", "owner-a")
        await stub.Cancel(pb.CancelRequest(namespace=namespace, task_id="gone", reason="ops"))
        spans = {
            task_id: (await rpc_span(exporter, method, task_id))[0]
            for method, task_id in (("Release", "free"), ("Release", "done"), ("Cancel", "gone"))
        }

    dispositions = {t: (s.attributes or {})["leasekeeper.disposition"] for t, s in spans.items()}
    assert dispositions == {"free": "released", "done": "completed", "gone": "cancelled"}
