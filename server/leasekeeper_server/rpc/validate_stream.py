"""ValidateFence's decision, and the ValidateFences stream that carries many of them.

An effect service validates a fence before every effect. A unary call costs
the server about three times what a message on an open stream costs in
gRPC's own machinery, so effect services keep one ValidateFences stream open
and send each check on it (``leasekeeper.LeaseClient.validate_fence`` does).

:func:`fence_answer` is the decision, written once: the unary ValidateFence
(``servicer.py``) and every check of a stream call it. It reads the task
through ``LeaseStore.get_lease``, whose reads arriving together share one
statement (the coalescer, ``storage/batch.py``): each check is submitted
after its message was read, so the statement that decides it reads the
database clock after the check arrived, as for a unary call; no answer is
ever served from an earlier read.

A stream reads messages in its handler's task (``_read``) and decides each
message's checks in a task of their own, so checks of later messages do not
wait for earlier ones: answers go out in the order they are decided, each
with its check's id. One writer task (``_write``) sends what is decided,
several answers per message when several are ready (group commit), at most
``MAX_CHECKS_PER_MESSAGE`` a message. At most ``MAX_DECIDING`` checks of a
stream are read and not yet written (being decided, or decided and waiting
for the writer); past that the stream stops reading, and gRPC's flow control
holds the client back: a client that stops reading its answers makes the
server stop reading its checks, never buffer them without bound.

A check's bad input, or a namespace the caller's token does not cover, is
that check's answer (a serialized ``google.rpc.Status``, made by
``handling.status_for`` as a unary call's would be); the stream goes on.
The stream ends OK after the client half-closes and every check read is
answered; UNAVAILABLE when the server shuts down (after answering the checks
it had read); UNAUTHENTICATED or PERMISSION_DENIED when the caller's token
is revoked or no longer covers a namespace the stream named; and
INVALID_ARGUMENT for a message that does not parse (its checks cannot be
told apart, so none can be answered).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.core.errors import InvalidArgument, ShuttingDown
from leasekeeper_server.core.model import TaskKey, fence_loss
from leasekeeper_server.rpc import convert, validate
from leasekeeper_server.rpc.handling import check_parsed, error_bytes
from leasekeeper_server.rpc.waiting import first_of, guarding_credentials
from leasekeeper_server.security import caller as auth
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage.protocol import LeaseStore

log = logging.getLogger(__name__)

# The most checks in one message (a batch statement's size, storage/batch.py).
MAX_CHECKS_PER_MESSAGE = 1000
# The most checks of one stream read and not yet answered on the wire (being
# decided, or decided and waiting for the writer).
MAX_DECIDING = 4000
# The trailer that carries a status's google.rpc.Status (grpc_status.rpc_status).

Answer = pb.ValidateFencesResponse.Answer


async def fence_answer(store: LeaseStore, key: TaskKey, fence: int) -> pb.ValidateFenceResponse:
    """Whether ``fence`` may act on the task now: ValidateFence's answer, always OK.

    One read of the task on the database clock (``core.model.fence_loss`` is
    the rule); a refused stale fence is written to the task's history (the
    first refusal of each fence and reason, method ``ValidateFence``).

    Raises:
        DatabaseUnavailable: the database could not be reached (UNAVAILABLE).
    """
    lease = await store.get_lease(key)
    reason = fence_loss(lease, fence)
    if reason is None and lease is not None:
        return pb.ValidateFenceResponse(
            valid=True,
            current_fence=lease.fence,
            remaining_ttl=convert.duration(lease.remaining_ttl),
            expire_time=convert.timestamp(lease.expire_time),
        )
    if lease is not None and reason is not None:  # a stale fence: into the task's history
        await store.record_refusal(key, fence, reason, "ValidateFence")
    return pb.ValidateFenceResponse(
        valid=False,
        current_fence=lease.fence if lease is not None else 0,
        reason=convert.loss_reason(reason),
    )


class ValidateFencesService:
    """Serves ValidateFences streams; the server's shutdown ends them (UNAVAILABLE)."""

    def __init__(self, store: LeaseStore, settings: Settings, *, shutdown: asyncio.Event) -> None:
        """The service; ``shutdown`` is the server-wide signal (``app.py`` sets it to stop)."""
        self._store = store
        self._settings = settings
        self._shutdown = shutdown
        self.open_streams = 0
        """ValidateFences streams open now."""
        self.unwritten = 0
        """Checks read on the open streams whose answers are not yet written."""
        self.held_back = 0
        """Open streams not reading, until answers already decided are written."""

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        """Runs one stream to its end (the handler is wrapped by ``handling.streaming``).

        Returns when the client has half-closed and every check read is answered (OK).

        Raises:
            ShuttingDown: the server is shutting down (UNAVAILABLE), after the
                checks already read were answered.
            InvalidArgument: a message does not parse.
            Unauthenticated, PermissionDenied: the token was revoked, or no
                longer covers a namespace the stream named.
        """
        self.open_streams += 1
        try:
            await _Stream(self, context).run()
        finally:
            self.open_streams -= 1


