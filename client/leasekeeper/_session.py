"""One Session stream per client, carrying every lease its ``hold()`` blocks keep.

A client that holds one lease at a time keeps it on a Heartbeat stream of
its own (``_heartbeat.py``), exactly as before sessions existed. As soon as
it keeps a second one, :class:`SessionKeeper` moves them all onto one
``Session`` stream, and every lease it keeps from then on joins that stream:
one beat renews them all, in one database statement on the server.

Each lease keeps what a heartbeat gives it, from its :class:`SessionLease`:

* its own :class:`~leasekeeper._trust.TrustWindow`, moved by each answer that
  renewed it (measured from when the answered message was sent). When its
  trust deadline passes without a confirmed renewal, however healthy the
  stream looks, it is lost (``LEASE_EXPIRED`` or ``RUNTIME_EXCEEDED``) and
  dropped from the session; the others go on;
* its loss, pushed by the server with its reason as soon as the server learns
  it: the lease leaves the session, its ``on_lost`` is called at once (its
  ``hold()`` block is cancelled), and the stream goes on;
* ``renewal_error`` while the stream is failing: UNAVAILABLE, a broken,
  stalled or early-ended stream reopens on the same channel (perhaps another
  replica) with backoff (each wait at most ``RESUME_MAX_S`` and a quarter of
  the shortest trust left), and the new stream adds every lease again with
  its fence; another error the server would repeat loses every lease with
  its reason; a server without Session (UNIMPLEMENTED) sends every lease back
  to a heartbeat of its own;
* ``stop()``: the lease is dropped (the server answers the drop, so a release
  sent after it is never mistaken for a loss); it stays HELD until released.

Checkpoints do not ride on the session: a lease in a session saves them with
SaveCheckpoint (``checkpoints.py``). A checkpoint is a write with its own
answer, up to 256 KiB, rarely as frequent as beats; on a shared stream it
would hold up every other lease's renewal behind its bytes and its refusal.

When its last lease leaves, the session half-closes its stream (the server
ends it OK); the next lease to join opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from ._backoff import Backoff
from ._heartbeat import (
    _TRANSIENT_CODES,
    RESUME_MAX_S,
    RESUME_SHARE_OF_TRUST,
    STALL_INTERVALS,
    STOP_TIMEOUT_S,
)
from ._trust import Clock, TrustWindow
from ._types import from_duration, instant
from ._validate_stream import check_error
from .errors import LeaseError, LeaseLost, from_rpc_error
from .v1 import lease_service_pb2 as pb

logger = logging.getLogger("leasekeeper.session")

MAX_ADDS_PER_MESSAGE = 1000
"""The most adds one SessionRequest may carry (the server's limit)."""


class SessionMember(Protocol):
    """A held lease as the session moves it (``HeldLease``)."""

    def enter_session(self, keeper: SessionKeeper) -> None:
        """Be kept on ``keeper``'s stream from now on (a heartbeat it has stops once confirmed)."""


class _StreamStalled(Exception):
    """A message went unanswered for longer than STALL_INTERVALS beat intervals."""


class _Unsupported(Exception):
    """The server has no Session (UNIMPLEMENTED): every lease goes back to a heartbeat."""


class SessionLease:
    """One lease in the client's session: its trust window, its loss, its renewal error.

    Made by :meth:`SessionKeeper.add`. ``on_lost`` is called once, from the
    session's task, when the lease is lost; ``fallback`` when the server has
    no Session (the lease must be kept by a heartbeat of its own instead).
    """

    def __init__(
        self,
        keeper: SessionKeeper,
        lease_id: int,
        add: pb.SessionRequest.Add,
        interval_s: float,
        window: TrustWindow,
        on_lost: Callable[[LeaseLost], None],
        fallback: Callable[[], None],
    ) -> None:
        self._keeper = keeper
        self.id = lease_id
        self.add = add
        self.interval_s = interval_s
        self.window = window
        self._on_lost = on_lost
        self._fallback = fallback
        self.lost: LeaseLost | None = None
        self.renewal_error: LeaseError | None = None
        """Why the session's last stream failed, while no renewal has been confirmed since."""
        self.stored_checkpoint_version = 0
        """The highest stored checkpoint version the session's answers told (0: none)."""
        self.settled = asyncio.Event()
        """Set once a renewal on the session is confirmed, or the lease left it."""
        self.stream = 0  # the number of the stream it was added on (0: not on the current one)
        self.stopped = False

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Drop the lease from the session; waits up to ``timeout_s`` for the server's answer.

        The lease stays HELD until it expires or is released. Idempotent.
        """
        await self._keeper.remove(self, timeout_s)

    def _confirm(self, send_time: float, held: pb.SessionResponse.Held) -> None:
        self.window.confirm(
            send_time,
            from_duration(held.remaining_ttl),
            renewed=held.renewed,
            expire_time=instant(held, "expire_time"),
        )
        self.stored_checkpoint_version = max(
            self.stored_checkpoint_version, held.checkpoint_version
        )
        if held.renewed:
            self.renewal_error = None
        self.settled.set()

    def _lose(self, error: LeaseLost) -> None:
        self.settled.set()
        if self.lost is None and not self.stopped:
            self.lost = error
            self._on_lost(error)

    def _lost_error(self, reason: str, cause: BaseException | None = None) -> LeaseLost:
        error = LeaseLost(reason, self.add.task_id, self.add.fence)
        error.__cause__ = cause
        return error


class _Sent:
    """One message sent and not yet answered."""

    __slots__ = ("drops", "send_time", "sequence", "written_time")

    def __init__(self, sequence: int, send_time: float, drops: list[asyncio.Future[None]]) -> None:
        self.sequence = sequence
        self.send_time = send_time
        self.written_time = float("inf")  # until the write returned
        self.drops = drops  # resolved by this message's answer


class SessionKeeper:
    """The client's Session stream and the leases on it (one per ``LeaseClient``).

    Args:
        open_stream: Opens a new ``Session`` stream-stream call.
        clock: The trust windows' monotonic clock.
        backoff: Delays between stream reopenings.
    """

    def __init__(
        self, *, open_stream: Callable[[], Any], clock: Clock, backoff: Backoff | None = None
    ) -> None:
        self._open_stream = open_stream
        self._clock = clock
        self._backoff = backoff or Backoff(initial_s=0.05, max_s=RESUME_MAX_S)
        self._ids = itertools.count(1)
        self._leases: dict[int, SessionLease] = {}
        self._drops: dict[int, asyncio.Future[None]] = {}  # ids to drop on the current stream
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stream = 0  # the current stream's number (0: none open)
        self._half_closed = False  # the current stream's writer half-closed it (no lease left)
        self._holding: set[SessionMember] = set()
        self._on_heartbeat: set[SessionMember] = set()
        self.unsupported = False
        """True once the server answered UNIMPLEMENTED: every lease is kept by a heartbeat."""
        self.streams_opened = 0

    @property
    def leases(self) -> int:
        """Leases in the session now."""
        return len(self._leases)

    # --- which leases ride on the session --------------------------------------------

    def hold(self, member: SessionMember) -> bool:
        """A lease starts being kept: True when it is to join the session, False for a heartbeat.

        The first lease a client keeps gets a heartbeat of its own (one lease:
        exactly what the client did before sessions). A second one joins the
        session, and every lease still on a heartbeat is moved onto it.
        """
        self._holding.add(member)
        if self.unsupported or len(self._holding) < 2:
            self._on_heartbeat.add(member)
            return False
        moving = [m for m in self._on_heartbeat if m is not member]
        self._on_heartbeat.clear()
        for other in moving:
            other.enter_session(self)
        return True

    def release(self, member: SessionMember) -> None:
        """A lease is no longer kept (its block ended, or the run did)."""
        self._holding.discard(member)
        self._on_heartbeat.discard(member)

    def add(
        self,
        add: pb.SessionRequest.Add,
        *,
        interval_s: float,
        window: TrustWindow,
        on_lost: Callable[[LeaseLost], None],
        fallback: Callable[[], None],
    ) -> SessionLease:
        """Puts a lease in the session: it is added (and renewed) by the next message.

        Args:
            add: The lease (its ``id`` is set here).
            interval_s: Seconds between its beats; the session beats at the
                shortest interval of its leases.
            window: The lease's trust window; every confirmed renewal moves it.
            on_lost: Called once, from the session's task, when the lease is lost.
            fallback: Called when the server has no Session: keep the lease
                with a heartbeat instead.
        """
        lease_id = next(self._ids)
        add.id = lease_id
        lease = SessionLease(self, lease_id, add, interval_s, window, on_lost, fallback)
        self._leases[lease_id] = lease
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._supervise(), name="leasekeeper-session"
            )
        self._wake.set()
        return lease

    async def remove(self, lease: SessionLease, timeout_s: float) -> None:
        """Takes ``lease`` out of the session; waits up to ``timeout_s`` for the drop's answer."""
        lease.stopped = True
        lease.settled.set()
        if self._leases.pop(lease.id, None) is None:
            return
        dropped = self._drop(lease)
        self._wake.set()
        if dropped is not None and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(dropped), timeout_s)

    async def close(self) -> None:
        """Stops the session's task (the client is closing); its leases end by their ttl."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _drop(self, lease: SessionLease) -> asyncio.Future[None] | None:
        """Asks the current stream to drop ``lease``; None when it is not on it."""
        if lease.stream != self._stream or self._stream == 0:
            return None
        dropped: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drops[lease.id] = dropped
        return dropped

    def _lose(self, lease: SessionLease, error: LeaseLost, *, drop: bool) -> None:
        """``lease`` is lost: out of the session (dropped from the stream when ``drop``)."""
        if self._leases.pop(lease.id, None) is None:
            return
        if drop:
            self._drop(lease)
            self._wake.set()
        lease._lose(error)

    def _expire_untrusted(self) -> None:
        """Loses every lease whose trust deadline has passed (dropped from the stream)."""
        for lease in [lease for lease in self._leases.values() if lease.window.expired()]:
            self._lose(lease, lease._lost_error(lease.window.loss_reason), drop=True)

    def _until_untrusted_s(self) -> float | None:
        """Seconds until the earliest trust deadline of the session's leases (None: none)."""
        if not self._leases:
            return None
        return max(0.0, min(lease.window.remaining_s() for lease in self._leases.values()))

    def _interval_s(self) -> float:
        return min((lease.interval_s for lease in self._leases.values()), default=RESUME_MAX_S)

    # --- the stream ------------------------------------------------------------------

    async def _supervise(self) -> None:
        while self._leases:
            self._expire_untrusted()
            if not self._leases:
                break
            try:
                if await self._stream_once():
                    continue  # ended OK after our half-close: every lease had left
                error: LeaseError = LeaseError("session stream ended before it was stopped")
            except _Unsupported:
                self._fall_back()
                return
            except _StreamStalled:
                error = LeaseError(
                    f"session stream stalled: a message unanswered for {STALL_INTERVALS} intervals"
                )
            except LeaseError as failure:
                if failure.code not in _TRANSIENT_CODES:
                    for lease in list(self._leases.values()):
                        reason = failure.reason or _code_name(failure)
                        self._lose(lease, lease._lost_error(reason, failure), drop=False)
                    return
                error = failure
            except Exception as failure:
                logger.exception("session stream failed")
                for lease in list(self._leases.values()):
                    self._lose(lease, lease._lost_error("INTERNAL", failure), drop=False)
                return
            logger.info("session stream failed (%d leases): %s", len(self._leases), error)
            for lease in self._leases.values():
                lease.renewal_error = error
            await self._wait_to_resume()

    async def _wait_to_resume(self) -> None:
        """Waits the backoff's delay (at most a share of the shortest trust left)."""
        trust_s = self._until_untrusted_s() or 0.0
        delay_s = min(self._backoff.next_delay_s(), RESUME_SHARE_OF_TRUST * trust_s)
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay_s)

    def _fall_back(self) -> None:
        """The server has no Session: every lease goes back to a heartbeat of its own."""
        logger.info("the server has no Session stream: each lease keeps a heartbeat")
        self.unsupported = True
        leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            lease.stopped = True
            lease.settled.set()
            lease._fallback()

    async def _stream_once(self) -> bool:
        """Runs one stream until it ends; True when it ended OK after our half-close."""
        call = self._open_stream()
        self.streams_opened += 1
        self._stream = self.streams_opened
        self._drops = {}
        self._half_closed = False
        sent: deque[_Sent] = deque()
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(call, sent))
        writer = loop.create_task(self._write(call, sent))
        try:
            while not reader.done():
                # Each lease's trust deadline is kept here too: a write blocked on a
                # black-holed connection must not keep a lease trusted.
                done, _ = await asyncio.wait(
                    {reader, writer},
                    timeout=self._until_untrusted_s(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done:
                    self._expire_untrusted()
                elif writer in done and reader not in done:
                    writer.result()  # raises what stopped the writer (a stall)
                    await asyncio.wait(
                        {reader}, timeout=None if self._half_closed else STOP_TIMEOUT_S
                    )
                    if not reader.done():
                        raise LeaseError("session stream: no answer after its last message")
            reader.result()  # raises the stream's status
            return self._half_closed
        finally:
            self._stream = 0
            for task in (reader, writer):
                if not task.done():
                    task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            call.cancel()
            # The stream is gone: so is every lease on it, as far as the server knows.
            for record in sent:
                for dropped in record.drops:
                    if not dropped.done():
                        dropped.set_result(None)
            for dropped in self._drops.values():
                if not dropped.done():
                    dropped.set_result(None)
            self._drops = {}

    async def _write(self, call: Any, sent: deque[_Sent]) -> None:
        """Sends adds, drops and beats; half-closes once no lease is left."""
        sequence = 0
        stream = self._stream
        next_beat = self._clock()  # the first message adds every lease (renewing it)
        while True:
            self._expire_untrusted()
            interval_s = self._interval_s()
            now = self._clock()
            if sent and now - sent[0].written_time > STALL_INTERVALS * interval_s:
                raise _StreamStalled()
            if not self._leases and not self._drops:
                self._half_closed = True
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await call.done_writing()
                return
            adding = [lease for lease in self._leases.values() if lease.stream != stream]
            adding = adding[:MAX_ADDS_PER_MESSAGE]
            covers_all = len(adding) == len(self._leases)  # every lease renewed by its add
            beat = now >= next_beat and not covers_all
            if adding or self._drops or beat:
                sequence += 1
                drops, self._drops = self._drops, {}
                request = pb.SessionRequest(
                    sequence=sequence,
                    add=[lease.add for lease in adding],
                    drop=list(drops),
                    beat=beat,
                )
                record = _Sent(sequence, now, list(drops.values()))
                sent.append(record)
                for lease in adding:
                    lease.stream = stream
                try:
                    await call.write(request)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    return  # the call is over; the reader reports its status
                record.written_time = self._clock()
                if beat or covers_all:
                    next_beat = now + interval_s
                continue  # more to add, or drops that came meanwhile
            wait_s = max(0.0, next_beat - self._clock())
            untrusted_s = self._until_untrusted_s()
            if untrusted_s is not None:
                wait_s = min(wait_s, untrusted_s)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)

    async def _read(self, call: Any, sent: deque[_Sent]) -> None:
        """Applies each answer (renewals, losses, refusals) and each pushed loss."""
        while True:
            try:
                response = await call.read()
            except grpc.aio.AioRpcError as error:
                if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                    raise _Unsupported() from error
                raise from_rpc_error(error) from error
            if response is grpc.aio.EOF:
                return
            send_time: float | None = None
            if response.sequence:
                while sent and sent[0].sequence < response.sequence:
                    sent.popleft()  # never happens with a server that answers each message
                if sent and sent[0].sequence == response.sequence:
                    record = sent.popleft()
                    send_time = record.send_time
                    for dropped in record.drops:
                        if not dropped.done():
                            dropped.set_result(None)
            if send_time is not None:
                for held in response.held:
                    lease = self._leases.get(held.id)
                    if lease is not None:
                        lease._confirm(send_time, held)
            for lost in response.lost:
                lease = self._leases.get(lost.id)
                if lease is not None:
                    reason = pb.LossReason.Name(lost.reason).removeprefix("LOSS_REASON_")
                    self._lose(lease, lease._lost_error(reason), drop=False)
            for refused in response.refused:
                lease = self._leases.get(refused.id)
                if lease is not None:
                    refusal = check_error(refused.error, lease.add.task_id, lease.add.fence)
                    reason = refusal.reason or _code_name(refusal)
                    self._lose(lease, lease._lost_error(reason, refusal), drop=False)
            self._backoff.reset()


def _code_name(error: LeaseError) -> str:
    return error.code.name if error.code is not None else "UNKNOWN"
