"""The Session stream: many leases of one worker kept alive on one stream.

A Heartbeat stream serves one lease; a worker holding a hundred leases would
keep a hundred streams, each message one renewal. A session carries them all
(as etcd's LeaseKeepAlive stream carries every lease of a client, and a
Consul session's renewal covers every lock taken through it), while each
lease keeps its own ttl, fence and expiry in its own row: a lease is lost
alone, and the stream goes on with the others.

Each message adds leases, drops leases, and with ``beat`` renews every lease
of the session; it gets one answer carrying its ``sequence``. An add is
checked like a Heartbeat's first message (the fields, then the caller's
token against its namespace) and renewed at once; a refused add is answered
with its status and the stream goes on. The renewals one message asks for
are submitted together, so they join one batch of the ``renew`` statement
(``storage.batch``), with the renewals of every other stream arriving at
the same time: one statement for many renewals. A lease renewed sooner than
its renew interval (``keeping.renew_interval_s``) is answered from that
renewal, without a write.

Beside the stream's task, one watchdog task per session waits
(``waiting.first_of``) for any of its leases' tasks to change (each lease
rings the session's doorbell, ``ChangeFeed.ring``: no task or event per
lease), for the earliest instant the database said one of them would end,
for the server's shutdown and for the caller's token. It then reads the
leases concerned on the database clock (the reads of one wake-up share a
statement) and pushes each loss at once, with its reason, in a message of
sequence 0. A lease starts ringing before its first renewal, so no change
falls between the two.

The stream ends with OK when the client half-closes (every lease left in the
session stays HELD until it expires or is released), with UNAVAILABLE when
the server shuts down or loses its database (the leases live on: the client
adds them to a new session with the same fences), with UNAUTHENTICATED or
PERMISSION_DENIED when the caller's token is revoked or no longer covers a
namespace of the session, and with INVALID_ARGUMENT for a message whose
answers could not be matched (not a SessionRequest, sequence 0, an add id
that is 0 or already in the session, too many adds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.core.errors import InvalidArgument, LeaseLost, PermissionDenied
from leasekeeper_server.core.model import Lease, LeaseRef, LossReason, TaskKey
from leasekeeper_server.observability.metrics import Metrics
from leasekeeper_server.rpc import convert, validate
from leasekeeper_server.rpc.handling import check_parsed, error_bytes
from leasekeeper_server.rpc.keeping import (
    log_loss,
    read_loss,
    remaining_since,
    renew_interval_s,
    seconds_left,
)
from leasekeeper_server.rpc.waiting import TIMER_SLACK_S, Woken, first_of, guarding_credentials
from leasekeeper_server.security import caller as auth
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage.protocol import ChangeFeed, LeaseStore

log = logging.getLogger(__name__)

MAX_ADDS = 1000
"""The most adds one SessionRequest may carry."""
MAX_LEASES = 10_000
"""The most leases one session may hold; an add beyond it is refused (field ``add``)."""


class SessionService:
    """Serves Session streams; the server's shutdown ends them all (UNAVAILABLE)."""

    def __init__(
        self,
        store: LeaseStore,
        events: ChangeFeed,
        settings: Settings,
        metrics: Metrics | None = None,
        *,
        shutdown: asyncio.Event,
    ) -> None:
        """The service; ``shutdown`` is the server-wide signal (``app.py`` sets it when stopping).

        ``metrics`` receives the loss-notice time (:meth:`Metrics.loss_told`)
        of the losses the watchdog reads; None for a registry of its own.
        """
        self._store = store
        self._events = events
        self._settings = settings
        self._metrics = metrics if metrics is not None else Metrics()
        self._shutdown = shutdown
        self.open_streams = 0
        """Session streams open now."""
        self.leases = 0
        """Leases in open sessions now."""

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        """Runs one stream to its end (the handler is wrapped by ``handling.streaming``).

        Returns when the client half-closes (OK).

        Raises:
            InvalidArgument: a message whose answers could not be matched.
            ShuttingDown: the server is shutting down (UNAVAILABLE).
            Unauthenticated, PermissionDenied: the token is refused or revoked.
            DatabaseUnavailable: the database is out of reach (UNAVAILABLE).
        """
        self.open_streams += 1
        try:
            await _Session(self, context).run()
        finally:
            self.open_streams -= 1


