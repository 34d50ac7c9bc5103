"""Health and reflection, and what a shutdown does to callers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import running_server
from tests.integration.contract_helpers import failure, grant, row

pytestmark = pytest.mark.timeout(30)

SERVICE = "leasekeeper.v1.LeaseService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("service", ["", SERVICE], ids=["overall", "lease-service"])
async def test_health_check_database_answers_serving(channel, service):
    health = health_pb2_grpc.HealthStub(channel)

    reply = await health.Check(health_pb2.HealthCheckRequest(service=service))

    assert reply.status == SERVING


async def test_health_check_unknown_service_not_found(channel):
    health = health_pb2_grpc.HealthStub(channel)

    exc = await failure(health.Check(health_pb2.HealthCheckRequest(service="no.such.Service")))

    assert exc.code() == grpc.StatusCode.NOT_FOUND


async def _reflect(channel, request: reflection_pb2.ServerReflectionRequest):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo()
    await call.write(request)
    reply = await call.read()
    await call.done_writing()
    return reply


async def test_reflection_list_services_names_lease_service(channel):
    reply = await _reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))

    names = {s.name for s in reply.list_services_response.service}
    assert SERVICE in names
    assert "grpc.health.v1.Health" in names


async def test_reflection_file_containing_lease_service_describes_it(channel):
    reply = await _reflect(
        channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)
    )

    assert reply.HasField("file_descriptor_response")
    from google.protobuf import descriptor_pb2

    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in reply.file_descriptor_response.file_descriptor_proto
    ]
    services = {s.name: [m.name for m in s.method] for f in files for s in f.service}
    assert set(services["LeaseService"]) >= {
        "Claim",
        "Renew",
        "Release",
        "ValidateFence",
        "Heartbeat",
        "GetLease",
        "ListLeases",
    }


async def test_shutdown_health_watch_turns_not_serving(database_url):
    async with running_server(database_url) as running:
        async with grpc.aio.insecure_channel(running.target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE)
            )
            assert (await watch.read()).status == SERVING
            stopping = asyncio.ensure_future(running.server.stop(0.5))
            statuses = []
            try:
                while True:
                    reply = await watch.read()
                    if reply is grpc.aio.EOF:
                        break
                    statuses.append(reply.status)
                    if reply.status == NOT_SERVING:
                        break
            except grpc.aio.AioRpcError:
                pass
            await stopping

    assert statuses[-1:] == [NOT_SERVING]


async def test_shutdown_leases_live_on_in_database(database_url, namespace, db):
    async with running_server(database_url) as running:
        async with grpc.aio.insecure_channel(running.target) as channel:
            lease = await grant(rpc.LeaseServiceStub(channel), namespace, "t", "a", ttl_s=5.0)
            await running.server.stop(0.5)

    stored = await row(db, namespace, "t")
    assert (stored["state"], stored["fence"]) == ("held", lease.fence)
    async with running_server(database_url) as again:
        async with grpc.aio.insecure_channel(again.target) as channel:
            check = await rpc.LeaseServiceStub(channel).ValidateFence(
                pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=lease.fence)
            )
    assert check.valid
