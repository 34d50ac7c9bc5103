"""A bare grpc.aio server of ``leasekeeper.v1.LeaseService`` that does no work.

    python -m bench.noop_server [--listen 127.0.0.1:0] [--loop uvloop|asyncio]

It registers the real service name with the real request and response types,
so the real client (``leasekeeper.LeaseClient``) can be pointed at it, but
every unary handler answers a fixed, plausibly filled response made once at
start-up, and Heartbeat echoes: one ``HeartbeatResponse(renewed=True,
fence=request.fence)`` written per request read; ValidateFences likewise
answers each message read with one message holding the fixed valid answer
for each of its checks; Session answers each message read with one message
holding a renewed lease for each lease its stream has added (a beat) or
this message adds. No interceptors, no
database, grpc's default options except ``grpc.so_reuseport`` 0. It is the
reference "the same gRPC stack and client, with no server work".

Prints one line ``serving on HOST (port N)`` on stdout once it listens; stops
on SIGTERM or SIGINT. Methods it does not implement answer UNIMPLEMENTED.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as pb_grpc

SERVER_OPTIONS = (("grpc.so_reuseport", 0),)
TTL_S = 30
MAX_RUNTIME_S = 3600


def _timestamp(at: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(at)
    return stamp


class NoopLeaseService(pb_grpc.LeaseServiceServicer):
    """Fixed answers, made once; Heartbeat echoes each request's fence."""

    def __init__(self) -> None:
        now = datetime.now(UTC)
        expire = _timestamp(now + timedelta(seconds=TTL_S))
        remaining = Duration(seconds=TTL_S)
        lease = pb.Lease(
            namespace="default",
            task_id="noop",
            owner_id="noop-owner",
            fence=1,
            state=pb.TASK_STATE_HELD,
            expire_time=expire,
            remaining_ttl=remaining,
            runtime_deadline=_timestamp(now + timedelta(seconds=MAX_RUNTIME_S)),
            claim_time=_timestamp(now),
        )
        effect = pb.Effect(
            namespace="default",
            task_id="noop",
            effect_key="noop-effect",
            policy=pb.EFFECT_POLICY_ONCE,
            request_digest=b"\x00" * 32,
            state=pb.EFFECT_STATE_RESERVED,
            fence=1,
            attempts=1,
            begin_time=_timestamp(now),
        )
        done = pb.Effect()
        done.CopyFrom(effect)
        done.state = pb.EFFECT_STATE_SUCCEEDED
        done.complete_fence = 1
        done.complete_time.CopyFrom(_timestamp(now))
        self._claim = pb.ClaimResponse(acquired=True, lease=lease)
        self._renew = pb.RenewResponse(lease=lease)
        self._release = pb.ReleaseResponse(lease=lease)
        self._validate = pb.ValidateFenceResponse(
            valid=True, current_fence=1, remaining_ttl=remaining, expire_time=expire
        )
        self._begin = pb.BeginEffectResponse(decision=pb.EFFECT_DECISION_PROCEED, effect=effect)
        self._complete = pb.CompleteEffectResponse(effect=done)
        self._expire = expire
        self._remaining = remaining

    async def Claim(self, request: pb.ClaimRequest, context: Any) -> pb.ClaimResponse:
        return self._claim

    async def Renew(self, request: pb.RenewRequest, context: Any) -> pb.RenewResponse:
        return self._renew

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        return self._release

    async def ValidateFence(
        self, request: pb.ValidateFenceRequest, context: Any
    ) -> pb.ValidateFenceResponse:
        return self._validate

    async def BeginEffect(
        self, request: pb.BeginEffectRequest, context: Any
    ) -> pb.BeginEffectResponse:
        return self._begin

    async def CompleteEffect(
        self, request: pb.CompleteEffectRequest, context: Any
    ) -> pb.CompleteEffectResponse:
        return self._complete

    async def Heartbeat(
        self, request_iterator: AsyncIterator[pb.HeartbeatRequest], context: Any
    ) -> AsyncIterator[pb.HeartbeatResponse]:
        expire, remaining = self._expire, self._remaining
        async for request in request_iterator:
            yield pb.HeartbeatResponse(
                fence=request.fence, expire_time=expire, remaining_ttl=remaining, renewed=True
            )

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: Any
    ) -> AsyncIterator[pb.SessionResponse]:
        held: dict[int, pb.SessionResponse.Held] = {}
        expire, remaining = self._expire, self._remaining
        async for request in request_iterator:
            for lease_id in request.drop:
                held.pop(lease_id, None)
            added = []
            for add in request.add:
                held[add.id] = pb.SessionResponse.Held(
                    id=add.id,
                    fence=add.fence,
                    expire_time=expire,
                    remaining_ttl=remaining,
                    renewed=True,
                )
                added.append(held[add.id])
            yield pb.SessionResponse(
                sequence=request.sequence, held=list(held.values()) if request.beat else added
            )

    async def ValidateFences(
        self, request_iterator: AsyncIterator[pb.ValidateFencesRequest], context: Any
    ) -> AsyncIterator[pb.ValidateFencesResponse]:
        Answer = pb.ValidateFencesResponse.Answer
        async for request in request_iterator:
            yield pb.ValidateFencesResponse(
                answers=[Answer(id=check.id, response=self._validate) for check in request.checks]
            )


async def serve(listen: str) -> None:
    """Serves until SIGTERM or SIGINT; prints ``serving on HOST (port N)`` once listening.

    Raises:
        RuntimeError: ``listen`` cannot be bound.
    """
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_LeaseServiceServicer_to_server(NoopLeaseService(), server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise RuntimeError(f"cannot listen on {listen}")
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    host = listen.rsplit(":", 1)[0]
    print(f"serving on {host} (port {port})", flush=True)
    await stopping.wait()
    await server.stop(0.5)


def main(argv: list[str] | None = None) -> None:
    """Parses the command line and serves on the chosen event loop."""
    parser = argparse.ArgumentParser(prog="python -m bench.noop_server", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port (port 0: any free)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args(argv)
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(serve(args.listen))
    else:
        asyncio.run(serve(args.listen))


if __name__ == "__main__":
    main()
