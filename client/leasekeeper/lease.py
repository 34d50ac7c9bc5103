"""Holding a lease: ``async with client.hold(task_id) as lease``.

:class:`LeaseHold` is the async context manager returned by
``LeaseClient.hold``; it yields a :class:`HeldLease`.

Entering claims the task (waiting for it if asked, see :mod:`leasekeeper._acquire`),
sets the trust deadline from the claim, and starts one heartbeat stream renewing
every ``heartbeat_interval`` (ttl / 3 by default); while the client keeps more
than one lease, its one Session stream renews them all instead (the same
trust deadlines, losses and exits: :mod:`leasekeeper._session`). A grant that arrives after its
own trust deadline (a late reply) raises ``LeaseLost`` at once: no heartbeat is
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

The block may end the run itself: ``lease.complete()`` (COMPLETED) or
``lease.fail(reason)`` (FAILED), both terminal. It saves its progress with
``lease.save_checkpoint(...)``; ``lease.checkpoint`` is the one received with
the grant, to resume from (see :mod:`leasekeeper.checkpoints`).

Exiting stops the heartbeat (half-close) and releases the lease (best effort:
a failed release is logged; the lease then ends by its ttl). An exception
raised by the block propagates unchanged; the lease is released all the same.
A block that exits normally after the trust deadline passed raises
``LeaseLost``: its work may have run without the lease. After a loss nothing
stands between the block and the error: the stream is cancelled, not
half-closed, and a lease that may still be ours is released in the background
(within RELEASE_AFTER_LOSS_TIMEOUT_S, by a task of the client, which ``close()``
waits for no longer than that).

:class:`HeldLease` is a state machine (:class:`LeaseState`); every change of
state goes through one method, which checks it, records the loss and cancels
the block.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from types import TracebackType
from typing import Any, NamedTuple

import grpc

from ._acquire import acquire
from ._checkpoint import Checkpoint, CheckpointLike
from ._heartbeat import STOP_TIMEOUT_S, HeartbeatKeeper, beat_interval_s
from ._ports import HoldingClient
from ._session import SessionKeeper, SessionLease
from ._trust import TrustWindow, default_safety_margin
from ._types import ClaimResult, LeaseInfo, to_duration
from .checkpoints import CheckpointWriter
from .effects import EffectRunner, Reconcile
from .errors import LeaseError, LeaseLost, TaskCompleted, TaskFailed
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
        "TASK_CANCELLED",
        "TASK_FAILED",
        "NOT_OWNER",
        "FENCE_UNKNOWN",
    }
)
RELEASE_AFTER_LOSS_TIMEOUT_S = 2.0
"""Seconds the background release of a lost lease may take, if the call timeout is longer (a
dead network would take all of it); the lease ends by its ttl if it does not get through."""


class LeaseState(enum.Enum):
    """Where a :class:`HeldLease` is in its life (``HeldLease.state``).

    Its transitions (every one through ``HeldLease._move``)::

        HOLDING    -> COMPLETING (complete()), FAILING (fail()), LOST,
                      RELEASING (the block ended)
        COMPLETING -> COMPLETED, LOST; back to HOLDING (or CLOSED, the block
                      having ended) when it failed without a loss
        FAILING    -> FAILED, LOST; back as COMPLETING goes
        RELEASING  -> CLOSED, LOST (the trust deadline passed while stopping)
        CLOSED     -> LOST (the trust window runs on after the block), COMPLETING, FAILING
        COMPLETED, FAILED, LOST: final

    A loss while COMPLETING or FAILING is recorded for the call's outcome to
    judge, one after COMPLETED or FAILED is none, and one while LOST may
    refine the reason: each keeps its state.
    """

    HOLDING = "HOLDING"
    """The lease is trusted: the block runs (its task is cancelled on a loss)."""
    COMPLETING = "COMPLETING"
    """complete() awaits the server. A loss meanwhile is recorded but cancels nothing:
    the server ends the heartbeat once the task is completed, and the completion's
    outcome decides."""
    COMPLETED = "COMPLETED"
    """The task is completed (complete() succeeded): nothing to release, never lost. Final."""
    FAILING = "FAILING"
    """fail() awaits the server; a loss meanwhile is recorded as while COMPLETING."""
    FAILED = "FAILED"
    """The run ended as failed (fail() succeeded): the task is FAILED, terminal; nothing
    to release, never lost. Final."""
    LOST = "LOST"
    """Ownership is lost; ``loss`` says why. Final (the reason may be made more precise)."""
    RELEASING = "RELEASING"
    """The block ended on a trusted lease: the heartbeat is stopping, the release in flight."""
    CLOSED = "CLOSED"
    """The block ended and the lease was released (or kept to its ttl, release_on_exit=False)."""


_S = LeaseState
_TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    _S.HOLDING: frozenset({_S.COMPLETING, _S.FAILING, _S.LOST, _S.RELEASING}),
    _S.COMPLETING: frozenset({_S.COMPLETING, _S.COMPLETED, _S.LOST, _S.HOLDING, _S.CLOSED}),
    _S.COMPLETED: frozenset({_S.COMPLETED}),
    _S.FAILING: frozenset({_S.FAILING, _S.FAILED, _S.LOST, _S.HOLDING, _S.CLOSED}),
    _S.FAILED: frozenset({_S.FAILED}),
    _S.LOST: frozenset({_S.LOST}),
    _S.RELEASING: frozenset({_S.COMPLETING, _S.FAILING, _S.LOST, _S.CLOSED}),
    # The trust window runs on after the block: a lease kept to its ttl is lost at its end.
    _S.CLOSED: frozenset({_S.COMPLETING, _S.FAILING, _S.LOST}),
}
_ENDING = frozenset({_S.COMPLETING, _S.FAILING})  # the run's end awaits the server
_ENDED = frozenset({_S.COMPLETED, _S.FAILED})  # the run ended: nothing to release or lose
# Where a loss takes each state: while ending the run it is only recorded,
# once ended there is nothing to lose.
_ON_LOSS: dict[LeaseState, LeaseState] = {
    state: state if state in _ENDING | _ENDED else _S.LOST for state in LeaseState
}


class BlockEnd(NamedTuple):
    """What ended a ``hold()`` block, as :meth:`HeldLease.end_block` judged it.

    Attributes:
        loss: The loss when the block ended (None: the lease was trusted).
        cancelled_for: The loss the block's task was cancelled for, or None if
            it was not cancelled.
    """

    loss: LeaseLost | None
    cancelled_for: LeaseLost | None


class HeldLease:
    """A lease held inside ``async with client.hold(...)``.

    Pass :meth:`metadata` to every side effect, and :meth:`check` before
    starting each piece of work. Run effects that must not be repeated through
    :meth:`effect`.
    """

    def __init__(
        self,
        client: HoldingClient,
        info: LeaseInfo,
        window: TrustWindow,
        *,
        body: asyncio.Task[Any] | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        """A lease trusted within ``window`` (state HOLDING).

        Args:
            client: The client that claimed it.
            info: The lease as granted.
            window: Its trust window, confirmed by the grant.
            body: The task running the ``hold()`` block: cancelled when the lease
                is lost while the block runs. None: nothing to cancel.
            checkpoint: The task's checkpoint received with the grant, or None.

        """
        self._client = client
        self._info = info
        self._checkpoint = checkpoint
        self._checkpoints = CheckpointWriter(client, info.task_id, info.fence, checkpoint)
        self._window = window
        self._keeper: HeartbeatKeeper | None = None
        self._renewing: tuple[float | None, float] | None = None  # (ttl_s, interval_s), once kept
        self._sessions: SessionKeeper | None = None  # the client's session, when it has one
        self._session: SessionLease | None = None  # this lease's place in it
        self._state = LeaseState.HOLDING
        self._loss: LeaseLost | None = None
        self._body = body  # None once the block has ended: no cancellation lands then
        self._cancelled = False

    @property
    def state(self) -> LeaseState:
        """Where the lease is in its life (the lease's state as this holder knows it)."""
        return self._state

    @property
    def client(self) -> HoldingClient:
        """The client the lease was claimed with (its effects are sent through it)."""
        return self._client

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
        """The lease as granted by the claim (as completed, after :meth:`complete`)."""
        return self._info

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The task's checkpoint received with the grant: resume from it. None: none was saved.

        Read in the same statement as the grant, so it is the latest: only the
        holder of the live fence writes one. Later saves do not change it.
        """
        return self._checkpoint

    @property
    def checkpoint_version(self) -> int:
        """The stored checkpoint's version as this holder last heard it (0: none).

        The grant's, then this lease's own saves and what each heartbeat answer tells.
        """
        heard = self._session.stored_checkpoint_version if self._session is not None else 0
        return max(self._checkpoints.known_version(self._keeper), heard)

    async def save_checkpoint(
        self, version: int, data: bytes, content_type: str = ""
    ) -> Checkpoint:
        """Save the task's progress under this lease: a replacement resumes from it.

        Stored only while this lease is the task's live current fence and
        ``version`` is higher than the stored one, on the database clock.
        While the heartbeat stream is open the checkpoint rides on a beat of
        its own, sent at once (its renewal writes it); otherwise, or when the
        stream ends before the beat is answered, SaveCheckpoint is sent (it
        decides whether that beat stored it: the same version written again
        with the same data answers OK). Saves of one lease go one at a time.
        Does not change :attr:`checkpoint`.

        Args:
            version: Higher than the stored version (e.g. the step number); >= 1.
            data: The progress, opaque to the server; at most its
                ``max_checkpoint_bytes`` (256 KiB by default).
            content_type: What ``data`` is (e.g. ``"application/json"``); at most
                128 bytes of printable ASCII; may be empty.

        Returns:
            The checkpoint as stored (``write_time`` None when the stream carried it).

        Raises:
            CheckpointNotNewer: FAILED_PRECONDITION CHECKPOINT_NOT_NEWER (or the
                beat's answer): a version at least as high is stored
                (``current_version``); nothing was stored.
            LeaseLost: The lease is already lost (nothing is sent), or the
                server refused ABORTED with the loss reason (LEASE_EXPIRED,
                LEASE_SUPERSEDED, TASK_CANCELLED, ...): nothing was stored.
            InvalidArgument: INVALID_ARGUMENT (data too large, version < 1, a bad
                content type), or locally for values of the wrong type.
            LeaseUnavailable: UNAVAILABLE; safe to call again.

        """
        # In a session a checkpoint is not carried (see _session.py): SaveCheckpoint.
        stream = self._keeper if self._session is None else None
        return await self._checkpoints.save(
            version, data, content_type, stream=stream, check=self.check
        )

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
        if self._state in _ENDED:
            return None
        if self._loss is None and self._window.expired():
            # Recorded, not acted on: the reader may be the block itself, and the
            # heartbeat reports the same passed deadline on its own.
            self._move(_ON_LOSS[self._state], self._window_loss())
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
        next_checkpoint: CheckpointLike | None = None,
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
            next_checkpoint: The task's checkpoint after this effect (a
                :class:`Checkpoint`, or ``(version, data[, content_type])``),
                saved in the same transaction as its SUCCEEDED outcome: both
                are stored or neither. The function may return
                ``Performed(result, external_operation_id)`` to record the
                outside system's operation id too.

        Returns:
            The runner; nothing is sent until it runs.

        Raises:
            InvalidArgument: ``policy`` is not ONCE or LATEST (raised locally).

        """
        return EffectRunner(
            self,
            effect_key,
            policy=policy,
            request_digest=request_digest,
            reconcile=reconcile,
            next_checkpoint=next_checkpoint,
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
        if self._session is not None:
            return self._session.renewal_error
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
            TaskFailed: The run already ended as failed (raised locally, nothing sent).
            LeaseUnavailable: UNAVAILABLE: the task is not completed, the heartbeat
                goes on; safe to call again.

        """
        return await self._end_run(LeaseState.COMPLETING, LeaseState.COMPLETED)

    async def fail(self, reason: str = "") -> LeaseInfo:
        """End the run as failed now (release with ``fail=True``), then stop the heartbeat.

        The task becomes FAILED: terminal like COMPLETED, never granted again;
        ``LeaseInfo.fail_reason`` keeps ``reason``. For a run that must not be
        tried again (bad input); a run that may succeed later just raises (or
        leaves the block): its lease is released and the task FREE again. The
        call's deadline, and what a loss means, are as for :meth:`complete`.
        Idempotent once it succeeded.

        Args:
            reason: Why the run failed: at most 1024 bytes of UTF-8; may be empty.

        Returns:
            The task's lease, now FAILED.

        Raises:
            LeaseLost: As for :meth:`complete`: the task is not failed (or, for a
                passed trust deadline, whether it was is unknown).
            TaskCompleted: The run was already completed (raised locally, nothing sent).
            InvalidArgument: INVALID_ARGUMENT (a bad ``reason``).
            LeaseUnavailable: UNAVAILABLE: the task is not failed, the heartbeat
                goes on; safe to call again.

        """
        return await self._end_run(LeaseState.FAILING, LeaseState.FAILED, fail_reason=reason)

    async def _end_run(
        self, ending: LeaseState, ended: LeaseState, *, fail_reason: str | None = None
    ) -> LeaseInfo:
        """Complete (``fail_reason`` None) or fail the run: Release, then stop the heartbeat.

        ``ending`` and ``ended`` are the states the lease passes through
        (COMPLETING and COMPLETED, or FAILING and FAILED).
        """
        if self._state is ended:
            return self._info
        if self._state in _ENDED:
            raise _ended_already(self._state, self.task_id)
        self.check()
        before, body = self._state, self._body
        deadline, left_s = self._window.deadline, self._window.remaining_s()
        self._move(ending)
        try:
            info = await self._client._release(
                self.task_id,
                self.fence,
                fail_reason is None,
                left_s,
                fail=fail_reason is not None,
                fail_reason=fail_reason or "",
            )
        except LeaseLost as error:
            self._move(LeaseState.LOST, error)
            raise
        except LeaseError as error:
            if self._loss is None and self._cut_off(error, deadline, left_s):
                self._move(LeaseState.LOST, self._window_loss(cut_off=True))
            self._move(self._after_failed_completion(before, body))
            if self._loss is not None:
                raise self._loss from error
            raise
        except BaseException:
            self._move(self._after_failed_completion(before, body))
            raise
        self._info = info
        self._move(ended)
        await self._stop_renewing(STOP_TIMEOUT_S)
        return info

    def keep_renewed(self, *, ttl_s: float | None, interval_s: float) -> None:
        """Start renewing this lease every ``interval_s`` seconds.

        Called once, by ``hold()`` on entering its block; a loss the heartbeat
        (or the session) reports cancels the block. While it is the only lease
        its client keeps, a heartbeat stream of its own renews it; when the
        client keeps several, the client's session does (``_session.py``).

        Args:
            ttl_s: The ttl each renewal asks for, in seconds; None for the server's default.
            interval_s: Seconds between beats.

        Raises:
            RuntimeError: The heartbeat was already started.

        """
        if self._renewing is not None:
            raise RuntimeError("the heartbeat of a HeldLease is started only once")
        self._renewing = (ttl_s, interval_s)
        self._sessions = self._client._session_keeper()
        if self._sessions is not None and self._sessions.hold(self):
            self.enter_session(self._sessions)
        else:
            self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        """Renew the lease on a Heartbeat stream of its own."""
        assert self._renewing is not None
        ttl_s, interval_s = self._renewing
        first = pb.HeartbeatRequest(
            namespace=self.namespace,
            task_id=self.task_id,
            owner_id=self.owner_id,
            fence=self.fence,
            ttl=to_duration(ttl_s, "ttl"),
        )
        self._keeper = HeartbeatKeeper(
            open_stream=self._client._open_heartbeat,
            first_request=first,
            interval_s=interval_s,
            window=self._window,
            on_lost=self._on_heartbeat_lost,
            clock=self._client.clock,
        )
        self._keeper.start()

    def enter_session(self, keeper: SessionKeeper) -> None:
        """Be renewed by the client's session from now on (``SessionKeeper.hold`` moves it).

        A heartbeat this lease has goes on until the session has confirmed a
        renewal, then stops (half-closed: the lease stays HELD); until then both
        renew it, and a loss either reports counts once.
        """
        if self._session is not None or self._renewing is None or self.lost:
            return
        ttl_s, interval_s = self._renewing
        add = pb.SessionRequest.Add(
            namespace=self.namespace,
            task_id=self.task_id,
            owner_id=self.owner_id,
            fence=self.fence,
            ttl=to_duration(ttl_s, "ttl"),
        )
        self._session = keeper.add(
            add,
            interval_s=interval_s,
            window=self._window,
            on_lost=self._on_heartbeat_lost,
            fallback=self._leave_session,
        )
        if self._keeper is not None:
            self._client._spawn(
                self._retire_heartbeat(self._session, self._keeper),
                name=f"leasekeeper-retire-{self.task_id}",
            )

    async def _retire_heartbeat(self, session: SessionLease, keeper: HeartbeatKeeper) -> None:
        """Stops ``keeper`` once ``session`` has confirmed a renewal of this lease."""
        await session.settled.wait()
        if session.lost is None and not session.stopped:
            await keeper.stop()

    def _leave_session(self) -> None:
        """The server has no Session: back to a heartbeat of its own."""
        self._session = None
        if self._keeper is None or not self._keeper.running:
            self._start_heartbeat()

    async def _stop_renewing(self, timeout_s: float) -> None:
        """Stop the heartbeat and leave the session (within ``timeout_s`` each). Idempotent."""
        if self._sessions is not None:
            self._sessions.release(self)
        if self._keeper is not None:
            await self._keeper.stop(timeout_s=timeout_s)
        if self._session is not None:
            await self._session.stop(timeout_s)

    async def end_block(self, *, release: bool) -> BlockEnd:
        """The ``hold()`` block has ended: stop the heartbeat and release (best effort).

        Called once, by ``hold()`` on leaving its block. From here on no loss
        cancels the block's task. After a loss the heartbeat stream is cancelled
        at once and a lease that may still be ours is released in the background
        (within RELEASE_AFTER_LOSS_TIMEOUT_S), so the error is not held up.

        Args:
            release: Release the lease (False: leave it to end by its ttl).

        Returns:
            The loss judged as the block ended (before this call's own time), and
            the loss its task was cancelled for, if it was.

        """
        self._body = None  # before any await: no cancellation lands in the exit
        loss = self.loss  # judged now: the cleanup's own time must not count against the block
        cancelled_for = (loss or self._window_loss()) if self._cancelled else None
        if self._state is LeaseState.HOLDING:
            self._move(LeaseState.RELEASING)
        # After a loss there is no OK to wait for: cancel the stream (or drop from the session).
        await self._stop_renewing(0.0 if self.lost else STOP_TIMEOUT_S)
        if release and self._state not in _ENDED:
            late_loss = self.loss  # judged again: the trust deadline may have passed while stopping
            if late_loss is None:
                await self._release(timeout_s=None, level=logging.WARNING)
            elif late_loss.reason not in _NOT_OURS:
                self._client._spawn(
                    self._release(timeout_s=RELEASE_AFTER_LOSS_TIMEOUT_S, level=logging.INFO),
                    name=f"leasekeeper-release-{self.task_id}",
                )
        if self._state is LeaseState.RELEASING:
            self._move(LeaseState.CLOSED)
        return BlockEnd(loss, cancelled_for)

    def _move(
        self, to: LeaseState, loss: LeaseLost | None = None, *, reported: bool = False
    ) -> None:
        """The one transition of the state machine: check it, record the loss, cancel the block.

        Args:
            to: The new state; it must be allowed from the current one.
            loss: Why, for a loss: kept unless a loss is already recorded, or
                the recorded one is a passed trust deadline (LEASE_EXPIRED) and
                this one the heartbeat's report (the server's reason is the
                truth). Dropped when ``to`` is COMPLETED or FAILED, which clear any loss.
            reported: The heartbeat reported the loss: a lease lost while its
                block runs has the block's task cancelled (once). A loss found
                by reading :attr:`loss` is only recorded: the reader may be the
                block itself, which then raises it.

        Raises:
            RuntimeError: ``to`` is not allowed from the current state (a bug).

        """
        if to not in _TRANSITIONS[self._state]:
            raise RuntimeError(f"HeldLease cannot go from {self._state.name} to {to.name}")
        self._state = to
        if to in _ENDED:
            self._loss = None
            return
        if loss is not None and (
            self._loss is None or (reported and self._loss.reason == "LEASE_EXPIRED")
        ):
            self._loss = loss
        if reported and to is LeaseState.LOST and self._body is not None and not self._cancelled:
            self._cancelled = True
            self._body.cancel()

    def _on_heartbeat_lost(self, error: LeaseLost) -> None:
        """Called by the heartbeat, in its own task, when ownership is lost."""
        self._move(_ON_LOSS[self._state], error, reported=True)

    def _window_loss(self, *, cut_off: bool = False) -> LeaseLost:
        """The loss of a passed trust deadline (``cut_off``: one that cut a completion short)."""
        reason = self._window.loss_reason
        message = None
        if cut_off:
            message = (
                "lease lost: its trust deadline passed before the completion "
                f"was confirmed ({reason})"
            )
        return LeaseLost(reason, self.task_id, self.fence, message=message)

    def _after_failed_completion(
        self, before: LeaseState, body: asyncio.Task[Any] | None
    ) -> LeaseState:
        """The state after an end of the run that failed: LOST with a loss, else where it was.

        ``before`` is the state complete() started from and ``body`` the block's
        task then; a block that ended while the completion was in flight leaves
        the lease CLOSED (its exit sent the release).
        """
        if self._state is LeaseState.LOST or self._loss is not None:
            return LeaseState.LOST
        if before is LeaseState.HOLDING and (body is None or self._body is not None):
            return LeaseState.HOLDING
        return LeaseState.CLOSED

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


def _ended_already(state: LeaseState, task_id: str) -> LeaseError:
    """The refusal of a second, other end of a run that already ended in ``state``."""
    if state is LeaseState.FAILED:
        return TaskFailed(f"task {task_id!r}: the run already ended as failed")
    return TaskCompleted(f"task {task_id!r}: the run is already completed")


class LeaseHold:
    """``async with client.hold(...) as lease``: claim, keep renewed, release.

    Entering:

    * claims the task; when another owner holds it and ``wait_s`` is set, the
      server waits for it (``Claim`` with ``wait``, woken when the task is
      released, revoked, completed or expires; a fresh Claim per
      ``CLAIM_WAIT_MAX_S``) until ``wait_s`` seconds have passed, then raises
      ``ClaimTimeout``; with ``wait_s`` None raises ``NotAcquired`` at once;
    * UNAVAILABLE and DEADLINE_EXCEEDED (the outcome of a claim is then
      unknown: it may have been granted, its reply lost) are retried with
      exponential backoff and full jitter within ``wait_s``, else raised
      (``LeaseUnavailable``, ``LeaseError``). Every attempt of one acquisition
      carries the same request id, so a retry of a claim that was granted gets
      that same lease and fence back, on whichever replica it lands;
      ``TaskEnded`` (COMPLETED, CANCELLED, FAILED), ``TaskQuarantined`` and
      ``InvalidArgument`` are raised;
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
        max_attempts: int = 0,
    ) -> None:
        self._client = client
        self._max_attempts = max_attempts
        self._task_id = task_id
        self._ttl_s = ttl_s
        self._max_runtime_s = max_runtime_s
        self._wait_s = wait_s
        self._safety_margin_s = safety_margin_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._release_on_exit = release_on_exit
        self._lease: HeldLease | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0

    async def __aenter__(self) -> HeldLease:
        if self._lease is not None:
            raise RuntimeError("a LeaseHold can be entered only once")
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("hold() must be used inside an asyncio task")
        self._task, self._cancelling = task, task.cancelling()
        result = await acquire(
            self._client,
            self._task_id,
            ttl_s=self._ttl_s,
            max_runtime_s=self._max_runtime_s,
            wait_s=self._wait_s,
            max_attempts=self._max_attempts,
        )
        try:
            self._lease = self._start(result, task)
        except BaseException:
            self._client._unmark_held(self._task_id)
            raise
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease = self._lease
        assert lease is not None and self._task is not None
        try:
            ended = await lease.end_block(release=self._release_on_exit)
        finally:
            self._client._unmark_held(self._task_id)
        if ended.cancelled_for is not None:
            mine = self._task.uncancel() <= self._cancelling
            if mine and (exc is None or isinstance(exc, asyncio.CancelledError)):
                raise ended.cancelled_for from exc
            return
        if exc is None and ended.loss is not None:
            raise ended.loss

    def _start(self, result: ClaimResult, task: asyncio.Task[Any]) -> HeldLease:
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
        lease = HeldLease(client, info, window, body=task, checkpoint=result.checkpoint)
        lease.keep_renewed(
            ttl_s=self._ttl_s,
            interval_s=beat_interval_s(self._heartbeat_interval_s, ttl_s),
        )
        return lease
