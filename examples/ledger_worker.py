"""A worker that sends one message through the gateway under the effect ledger.

It claims a task, then sends ONE message through the demo gateway
(``gateway.py``) as the effect ``summary`` of policy ONCE::

    lease.effect("summary", policy="ONCE", request_digest=request_digest(message),
                 reconcile=<ask the gateway's Lookup; its send_id, or None>)

so that a replacement worker never repeats a send its predecessor made: the
ledger answers PROCEED (send now), ALREADY_APPLIED (the recorded send_id;
nothing is sent) or IN_DOUBT (an earlier attempt was never confirmed: the
gateway is asked, and only when it has no record is the message sent once
more).

Faults, for the tests (``tests/process/test_effect_ledger.py``):

``--stop-at STEP``
    At STEP the worker prints ``worker NAME: at STEP`` and stops itself with
    SIGSTOP, so that a test can SIGKILL it there, or let its lease expire and
    SIGCONT it. STEP is one of ``before-begin`` (lease held, BeginEffect not
    called), ``after-begin`` (PROCEED, the send not made), ``after-effect``
    (the gateway accepted the send, CompleteEffect not called) and
    ``after-complete`` (the outcome recorded, the lease not released).
``--lose-reply N``
    The first N sends reach the gateway and are recorded there, but the
    worker treats each as timed out (TimeoutError): the reply was lost.
``--lose-request N``
    The first N sends time out before reaching the gateway (TimeoutError,
    nothing recorded): the request was lost.

A send that timed out leaves the effect RESERVED (in doubt). The worker then
runs the effect again up to ``--retries`` times (default 1): the ledger
answers IN_DOUBT and the gateway's Lookup decides between "it happened"
(recorded, not resent) and one more attempt.

Once the effect function has started, it runs to its end even when the lease
is lost meanwhile (``hold()`` cancels the block): what the send did and what
the ledger answered to its completion are still reported. The ledger, not
the worker, decides whether a late completion counts.

One line on stdout per event (``worker NAME: ...``), each effect-ledger call
included (``begin ... -> PROCEED ...``, ``complete ... -> REFUSED ...``), and
one exit code per outcome (:class:`Exit`)::

    python examples/ledger_worker.py --name A --target 127.0.0.1:9457 \
        --gateway 127.0.0.1:50051 --namespace demo --task-id contract-summary-r42 --ttl-s 2
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import os
import signal
import sys
from typing import Any

import grpc
from worker import add_worker_arguments, error_reason, run_to_exit, say

from leasekeeper import (
    BeginResult,
    ClaimTimeout,
    EffectFailed,
    EffectInDoubt,
    EffectOutcome,
    EffectRecord,
    HeldLease,
    LeaseClient,
    LeaseLost,
    request_digest,
)

SEND_METHOD = "/demo.v1.Gateway/Send"
LOOKUP_METHOD = "/demo.v1.Gateway/Lookup"
EFFECT_KEY = "summary"
STEPS = ("before-begin", "after-begin", "after-reconcile", "after-effect", "after-complete")
LOOKUP_TIMEOUT_S = 10.0


class Exit(enum.IntEnum):
    """The worker's exit codes, one per outcome."""

    SENT = 0
    """BeginEffect said PROCEED at once; sent, recorded SUCCEEDED, released."""
    ERROR = 1
    """Anything unexpected (a traceback or the error is printed)."""
    FENCED = 3
    """The lease was lost and a fence check refused this worker: the gateway refused
    the send, or the ledger refused BeginEffect or CompleteEffect (ABORTED)."""
    RESENT = 4
    """IN_DOUBT; the gateway had no record of the earlier attempt (recorded FAILED,
    retryable), so one more attempt was made: sent, recorded SUCCEEDED."""
    RECONCILED = 5
    """IN_DOUBT; the gateway had the earlier attempt's send: recorded SUCCEEDED with
    its send_id. Nothing was sent."""
    ALREADY_APPLIED = 6
    """BeginEffect said ALREADY_APPLIED: the recorded send_id. Nothing was sent."""
    IN_DOUBT = 7
    """The effect was left in doubt: a send timed out and no retry was left, or
    the ledger was still in doubt (EffectInDoubt)."""
    NOT_ACQUIRED = 8
    """Another owner held the task for the whole wait."""
    LOST = 9
    """The client gave the lease up on its own before any fence check refused it."""
    EFFECT_FAILED = 10
    """The gateway refused the send while the lease was live: recorded FAILED."""


def _record_text(effect: EffectRecord) -> str:
    return (
        f"state={effect.state} fence={effect.fence} complete_fence={effect.complete_fence} "
        f"attempts={effect.attempts} result={effect.result.decode(errors='replace')!r}"
    )


