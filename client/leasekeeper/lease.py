"""Holding a lease: ``async with client.hold(task_id) as lease``.

:class:`LeaseHold` is the async context manager returned by
``LeaseClient.hold``; it yields a :class:`HeldLease`.

Entering claims the task (waiting for it if asked), sets the trust deadline
from the claim, and starts one heartbeat stream renewing every
``heartbeat_interval`` (ttl / 3 by default). A grant that arrives after its own
trust deadline (a late reply) raises ``LeaseLost`` at once: no heartbeat is
opened and nothing is sent for that fence. While the block runs the heartbeat
moves the deadline after each confirmed renewal (``send_time + remaining_ttl -
safety_margin`` on the client's monotonic clock).

When ownership is lost -- the server ends the heartbeat with a reason, or the
trust deadline passes without a confirmed renewal, however healthy the stream
looks -- the task running the block is cancelled, as ``asyncio.timeout`` does,
and the ``async with`` raises :class:`~leasekeeper.LeaseLost`: for a passed
trust deadline reason ``RUNTIME_EXCEEDED`` when the last confirmed answer
already ended the lease at its runtime budget, else ``LEASE_EXPIRED``; the
server's reason otherwise.

Exiting stops the heartbeat (half-close) and releases the lease (best effort:
a failed release is logged; the lease then ends by its ttl). An exception
raised by the block propagates unchanged; the lease is released all the same.
A block that exits normally after the trust deadline passed raises
``LeaseLost``: its work may have run without the lease. After a loss nothing
stands between the block and the error: the stream is cancelled, not
half-closed, and a lease that may still be ours is released in the background
(within RELEASE_AFTER_LOSS_TIMEOUT_S, by a task of the client, which ``close()``
waits for no longer than that).
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType

import grpc

from ._backoff import Backoff
from ._heartbeat import STOP_TIMEOUT_S, HeartbeatKeeper, beat_interval_s
from ._owner import new_request_id
from ._ports import HoldingClient
from ._trust import TrustWindow, default_safety_margin
from ._types import ClaimResult, LeaseInfo, to_duration
from .effects import EffectRunner, Reconcile
from .errors import (
    ClaimTimeout,
    LeaseError,
    LeaseLost,
    NotAcquired,
)
from .fencing import FenceRef
from .v1 import lease_service_pb2 as pb

logger = logging.getLogger("leasekeeper.lease")

# A lease lost for one of these reasons belongs to someone else (or to nobody
# ever again): releasing it is pointless.
_NOT_OURS = frozenset(
    {
        "LEASE_SUPERSEDED",
        "LEASE_RELEASED",
        "LEASE_REVOKED",
        "TASK_COMPLETED",
        "NOT_OWNER",
        "FENCE_UNKNOWN",
    }
)
# Codes after which a claim's outcome is unknown or it never ran: retried with
# the same request id (a granted claim comes back as the same lease). CANCELLED:
# a replica shutting down cancels calls it had not yet handed to the service.
_CLAIM_RETRY_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
RELEASE_AFTER_LOSS_TIMEOUT_S = 2.0
"""Seconds the background release of a lost lease may take, if the call timeout is longer (a
dead network would take all of it); the lease ends by its ttl if it does not get through."""
CLAIM_BACKOFF_INITIAL_S = 0.05
CLAIM_BACKOFF_MAX_S = 2.0


class HeldLease:
    """A lease held inside ``async with client.hold(...)``.

    Pass :meth:`metadata` to every side effect, and :meth:`check` before
    starting each piece of work. Run effects that must not be repeated through
    :meth:`effect`.
    """

    def __init__(self, client: HoldingClient, info: LeaseInfo, window: TrustWindow) -> None:
        self._client = client
        self._info = info
        self._window = window
        self._keeper: HeartbeatKeeper | None = None
        self._loss: LeaseLost | None = None
        self._body_task: asyncio.Task[object] | None = None
        self._body_active = False
        self._cancelled_body = False
        self._releasing = False
        self._released = False
        self._completed = False

    @property
    def task_id(self) -> str:
        """The task."""
        return self._info.task_id

    @property
    def namespace(self) -> str:
        """The task's namespace."""
        return self._info.namespace

    @property
    def owner_id(self) -> str:
        """The owner the lease was granted to."""
        return self._info.owner_id

    @property
    def fence(self) -> int:
        """The fencing token of this lease."""
        return self._info.fence

    @property
    def info(self) -> LeaseInfo:
        """The lease as granted by the claim."""
        return self._info

    @property
    def ref(self) -> FenceRef:
        """``(namespace, task_id, fence)`` as a :class:`~leasekeeper.FenceRef`."""
        return FenceRef(self.namespace, self.task_id, self.fence)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata carrying the lease to an effect boundary.

        Returns:
            ``(("leasekeeper-namespace", ns), ("leasekeeper-task-id", id),
            ("leasekeeper-fence", str(fence)))``.

        """
        return self.ref.metadata()

    @property
    def lost(self) -> bool:
        """True once ownership is lost: reported by the server or trust deadline passed."""
        return self.loss is not None

    @property
    def loss(self) -> LeaseLost | None:
        """The loss, or None while the lease is trusted (or after :meth:`complete`)."""
        if self._completed:
            return None
        if self._loss is None and self._window.expired():
            self._loss = LeaseLost(self._window.loss_reason, self.task_id, self.fence)
        return self._loss

    def check(self) -> None:
        """Raise if the lease may not be acted on any more.

        Raises:
            LeaseLost: The lease is lost (reason from the server, or LEASE_EXPIRED /
                RUNTIME_EXCEEDED for a passed trust deadline).

        """
        loss = self.loss
        if loss is not None:
            raise loss

    def effect(
        self,
        effect_key: str,
        *,
        policy: str,
        request_digest: bytes = b"",
        reconcile: Reconcile | None = None,
    ) -> EffectRunner:
        """An effect of this lease's task, run through the effect ledger with this fence.

        Use the runner as a decorator or call its ``run``; see
        :mod:`leasekeeper.effects` for the protocol::

            @lease.effect("email:welcome", policy="ONCE", reconcile=find_sent)
            async def send() -> str:
                return await mailer.send(to, body)

            outcome = await send()  # outcome.result, outcome.fresh

        Args:
            effect_key: The effect's idempotency key, unique within the task
                (1-256 bytes UTF-8 by default, no control characters).
            policy: Required. ``"ONCE"`` when the effect cannot be taken back
                (an email sent, a card charged): the first confirmed outcome
                stands for ever, a later owner gets it instead of a second send.
                ``"LATEST"`` when it replaces what was there (a draft, a status):
                a newer fence does it again and an older fence's completion is
                refused.
            request_digest: Digest of what the effect will do
                (:func:`~leasekeeper.request_digest`); the same key begun with
                another digest is refused. At most 64 bytes; empty for none.
            reconcile: ``async (EffectRecord) -> bytes | str | None``: asked
                when an earlier attempt was never confirmed; returns the outside
                system's record of the effect, or None if it never happened.
                None: such an effect raises ``EffectInDoubt``.

        Returns:
            The runner; nothing is sent until it runs.

        Raises:
            InvalidArgument: ``policy`` is not ONCE or LATEST (raised locally).

        """
        return EffectRunner(
            self, effect_key, policy=policy, request_digest=request_digest, reconcile=reconcile
        )

    def remaining_s(self) -> float:
        """Seconds left until the trust deadline on the client's monotonic clock (>= 0)."""
        return max(self._window.remaining_s(), 0.0)

    @property
    def renewal_error(self) -> LeaseError | None:
        """Why renewals are not being confirmed now, or None while they are.

        Set as soon as a heartbeat stream fails without a loss: ``LeaseUnavailable``
        when the server ends it UNAVAILABLE (reason ``DATABASE_UNAVAILABLE``: the
        database is out of reach or refuses writes; ``SHUTTING_DOWN``: the replica
        is stopping), another transient status, or a stream that stalled or ended
        early. Cleared by the next confirmed renewal.

        It is not a loss: the lease stays HELD in the database until its
        expire_time, and the heartbeat keeps resuming it with the same fence (on
        whichever replica answers) until the trust deadline; only then is the
        lease lost and the block cancelled. A holder that would rather not start
        a step it cannot finish within :meth:`remaining_s` checks it between steps.
        """
        return self._keeper.renewal_error if self._keeper is not None else None

    async def complete(self) -> LeaseInfo:
        """Mark the task COMPLETED now (release with ``complete=True``), then stop the heartbeat.

        The call's deadline is the trust deadline when that comes before the
        call timeout: past the trust deadline the lease counts as lost, and no
        answer can change that. The block's exit then releases nothing.
        Idempotent once it succeeded.

        Returns:
            The task's lease, now COMPLETED.

        Raises:
            LeaseLost: The lease was already lost (nothing is sent); the server
                refused with ABORTED (e.g. LEASE_SUPERSEDED): the task is not
                completed; or the trust deadline passed before an answer came
                (LEASE_EXPIRED, or RUNTIME_EXCEEDED when the last confirmed answer
                ended the lease at its runtime budget; the call is cancelled, its
                DEADLINE_EXCEEDED the cause): whether the task was completed is
                unknown, and the lease is lost: commit nothing.
            LeaseUnavailable: UNAVAILABLE: the task is not completed, the heartbeat
                goes on; safe to call again.

        """
        if self._completed:
            return self._info
        self.check()
        deadline, left_s = self._window.deadline, self._window.remaining_s()
        self._releasing = True  # the server ends the heartbeat once completed: not a loss
        try:
            info = await self._client._release(self.task_id, self.fence, True, left_s)
        except LeaseLost as error:
            self._loss = self._loss or error
            raise
        except LeaseError as error:
            if self._loss is None and self._cut_off(error, deadline, left_s):
                self._loss = LeaseLost(
                    self._window.loss_reason,
                    self.task_id,
                    self.fence,
                    message="lease lost: its trust deadline passed before the completion "
                    f"was confirmed ({self._window.loss_reason})",
                )
            if self._loss is not None:
                raise self._loss from error
            raise
        finally:
            self._releasing = False
        self._info, self._completed, self._released, self._loss = info, True, True, None
        if self._keeper is not None:
            await self._keeper.stop()
        return info

    def _cut_off(self, error: LeaseError, deadline: float | None, left_s: float) -> bool:
        """Whether ``error`` is the cut-off of a call bounded by the trust deadline ``deadline``.

        A renewal confirmed while the call ran moved the deadline: the lease is
        then still trusted and the error is only the call's.
        """
        call_timeout_s = self._client._call_timeout_s
        bounded = call_timeout_s is None or left_s < call_timeout_s
        return (
            bounded
            and error.code is grpc.StatusCode.DEADLINE_EXCEEDED
            and self._window.deadline == deadline
        )

    def _on_lost(self, error: LeaseLost) -> None:
        """Called by the heartbeat, in its own task, when ownership is lost."""
        if self._loss is None or self._loss.reason == "LEASE_EXPIRED":
            self._loss = error
        if self._releasing or not self._body_active or self._body_task is None:
            return
        self._cancelled_body = True
        self._body_task.cancel()

    async def _finish(self, release: bool) -> None:
        """Stop the heartbeat and release (best effort; in the background after a loss)."""
        if self._keeper is not None:
            # After a loss there is no OK to wait for: cancel the stream at once.
            await self._keeper.stop(timeout_s=0.0 if self.lost else STOP_TIMEOUT_S)
        if not release or self._released:
            return
        self._released = True
        loss = self.loss  # judged again: the trust deadline may have passed while stopping
        if loss is None:
            await self._release(timeout_s=None, level=logging.WARNING)
        elif loss.reason not in _NOT_OURS:
            self._client._spawn(
                self._release(timeout_s=RELEASE_AFTER_LOSS_TIMEOUT_S, level=logging.INFO),
                name=f"leasekeeper-release-{self.task_id}",
            )

    async def _release(self, *, timeout_s: float | None, level: int) -> None:
        """Release this fence (within ``timeout_s`` if below the call timeout); log a failure."""
        try:
            await self._client._release(self.task_id, self.fence, False, timeout_s)
        except LeaseLost:
            pass  # already gone; nothing to give back
        except LeaseError as error:
            logger.log(
                level,
                "release of %s/%s fence %d failed (the lease ends by its ttl): %s",
                self.namespace,
                self.task_id,
                self.fence,
                error,
            )