class _Kept:
    """One lease of a session: what its add asked, its last read, and its doorbell."""

    __slots__ = (
        "id",
        "interval_s",
        "lease",
        "ref",
        "renewed_at",
        "ringing",
        "seen_at",
        "session",
        "ttl",
    )

    def __init__(self, session: _Session, lease_id: int, ref: LeaseRef, ttl: timedelta) -> None:
        self.session = session
        self.id = lease_id
        self.ref = ref
        self.ttl = ttl
        self.interval_s = renew_interval_s(session.settings, ttl)
        self.lease: Lease | None = None  # the last read (renewal or check); None before the first
        self.seen_at = 0.0  # monotonic, when that read was answered
        self.renewed_at = 0.0  # monotonic, when the last renewal was answered
        self.ringing: contextlib.AbstractContextManager[None] | None = None

    def set(self) -> None:
        """The doorbell: the lease's task changed (or changes may have been missed)."""
        self.session.rung(self)

    def renewed(self, lease: Lease) -> None:
        """Records a renewal's answer: the lease as renewed, and when it was answered."""
        self.lease = lease
        self.seen_at = self.renewed_at = time.monotonic()

    def held(self, renewed: bool) -> pb.SessionResponse.Held:
        """The lease as its last renewal left it (its ttl counted down when not ``renewed``)."""
        lease = self.lease
        assert lease is not None
        remaining = lease.remaining_ttl if renewed else remaining_since(lease, self.seen_at)
        return pb.SessionResponse.Held(
            id=self.id,
            fence=lease.fence,
            expire_time=convert.timestamp(lease.expire_time),
            remaining_ttl=convert.duration(remaining),
            renewed=renewed,
            checkpoint_version=lease.checkpoint_version or 0,
        )


