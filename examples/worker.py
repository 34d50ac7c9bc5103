"""A worker: claim a task, do its slow "work", send one message through the gateway.

One line on stdout per event (``worker NAME: ...``) and one exit code per outcome,
so that the demo and the tests can play worker A (the one that gets paused) and
worker B (its replacement) with the same script::

    python examples/worker.py --name A --target 127.0.0.1:9457 --gateway 127.0.0.1:50051 \
        --namespace demo --task-id contract-summary-r42 --ttl-s 2 --work-s 1
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from leasekeeper import ClaimTimeout, HeldLease, LeaseClient, LeaseError, LeaseLost

ExitCode = TypeVar("ExitCode", bound=enum.IntEnum)

SEND_METHOD = "/demo.v1.Gateway/Send"
SEND_TIMEOUT_S = 10.0


class Exit(enum.IntEnum):
    """The worker's exit codes, one per outcome."""

    SENT = 0
    """Claimed, sent (accepted), released: the normal run."""
    ERROR = 1
    """Anything unexpected (a traceback is printed)."""
    REFUSED_LEASE_LOST = 3
    """The gateway refused the send and the client raised LeaseLost: a stale worker, fenced."""
    SENT_LEASE_LOST = 4
    """The gateway accepted the send but the lease was lost: the outcome fencing must prevent."""
    REFUSED = 5
    """The gateway refused the send although the client still trusted its lease."""
    LOST_BEFORE_SEND = 6
    """The client raised LeaseLost before any send was attempted."""
    NOT_ACQUIRED = 7
    """Another owner held the task for the whole wait."""


@dataclass(frozen=True)
class SendResult:
    """The gateway's answer to one send.

    Attributes:
        accepted: True when the gateway recorded (or had already recorded) the send.
        text: A one-line description: send id, or status code, reason and details.
    """

    accepted: bool
    text: str


def say(name: str, text: str) -> None:
    """One event line on stdout: ``worker NAME: TEXT``."""
    print(f"worker {name}: {text}", flush=True)


def error_reason(error: grpc.RpcError) -> str:
    """The ErrorInfo reason on a failed call (any domain), or ``-``."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return "-"


def send_message(gateway: str, metadata: tuple[tuple[str, str], ...], message: str) -> SendResult:
    """Send one message through the gateway (blocking; for a worker thread).

    Args:
        gateway: The gateway's ``host:port``.
        metadata: The lease's metadata (``HeldLease.metadata()``).
        message: The message.

    Returns:
        Whether the gateway accepted it. Other errors than ABORTED are raised.

    """
    request = json.dumps({"effect_key": "summary", "message": message}).encode()
    with grpc.insecure_channel(gateway) as channel:
        send = channel.unary_unary(SEND_METHOD)  # bytes in, bytes out
        try:
            reply = json.loads(send(request, metadata=metadata, timeout=SEND_TIMEOUT_S))
        except grpc.RpcError as error:
            if error.code() is not grpc.StatusCode.ABORTED:  # type: ignore[attr-defined]
                raise
            code = error.code().name  # type: ignore[attr-defined]
            text = f"code={code} reason={error_reason(error)} detail={error.details()!r}"  # type: ignore[attr-defined]
            return SendResult(False, text)
    return SendResult(True, f"send_id={reply['send_id']} status={reply['status']}")


def work_then_send(work_s: float, gateway: str, lease: HeldLease, message: str) -> SendResult:
    """One agent step that cannot be interrupted: a slow model call, then the tool call.

    Runs in a thread. A worker frozen here (SIGSTOP, a GC pause, a VM
    migration) resumes with the send still ahead of it and its fence in hand:
    its client cannot stop what runs in this thread, and even a
    ``lease.check()`` right before the send would leave a window in which the
    same pause could land. The step has no such check on purpose, so that it
    stands for that window: only the gateway's fence check can refuse the send.
    """
    # The slow model call. Its deadline is absolute: after a long pause it returns at once.
    time.sleep(work_s)
    return send_message(gateway, lease.metadata(), message)


class Attempt:
    """The send attempt of one run: None until the gateway has answered."""

    result: SendResult | None = None


async def run_step(name: str, args: argparse.Namespace, lease: HeldLease, attempt: Attempt) -> None:
    """Run :func:`work_then_send` to its end, even when the lease is lost meanwhile.

    When ``hold()`` cancels the body (lease lost) the step is already under way
    in its thread, and the send may already be on the wire: it cannot be
    called back. Waiting for its answer lets the worker report what the gateway
    did with it; the cancellation is then re-raised, so that ``hold()`` raises
    LeaseLost as it should.
    """
    message = f"contract summary for {args.task_id}, by worker {name} with fence {lease.fence}"
    step = asyncio.ensure_future(
        asyncio.to_thread(work_then_send, args.work_s, args.gateway, lease, message)
    )
    try:
        await asyncio.shield(step)
    except asyncio.CancelledError:
        await step
        raise
    finally:
        if step.done() and not step.cancelled() and step.exception() is None:
            attempt.result = step.result()
            verdict = "accepted" if attempt.result.accepted else "REFUSED"
            say(name, f"send {verdict} fence={lease.fence} {attempt.result.text}")


def _report_loss(name: str, lost: LeaseLost) -> None:
    """Print how the client learnt of the loss: the heartbeat's status, or its own deadline."""
    cause = lost.__cause__
    if isinstance(cause, grpc.aio.AioRpcError):
        say(name, f"heartbeat stream ended code={cause.code().name} reason={lost.reason}")
    elif lost.reason != "LEASE_EXPIRED" and lost.code is not None:
        # Only the server names other reasons; hold() chains the error to the
        # cancellation of the body, so the stream's status is not the cause here.
        say(name, f"heartbeat stream ended code={lost.code.name} reason={lost.reason}")
    else:
        say(name, "heartbeat stream: no end status read (the trust deadline passed first)")
    say(name, f"LeaseLost reason={lost.reason}")


