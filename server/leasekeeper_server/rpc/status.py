"""The one table from domain errors to gRPC status codes, and rich error details.

Every non-OK status carries exactly one ``google.rpc.ErrorInfo`` (domain
``leasekeeper``, the error's reason, its dynamic values as metadata);
INVALID_ARGUMENT also carries ``google.rpc.BadRequest`` naming the field.
Codes follow gRPC's own guidance (``grpc/doc/statuscodes.md``): a failed
sequencer check is ABORTED (claim again), a terminal task is
FAILED_PRECONDITION, a database out of reach is UNAVAILABLE (retry the call).
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from leasekeeper.errors import DOMAIN
from leasekeeper_server.core import errors

# Most specific class first: the first match wins.
_CODES: tuple[tuple[type[errors.LeaseServiceError], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.LeaseLost, grpc.StatusCode.ABORTED),
    (errors.TaskNotClaimable, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.TaskNotQuarantined, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CheckpointNotNewer, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.EffectConflict, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.TaskNotFound, grpc.StatusCode.NOT_FOUND),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.ServiceUnavailable, grpc.StatusCode.UNAVAILABLE),
)


def code_of(error: errors.LeaseServiceError) -> grpc.StatusCode:
    """The gRPC status code for a domain error (INTERNAL for an unknown kind)."""
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def rich_status(
    code: grpc.StatusCode,
    message: str,
    reason: str,
    metadata: dict[str, str] | None = None,
    field: str | None = None,
    retry_after_s: float | None = None,
) -> grpc.Status:
    """Builds a status with one ErrorInfo.

    Adds a google.rpc.BadRequest when ``field`` is given, and a
    google.rpc.RetryInfo when ``retry_after_s`` (seconds) is.
    """
    details = [
        _pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata or {}))
    ]
    if field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    if retry_after_s is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromNanoseconds(max(0, round(retry_after_s * 1e9)))
        details.append(_pack(retry))
    proto = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=details)
    return rpc_status.to_status(proto)


def status_of(error: errors.LeaseServiceError) -> grpc.Status:
    """The rich gRPC status for a domain error."""
    field = error.field if isinstance(error, errors.InvalidArgument) else None
    retry = error.retry_after_s if isinstance(error, errors.LimitExceeded) else None
    return rich_status(code_of(error), str(error), error.reason, error.metadata(), field, retry)


def internal_status(error_id: str) -> grpc.Status:
    """The status for a bug; ``error_id`` is logged with the traceback."""
    return rich_status(
        grpc.StatusCode.INTERNAL, f"internal error {error_id}", "INTERNAL", {"error_id": error_id}
    )
