"""A scripted lease scenario, run as a worker process (possibly under faketime).

Usage: ``python clock_scenario.py TARGET NAMESPACE``. Prints one JSON list of
outcomes: per step the acquired flags, fences, validity, reasons, status codes
and remaining ttls rounded to whole seconds. Nothing in it depends on the
wall clock of this process or of the server, so every clock offset must give
the same list. Raw grpc stubs only: no leasekeeper client logic in between.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc

CALL_TIMEOUT_S = 5.0
TASK = "clock-task"


def ttl(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def secs(d: duration_pb2.Duration) -> int:
    return round(d.ToNanoseconds() / 1e9)


def failure(error: grpc.RpcError) -> dict[str, Any]:
    reason = None
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
    return {"code": error.code().name, "reason": reason}  # type: ignore[attr-defined]


def reason(value: int) -> str:
    return pb.LossReason.Name(value)


def state(value: int) -> str:
    return pb.TaskState.Name(value)


def run(stub: rpc.LeaseServiceStub, ns: str) -> list[Any]:
    out: list[Any] = []

    def claim(owner: str) -> None:
        try:
            r = stub.Claim(
                pb.ClaimRequest(namespace=ns, task_id=TASK, owner_id=owner, ttl=ttl(1)),
                timeout=CALL_TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            out.append(["claim", owner, failure(exc)])
            return
        if r.acquired:
            lease = r.lease
            out.append(
                ["claim", owner, True, lease.fence, state(lease.state), secs(lease.remaining_ttl)]
            )
        else:
            out.append(["claim", owner, False, secs(r.holder_remaining_ttl)])

    def renew(owner: str, fence: int) -> None:
        try:
            r = stub.Renew(
                pb.RenewRequest(
                    namespace=ns, task_id=TASK, owner_id=owner, fence=fence, ttl=ttl(1)
                ),
                timeout=CALL_TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            out.append(["renew", owner, fence, failure(exc)])
            return
        out.append(["renew", owner, fence, r.lease.fence, secs(r.lease.remaining_ttl)])

    def validate(fence: int) -> list[Any]:
        r = stub.ValidateFence(
            pb.ValidateFenceRequest(namespace=ns, task_id=TASK, fence=fence),
            timeout=CALL_TIMEOUT_S,
        )
        return [
            "validate",
            fence,
            r.valid,
            r.current_fence,
            reason(r.reason),
            secs(r.remaining_ttl),
        ]

    def release(owner: str, fence: int, complete: bool = False) -> None:
        r = stub.Release(
            pb.ReleaseRequest(
                namespace=ns, task_id=TASK, owner_id=owner, fence=fence, complete=complete
            ),
            timeout=CALL_TIMEOUT_S,
        )
        out.append(["release", owner, fence, r.lease.fence, state(r.lease.state)])

    def heartbeat_until_lost(owner: str, fence: int) -> None:
        """Two beats, then silence: the server must push the expiry by itself.

        The beats' ttl is 2 s and the second beat goes 0.3 s after the first one's
        answer (past the minimum renew interval): on a loaded machine the second
        still renews before the first beat's lease runs out.
        """
        first = pb.HeartbeatRequest(namespace=ns, task_id=TASK, owner_id=owner, fence=fence)
        first.ttl.CopyFrom(ttl(2))
        answered = threading.Event()

        def requests():
            yield first
            answered.wait(CALL_TIMEOUT_S)
            time.sleep(0.3)
            yield pb.HeartbeatRequest()
            time.sleep(10)  # keeps the stream open and silent

        call = stub.Heartbeat(requests(), timeout=CALL_TIMEOUT_S + 5)
        try:
            for reply in call:
                out.append(["beat", reply.fence, reply.renewed, secs(reply.remaining_ttl)])
                answered.set()
            out.append(["heartbeat_end", "OK"])
        except grpc.RpcError as exc:
            out.append(["heartbeat_end", failure(exc)])

    claim("a")  # granted: fence 1
    claim("b")  # held by a: not acquired
    claim("a")  # a's retried claim: the same lease back
    renew("a", 1)
    out.append(validate(1))
    heartbeat_until_lost("a", 1)  # ends ABORTED LEASE_EXPIRED about 2 s after the last beat
    deadline = time.monotonic() + 5
    while (step := validate(1))[2] and time.monotonic() < deadline:
        time.sleep(0.05)
    out.append(step)
    renew("a", 1)  # expired: never revived
    claim("b")  # granted: fence 2
    out.append(validate(1))  # superseded
    out.append(validate(2))
    renew("a", 1)
    release("b", 2)
    out.append(validate(2))  # released
    out.append(validate(3))  # never issued
    claim("a")  # fence 3
    release("a", 3, complete=True)
    claim("b")  # completed: FAILED_PRECONDITION
    return out


def main() -> None:
    target, ns = sys.argv[1], sys.argv[2]
    with grpc.insecure_channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT_S)
        outcomes = run(rpc.LeaseServiceStub(channel), ns)
    print(json.dumps({"outcomes": outcomes, "worker_time": time.time()}))


if __name__ == "__main__":
    main()
