"""LeaseClient: the asyncio client of ``leasekeeper.v1.LeaseService``.

A thin layer over the generated stub: every RPC maps to one method, durations
go in as seconds or ``timedelta`` and come back as float seconds, and every
failed call is translated into a :mod:`leasekeeper.errors` class by its gRPC
status code and ``ErrorInfo`` reason. The client never retries a call on its
own, except inside :meth:`LeaseClient.hold`, which documents its retries.

This module holds a worker's calls (claim, renew, release, validate_fence,
save_checkpoint, hold); the rest of the class comes from its bases, one module
each: the reads (``_reads``), the operator's calls (``_operator``), the effect
ledger (``_effect_calls``) and the connection they all go through
(``_connection``; the channel's options are :mod:`leasekeeper.channel`).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import grpc

from . import _checkpoint, _types, checkpoints
from ._checkpoint import Checkpoint
from ._connection import Connection
from ._effect_calls import EffectCalls
from ._heartbeat import check_beat_interval
from ._operator import OperatorCalls
from ._owner import OwnerIdentity, new_request_id
from ._reads import Reads
from ._session import SessionKeeper
from ._trust import Clock
from ._types import ClaimResult, FenceCheck, LeaseInfo, RenewedLease, Seconds
from ._validate_stream import FenceStream
from .channel import DEFAULT_CALL_TIMEOUT_S, DEFAULT_NAMESPACE, TOKEN_ENV, default_target
from .errors import InvalidArgument, LeaseError, LeaseLost
from .lease import LeaseHold
from .v1 import lease_service_pb2 as pb
from .v1 import lease_service_pb2_grpc as pb_grpc


class LeaseClient(Reads, OperatorCalls, EffectCalls, Connection):
    """Claims, renews, releases and inspects leases in one namespace.

    Use it as an async context manager, or call :meth:`close` when done. The
    gRPC channel is opened on first use, inside the running event loop.

    Example::

        async with LeaseClient("127.0.0.1:9457", namespace="billing") as client:
            async with client.hold("invoice-42", ttl=30.0, wait=60.0) as lease:
                await send_invoice(metadata=lease.metadata())
    """

    def __init__(
        self,
        target: str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        owner_id: str | None = None,
        channel: grpc.aio.Channel | None = None,
        *,
        call_timeout: Seconds | None = DEFAULT_CALL_TIMEOUT_S,
        clock: Clock = time.monotonic,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        validate_stream: bool = True,
        sessions: bool = True,
    ) -> None:
        """Create a client; no connection is made until the first call.

        Args:
            target: The server address (``host:port``, any gRPC target); unused
                when ``channel`` is given. None: the ``LEASEKEEPER_TARGET``
                environment variable if set, else ``127.0.0.1:9457`` (the
                ``leasekeeper`` command reads the same variable). Replicas may be listed, e.g.
                ``"ipv4:10.0.0.1:9457,10.0.0.2:9457"``: the channel uses the first
                that answers and moves to the next when it goes away, and the
                heartbeat resumes there with the same fence.
            namespace: The namespace of every task named by this client.
            owner_id: This worker incarnation's owner id. None (recommended):
                a fresh :func:`~leasekeeper.new_owner_id`, regenerated in a
                forked child. An explicit id must never be used by two live
                processes at once. Reusing it after a restart (a pod name) is
                safe: every claim carries a request id, so the restarted
                process gets a new fence and its predecessor's fence is refused.
            channel: A ``grpc.aio`` channel to use; the caller keeps ownership
                (``close()`` does not close it) and its options (pass
                ``options=leasekeeper.CHANNEL_OPTIONS`` to find a dead server
                as the client's own channel does). None: a channel to ``target``
                (secure with ``credentials``, else insecure, with
                ``CHANNEL_OPTIONS``), owned and closed by the client.
            call_timeout: Deadline of each unary call, in seconds (or a
                ``timedelta``); None for no deadline. The heartbeat stream has none.
            clock: Monotonic clock in seconds for send times and trust deadlines.
            token: The bearer token sent as ``authorization: Bearer <token>``
                metadata on every call and on the heartbeat stream (metadata
                rather than call credentials, so it works on a plaintext
                loopback channel and on a ``channel`` given by the caller).
                None: the ``LEASEKEEPER_TOKEN`` environment variable, if set.
                ``""``: no token, whatever the environment says.
                A server with authentication on answers calls without a valid
                token UNAUTHENTICATED, and calls outside the token's role or
                namespaces PERMISSION_DENIED (both raised as ``LeaseError``).
            credentials: TLS for the channel the client opens, e.g.
                ``grpc.ssl_channel_credentials(root_certificates=ca_pem)``, with
                ``private_key`` and ``certificate_chain`` for mutual TLS.
                None: an insecure channel. Unused when ``channel`` is given.
            validate_stream: True (default): :meth:`validate_fence` sends its
                checks on one ValidateFences stream the client opens on first
                use and shares among its calls (much less server CPU per check
                than a unary call, the same answers); a server without it is
                asked with ValidateFence. False: one unary ValidateFence per check.
            sessions: True (default): while the client keeps more than one
                lease in :meth:`hold` blocks, they share one Session stream
                (one beat renews them all; each keeps its own trust deadline and
                is cancelled as soon as its loss is pushed); a single lease
                keeps a Heartbeat stream of its own. False: a Heartbeat stream
                per lease, always.

        Raises:
            InvalidArgument: ``call_timeout`` is not a finite duration (raised locally).

        """
        self._target = target or default_target()
        self._namespace = namespace
        self._owner = OwnerIdentity(owner_id)
        self._channel = channel
        self._owns_channel = channel is None
        self._stub: pb_grpc.LeaseServiceStub | None = None
        self._call_timeout_s = _types.optional_seconds(call_timeout, "call_timeout")
        self._clock = clock
        self._credentials = credentials
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._metadata: tuple[tuple[str, str], ...] | None = (
            (("authorization", f"Bearer {token}"),) if token else None
        )
        self._held: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._closing = False
        self._closed = False
        self._use_sessions = sessions
        self._sessions: SessionKeeper | None = None
        self._fences = (
            FenceStream(self._open_fence_stream, self._validate_unary, self._call_timeout_s)
            if validate_stream
            else None
        )

    async def claim(
        self,
        task_id: str,
        ttl: Seconds | None = 30.0,
        max_runtime: Seconds | None = None,
        *,
        request_id: str | None = None,
        wait: Seconds | None = None,
        max_attempts: int = 0,
    ) -> ClaimResult:
        """Claim a task for this owner. One atomic decision on the database clock.

        FREE or EXPIRED: granted with a fence one higher than the last. HELD by
        another owner: ``acquired=False`` and the holder's remaining ttl. HELD by
        this owner: with the ``request_id`` of the claim that granted it, the
        same lease back (a retry whose reply was lost); with another request id,
        a new incarnation of this owner: a new lease with the next fence, and
        the earlier fence is superseded (its heartbeat ends LEASE_SUPERSEDED).

        This method sends the request once and never retries on its own. Each
        call is a new logical claim unless it is given the request id of an
        earlier one: to retry a claim whose outcome is unknown (UNAVAILABLE,
        DEADLINE_EXCEEDED), call again with the same ``request_id`` (make it
        with :func:`~leasekeeper.new_request_id` before the first attempt, or
        take it from the ``ClaimResult`` of a claim that answered). ``hold()``
        does this for you.

        Args:
            task_id: The task (1-256 bytes UTF-8 by default, no control characters).
            ttl: Lease length in seconds (or ``timedelta``), within the server's
                ``[min_ttl, max_ttl]``; None for the server's default.
            max_runtime: Runtime budget from the grant in seconds; no renewal
                reaches past it. None: the server's maximum.
            request_id: Names this logical claim (AIP-155); the same rules as
                ids (1-256 bytes UTF-8 by default, no control characters). None:
                a fresh :func:`~leasekeeper.new_request_id`. ``""``: no request id
                (the behaviour of clients older than request ids: a claim by the
                owner of a live lease always gets that lease back).
            wait: Seconds the server may wait for a task held by another owner
                (or in its namespace's lock delay) to become free, woken by the
                database's announcement of the change, within the server's
                ``max_claim_wait``; keep it below ``call_timeout``. None: answer
                at once.
            max_attempts: The attempt limit this grant carries: when its lease
                ends without a release (expiry, revoke) and the task's attempts
                reach it, the task becomes QUARANTINED until an operator's
                :meth:`retry`. 0: the namespace's default, else none. At most 1000000.

        Returns:
            The outcome; ``send_time`` is this client's clock when the request
            left, ``request_id`` the request id it carried, ``checkpoint`` the
            task's checkpoint when acquired (resume from it).

        Raises:
            TaskCompleted: FAILED_PRECONDITION, the task is terminal.
            TaskCancelled: FAILED_PRECONDITION TASK_CANCELLED, terminal.
            TaskFailed: FAILED_PRECONDITION TASK_FAILED, terminal.
            TaskQuarantined: FAILED_PRECONDITION TASK_QUARANTINED: attempts used
                up; no claim is granted until an operator's :meth:`retry`.
            InvalidArgument: INVALID_ARGUMENT (or raised locally for a non-finite duration).
            LimitExceeded: RESOURCE_EXHAUSTED, a namespace limit; wait ``retry_after``.
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            LeaseUnavailable: UNAVAILABLE; retry with the same ``request_id``.
            LeaseError: Any other status (e.g. DEADLINE_EXCEEDED: outcome unknown;
                a retry with the same ``request_id`` returns the same lease).

        """
        return await self._claim(
            task_id,
            ttl,
            max_runtime,
            request_id=new_request_id() if request_id is None else request_id,
            wait=wait,
            max_attempts=max_attempts,
        )

    async def _claim(
        self,
        task_id: str,
        ttl: Seconds | None,
        max_runtime: Seconds | None,
        *,
        request_id: str,
        wait: Seconds | None,
        deadline_past_wait: bool = False,
        max_attempts: int = 0,
    ) -> ClaimResult:
        """:meth:`claim`, sent once.

        With ``deadline_past_wait`` (``hold()``) the call timeout counts from the
        end of the server's wait: the deadline is a call timeout past the wait,
        so a wait longer than the call timeout is not cut short.
        """
        request = pb.ClaimRequest(
            namespace=self._namespace,
            task_id=task_id,
            owner_id=self.owner_id,
            ttl=_types.to_duration(ttl, "ttl"),
            max_runtime=_types.to_duration(max_runtime, "max_runtime"),
            request_id=request_id,
            wait=_types.to_duration(wait, "wait"),
            max_attempts=max_attempts,
        )
        past_s = _types.seconds(wait, "wait") if deadline_past_wait and wait is not None else 0.0
        send_time = self._clock()
        response = await self._call(self.stub.Claim, request, task_id=task_id, server_wait_s=past_s)
        return _types.claim_result(response, send_time, request_id)

    async def renew(
        self,
        task_id: str,
        fence: int,
        ttl: Seconds | None = None,
        *,
        trust_deadline: float | None = None,
    ) -> RenewedLease:
        """Renew a live lease: ``expire_time = least(db now + ttl, runtime_deadline)``.

        Atomic; never revives an expired lease. Prefer :meth:`hold`, which keeps
        a lease renewed over one stream.

        Args:
            task_id: The task.
            fence: The lease's fence; >= 1.
            ttl: New lease length in seconds from now (database clock); None for
                the server's default.
            trust_deadline: The lease's trust deadline on this client's clock
                (seconds, a reading of :attr:`clock`): the claim's ``send_time +
                lease.remaining_ttl - safety_margin``, then the previous renewal's
                :meth:`~leasekeeper.RenewedLease.trust_deadline`. The call's
                deadline is then no later than it. None: the call timeout only.

        Returns:
            The renewed lease, with ``send_time`` (this client's clock when the
            request left): the next trust deadline is ``send_time +
            remaining_ttl - safety_margin``.

        Raises:
            LeaseLost: ABORTED with the reason (LEASE_EXPIRED, LEASE_SUPERSEDED, ...):
                claim again, do not retry the renewal. Also LEASE_EXPIRED, raised
                locally, when ``trust_deadline`` passed before an answer came
                (the call is cancelled then) or before the call (nothing is sent).
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.RenewRequest(
            namespace=self._namespace,
            task_id=task_id,
            owner_id=self.owner_id,
            fence=fence,
            ttl=_types.to_duration(ttl, "ttl"),
        )
        left_s = None if trust_deadline is None else trust_deadline - self._clock()
        if left_s is not None and left_s <= 0:
            raise LeaseLost(
                "LEASE_EXPIRED",
                task_id,
                fence,
                message="lease lost: its trust deadline passed before the renewal was sent",
            )
        bound_by_trust = left_s is not None and (
            self._call_timeout_s is None or left_s < self._call_timeout_s
        )
        send_time = self._clock()
        try:
            response = await self._call(
                self.stub.Renew, request, task_id=task_id, fence=fence, timeout_s=left_s
            )
        except LeaseError as error:
            if bound_by_trust and error.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise LeaseLost(
                    "LEASE_EXPIRED",
                    task_id,
                    fence,
                    message="lease lost: no renewal confirmed by its trust deadline",
                ) from error
            raise
        return _types.renewed_lease(response.lease, send_time)

    async def release(
        self,
        task_id: str,
        fence: int,
        complete: bool = False,
        *,
        fail: bool = False,
        fail_reason: str = "",
    ) -> LeaseInfo:
        """Release a lease (live or expired, unless a newer fence exists).

        Atomic and idempotent: releasing again with the same fence answers OK.
        The task becomes FREE; COMPLETED (never granted again) with ``complete``;
        FAILED (terminal too) with ``fail``. A release never counts as an attempt.

        Args:
            task_id: The task.
            fence: The lease's fence; >= 1.
            complete: Mark the task COMPLETED.
            fail: End the run as failed: the task becomes FAILED. Not with ``complete``.
            fail_reason: With ``fail``: why (``LeaseInfo.fail_reason``); at most
                1024 bytes of UTF-8; may be empty.

        Returns:
            The task's lease after the release.

        Raises:
            LeaseLost: ABORTED: LEASE_SUPERSEDED (the newer lease is untouched),
                NOT_OWNER, LEASE_REVOKED, TASK_COMPLETED, TASK_CANCELLED,
                TASK_FAILED, FENCE_UNKNOWN.
            InvalidArgument: INVALID_ARGUMENT (or locally: ``fail`` with
                ``complete``, or a ``fail_reason`` without ``fail``).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        return await self._release(task_id, fence, complete, fail=fail, fail_reason=fail_reason)

    async def _release(
        self,
        task_id: str,
        fence: int,
        complete: bool,
        timeout_s: float | None = None,
        *,
        fail: bool = False,
        fail_reason: str = "",
    ) -> LeaseInfo:
        """:meth:`release` within ``timeout_s`` seconds, if shorter than the call timeout."""
        problem = None
        if fail and complete:
            field, problem = "fail", "a run ends completed or failed, not both"
        elif fail_reason and not fail:
            field, problem = "fail_reason", "only a failed run has a fail_reason"
        if problem is not None:
            raise InvalidArgument(
                f"{field}: {problem}", field_violations=[(field, problem)], code=None
            )
        request = pb.ReleaseRequest(
            namespace=self._namespace,
            task_id=task_id,
            owner_id=self.owner_id,
            fence=fence,
            complete=complete,
            fail=fail,
            fail_reason=fail_reason,
        )
        response = await self._call(
            self.stub.Release, request, task_id=task_id, fence=fence, timeout_s=timeout_s
        )
        return _types.lease_info(response.lease)

    async def validate_fence(
        self, task_id: str, fence: int, namespace: str | None = None
    ) -> FenceCheck:
        """Say whether ``fence`` may act now (database clock). Changes no lease.

        A refused stale fence is recorded in the task's history (FENCE_REFUSED).

        Args:
            task_id: The task.
            fence: The fence to check; >= 1.
            namespace: The task's namespace; None for this client's.

        Returns:
            ``valid`` iff the fence is current, its lease HELD and the task not
            ended (COMPLETED, FAILED or CANCELLED); otherwise the current fence
            and the reason.

        Raises:
            InvalidArgument: INVALID_ARGUMENT.
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            LeaseUnavailable: UNAVAILABLE; safe to retry. Also when the client's
                ValidateFences stream ended before the answer came: the check
                was not validated (the next call opens a new stream).
            LeaseError: DEADLINE_EXCEEDED: no answer within the call timeout.

        """
        request = pb.ValidateFenceRequest(
            namespace=self._namespace if namespace is None else namespace,
            task_id=task_id,
            fence=fence,
        )
        if self._fences is not None:  # the client's one ValidateFences stream (_validate_stream)
            response = await self._fences.validate(request, task_id=task_id, fence=fence)
        else:
            response = await self._validate_unary(request)
        return _types.fence_check(response)

    async def _validate_unary(self, request: pb.ValidateFenceRequest) -> pb.ValidateFenceResponse:
        return await self._call(
            self.stub.ValidateFence, request, task_id=request.task_id, fence=request.fence
        )

    def _open_fence_stream(self) -> Any:
        return self.stub.ValidateFences(metadata=self._metadata)

    async def save_checkpoint(
        self, task_id: str, fence: int, version: int, data: bytes, content_type: str = ""
    ) -> Checkpoint:
        """Save the task's checkpoint under the caller's live lease (SaveCheckpoint).

        One statement on the database clock: stored only when this owner holds
        ``fence``, the task's current fence, live, and ``version`` is higher
        than the stored version; nothing is stored otherwise. Does not renew the
        lease. Idempotent: the stored version written again by the same fence
        with the same data and content type answers OK. Inside ``hold()``
        prefer :meth:`HeldLease.save_checkpoint <leasekeeper.HeldLease.save_checkpoint>`,
        which rides on the heartbeat.

        Args:
            task_id: The task.
            fence: The caller's fence; >= 1.
            version: Higher than the stored version; >= 1.
            data: Opaque; at most the server's ``max_checkpoint_bytes`` (256 KiB by default).
            content_type: What ``data`` is; at most 128 bytes of printable ASCII; may be empty.

        Returns:
            The checkpoint as stored (the data sent, the server's fence and write time).

        Raises:
            CheckpointNotNewer: FAILED_PRECONDITION CHECKPOINT_NOT_NEWER: the
                version does not move forward (``current_version`` is stored).
            LeaseLost: ABORTED with the loss reason (LEASE_EXPIRED,
                LEASE_SUPERSEDED, TASK_CANCELLED, TASK_FAILED, ...).
            InvalidArgument: INVALID_ARGUMENT (field ``checkpoint.data`` when too
                large), or locally for values of the wrong type.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        sent = checkpoints.checkpoint_message((version, data, content_type))
        request = pb.SaveCheckpointRequest(
            namespace=self._namespace,
            task_id=task_id,
            owner_id=self.owner_id,
            fence=fence,
            checkpoint=sent,
        )
        response = await self._call(self.stub.SaveCheckpoint, request, task_id=task_id, fence=fence)
        stored = response.checkpoint if response.HasField("checkpoint") else None
        return _checkpoint.saved(sent, stored, fence)

    def hold(
        self,
        task_id: str,
        ttl: Seconds | None = 30.0,
        *,
        max_runtime: Seconds | None = None,
        wait: Seconds | None = None,
        safety_margin: Seconds | None = None,
        release_on_exit: bool = True,
        heartbeat_interval: Seconds | None = None,
        max_attempts: int = 0,
    ) -> LeaseHold:
        """Claim a task, keep it renewed, and release it on exit.

        ``async with client.hold("t") as lease:`` yields a
        :class:`~leasekeeper.HeldLease`. See :class:`~leasekeeper.lease.LeaseHold`
        for waiting, heartbeat, loss and exit behaviour.

        Args:
            task_id: The task.
            ttl: Lease length in seconds (or ``timedelta``); renewed every
                ``heartbeat_interval``. None: the server's default.
            max_runtime: Runtime budget in seconds; None for the server's maximum.
            wait: Seconds to wait while another owner holds the task: the
                server waits (``Claim`` with ``wait``) and grants the task as soon
                as the database announces it free, one Claim per wait of up to
                60 s; failed attempts are retried with exponential backoff and
                full jitter. None: one attempt.
            safety_margin: Seconds subtracted from every confirmed remaining ttl
                for the trust deadline. None: ``min(1 s, ttl / 10)``.
            release_on_exit: Release the lease when the block exits (in the
                background, bounded, after a loss: the error comes first).
            heartbeat_interval: Seconds (or ``timedelta``) between heartbeat
                beats, each a renewal. None: ttl / 3. Shorter hears of a loss
                sooner and rides out slow answers, at one database write per
                beat (beats sooner than the server's minimum renew interval are
                answered without one). At most ttl / 2 (two beats per ttl), and
                only with an explicit ``ttl``.
            max_attempts: The attempt limit of the grant (see :meth:`claim`); 0:
                the namespace's default, else none.

        Returns:
            An async context manager; it raises, from ``async with``:
            NotAcquired (``wait`` None) or ClaimTimeout when not acquired;
            TaskEnded (TaskCompleted, TaskCancelled, TaskFailed) or
            TaskQuarantined (FAILED_PRECONDITION); LeaseUnavailable (UNAVAILABLE)
            or LeaseError (DEADLINE_EXCEEDED), after retrying within ``wait``
            with the same request id; InvalidArgument; and LeaseLost when
            ownership is lost while the block runs, or at once when the grant
            arrives after its own trust deadline.

        Raises:
            InvalidArgument: (a ``ValueError``, raised here at the call, nothing
                sent) a duration that is not finite, or a ``heartbeat_interval``
                that leaves fewer than two beats per ttl (above ttl / 2), is
                below 0.01 s, or comes without a ``ttl``; the error names the
                parameter.

        """
        ttl_s = _types.optional_seconds(ttl, "ttl")
        heartbeat_interval_s = _types.optional_seconds(heartbeat_interval, "heartbeat_interval")
        check_beat_interval(heartbeat_interval_s, ttl_s)
        return LeaseHold(
            self,
            task_id,
            ttl_s=ttl_s,
            max_runtime_s=_types.optional_seconds(max_runtime, "max_runtime"),
            wait_s=_types.optional_seconds(wait, "wait"),
            safety_margin_s=_types.optional_seconds(safety_margin, "safety_margin"),
            release_on_exit=release_on_exit,
            heartbeat_interval_s=heartbeat_interval_s,
            max_attempts=max_attempts,
        )

    def _open_heartbeat(self) -> Any:
        return self.stub.Heartbeat(metadata=self._metadata)

    def _session_keeper(self) -> SessionKeeper | None:
        """The client's session (made on first use); None when sessions are off."""
        if not self._use_sessions:
            return None
        if self._sessions is None:
            self._sessions = SessionKeeper(
                open_stream=lambda: self.stub.Session(metadata=self._metadata), clock=self._clock
            )
        return self._sessions

    def _mark_held(self, task_id: str) -> bool:
        """Reserve ``task_id`` for one hold() of this client; False if already held."""
        if task_id in self._held:
            return False
        self._held.add(task_id)
        return True

    def _unmark_held(self, task_id: str) -> None:
        self._held.discard(task_id)
