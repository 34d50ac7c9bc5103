"""Small helpers for tests: building requests and reading rich errors."""

from __future__ import annotations

from datetime import timedelta

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status


def dur(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromTimedelta(timedelta(seconds=seconds))
    return d


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The single ErrorInfo of a failed call (asserts there is exactly one)."""
    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status on the error"
    infos = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            infos.append(info)
    assert len(infos) == 1, f"expected one ErrorInfo, got {len(infos)}"
    assert infos[0].domain == "leasekeeper"
    return infos[0]


def bad_request_fields(error: grpc.aio.AioRpcError) -> list[str]:
    """The field names of the BadRequest detail of a failed call."""
    status = rpc_status.from_call(error)
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            detail.Unpack(br)
            return [v.field for v in br.field_violations]
    return []