class _Session:
    def __init__(self, service: SessionService, context: grpc.aio.ServicerContext) -> None:
        self._service = service
        self._store = service._store
        self._events = service._events
        self.settings = service._settings
        self._metrics = service._metrics
        self._shutdown = service._shutdown
        self._context = context
        self._kept: dict[int, _Kept] = {}  # by id
        self._tasks: dict[TaskKey, _Kept] = {}  # the same leases, by task
        # The namespaces of the leases, counted: the credentials guard re-checks
        # each of them (its keys) whenever it checks the token.
        self._namespaces: Counter[str] = Counter()
        self._rung: set[_Kept] = set()  # leases whose task changed since the watchdog looked
        self._wake = asyncio.Event()  # a lease rang, or was added (an earlier timer, perhaps)
        self._writing = asyncio.Lock()  # answers and pushed losses are written one at a time
        self._ended: Exception | None = None  # why the watchdog ended the stream

    async def run(self) -> None:
        reader = asyncio.current_task()
        assert reader is not None
        # A token revoked while the stream runs ends it (UNAUTHENTICATED).
        async with guarding_credentials(self._namespaces) as credentials:
            watchdog = asyncio.ensure_future(self._watch(credentials, reader))
            try:
                while True:
                    message = await self._context.read()
                    if message is grpc.aio.EOF:
                        return
                    await self._answer(message)
            except asyncio.CancelledError:
                if self._ended is None:
                    raise  # the call itself was cancelled
                reader.uncancel()
                raise self._ended from None
            finally:
                watchdog.cancel()
                for kept in list(self._kept.values()):
                    self._leave(kept)

    # --- the stream's task: one message, one answer ---------------------------------

    async def _answer(self, message: Any) -> None:
        """Handles one message (drops, adds, beat) and writes its answer.

        Raises:
            InvalidArgument: the message cannot be answered (ends the stream).
        """
        check_parsed(message)
        if message.sequence == 0:
            raise InvalidArgument("sequence", "must be at least 1")
        if len(message.add) > MAX_ADDS:
            raise InvalidArgument("add", f"at most {MAX_ADDS} per message, got {len(message.add)}")
        self._check_add_ids(message)
        answer = pb.SessionResponse(sequence=message.sequence)
        for lease_id in message.drop:
            kept = self._kept.get(lease_id)
            if kept is not None:
                self._leave(kept)
        added = [kept for add in message.add if (kept := self._admit(add, answer)) is not None]
        renewing = list(added)
        unwritten: list[_Kept] = []
        if message.beat:
            now, fresh = time.monotonic(), set(added)
            for kept in self._kept.values():
                if kept in fresh:
                    continue
                if now - kept.renewed_at >= kept.interval_s:
                    renewing.append(kept)
                else:
                    unwritten.append(kept)
        await self._renew(renewing, answer)
        answer.held.extend(k.held(renewed=False) for k in unwritten if self._has(k))
        await self._write(answer)

    def _check_add_ids(self, message: Any) -> None:
        """Checks that each add's id can name its answer, before the message changes anything.

        Raises:
            InvalidArgument: an add's id is 0, names a lease of the session
                that the message does not drop, or is another add's of the
                same message (even a refused one: its refusal and the other's
                answer would carry one id); ends the stream.
        """
        dropped = set(message.drop)
        seen: set[int] = set()
        for add in message.add:
            if add.id == 0:
                raise InvalidArgument("add.id", "must be at least 1")
            if add.id in seen:
                raise InvalidArgument("add.id", f"{add.id} names two adds of this message")
            if add.id in self._kept and add.id not in dropped:
                raise InvalidArgument("add.id", f"{add.id} already names a lease of this session")
            seen.add(add.id)

    def _admit(self, add: pb.SessionRequest.Add, answer: pb.SessionResponse) -> _Kept | None:
        """Checks an add and puts its lease in the session (ringing); None when refused.

        Its id was checked (``_check_add_ids``). A refused add is answered in
        ``answer.refused`` with its status.
        """
        try:
            ref = validate.lease_ref(add, self.settings)
            ttl = validate.ttl(add, self.settings)
            auth.authorize_namespace(ref.key.namespace)
            other = self._tasks.get(ref.key)
            if other is not None:
                raise InvalidArgument("task_id", f"is already in this session (id {other.id})")
            if len(self._kept) >= MAX_LEASES:
                raise InvalidArgument("add", f"the session already holds {MAX_LEASES} leases")
        except (InvalidArgument, PermissionDenied) as error:
            answer.refused.add(id=add.id, error=error_bytes(error))
            return None
        kept = _Kept(self, add.id, ref, ttl)
        self._enter(kept)
        return kept

    async def _renew(self, renewing: list[_Kept], answer: pb.SessionResponse) -> None:
        """Renews ``renewing`` (submitted together: one batch) and answers each.

        A lease found lost leaves the session, answered in ``answer.lost``.

        Raises:
            DatabaseUnavailable: the database is out of reach (ends the stream).
        """
        if not renewing:
            return
        # Each renewal joins the coalescer's next batch of `renew` (four frames to
        # SQL, as a Heartbeat's): submitted in one turn of the loop, one statement.
        results = await asyncio.gather(
            *(self._store.renew(kept.ref, kept.ttl) for kept in renewing),
            return_exceptions=True,
        )
        failure: BaseException | None = None
        for kept, result in zip(renewing, results, strict=True):
            if isinstance(result, Lease):
                kept.renewed(result)
                if self._has(kept):
                    answer.held.append(kept.held(renewed=True))
            elif isinstance(result, LeaseLost):
                lost = self._lose(kept, result.loss, result.current_fence)
                if lost is not None:
                    answer.lost.append(lost)
            elif failure is None:
                failure = result
        if failure is not None:
            raise failure

    # --- the watchdog: losses pushed as soon as they are learned ----------------------

    async def _watch(self, credentials: asyncio.Future[Any], reader: asyncio.Task[Any]) -> None:
        """Pushes each lease's loss; ends the stream (cancelling ``reader``) when it must end.

        It must end on the server's shutdown, a lost token or a database error.
        Waits for a ring of a lease's task, the earliest instant the database
        said a lease would end (if no renewal moved it since), the server's
        shutdown or the token's revocation; then reads the leases concerned,
        one read each on the database clock (together: one statement).
        """
        try:
            while True:
                woken = await first_of(
                    changed=self._wake,
                    shutdown=self._shutdown,
                    credentials=credentials,
                    timeout_s=self._until_check_s(),
                    then="open a session again and add the leases with the same fences",
                )
                if woken is Woken.CHANGED:
                    self._wake.clear()
                due = self._rung | self._ending()
                self._rung = set()
                await self._check([kept for kept in due if self._has(kept)])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # ends the stream with this status
            self._ended = exc
            reader.cancel()

    def _until_check_s(self) -> float | None:
        """Seconds until the earliest end the database named for a lease (None: no lease)."""
        lefts = [seconds_left(k.lease, k.seen_at) for k in self._kept.values() if k.lease]
        return max(0.0, min(lefts)) + TIMER_SLACK_S if lefts else None

    def _ending(self) -> set[_Kept]:
        """The leases whose end, as the database last named it, has come."""
        return {k for k in self._kept.values() if k.lease and seconds_left(k.lease, k.seen_at) <= 0}

    async def _check(self, leases: list[_Kept]) -> None:
        """Reads each of ``leases`` on the database clock; pushes the losses in one message."""
        if not leases:
            return
        metrics = self._metrics
        reads = await asyncio.gather(*(read_loss(self._store, k.ref, metrics) for k in leases))
        pushed = pb.SessionResponse(sequence=0)
        for kept, (lease, reason) in zip(leases, reads, strict=True):
            if reason is None:
                assert lease is not None
                # Still ours (renewed meanwhile, perhaps): plan the next check from this read.
                kept.lease, kept.seen_at = lease, time.monotonic()
                continue
            lost = self._lose(kept, reason, lease.fence if lease is not None else 0)
            if lost is not None:
                pushed.lost.append(lost)
        if pushed.lost:
            await self._write(pushed)

    # --- the session's leases ---------------------------------------------------------

    def rung(self, kept: _Kept) -> None:
        """A lease's doorbell: its task changed; the watchdog reads it."""
        self._rung.add(kept)
        self._wake.set()

    def _has(self, kept: _Kept) -> bool:
        """Whether ``kept`` is still in the session (not lost or dropped meanwhile)."""
        return self._kept.get(kept.id) is kept

    def _enter(self, kept: _Kept) -> None:
        """Puts a lease in the session, ringing from now on (before its first renewal)."""
        self._kept[kept.id] = kept
        self._tasks[kept.ref.key] = kept
        self._namespaces[kept.ref.key.namespace] += 1
        kept.ringing = self._events.ring(kept.ref.key, kept)
        kept.ringing.__enter__()
        self._service.leases += 1
        self._wake.set()  # its expiry may be the earliest: the watchdog plans again

    def _leave(self, kept: _Kept) -> None:
        """Takes a lease out of the session (dropped, lost, or the stream ended)."""
        if not self._has(kept):
            return
        del self._kept[kept.id]
        del self._tasks[kept.ref.key]
        namespace = kept.ref.key.namespace
        self._namespaces[namespace] -= 1
        if self._namespaces[namespace] <= 0:
            del self._namespaces[namespace]
        self._rung.discard(kept)
        if kept.ringing is not None:
            kept.ringing.__exit__(None, None, None)
            kept.ringing = None
        self._service.leases -= 1

    def _lose(
        self, kept: _Kept, reason: LossReason, current_fence: int
    ) -> pb.SessionResponse.Lost | None:
        """Takes a lost lease out of the session; its Lost entry (None if it had left already)."""
        if not self._has(kept):
            return None
        self._leave(kept)
        log_loss(log, "session lease lost", kept.ref, reason)
        return pb.SessionResponse.Lost(
            id=kept.id, reason=convert.loss_reason(reason), current_fence=current_fence
        )

    async def _write(self, message: pb.SessionResponse) -> None:
        async with self._writing:
            await self._context.write(message)
