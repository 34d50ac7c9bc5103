"""The heartbeat: one loop per held lease that keeps it renewed over a stream.

One supervisor task per lease opens a ``Heartbeat`` stream, and on it runs a
writer (a beat every ``interval_s``) and a reader (one answer per beat, in
order, each moving the :class:`~leasekeeper._trust.TrustWindow`). Outcomes:

* the stream ends ABORTED with a reason: the lease is lost (pushed by the server);
* the trust deadline passes without a confirmed renewal, however healthy the
  stream looks (a black-holed network): lost with ``LEASE_EXPIRED`` (or
  ``RUNTIME_EXCEEDED`` when the lease was already ending at its runtime budget);
* UNAVAILABLE, a broken or stalled stream, an unexpected end: reopen the stream
  on the same channel (possibly another replica) with the same fence, with
  backoff (each wait at most RESUME_MAX_S and a quarter of the trust left), for
  as long as the trust deadline allows; meanwhile
  ``renewal_error`` says why, until a renewal is confirmed again;
* another error the server will repeat (INVALID_ARGUMENT, ...): lost, with that
  reason; except an INVALID_ARGUMENT naming a carried checkpoint's field (its
  data too large): the stream is reopened at once and the save asks SaveCheckpoint;
* stop(): half-close, the server ends the stream OK; the lease stays HELD.

A checkpoint may ride on the stream (:meth:`HeartbeatKeeper.carry_checkpoint`):
the writer sends it on a beat of its own at once, and the answer to that beat
says which version is stored after it. Every answer's ``checkpoint_version``
is kept (``stored_checkpoint_version``). A checkpoint whose beat is not
answered on the stream it was sent on is reported not carried
(:class:`CheckpointNotCarried`): its caller asks SaveCheckpoint instead, which
decides whether it was stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from ._backoff import Backoff
from ._trust import Clock, TrustWindow
from ._types import from_duration, instant
from .errors import InvalidArgument, LeaseError, LeaseLost, from_rpc_error
from .v1 import lease_service_pb2 as pb

logger = logging.getLogger("leasekeeper.heartbeat")

# Codes after which the stream is reopened with the same fence. INTERNAL is
# among them because grpc.aio reports "Internal error from Core" in place of
# the server's status when a beat's write races the stream's end
# (grpc/grpc#36066): the reopened stream's first message then hears the real
# reason (ABORTED with it, if the lease is lost).
_TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
RESUME_MAX_S = 1.0
"""The longest wait before reopening a failed heartbeat stream, in seconds."""
RESUME_SHARE_OF_TRUST = 0.25
"""The largest share of the time left until the trust deadline one resume wait may take.

Each wait before reopening a stream is drawn with full jitter (so a fleet that
lost one server does not come back in one wave) from an exponential backoff
from 50 ms up to ``min(interval, RESUME_MAX_S)``, and is never longer than this
share of the trust left: a worker tries again many times before its lease
could be lost, ever more often as the deadline nears."""
DEFAULT_BEATS_PER_TTL = 3
"""Beats per ttl when the caller does not choose the cadence (an interval of ttl / 3)."""
MIN_BEATS_PER_TTL = 2
"""The fewest beats per ttl a chosen cadence may leave: an interval of at most ttl / 2.