class ReportingLeaseClient(LeaseClient):
    """A LeaseClient that prints each effect-ledger call and its answer.

    ``lease.effect`` makes its BeginEffect and CompleteEffect calls through the
    lease's client; printing them here shows which call the ledger refused.
    """

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.name = name
        self.refusals: list[str] = []

    def _refused(self, call: str, error: LeaseLost) -> None:
        code = error.code.name if error.code is not None else "-"
        text = f"{call} -> REFUSED code={code} reason={error.reason}"
        self.refusals.append(text)
        say(self.name, text)

    async def begin_effect(
        self, task_id: str, fence: int, effect_key: str, **kwargs: Any
    ) -> BeginResult:
        """BeginEffect, printed with its decision or refusal."""
        call = f"begin effect_key={effect_key!r} fence={fence}"
        try:
            begun = await super().begin_effect(task_id, fence, effect_key, **kwargs)
        except LeaseLost as error:
            self._refused(call, error)
            raise
        say(self.name, f"{call} -> {begun.decision} {_record_text(begun.effect)}")
        return begun

    async def complete_effect(
        self, task_id: str, fence: int, effect_key: str, **kwargs: Any
    ) -> EffectRecord:
        """CompleteEffect, printed with the record or the refusal."""
        call = f"complete {kwargs.get('outcome')} effect_key={effect_key!r} fence={fence}"
        try:
            effect = await super().complete_effect(task_id, fence, effect_key, **kwargs)
        except LeaseLost as error:
            self._refused(call, error)
            raise
        say(self.name, f"{call} -> recorded {_record_text(effect)}")
        return effect


