"""Decoding gRPC statuses (google.rpc.Status with ErrorInfo) into client errors."""

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from leasekeeper import (
    InvalidArgument,
    LeaseError,
    LeaseLost,
    LeaseUnavailable,
    LimitExceeded,
    MissingFence,
    TaskCompleted,
    TaskNotFound,
)
from leasekeeper.errors import error_details, from_rpc_error, rich_status_of


def _any(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def rpc_error(
    code: grpc.StatusCode,
    reason: str | None,
    metadata: dict[str, str] | None = None,
    *,
    domain: str = "leasekeeper",
    violations: tuple[tuple[str, str], ...] = (),
    message: str = "details",
) -> grpc.aio.AioRpcError:
    details = []
    if reason is not None:
        details.append(
            _any(error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=metadata or {}))
        )
    if violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                for f, d in violations
            ]
        )
        details.append(_any(bad))
    status = status_pb2.Status(code=code.value[0], message=message, details=details)
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


@pytest.mark.parametrize(
    ("code", "reason", "kind"),
    [
        (grpc.StatusCode.ABORTED, "LEASE_EXPIRED", LeaseLost),
        (grpc.StatusCode.ABORTED, "LEASE_SUPERSEDED", LeaseLost),
        (grpc.StatusCode.ABORTED, "LEASE_RELEASED", LeaseLost),
        (grpc.StatusCode.ABORTED, "LEASE_REVOKED", LeaseLost),
        (grpc.StatusCode.ABORTED, "RUNTIME_EXCEEDED", LeaseLost),
        (grpc.StatusCode.ABORTED, "TASK_COMPLETED", LeaseLost),
        (grpc.StatusCode.ABORTED, "NOT_OWNER", LeaseLost),
        (grpc.StatusCode.ABORTED, "FENCE_UNKNOWN", LeaseLost),
        (grpc.StatusCode.ABORTED, "FENCE_MISSING", MissingFence),
        (grpc.StatusCode.FAILED_PRECONDITION, "TASK_COMPLETED", TaskCompleted),
        (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, "TASK_NOT_FOUND", TaskNotFound),
        (grpc.StatusCode.UNAVAILABLE, "DATABASE_UNAVAILABLE", LeaseUnavailable),
        (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN", LeaseUnavailable),
        (grpc.StatusCode.INTERNAL, "INTERNAL", LeaseError),
    ],
)
def test_from_rpc_error_maps_code_and_reason_to_error_class(code, reason, kind):
    error = from_rpc_error(rpc_error(code, reason), task_id="t1", fence=3)
    assert type(error) is kind
    assert error.reason == reason
    assert isinstance(error, LeaseError)


def test_from_rpc_error_lease_lost_carries_task_fence_and_current_fence():
    error = from_rpc_error(
        rpc_error(grpc.StatusCode.ABORTED, "LEASE_SUPERSEDED", {"current_fence": "8"}),
        task_id="t1",
        fence=7,
    )
    assert isinstance(error, LeaseLost)
    assert (error.reason, error.task_id, error.fence) == ("LEASE_SUPERSEDED", "t1", 7)
    assert error.current_fence == 8
    assert error.code is grpc.StatusCode.ABORTED
    assert not error.retryable


def test_from_rpc_error_invalid_argument_carries_field_violations():
    error = from_rpc_error(
        rpc_error(
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            {"field": "ttl"},
            violations=(("ttl", "ttl 0.001s is below min_ttl 1s"),),
        )
    )
    assert isinstance(error, InvalidArgument)
    assert isinstance(error, ValueError)
    assert error.field == "ttl"
    assert error.field_violations == (("ttl", "ttl 0.001s is below min_ttl 1s"),)


def test_from_rpc_error_unavailable_without_details_is_retryable():
    bare = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="conn"
    )
    error = from_rpc_error(bare)
    assert isinstance(error, LeaseUnavailable)
    assert error.reason is None
    assert error.retryable


def test_from_rpc_error_resource_exhausted_without_a_reason_is_unavailable_not_a_limit():
    # gRPC's own RESOURCE_EXHAUSTED: a connection the server ended (ENHANCE_YOUR_CALM) after
    # this process missed its keepalive ping. Its outcome is unknown; a limit carries its reason.
    bare = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="Bandwidth exhausted or memory limit exceeded",
    )
    error = from_rpc_error(bare)
    assert isinstance(error, LeaseUnavailable)
    assert not isinstance(error, LimitExceeded)
    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.reason is None
    assert error.retryable


def test_from_rpc_error_aborted_without_details_is_lost_unknown():
    bare = grpc.aio.AioRpcError(grpc.StatusCode.ABORTED, grpc.aio.Metadata(), grpc.aio.Metadata())
    error = from_rpc_error(bare, task_id="t", fence=1)
    assert isinstance(error, LeaseLost)
    assert error.reason == "UNKNOWN"


def test_from_rpc_error_ignores_error_info_of_foreign_domain():
    error = from_rpc_error(rpc_error(grpc.StatusCode.ABORTED, "QUOTA", domain="example.com"))
    assert isinstance(error, LeaseLost)
    assert error.reason == "UNKNOWN"


def test_from_rpc_error_failed_precondition_other_reason_is_generic():
    error = from_rpc_error(rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "SOMETHING_ELSE"))
    assert type(error) is LeaseError
    assert error.code is grpc.StatusCode.FAILED_PRECONDITION


def test_from_rpc_error_never_reads_message_text():
    error = from_rpc_error(
        rpc_error(grpc.StatusCode.ABORTED, "LEASE_REVOKED", message="lease expired (superseded)")
    )
    assert error.reason == "LEASE_REVOKED"


def test_rich_status_of_malformed_trailer_is_none():
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", b"\xff\xff not a proto"))
    error = grpc.aio.AioRpcError(grpc.StatusCode.ABORTED, grpc.aio.Metadata(), trailing)
    assert rich_status_of(error) is None
    assert isinstance(from_rpc_error(error), LeaseLost)


def test_error_details_of_none_is_empty():
    assert error_details(None) == (None, {}, ())