async def run(args: argparse.Namespace) -> Exit:
    """Claim, work, send, release; returns the outcome's exit code."""
    name, attempt = args.name, Attempt()
    async with LeaseClient(args.target, namespace=args.namespace, owner_id=args.owner_id) as client:
        try:
            async with client.hold(args.task_id, ttl=args.ttl_s, wait=args.wait_s) as lease:
                say(name, f"claimed task={args.task_id} fence={lease.fence} ttl_s={args.ttl_s}")
                say(name, f"working for {args.work_s} s, then sending")
                await run_step(name, args, lease, attempt)
        except ClaimTimeout as error:
            say(name, f"not acquired: {error}")
            return Exit.NOT_ACQUIRED
        except LeaseLost as lost:
            _report_loss(name, lost)
            if attempt.result is None:
                return Exit.LOST_BEFORE_SEND
            return Exit.SENT_LEASE_LOST if attempt.result.accepted else Exit.REFUSED_LEASE_LOST
    assert attempt.result is not None
    if not attempt.result.accepted:
        return Exit.REFUSED
    say(name, "released")
    return Exit.SENT


def main(argv: list[str] | None = None) -> int:
    """Entry point; the exit code is an :class:`Exit`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_worker_arguments(parser)
    parser.add_argument("--work-s", type=float, default=1.0, help="duration of the work")
    args = parser.parse_args(argv)
    return run_to_exit(args.name, run(args), Exit.ERROR)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every demo worker takes: who it is, where to claim, what to claim."""
    parser.add_argument("--name", default="A", help="the worker's name in its output")
    parser.add_argument("--target", default="127.0.0.1:9457", help="lease service address")
    parser.add_argument("--gateway", required=True, help="effect gateway address")
    parser.add_argument("--namespace", default="demo")
    parser.add_argument("--task-id", default="contract-summary-r42")
    parser.add_argument("--ttl-s", type=float, default=2.0, help="lease ttl in seconds")
    parser.add_argument("--wait-s", type=float, default=None, help="wait this long for the task")
    parser.add_argument(
        "--owner-id",
        default=None,
        help="an explicit owner id, reused across restarts (a pod name); default: a fresh one",
    )


def run_to_exit(name: str, work: Coroutine[Any, Any, ExitCode], error: ExitCode) -> int:
    """Run a worker to its exit code; a leasekeeper error is reported as ``error``."""
    try:
        code = asyncio.run(work)
    except LeaseError as failure:
        say(name, f"error: {failure!r}")
        code = error
    say(name, f"exit {int(code)} ({code.name})")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