class LedgerWorker:
    """One run: claim, send the summary once through the ledger, release."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name: str = args.name
        self.message: str = args.message or f"contract summary for {args.task_id}"
        self.lose_reply: int = args.lose_reply
        self.lose_request: int = args.lose_request
        self.gateway_refused = False
        self.found: bool | None = None  # what reconcile learnt, once it ran
        self.sends = 0
        self.outcome: EffectOutcome | None = None
        self.error: Exception | None = None
        self._channel: grpc.aio.Channel | None = None
        self._lease: HeldLease | None = None

    def say(self, text: str) -> None:
        """Print one event line."""
        say(self.name, text)

    def stop_at(self, step: str) -> None:
        """At the fault point ``step`` (if it is ``--stop-at``): say so, then SIGSTOP."""
        if self.args.stop_at == step:
            self.say(f"at {step}")
            os.kill(os.getpid(), signal.SIGSTOP)
            self.say(f"resumed at {step}")

    @property
    def lease(self) -> HeldLease:
        """The held lease (inside the block)."""
        assert self._lease is not None
        return self._lease

    async def _gateway(self, method: str, body: dict[str, Any], timeout_s: float) -> Any:
        assert self._channel is not None
        call = self._channel.unary_unary(method)  # bytes in, bytes out
        reply = await call(
            json.dumps(body).encode(), metadata=self.lease.metadata(), timeout=timeout_s
        )
        return json.loads(reply)

    async def send(self) -> str:
        """The effect: send the message; the gateway's send_id is the recorded result.

        Raises:
            EffectFailed: The gateway refused the send (ABORTED): it did not
                happen, a later owner may make it (retryable).
            TimeoutError: The send timed out (or a lost request or reply was
                injected): it may have happened; the effect stays in doubt.

        """
        self.stop_at("after-begin")
        fence = self.lease.fence
        if self.lose_request > 0:
            self.lose_request -= 1
            self.say(f"send request lost fence={fence}: timed out before the gateway got it")
            raise TimeoutError("the send timed out (request lost)")
        self.sends += 1
        body = {"effect_key": EFFECT_KEY, "message": self.message}
        try:
            reply = await self._gateway(SEND_METHOD, body, self.args.send_timeout_s)
        except grpc.aio.AioRpcError as error:
            code, reason = error.code(), error_reason(error)
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                self.say(f"send timed out fence={fence} code={code.name}")
                raise TimeoutError("the send timed out") from error
            if code is not grpc.StatusCode.ABORTED:
                raise
            self.gateway_refused = True
            self.say(f"send REFUSED fence={fence} code={code.name} reason={reason}")
            raise EffectFailed(
                f"the gateway refused fence {fence}", retryable=True, result=reason
            ) from error
        self.say(f"send accepted fence={fence} send_id={reply['send_id']} status={reply['status']}")
        if self.lose_reply > 0:
            self.lose_reply -= 1
            self.say(f"send reply lost fence={fence}: treated as timed out")
            raise TimeoutError("the send timed out (reply lost)")
        self.stop_at("after-effect")
        return str(reply["send_id"])

    async def reconcile(self, earlier: EffectRecord) -> str | None:
        """Ask the gateway whether the earlier attempt's send happened: its send_id, or None."""
        self.say(
            f"in doubt: attempt {earlier.attempts} by fence {earlier.fence}; asking the gateway"
        )
        found = await self._gateway(LOOKUP_METHOD, {"effect_key": EFFECT_KEY}, LOOKUP_TIMEOUT_S)
        self.found = bool(found["found"])
        if not self.found:
            self.say("reconcile: not found")
            self.stop_at("after-reconcile")
            return None
        self.say(
            f"reconcile: found send_id={found['send_id']} fence={found['fence']} "
            f"count={found['count']}"
        )
        return str(found["send_id"])

    async def run_effect_once(self) -> EffectOutcome:
        """One run of the effect protocol, carried to its end even if the block is cancelled.

        When ``hold()`` cancels the block (lease lost) the send may already be
        on the wire: waiting for the run lets the ledger, not this worker,
        decide whether its completion counts. What the run did is kept
        (``outcome`` or ``error``) and the cancellation re-raised, so that
        ``hold()`` raises LeaseLost as it should.
        """
        runner = self.lease.effect(
            EFFECT_KEY,
            policy="ONCE",
            request_digest=request_digest(self.message),
            reconcile=self.reconcile,
        )
        step = asyncio.ensure_future(runner.run(self.send))
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            if not step.done():
                await asyncio.wait([step])
            error = step.exception()
            if error is None:
                self.outcome = step.result()
            elif isinstance(error, Exception):
                self.error = error
            raise

    async def run_effect(self) -> None:
        """Run the effect; after a timeout (in doubt) run it again up to ``--retries`` times.

        Sets ``outcome`` when the effect settled, else ``error``.
        """
        for left in range(self.args.retries, -1, -1):
            try:
                self.outcome, self.error = await self.run_effect_once(), None
                return
            except asyncio.CancelledError:
                raise
            except Exception as error:  # judged after the block: see run()
                self.error = error
                if not isinstance(error, TimeoutError):
                    return
                self.say(f"effect left in doubt ({error}); {left} retries left")
                if left == 0:
                    return

    def outcome_exit(self, outcome: EffectOutcome) -> Exit:
        """The exit code of a settled effect."""
        self.say(f"effect settled fresh={outcome.fresh} {_record_text(outcome.effect)}")
        if outcome.fresh:
            return Exit.RESENT if self.found is False else Exit.SENT
        return Exit.RECONCILED if self.found else Exit.ALREADY_APPLIED

    def error_exit(self, refusals: list[str], error: Exception) -> Exit:
        """The exit code of an effect that did not settle."""
        if isinstance(error, LeaseLost):
            self.say(f"LeaseLost reason={error.reason}")
            return Exit.FENCED if refusals or self.gateway_refused else Exit.LOST
        if isinstance(error, EffectFailed):
            self.say(f"effect FAILED retryable={error.retryable}")
            return Exit.EFFECT_FAILED
        if isinstance(error, EffectInDoubt | TimeoutError):
            self.say(f"effect in doubt: {error}")
            return Exit.IN_DOUBT
        self.say(f"error: {error!r}")
        return Exit.ERROR

    async def run(self) -> Exit:
        """Claim, run the effect, release; returns the outcome's exit code."""
        args = self.args
        client = ReportingLeaseClient(
            self.name, args.target, namespace=args.namespace, owner_id=args.owner_id
        )
        async with client, grpc.aio.insecure_channel(args.gateway) as channel:
            self._channel = channel
            lost: LeaseLost | None = None
            try:
                async with client.hold(args.task_id, ttl=args.ttl_s, wait=args.wait_s) as lease:
                    self._lease = lease
                    self.say(f"claimed task={args.task_id} fence={lease.fence} ttl_s={args.ttl_s}")
                    self.stop_at("before-begin")
                    await self.run_effect()
                    if self.outcome is not None:
                        self.stop_at("after-complete")
            except ClaimTimeout as error:
                self.say(f"not acquired: {error}")
                return Exit.NOT_ACQUIRED
            except LeaseLost as error:  # raised by hold(): the block was cancelled, or late
                lost = error
        if lost is not None:
            self.say(f"hold ended: LeaseLost reason={lost.reason}")
        elif not isinstance(self.error, LeaseLost):
            self.say("released")
        if self.outcome is not None:
            return self.outcome_exit(self.outcome)
        unsettled = self.error if self.error is not None else lost
        assert unsettled is not None
        return self.error_exit(client.refusals, unsettled)


def main(argv: list[str] | None = None) -> int:
    """Entry point; the exit code is an :class:`Exit`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_worker_arguments(parser)
    parser.add_argument("--message", default=None, help="default: 'contract summary for TASK'")
    parser.add_argument("--send-timeout-s", type=float, default=10.0, help="Send's deadline (s)")
    parser.add_argument("--stop-at", choices=STEPS, default=None, help="SIGSTOP at this step")
    parser.add_argument("--lose-reply", type=int, nargs="?", const=1, default=0, metavar="N")
    parser.add_argument("--lose-request", type=int, nargs="?", const=1, default=0, metavar="N")
    parser.add_argument("--retries", type=int, default=1, help="runs again after a timeout")
    args = parser.parse_args(argv)
    return run_to_exit(args.name, LedgerWorker(args).run(), Exit.ERROR)


if __name__ == "__main__":
    sys.exit(main())