class _Stream:
    def __init__(self, service: ValidateFencesService, context: grpc.aio.ServicerContext) -> None:
        self._service = service
        self._store = service._store
        self._settings = service._settings
        self._shutdown = service._shutdown
        self._context = context
        self._outbox: list[Any] = []  # answers decided and not yet written
        self._answered = asyncio.Event()  # set when an answer joins the outbox
        self._flushed = asyncio.Event()  # set when the writer has emptied the outbox
        self._deciding = 0  # checks read and not yet answered
        self._unwritten = 0  # checks read whose answer is not yet written (at most MAX_DECIDING)
        self._room = asyncio.Event()  # set when the stream may read again (below MAX_DECIDING)
        self._draining = False  # nothing more will be read: the writer ends once all is written
        self._namespaces: set[str] = set()  # the namespaces the stream named, for the guard
        self._tasks: set[asyncio.Task[None]] = set()  # one per message being decided

    async def run(self) -> None:
        async with guarding_credentials(self._namespaces) as credentials:
            watchdog = asyncio.ensure_future(
                first_of(
                    changed=None,
                    shutdown=self._shutdown,
                    credentials=credentials,
                    timeout_s=None,
                    then="validate again on a new stream",
                )
            )
            writing = asyncio.ensure_future(self._write())
            reading = asyncio.ensure_future(self._read())
            ended: BaseException | None = None  # a shutdown: the stream's status once drained
            try:
                pending: set[asyncio.Future[Any]] = {watchdog, writing, reading}
                while writing in pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    if watchdog in done:
                        ended = watchdog.exception()
                        if not isinstance(ended, ShuttingDown):
                            watchdog.result()  # the token: raises at once, nothing more answered
                        reading.cancel()  # shutting down: answer what was read, then end
                        self._stop_reading()
                    if reading in done:
                        if not reading.cancelled():
                            reading.result()  # raises for a message that does not parse
                        self._stop_reading()
                writing.result()  # raises when a write failed
                if ended is not None:
                    raise ended
            finally:
                tasks = (watchdog, writing, reading, *self._tasks)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self._service.unwritten -= self._unwritten

    def _stop_reading(self) -> None:
        self._draining = True
        self._answered.set()  # the writer ends once every check read is written

    async def _read(self) -> None:
        """Reads messages until the client half-closes; starts the deciding of each one's checks.

        Raises:
            InvalidArgument: a message does not parse.
        """
        loop = asyncio.get_running_loop()
        while True:
            message = await self._context.read()
            if message is grpc.aio.EOF:
                return
            check_parsed(message)
            checks = message.checks
            if not checks:
                continue
            while self._unwritten and self._unwritten + len(checks) > MAX_DECIDING:
                self._room.clear()
                self._service.held_back += 1
                try:
                    await self._room.wait()
                finally:
                    self._service.held_back -= 1
            self._deciding += len(checks)
            self._unwritten += len(checks)
            self._service.unwritten += len(checks)
            task = loop.create_task(self._decide_all(checks))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _decide_all(self, checks: Any) -> None:
        if len(checks) > MAX_CHECKS_PER_MESSAGE:
            error = error_bytes(
                InvalidArgument(
                    "checks",
                    f"{len(checks)} checks in one message; at most {MAX_CHECKS_PER_MESSAGE}",
                )
            )
            # A refusal per check, about 260 bytes each, for checks of about 16: made
            # a message's worth at a time, once the previous ones are written.
            for start in range(0, len(checks), MAX_CHECKS_PER_MESSAGE):
                self._flushed.clear()
                for check in checks[start : start + MAX_CHECKS_PER_MESSAGE]:
                    self._answer(Answer(id=check.id, error=error))
                await self._flushed.wait()
        elif len(checks) == 1:
            await self._decide(checks[0])
        else:
            await asyncio.gather(*(self._decide(check) for check in checks))

    async def _decide(self, check: Any) -> None:
        """Decides one check and puts its answer in the outbox (its error, for a refusal)."""
        try:
            request = check.request
            s = self._settings
            key = validate.task_key(request, s)
            fence = validate.fence("fence", request.fence)
            auth.authorize_namespace(key.namespace)  # the interceptor cannot read a stream's checks
            self._namespaces.add(key.namespace)  # re-checked while the stream runs
            # Four frames to SQL, as the unary call: fence_answer -> Store.get_lease ->
            # Coalescer.submit -> (the drainer) BatchedStatement._run_batch.
            answer = Answer(id=check.id, response=await fence_answer(self._store, key, fence))
        except Exception as exc:  # the check's answer; the stream goes on
            answer = Answer(id=check.id, error=error_bytes(exc))
        self._answer(answer)

    def _answer(self, answer: Any) -> None:
        self._outbox.append(answer)
        self._deciding -= 1
        self._answered.set()

    async def _write(self) -> None:
        """Writes the answers as they are decided; returns once draining and all is written.

        At most ``MAX_CHECKS_PER_MESSAGE`` answers a message, so that none
        outgrows a client's message size limit (4 MiB by default); the room
        for more checks is made once their answers are written.
        """
        while True:
            if self._outbox:
                answers = self._outbox[:MAX_CHECKS_PER_MESSAGE]
                del self._outbox[:MAX_CHECKS_PER_MESSAGE]
                await self._context.write(pb.ValidateFencesResponse(answers=answers))
                self._unwritten -= len(answers)
                self._service.unwritten -= len(answers)
                if self._unwritten < MAX_DECIDING:
                    self._room.set()
                if not self._outbox:
                    self._flushed.set()
                continue
            if self._draining and not self._deciding:
                return
            self._answered.clear()
            await self._answered.wait()
