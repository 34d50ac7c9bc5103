"""The Heartbeat stream: one loop per lease that renews and pushes loss.

A stream serves one lease. Its first message names the lease and renews it;
each later message renews it again, except that beats sooner than
``min(min_renew_interval_s, ttl / 3)`` after the last renewal are answered
from that renewal without a database write (a flood never becomes a write
storm, and a short ttl can still be kept alive).

The stream's task reads and answers beats one after another. Beside it, a
watchdog task waits on a notification that the task's ownership changed
(``events.py``), a timer set for the moment the database said the lease
would end (unless a renewal moved it since), the server's shutdown and the
caller's token. When the first two fire, one read on the database clock
decides; a lost lease ends the stream at once with ABORTED and the reason
(the watchdog cancels the stream's task, which leaves with that status),
without waiting for the client's next beat. The server's monotonic clock
only schedules that read; it never decides anything.

A beat may carry a checkpoint: it is saved by that beat's renewal, in the
same statement (``renew``), so such a beat is always written; the answer's
``checkpoint_version`` says what is stored (a version that does not move
forward is not stored, and does not end the stream).

The stream ends with OK when the client half-closes (the lease stays HELD
until it expires or is released), with UNAVAILABLE when the server shuts
down or loses its database (the lease lives on; resume with the same fence),
and with INVALID_ARGUMENT when a message names another lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

import grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.core.errors import InvalidArgument, LeaseLost
from leasekeeper_server.core.model import CheckpointWrite, Lease, LeaseRef
from leasekeeper_server.observability.metrics import Metrics
from leasekeeper_server.rpc import convert, validate
from leasekeeper_server.rpc.handling import check_parsed
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


class HeartbeatService:
    """Serves heartbeat streams; the server's shutdown ends them all (UNAVAILABLE)."""

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

        ``metrics`` receives the loss-notice time (:meth:`Metrics.loss_told`),
        which only the stream's watchdog sees; None for a registry of its own.
        """
        self._store = store
        self._events = events
        self._settings = settings
        self._metrics = metrics if metrics is not None else Metrics()
        self._shutdown = shutdown
        self.open_streams = 0

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        """Runs one stream to its end (the handler is wrapped by ``handling.streaming``).

        Returns when the client half-closes (OK).

        Raises:
            LeaseLost: the lease is lost (ABORTED, with the reason).
            ShuttingDown: the server is shutting down (UNAVAILABLE).
            InvalidArgument: a message is malformed or names another lease.
            Unauthenticated, PermissionDenied: the token is refused or revoked.
            DatabaseUnavailable: the database is out of reach (UNAVAILABLE).
        """
        self.open_streams += 1
        try:
            await _Stream(
                self._store, self._events, self._settings, self._metrics, self._shutdown, context
            ).run()
        finally:
            self.open_streams -= 1


class _Stream:
    def __init__(
        self,
        store: LeaseStore,
        events: ChangeFeed,
        settings: Settings,
        metrics: Metrics,
        shutdown: asyncio.Event,
        context: grpc.aio.ServicerContext,
    ) -> None:
        self._store = store
        self._events = events
        self._settings = settings
        self._metrics = metrics
        self._shutdown = shutdown
        self._context = context
        self._ref: LeaseRef | None = None
        self._ttl = timedelta(seconds=settings.default_ttl_s)
        self._renew_interval_s = 0.0  # beats sooner than this after a renewal are not written
        self._names: tuple[tuple[str, str], ...] = ()  # the first message's ids, by field
        self._lease: Lease | None = None  # the last read of the lease (renewal or check)
        self._seen_at = 0.0  # monotonic, when that read was answered
        self._renewed_at = 0.0  # monotonic, when the last renewal was answered
        self._ended: Exception | None = None  # why the watchdog ended the stream

    async def run(self) -> None:
        first = await self._context.read()
        if first is grpc.aio.EOF:
            return
        check_parsed(first)
        self._ref = ref = validate.lease_ref(first, self._settings)
        auth.authorize_namespace(self._ref.key.namespace)
        self._names = (
            ("namespace", self._ref.key.namespace),
            ("task_id", self._ref.key.task_id),
            ("owner_id", self._ref.owner_id),
        )
        self._set_ttl(validate.ttl(first, self._settings))
        # Subscribed to the task's changes BEFORE the first renewal: a revoke (or
        # any change of owner) committed after that renewal then sets ``changed``
        # for the watchdog, instead of falling between the renewal and the
        # subscription, where only the next beat (ttl/3 later) would find it.
        with self._events.watch(self._ref.key) as changed:
            checkpoint = self._checkpoint(first)
            if checkpoint is None:
                self._renewed(await self._store.renew(ref, self._ttl))
                await self._reply(renewed=True)
            else:
                await self._renew_saving(checkpoint)
            # Beats are read and answered here, one after another, with nothing
            # else to wait for (the cheapest loop per beat); the watchdog task
            # waits for the rest and, when the stream must end, cancels this one.
            beats = asyncio.current_task()
            assert beats is not None
            # A token revoked while the stream runs ends it (UNAUTHENTICATED).
            async with guarding_credentials(self._ref.key.namespace) as credentials:
                watchdog = asyncio.ensure_future(self._watch(changed, credentials, beats))
                try:
                    while True:
                        message = await self._context.read()
                        if message is grpc.aio.EOF:
                            return
                        renews = self._beat_renews(message)
                        checkpoint = self._checkpoint(message)
                        if checkpoint is not None:
                            await self._renew_saving(checkpoint)
                        elif renews:
                            # Four frames to SQL: Store.renew -> Coalescer.submit ->
                            # Coalescer._drain -> BatchedStatement._run_batch.
                            self._renewed(await self._store.renew(ref, self._ttl))
                            await self._reply(renewed=True)
                        else:
                            await self._reply(renewed=False)
                except asyncio.CancelledError:
                    if self._ended is None:
                        raise  # the call itself was cancelled
                    beats.uncancel()
                    raise self._ended from None
                finally:
                    watchdog.cancel()

    async def _watch(
        self,
        changed: asyncio.Event,
        credentials: asyncio.Future[Any],
        beats: asyncio.Task[Any],
    ) -> None:
        """Ends the stream (cancelling ``beats``) on shutdown, a lost token or a lost lease.

        Waits for a notification that the task's ownership changed, the
        server's shutdown, the token's revocation, or the instant the
        database said the lease would end (if no renewal moved it since);
        then one read on the database clock decides.
        """
        try:
            while True:
                seen_at = self._seen_at
                woken = await first_of(
                    changed=changed,
                    shutdown=self._shutdown,
                    credentials=credentials,
                    timeout_s=self._until_check_s(),
                    then="resume with the same fence",
                )
                if woken is Woken.CHANGED:
                    changed.clear()
                elif self._seen_at != seen_at:
                    continue  # renewed meanwhile: the lease ends later than the timer said
                await self._check()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # ends the stream with this status
            self._ended = exc
            beats.cancel()

    def _until_check_s(self) -> float:
        assert self._lease is not None
        return max(0.0, seconds_left(self._lease, self._seen_at)) + TIMER_SLACK_S

    def _beat_renews(self, message: Any) -> bool:
        """Checks a beat; True when it is to be written (a renewal), False when answered as is.

        A beat sooner than the renew interval after the last renewal is
        answered from that renewal, without a statement.

        Raises:
            InvalidArgument: the beat names another lease, or a bad ttl.
        """
        check_parsed(message)
        self._check_same_lease(message)
        if message.HasField("ttl"):
            self._set_ttl(validate.ttl(message, self._settings))
        return time.monotonic() - self._renewed_at >= self._renew_interval_s

    async def _renew_saving(self, checkpoint: CheckpointWrite) -> None:
        """A beat carrying a checkpoint: renewed and saved in one statement, then answered."""
        assert self._ref is not None
        lease, stored = await self._store.write_checkpoint(self._ref, checkpoint, self._ttl)
        self._renewed(lease)
        await self._reply(renewed=True, checkpoint_saved=stored is not None)

    def _checkpoint(self, message: pb.HeartbeatRequest) -> CheckpointWrite | None:
        """The checkpoint a beat carries, checked; None when it carries none."""
        if not message.HasField("checkpoint"):
            return None
        return validate.checkpoint("checkpoint", message.checkpoint, self._settings)

    def _set_ttl(self, ttl: timedelta) -> None:
        self._ttl = ttl
        self._renew_interval_s = renew_interval_s(self._settings, ttl)

    def _check_same_lease(self, message: pb.HeartbeatRequest) -> None:
        ref = self._ref
        assert ref is not None
        for field, mine in self._names:
            value = getattr(message, field)
            if value and value != mine:
                raise InvalidArgument(field, "names another lease than this stream's first message")
        if message.fence and message.fence != ref.fence:
            raise InvalidArgument("fence", "names another lease than this stream's first message")

    def _renewed(self, lease: Lease) -> None:
        """Records a renewal's answer: the lease as renewed, and when it was answered."""
        self._lease = lease
        self._seen_at = self._renewed_at = time.monotonic()

    async def _reply(self, renewed: bool, checkpoint_saved: bool = False) -> None:
        lease = self._lease
        assert lease is not None
        remaining = lease.remaining_ttl if renewed else remaining_since(lease, self._seen_at)
        await self._context.write(
            pb.HeartbeatResponse(
                fence=lease.fence,
                renewed=renewed,
                expire_time=convert.timestamp(lease.expire_time),
                remaining_ttl=convert.duration(remaining),
                checkpoint_version=lease.checkpoint_version or 0,
                checkpoint_saved=checkpoint_saved,
            )
        )

    async def _check(self) -> None:
        """One read on the database clock: ends the stream if the lease is lost."""
        ref = self._ref
        assert ref is not None
        lease, reason = await read_loss(self._store, ref, self._metrics)
        if reason is not None:
            log_loss(log, "heartbeat ends", ref, reason)
            raise LeaseLost.of(lease, reason)
        assert lease is not None
        # Still ours (renewed elsewhere, perhaps): plan the next check from this read.
        self._lease = lease
        self._seen_at = time.monotonic()