With one beat per ttl, each renewal would be sent at about the lease's trust
deadline, so the lease would be lost between every two beats; with two, a beat
has half the ttl (less the safety margin) to be answered.
"""
MIN_BEAT_INTERVAL_S = 0.01
"""The shortest interval between beats, chosen or default."""
STALL_INTERVALS = 2
"""A beat unanswered for this many beat intervals marks the stream stalled (reopen it)."""
STOP_TIMEOUT_S = 5.0
"""Seconds stop() waits for the server to end a half-closed stream before cancelling it."""


def check_beat_interval(interval_s: float | None, ttl_s: float | None) -> None:
    """Refuse a heartbeat cadence that leaves fewer than two beats per ttl.

    Args:
        interval_s: The chosen seconds between beats, or None for the default (ttl / 3).
        ttl_s: The lease's ttl in seconds, or None for the server's default.

    Raises:
        InvalidArgument: (a ``ValueError``, raised locally) naming ``heartbeat_interval``:
            below MIN_BEAT_INTERVAL_S, above ttl / 2, or given without a ttl
            (the server's default ttl is not known before the grant).

    """
    if interval_s is None:
        return
    if ttl_s is None:
        problem = "needs an explicit ttl (the server's default ttl is unknown before the grant)"
    elif interval_s < MIN_BEAT_INTERVAL_S:
        problem = f"must be at least {MIN_BEAT_INTERVAL_S} s"
    elif interval_s * MIN_BEATS_PER_TTL > ttl_s:
        problem = (
            f"must leave at least {MIN_BEATS_PER_TTL} beats per ttl "
            f"(at most ttl / {MIN_BEATS_PER_TTL} = {ttl_s / MIN_BEATS_PER_TTL:g} s)"
        )
    else:
        return
    raise InvalidArgument(
        f"heartbeat_interval {problem}, got {interval_s:g} s",
        field_violations=[("heartbeat_interval", problem)],
        code=None,
    )


def beat_interval_s(interval_s: float | None, ttl_s: float) -> float:
    """Seconds between beats: the chosen ``interval_s``, else ttl / 3 (at least 10 ms)."""
    if interval_s is not None:
        return interval_s
    return max(ttl_s / DEFAULT_BEATS_PER_TTL, MIN_BEAT_INTERVAL_S)


class _StreamStalled(Exception):
    """A beat went unanswered for longer than STALL_INTERVALS beat intervals."""


class CheckpointNotCarried(Exception):
    """A checkpoint could not be carried on the stream, or its beat went unanswered.

    Raised by :meth:`HeartbeatKeeper.carry_checkpoint` when no stream is open
    (reopening, stopped, lost) or the stream ended before the beat's answer:
    whether it was stored is then unknown. Ask SaveCheckpoint.
    """


class _Beat:
    """One beat sent and not yet answered: when it left, and the checkpoint it carried."""

    __slots__ = ("saved", "send_time", "written_time")

    def __init__(self, send_time: float, saved: asyncio.Future[tuple[int, bool]] | None) -> None:
        self.send_time = send_time
        self.written_time = float("inf")  # until the write returned
        self.saved = saved  # answered with the stored version, for a checkpoint's beat


class HeartbeatKeeper:
    """Keeps one lease renewed until stopped or lost.

    Args:
        open_stream: Opens a new ``Heartbeat`` stream-stream call.
        first_request: The message naming the lease, sent first on every stream.
        interval_s: Seconds between beats (:func:`beat_interval_s`).
        window: The lease's trust window; every confirmed renewal moves it.
        on_lost: Called once, from the keeper's task, when the lease is lost.
        clock: The window's monotonic clock.
        backoff: Delays between stream reopenings.
    """

    def __init__(
        self,
        *,
        open_stream: Callable[[], Any],
        first_request: pb.HeartbeatRequest,
        interval_s: float,
        window: TrustWindow,
        on_lost: Callable[[LeaseLost], None],
        clock: Clock,
        backoff: Backoff | None = None,
    ) -> None:
        self._open_stream = open_stream
        self._first_request = first_request
        self._interval_s = interval_s
        self._window = window
        self._on_lost = on_lost
        self._clock = clock
        self._backoff = backoff or Backoff(
            initial_s=0.05, max_s=max(min(interval_s, RESUME_MAX_S), 0.05)
        )
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # set by stop() and by a checkpoint to carry
        self._outbox: deque[tuple[pb.Checkpoint, asyncio.Future[tuple[int, bool]]]] = deque()
        self._streaming = False  # a stream is open and has answered a beat
        self._task: asyncio.Task[None] | None = None
        self.lost: LeaseLost | None = None
        self.renewal_error: LeaseError | None = None
        """Why the last stream failed, while no renewal has been confirmed since."""
        self.streams_opened = 0
        self.stored_checkpoint_version = 0
        """The highest stored checkpoint version the server's answers told (0: none)."""

    @property
    def running(self) -> bool:
        """True while the keeper task has not finished."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the keeper task on the running loop."""
        name = f"leasekeeper-heartbeat-{self._first_request.task_id}"
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name=name)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop beating: half-close the stream and wait for the server's OK.

        The lease stays HELD on the server until it expires or is released.
        After ``timeout_s`` seconds the stream is cancelled instead. Idempotent.
        """
        self._stop.set()
        self._wake.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        except asyncio.CancelledError:
            task.cancel()  # never leave a heartbeat running behind a cancelled exit
            raise

    async def carry_checkpoint(self, checkpoint: pb.Checkpoint) -> tuple[int, bool]:
        """Save ``checkpoint`` with a beat of the open stream, sent at once.

        The server decides it as SaveCheckpoint does, in the beat's renewal; a
        version that does not move forward is not stored and does not end the
        stream.

        Args:
            checkpoint: Its version, data and content type.

        Returns:
            The stored checkpoint's version after the beat, and whether the
            stored one is this checkpoint (HeartbeatResponse.checkpoint_saved:
            saved by the beat, or already stored alike by this fence).

        Raises:
            CheckpointNotCarried: No stream is open and answering now, or it
                ended before the beat was answered (stored or not: unknown).

        """
        if not self._streaming or self._stop.is_set() or self.lost is not None:
            raise CheckpointNotCarried("no heartbeat stream is open")
        stored: asyncio.Future[tuple[int, bool]] = asyncio.get_running_loop().create_future()
        self._outbox.append((checkpoint, stored))
        self._wake.set()
        return await stored

    def _next_beat(self) -> tuple[pb.HeartbeatRequest, asyncio.Future[tuple[int, bool]] | None]:
        """The next beat after the first: a checkpoint's, when one waits, else an empty one."""
        while self._outbox:
            checkpoint, stored = self._outbox.popleft()
            if not stored.done():  # its caller may have been cancelled
                return pb.HeartbeatRequest(checkpoint=checkpoint), stored
        return pb.HeartbeatRequest(), None

    def _drop_checkpoints(self, sent: deque[_Beat]) -> None:
        """The stream is over: every checkpoint not answered on it is not carried."""
        self._streaming = False
        waiting = [beat.saved for beat in sent if beat.saved is not None]
        waiting += [stored for _, stored in self._outbox]
        self._outbox.clear()
        for stored in waiting:
            if not stored.done():
                stored.set_exception(CheckpointNotCarried("the heartbeat stream ended"))

    def _lose(self, error: LeaseLost) -> None:
        if self.lost is None and not self._stop.is_set():
            self.lost = error
            self._on_lost(error)

    def _lost_error(self, reason: str, cause: BaseException | None = None) -> LeaseLost:
        request = self._first_request
        error = LeaseLost(reason, request.task_id, request.fence)
        error.__cause__ = cause
        return error

    async def _supervise(self) -> None:
        while not self._stop.is_set():
            if self._window.expired():
                self._lose(self._lost_error(self._window.loss_reason))
                return
            try:
                clean = await self._stream_within_trust()
            except LeaseLost as error:
                self._lose(error)
                return
            except LeaseError as error:
                if _checkpoint_refused(error):
                    # The carried checkpoint was refused, not the lease: its save
                    # asks SaveCheckpoint (which raises the refusal); beat on.
                    logger.info("heartbeat stream for %s: %s", self._task_name(), error)
                elif error.code not in _TRANSIENT_CODES:
                    self._lose(self._lost_error(error.reason or _code_name(error), error))
                    return
                else:
                    logger.info("heartbeat stream for %s failed: %s", self._task_name(), error)
                    self.renewal_error = error
            except _StreamStalled:
                logger.info("heartbeat stream for %s stalled; reopening", self._task_name())
                self.renewal_error = LeaseError(
                    f"heartbeat stream stalled: a beat unanswered for {STALL_INTERVALS} intervals"
                )
            except Exception as error:
                logger.exception("heartbeat for %s failed", self._task_name())
                self._lose(self._lost_error("INTERNAL", error))
                return
            else:
                if clean:
                    return
                logger.info("heartbeat stream for %s ended early; reopening", self._task_name())
                self.renewal_error = LeaseError("heartbeat stream ended before it was stopped")
            delay_s = min(
                self._backoff.next_delay_s(),
                RESUME_SHARE_OF_TRUST * max(self._window.remaining_s(), 0.0),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay_s)

    def _task_name(self) -> str:
        return f"{self._first_request.namespace}/{self._first_request.task_id}"

    async def _stream_within_trust(self) -> bool:
        """Run one stream until it ends; raise LeaseLost when trust runs out first."""
        call = self._open_stream()
        self.streams_opened += 1
        stream = asyncio.get_running_loop().create_task(self._run_stream(call))
        try:
            while not stream.done():
                remaining_s = self._window.remaining_s()
                if remaining_s <= 0:
                    raise self._lost_error(self._window.loss_reason)
                await asyncio.wait({stream}, timeout=remaining_s)
            return stream.result()
        finally:
            if not stream.done():
                stream.cancel()
                with contextlib.suppress(BaseException):
                    await stream
            call.cancel()

    async def _run_stream(self, call: Any) -> bool:
        """Beat on ``call``; True when it ended OK after our half-close."""
        sent: deque[_Beat] = deque()  # the beats not yet answered, in order
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(call, sent))
        writer = loop.create_task(self._write(call, sent))
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_EXCEPTION)
            if writer.done() and writer.exception() is not None:
                raise writer.exception()  # type: ignore[misc]
            await reader
        finally:
            self._drop_checkpoints(sent)  # first: no await may stop it
            for task in (reader, writer):
                if not task.done():
                    task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
        return self._stop.is_set()

    async def _write(self, call: Any, sent: deque[_Beat]) -> None:
        request, saved = self._first_request, None
        while True:
            # Measured from when the oldest unanswered beat left, not when it was
            # queued: the first write also waits for the connection.
            # Two intervals, not one: under load a slow answer is common, and a
            # needless reopen costs more than it saves.
            if sent and self._clock() - sent[0].written_time > STALL_INTERVALS * self._interval_s:
                raise _StreamStalled()
            # The trust window counts from before the send: the conservative end.
            beat = _Beat(self._clock(), saved)
            sent.append(beat)
            try:
                await call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return  # the call is over; the reader reports its status
            beat.written_time = self._clock()
            if not self._stop.is_set() and not self._outbox:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._interval_s)
            if self._stop.is_set():
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await call.done_writing()
                return
            request, saved = self._next_beat()

    async def _read(self, call: Any, sent: deque[_Beat]) -> None:
        request = self._first_request
        while True:
            try:
                response = await call.read()
            except grpc.aio.AioRpcError as error:
                raise from_rpc_error(error, task_id=request.task_id, fence=request.fence) from error
            if response is grpc.aio.EOF:
                return
            self.stored_checkpoint_version = max(
                self.stored_checkpoint_version, response.checkpoint_version
            )
            if not sent:
                continue  # more answers than beats: nothing to measure from
            beat = sent.popleft()
            self._window.confirm(
                beat.send_time,
                from_duration(response.remaining_ttl),
                renewed=response.renewed,
                expire_time=instant(response, "expire_time"),
            )
            self._streaming = True
            if response.renewed:
                self.renewal_error = None
            if beat.saved is not None and not beat.saved.done():
                beat.saved.set_result((response.checkpoint_version, response.checkpoint_saved))
            self._backoff.reset()


def _checkpoint_refused(error: LeaseError) -> bool:
    """True when the stream ended INVALID_ARGUMENT for a beat's checkpoint (e.g. its size)."""
    field = error.field if isinstance(error, InvalidArgument) else None
    return field is not None and field.startswith("checkpoint.")


def _code_name(error: LeaseError) -> str:
    return error.code.name if error.code is not None else "UNKNOWN"