class LeaseHold:
    """``async with client.hold(...) as lease``: claim, keep renewed, release.

    Entering:

    * claims the task; when another owner holds it and ``wait_s`` is set,
      retries with exponential backoff and full jitter (never sleeping past the
      holder's remaining ttl) until ``wait_s`` seconds have passed, then raises
      ``ClaimTimeout``; with ``wait_s`` None raises ``NotAcquired`` at once;
    * UNAVAILABLE and DEADLINE_EXCEEDED (the outcome of a claim is then
      unknown: it may have been granted, its reply lost) are retried the same
      way within ``wait_s``, else raised (``LeaseUnavailable``, ``LeaseError``).
      Every attempt of one acquisition carries the same request id, so a retry
      of a claim that was granted gets that same lease and fence back, on
      whichever replica it lands; ``TaskCompleted`` and ``InvalidArgument`` are
      raised;
    * a second ``hold()`` of the same task on the same client counts as "held by
      another owner" until the first exits, without asking the server (both
      are this client's owner id: the server would take the second claim, with
      its own request id, for a new incarnation and supersede the first).

    The trust safety margin defaults to ``min(1 s, ttl / 10)``; beats go every
    ``heartbeat_interval_s``, by default ttl / 3. With ``ttl_s`` None (the
    server's default ttl) the granted remaining ttl stands in for ttl.
    """

    def __init__(
        self,
        client: HoldingClient,
        task_id: str,
        *,
        ttl_s: float | None,
        max_runtime_s: float | None,
        wait_s: float | None,
        safety_margin_s: float | None,
        release_on_exit: bool,
        heartbeat_interval_s: float | None = None,
    ) -> None:
        self._client = client
        self._task_id = task_id
        self._ttl_s = ttl_s
        self._max_runtime_s = max_runtime_s
        self._wait_s = wait_s
        self._safety_margin_s = safety_margin_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._release_on_exit = release_on_exit
        self._lease: HeldLease | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> HeldLease:
        if self._lease is not None:
            raise RuntimeError("a LeaseHold can be entered only once")
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("hold() must be used inside an asyncio task")
        self._task, self._cancelling = task, task.cancelling()
        result = await self._acquire()
        try:
            self._lease = self._start(result, task)
        except BaseException:
            self._client._unmark_held(self._task_id)
            raise
        self._lease._body_active = True
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease = self._lease
        assert lease is not None and self._task is not None
        lease._body_active = False  # before any await: no cancellation lands in here
        loss = lease.loss  # judged now: the cleanup's own time must not count against the block
        await self._exit_cleanup()
        if lease._cancelled_body:
            mine = self._task.uncancel() <= self._cancelling
            if mine and (exc is None or isinstance(exc, asyncio.CancelledError)):
                raise (
                    loss or LeaseLost(lease._window.loss_reason, lease.task_id, lease.fence)
                ) from exc
            return
        if exc is None and loss is not None:
            raise loss

    async def _exit_cleanup(self) -> None:
        assert self._lease is not None
        try:
            await self._lease._finish(release=self._release_on_exit)
        finally:
            self._client._unmark_held(self._task_id)

    def _start(self, result: ClaimResult, task: asyncio.Task[object]) -> HeldLease:
        """Trust the grant and start its heartbeat.

        Raises:
            LeaseLost: The grant arrived after its own trust deadline (a late
                reply); nothing is started or sent for its fence.

        """
        assert result.lease is not None
        client, info = self._client, result.lease
        ttl_s = self._ttl_s if self._ttl_s is not None else info.remaining_ttl
        margin_s = (
            self._safety_margin_s
            if self._safety_margin_s is not None
            else default_safety_margin(ttl_s)
        )
        window = TrustWindow(margin_s, client.clock, info.runtime_deadline)
        window.confirm(result.send_time, info.remaining_ttl, expire_time=info.expire_time)
        if window.expired():
            raise LeaseLost(
                window.loss_reason,
                info.task_id,
                info.fence,
                message=f"lease lost: the grant arrived after its trust deadline "
                f"({window.loss_reason})",
            )
        lease = HeldLease(client, info, window)
        lease._body_task = task
        first = pb.HeartbeatRequest(
            namespace=info.namespace,
            task_id=info.task_id,
            owner_id=info.owner_id,
            fence=info.fence,
            ttl=to_duration(self._ttl_s, "ttl"),
        )
        lease._keeper = HeartbeatKeeper(
            open_stream=client._open_heartbeat,
            first_request=first,
            interval_s=beat_interval_s(self._heartbeat_interval_s, ttl_s),
            window=window,
            on_lost=lease._on_lost,
            clock=client.clock,
        )
        lease._keeper.start()
        return lease

    async def _acquire(self) -> ClaimResult:
        client, clock = self._client, self._client.clock
        deadline = None if self._wait_s is None else clock() + self._wait_s
        backoff = Backoff(CLAIM_BACKOFF_INITIAL_S, CLAIM_BACKOFF_MAX_S)
        # One logical claim, however many attempts: a retry of an attempt that was
        # granted (reply lost) gets that lease back instead of superseding it.
        request_id = new_request_id()
        while True:
            hint_s: float | None = None
            if client._mark_held(self._task_id):
                try:
                    result = await client.claim(
                        self._task_id, self._ttl_s, self._max_runtime_s, request_id=request_id
                    )
                except LeaseError as error:
                    client._unmark_held(self._task_id)
                    unknown = error.code in _CLAIM_RETRY_CODES
                    if not unknown or deadline is None or clock() >= deadline:
                        raise
                except BaseException:
                    client._unmark_held(self._task_id)
                    raise
                else:
                    if result.acquired:
                        return result
                    client._unmark_held(self._task_id)
                    hint_s = result.holder_remaining_ttl
            if deadline is None:
                raise NotAcquired(
                    f"task {self._task_id!r} is held by another owner",
                    task_id=self._task_id,
                    holder_remaining_ttl=hint_s,
                )
            left_s = deadline - clock()
            if left_s <= 0:
                raise ClaimTimeout(
                    f"task {self._task_id!r} still held by another owner after {self._wait_s} s",
                    task_id=self._task_id,
                    holder_remaining_ttl=hint_s,
                )
            await asyncio.sleep(min(backoff.next_delay_s(hint_s), left_s))
