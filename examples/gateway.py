"""An effect gateway: the side-effect boundary that refuses stale fences.

Workers call ``/demo.v1.Gateway/Send`` (JSON bytes in and out, no proto) with
their lease in the gRPC metadata (``HeldLease.metadata()``). Every fence is
checked twice:

1. by leasekeeper's :class:`~leasekeeper.FenceInterceptor`, which asks the
   lease service (ValidateFence, database clock) just before the handler runs
   and answers ABORTED to a stale or missing fence;
2. by the gateway's own ledger, in the same SQLite transaction as the send:
   :mod:`leasekeeper.fence_table` keeps the highest fence accepted per
   (namespace, task_id) and refuses a lower fence. This closes the window the
   first check leaves (the lease can be lost between ValidateFence and the
   insert), and keeps refusing an old fence even if the lease service is
   wrong or bypassed.

Sends carry an ``effect_key`` (idempotency key). Like a real outside system
(an email vendor), the gateway does not deduplicate them: every accepted send
is a new send, so that only the worker's effect ledger can prevent a second
one. With ``--dedupe`` a second send of the same effect for the same task
records nothing and answers ``duplicate`` with the first send's id, whatever
its fence.

``/demo.v1.Gateway/Lookup`` (body ``{"effect_key": ...}``, the lease in the
metadata) answers whether the task's send with that key happened: the
reconciliation question of a worker whose effect is IN_DOUBT. It is a fenced
read: in one transaction it first accepts the caller's fence in the fence
table, exactly as a send would, and only then reads. Once a replacement
worker has been told "not found", the paused worker whose attempt is in doubt
can no longer deliver it (its lower fence is refused), so "not found" stays
true and the replacement may send. A plain read would leave that window open:
the old attempt could land between the lookup and the replacement's send,
and the effect would happen twice.

Every accepted send, refusal and lookup prints one line on stdout.

Usage::

    python examples/gateway.py --leasekeeper 127.0.0.1:9457 --db /tmp/gateway.sqlite3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from leasekeeper import (
    FenceChecker,
    FenceInterceptor,
    FenceRef,
    LeaseClient,
    MissingFence,
    fence_from_metadata,
)
from leasekeeper.fence_table import (
    FENCE_BELOW_ACCEPTED,
    FenceRefused,
    accept_fence_sqlite,
    ensure_schema_sqlite,
)

SEND_METHOD = "/demo.v1.Gateway/Send"
LOOKUP_METHOD = "/demo.v1.Gateway/Lookup"
ERROR_DOMAIN = "demo.gateway"

# No UNIQUE on effect_key: without --dedupe a repeated effect is a second send.
SCHEMA = """
CREATE TABLE IF NOT EXISTS sends (
    send_id    INTEGER PRIMARY KEY,
    namespace  TEXT NOT NULL,
    task_id    TEXT NOT NULL,
    fence      INTEGER NOT NULL,
    effect_key TEXT NOT NULL,
    message    TEXT NOT NULL,
    sent_at    TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE INDEX IF NOT EXISTS sends_by_effect ON sends (namespace, task_id, effect_key);
"""

FIND_SENDS = """
SELECT send_id, fence, message FROM sends WHERE namespace = ? AND task_id = ? AND effect_key = ?
ORDER BY send_id
"""
INSERT_SEND = """
INSERT INTO sends (namespace, task_id, fence, effect_key, message) VALUES (?, ?, ?, ?, ?)
RETURNING send_id
"""
ALL_SENDS = (
    "SELECT send_id, namespace, task_id, fence, effect_key, message, sent_at FROM sends "
    "ORDER BY send_id"
)


@dataclass(frozen=True)
class SendOutcome:
    """What the ledger did with one send.

    Attributes:
        status: ``"accepted"`` (recorded now), ``"duplicate"`` (with dedupe: the
            effect was already recorded; nothing new) or ``"refused"`` (fence too low).
        send_id: The recorded send (the earlier one for a duplicate); None when refused.
        fence: The fence presented.
        highest_fence: The highest fence accepted for the task after the decision
            (for a duplicate: the earlier send's fence).
    """

    status: str
    send_id: int | None
    fence: int
    highest_fence: int


@dataclass(frozen=True)
class LookupOutcome:
    """The task's sends with one effect key, as the outside system knows them.

    Attributes:
        found: True when at least one send with the key was recorded.
        send_id: The first such send; None when not found.
        fence: Its fence; None when not found.
        message: Its message; None when not found.
        count: How many sends with the key were recorded (more than one only
            without dedupe: the effect happened more than once).
    """

    found: bool
    send_id: int | None
    fence: int | None
    message: str | None
    count: int


class _Duplicate(Exception):
    """With dedupe: the send was already recorded (rolls the transaction back)."""

    def __init__(self, send_id: int, fence: int) -> None:
        super().__init__(send_id, fence)
        self.send_id = send_id
        self.fence = fence


class Ledger:
    """The gateway's own table of sends, and leasekeeper's table of accepted fences.

    SQLite, one file, one connection used from the event loop's thread only:
    each call is a short local transaction, so it runs inline.

    Args:
        path: The database file (created if absent).
        dedupe: Record at most one send per ``(namespace, task_id, effect_key)``.
    """

    def __init__(self, path: Path, dedupe: bool = False) -> None:
        self._db = sqlite3.connect(path, isolation_level=None)  # explicit BEGIN/COMMIT
        self._db.executescript(SCHEMA)
        ensure_schema_sqlite(self._db)
        self.dedupe = dedupe

    def close(self) -> None:
        """Close the database file."""
        self._db.close()

    @contextlib.contextmanager
    def _fenced(self, ref: FenceRef) -> Iterator[sqlite3.Connection]:
        """One write transaction that first accepts ``ref``'s fence, then runs the block.

        Commits when the block ends normally; rolls back when it raises, and
        when the fence is refused (FenceRefused is raised on: nothing changed).
        """
        db = self._db
        db.execute("BEGIN IMMEDIATE")  # the write lock first: the check and the write are one
        try:
            accept_fence_sqlite(db, ref)
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def record_send(self, ref: FenceRef, effect_key: str, message: str) -> SendOutcome:
        """Record one send under ``ref`` unless a higher fence was accepted for its task.

        Atomic: the fence is accepted (:func:`~leasekeeper.fence_table.accept_fence_sqlite`)
        and the send recorded in one SQLite write transaction; a refusal or a
        duplicate rolls it back and changes nothing. Idempotent per
        ``(namespace, task_id, effect_key)`` only with dedupe.

        Args:
            ref: The lease the send is made under.
            effect_key: The send's idempotency key.
            message: The message to send.

        Returns:
            The outcome.

        """
        try:
            with self._fenced(ref) as db:
                if self.dedupe:
                    found = db.execute(FIND_SENDS, (ref.namespace, ref.task_id, effect_key))
                    earlier = found.fetchone()
                    if earlier is not None:
                        raise _Duplicate(earlier[0], earlier[1])
                (send_id,) = db.execute(
                    INSERT_SEND, (ref.namespace, ref.task_id, ref.fence, effect_key, message)
                ).fetchone()
        except FenceRefused as refused:
            return SendOutcome("refused", None, ref.fence, refused.highest_fence)
        except _Duplicate as duplicate:
            return SendOutcome("duplicate", duplicate.send_id, ref.fence, duplicate.fence)
        return SendOutcome("accepted", send_id, ref.fence, ref.fence)

    def lookup(self, ref: FenceRef, effect_key: str) -> LookupOutcome | None:
        """The task's sends with ``effect_key``: did the effect happen? A fenced read.

        Atomic: one SQLite write transaction accepts ``ref``'s fence (as a send
        would) and then reads, so no send with a lower fence can be recorded
        after this answer.

        Args:
            ref: The lease of the worker asking.
            effect_key: The send's idempotency key.

        Returns:
            The first such send and how many there are; None when a higher
            fence was accepted for the task (the asker is stale; nothing changed).

        """
        try:
            with self._fenced(ref) as db:
                rows = db.execute(FIND_SENDS, (ref.namespace, ref.task_id, effect_key)).fetchall()
        except FenceRefused:
            return None
        if not rows:
            return LookupOutcome(False, None, None, None, 0)
        send_id, fence, message = rows[0]
        return LookupOutcome(True, send_id, fence, message, len(rows))


def read_sends(path: Path) -> list[dict[str, Any]]:
    """Every recorded send in the ledger at ``path``, oldest first."""
    with sqlite3.connect(path) as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute(ALL_SENDS)]


def _say(text: str) -> None:
    print(f"gateway: {text}", flush=True)


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, reason: str, **meta: str
) -> NoReturn:
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=meta)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=[detail])
    await context.abort_with_status(rpc_status.to_status(status))
    raise AssertionError("abort_with_status returned")  # it raises; this tells type checkers


class GatewayHandlers:
    """The gateway's methods: ``Send`` records a send, ``Lookup`` reads them."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    async def _lease_of(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode) -> FenceRef:
        try:
            return fence_from_metadata(context.invocation_metadata())
        except MissingFence as error:
            _say(f"REFUSED call without a valid fence by ledger: {error}")
            await _abort(context, code, str(error), "FENCE_MISSING", key=error.key)

    async def send(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Record one send; ABORTED when the ledger refuses its fence."""
        ref = await self._lease_of(context, grpc.StatusCode.ABORTED)
        body = json.loads(request or b"{}")
        message, effect_key = str(body.get("message", "")), str(body.get("effect_key", "send"))
        outcome = self._ledger.record_send(ref, effect_key, message)
        where = f"{ref.namespace}/{ref.task_id} fence={ref.fence}"
        if outcome.status == "refused":
            text = f"fence {ref.fence} is lower than fence {outcome.highest_fence} already accepted"
            _say(f"REFUSED {where} by ledger: {text}")
            await _abort(
                context,
                grpc.StatusCode.ABORTED,
                text,
                FENCE_BELOW_ACCEPTED,
                highest_fence=str(outcome.highest_fence),
            )
        verb = "ACCEPTED" if outcome.status == "accepted" else "DUPLICATE (nothing sent)"
        _say(f"{verb} {where} send_id={outcome.send_id} effect_key={effect_key!r} {message!r}")
        return json.dumps(
            {"status": outcome.status, "send_id": outcome.send_id, "fence": ref.fence}
        ).encode()

    async def lookup(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Answer whether the caller's task sent ``effect_key``; ABORTED for a stale fence."""
        ref = await self._lease_of(context, grpc.StatusCode.INVALID_ARGUMENT)
        effect_key = str(json.loads(request or b"{}").get("effect_key", "send"))
        found = self._ledger.lookup(ref, effect_key)
        where = f"{ref.namespace}/{ref.task_id} fence={ref.fence}"
        if found is None:
            text = f"fence {ref.fence} is lower than a fence already accepted"
            _say(f"REFUSED lookup {where} by ledger: {text}")
            await _abort(context, grpc.StatusCode.ABORTED, text, FENCE_BELOW_ACCEPTED)
        _say(
            f"LOOKUP {ref.namespace}/{ref.task_id} effect_key={effect_key!r} "
            f"found={found.found} send_id={found.send_id} fence={found.fence} count={found.count} "
            f"(asked with fence {ref.fence}: older fences now refused)"
        )
        return json.dumps(
            {
                "found": found.found,
                "send_id": found.send_id,
                "fence": found.fence,
                "message": found.message,
                "count": found.count,
            }
        ).encode()


def _logging_rejections(
    handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails
) -> grpc.RpcMethodHandler:
    """Wrap the interceptor's rejecting handler so that its refusal prints one line."""
    reject = handler.unary_unary

    async def logged(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await reject(request, context)
        finally:
            try:
                where = fence_from_metadata(details.invocation_metadata)  # type: ignore[attr-defined]
                subject = f"{where.namespace}/{where.task_id} fence={where.fence}"
            except MissingFence:
                subject = "send without a valid fence"
            code = context.code()
            name = code.name if isinstance(code, grpc.StatusCode) else code
            _say(f"REFUSED {subject} by leasekeeper check: {name} {context.details()}")

    return grpc.unary_unary_rpc_method_handler(
        logged,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class LoggedFenceInterceptor(grpc.aio.ServerInterceptor):
    """leasekeeper's FenceInterceptor, printing a line for each call it rejects.

    It tells a rejection from a pass by whether FenceInterceptor hands back the
    handler its continuation produced (a pass) or a replacement (a rejection).
    """

    def __init__(self, inner: FenceInterceptor) -> None:
        self._inner = inner

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Run FenceInterceptor; wrap its rejection so that it is printed."""
        produced: list[grpc.RpcMethodHandler] = []

        async def remember(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
            produced.append(await continuation(details))
            return produced[-1]

        handler = await self._inner.intercept_service(remember, handler_call_details)
        if handler is None or (produced and handler is produced[-1]):
            return handler
        return _logging_rejections(handler, handler_call_details)


def build_server(
    ledger: Ledger, leases: LeaseClient | None, listen: str
) -> tuple[grpc.aio.Server, int]:
    """The gateway's gRPC server, not started.

    Args:
        ledger: Where sends and accepted fences are recorded.
        leases: A client of the lease service for the FenceInterceptor (on
            Send only); None to rely on the ledger alone (to show that it
            refuses on its own).
        listen: ``host:port``; port 0 picks a free one.

    Returns:
        The server and its bound port.

    """
    interceptors = []
    if leases is not None:
        fence_check = FenceInterceptor(FenceChecker(leases), methods={SEND_METHOD})
        interceptors.append(LoggedFenceInterceptor(fence_check))
    server = grpc.aio.server(interceptors=interceptors)
    handlers = GatewayHandlers(ledger)
    methods = {  # bytes in, bytes out
        "Send": grpc.unary_unary_rpc_method_handler(handlers.send),
        "Lookup": grpc.unary_unary_rpc_method_handler(handlers.lookup),
    }
    service = grpc.method_handlers_generic_handler("demo.v1.Gateway", methods)
    server.add_generic_rpc_handlers((service,))
    port = server.add_insecure_port(listen)
    return server, port


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT."""
    ledger = Ledger(Path(args.db), dedupe=args.dedupe)
    leases = None if args.ledger_only else LeaseClient(args.leasekeeper)
    server, port = build_server(ledger, leases, args.listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        checks = "ledger only" if leases is None else "leasekeeper check + ledger"
        host = args.listen.rsplit(":", 1)[0]
        dedupe = "; dedupe by effect_key" if args.dedupe else ""
        _say(f"listening on {host}:{port} (fence checks: {checks}; ledger {args.db}{dedupe})")
        await stop.wait()
    finally:
        await server.stop(0.5)
        if leases is not None:
            await leases.close()
        ledger.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point: serve the gateway, or print its ledger with ``--show``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", required=True, help="SQLite file of the gateway's ledger")
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port (0: any free port)")
    parser.add_argument("--leasekeeper", default="127.0.0.1:9457", help="lease service address")
    parser.add_argument(
        "--ledger-only", action="store_true", help="skip the leasekeeper check (ledger alone)"
    )
    parser.add_argument(
        "--dedupe", action="store_true", help="record one send per task and effect_key"
    )
    parser.add_argument("--show", action="store_true", help="print the ledger's sends and exit")
    args = parser.parse_args(argv)
    if args.show:
        for row in read_sends(Path(args.db)):
            print(json.dumps(row))
        return 0
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
