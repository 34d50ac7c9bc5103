"""Thin RPC handlers: validate, call one store method, convert back."""

from __future__ import annotations

from typing import Any

import grpc

from leasekeeper.v1 import lease_service_pb2 as pb

from . import convert, validate
from .errors import TaskNotFound
from .heartbeat import HeartbeatService
from .model import fence_loss
from .rpc import parse_or_malformed, unary
from .settings import Settings
from .store import Store


class LeaseServicer:
    """The leasekeeper.v1.LeaseService handlers."""

    def __init__(self, store: Store, heartbeats: HeartbeatService, settings: Settings) -> None:
        self._store = store
        self._heartbeats = heartbeats
        self._settings = settings

    @unary
    async def Claim(self, request: pb.ClaimRequest, context: Any) -> pb.ClaimResponse:
        """Claims a task (see the proto for outcomes and codes)."""
        s = self._settings
        key = validate.task_key(request, s)
        owner_id = validate.identifier("owner_id", request.owner_id, s.max_id_bytes)
        ttl = validate.ttl(request, s)
        max_runtime = validate.max_runtime(request, s)
        outcome = await self._store.claim(key, owner_id, ttl, max_runtime)
        if outcome.acquired:
            return pb.ClaimResponse(acquired=True, lease=convert.lease(outcome.task))
        response = pb.ClaimResponse(acquired=False)
        response.holder_remaining_ttl.FromTimedelta(outcome.task.remaining_ttl)
        response.holder_expire_time.FromDatetime(outcome.task.expire_time)
        return response

    @unary
    async def Renew(self, request: pb.RenewRequest, context: Any) -> pb.RenewResponse:
        """Renews a live lease; ABORTED with the reason otherwise."""
        ref = validate.lease_ref(request, self._settings)
        ttl = validate.ttl(request, self._settings)
        return pb.RenewResponse(lease=convert.lease(await self._store.renew(ref, ttl)))

    @unary
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        """Releases or completes a lease; idempotent for the same fence."""
        ref = validate.lease_ref(request, self._settings)
        task = await self._store.release(ref, request.complete)
        return pb.ReleaseResponse(lease=convert.lease(task))

    @unary
    async def ValidateFence(
        self, request: pb.ValidateFenceRequest, context: Any
    ) -> pb.ValidateFenceResponse:
        """Says whether a fence may act now; always OK."""
        key = validate.task_key(request, self._settings)
        fence = validate.fence("fence", request.fence)
        task = await self._store.get_task(key)
        reason = fence_loss(task, fence)
        response = pb.ValidateFenceResponse(
            valid=reason is None,
            current_fence=task.fence if task is not None else 0,
            reason=convert.loss_reason(reason),
        )
        if reason is None and task is not None:
            response.remaining_ttl.FromTimedelta(task.remaining_ttl)
            response.expire_time.FromDatetime(task.expire_time)
        return response

    @unary
    async def GetLease(self, request: pb.GetLeaseRequest, context: Any) -> pb.GetLeaseResponse:
        """The task's current state; NOT_FOUND when never claimed."""
        key = validate.task_key(request, self._settings)
        task = await self._store.get_task(key)
        if task is None:
            raise TaskNotFound(
                f"task {key.task_id!r} in namespace {key.namespace!r} was never claimed"
            )
        return pb.GetLeaseResponse(lease=convert.lease(task))

    @unary
    async def ListLeases(
        self, request: pb.ListLeasesRequest, context: Any
    ) -> pb.ListLeasesResponse:
        """One page of a namespace's tasks, by task_id."""
        s = self._settings
        namespace = validate.identifier("namespace", request.namespace, s.max_id_bytes)
        state = validate.task_state_filter(request.state)
        size = validate.page_size(request.page_size)
        after = validate.page_token(request.page_token, s)
        tasks = await self._store.list_tasks(namespace, after, size + 1, state)
        response = pb.ListLeasesResponse(leases=[convert.lease(t) for t in tasks[:size]])
        if len(tasks) > size:
            response.next_page_token = validate.encode_page_token(tasks[size - 1].task_id)
        return response

    async def Heartbeat(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """The heartbeat stream; see heartbeat.py."""
        await self._heartbeats.serve(context)


def method_handlers(servicer: LeaseServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, with deserializers that never raise."""

    def unary_handler(name: str, req: Any, resp: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=parse_or_malformed(req),
            response_serializer=resp.SerializeToString,
        )

    handlers = {
        "Claim": unary_handler("Claim", pb.ClaimRequest, pb.ClaimResponse),
        "Renew": unary_handler("Renew", pb.RenewRequest, pb.RenewResponse),
        "Release": unary_handler("Release", pb.ReleaseRequest, pb.ReleaseResponse),
        "ValidateFence": unary_handler(
            "ValidateFence", pb.ValidateFenceRequest, pb.ValidateFenceResponse
        ),
        "GetLease": unary_handler("GetLease", pb.GetLeaseRequest, pb.GetLeaseResponse),
        "ListLeases": unary_handler("ListLeases", pb.ListLeasesRequest, pb.ListLeasesResponse),
        "Heartbeat": grpc.stream_stream_rpc_method_handler(
            servicer.Heartbeat,
            request_deserializer=parse_or_malformed(pb.HeartbeatRequest),
            response_serializer=pb.HeartbeatResponse.SerializeToString,
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LeaseService"].full_name
