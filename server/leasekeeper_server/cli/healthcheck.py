"""A gRPC health probe for containers: ``python -m leasekeeper_server.cli.healthcheck``.

::

    python -m leasekeeper_server.cli.healthcheck [TARGET]    (default 127.0.0.1:9457)

Asks ``TARGET``'s health service about the lease service and prints one
line: ``TARGET: SERVING`` (or ``NOT_SERVING``, ...) on standard output, or
``TARGET: cannot ask: CODE: details`` on standard error when there was no
answer within 2 s (nothing listening, no health service, a timeout). Exits 0
when the answer is SERVING, 1 otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasekeeper.channel import default_target
from leasekeeper_server.rpc.service import SERVICE_NAME

SERVING = "SERVING"


def check(target: str, timeout_s: float = 2.0) -> str:
    """The lease service's health at ``target``: the status's name (``SERVING``, ``NOT_SERVING``).

    Raises:
        grpc.RpcError: no answer within ``timeout_s`` seconds, or an error status.
    """
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def probe(target: str, timeout_s: float = 2.0) -> bool:
    """True when ``target`` answers SERVING for the lease service."""
    try:
        return check(target, timeout_s) == SERVING
    except grpc.RpcError:
        return False


def _why(error: grpc.RpcError) -> str:
    """A failed call as one line: its status code and details."""
    if isinstance(error, grpc.Call):
        return " ".join(f"{error.code().name}: {error.details()}".split())
    return " ".join(str(error).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the state found (module docstring); returns 0 for SERVING, else 1."""
    args = sys.argv[1:] if argv is None else list(argv)
    target = args[0] if args else default_target()
    try:
        state = check(target)
    except grpc.RpcError as exc:
        print(f"{target}: cannot ask: {_why(exc)}", file=sys.stderr)
        return 1
    print(f"{target}: {state}")
    return 0 if state == SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
