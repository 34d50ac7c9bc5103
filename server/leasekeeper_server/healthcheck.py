"""A gRPC health probe for container health checks: ``python -m leasekeeper_server.healthcheck``.

Exits 0 when the server at the given address answers SERVING for the lease
service, 1 otherwise (NOT_SERVING, unreachable, or no answer within 2 s).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "leasekeeper.v1.LeaseService"


def probe(target: str, timeout_s: float = 2.0) -> bool:
    """True when ``target`` answers SERVING for the lease service."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    sys.exit(0 if probe(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:9457") else 1)
