"""LeaseClient: the asyncio client of ``leasekeeper.v1.LeaseService``.

A thin layer over the generated stub: every RPC maps to one method, durations
go in as seconds or ``timedelta`` and come back as float seconds, and every
failed call is translated into a :mod:`leasekeeper.errors` class by its gRPC
status code and ``ErrorInfo`` reason. The client never retries a call on its
own, except inside :meth:`LeaseClient.hold`, which documents its retries.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc

from . import _checkpoint, _types, checkpoints, history
from . import lease as _lease
from ._checkpoint import Checkpoint, CheckpointLike
from ._heartbeat import check_beat_interval
from ._owner import OwnerIdentity, new_request_id
from ._session import SessionKeeper
from ._trust import Clock
from ._types import (
    BeginResult,
    ClaimResult,
    EffectRecord,
    FenceCheck,
    LeaseInfo,
    NamespaceInfo,
    NamespaceStats,
    RenewedLease,
    Seconds,
    TaskEvent,
)
from ._validate_stream import FenceStream
from .errors import InvalidArgument, LeaseError, LeaseLost, from_rpc_error
from .history import HistoryEntry
from .lease import LeaseHold
from .v1 import lease_service_pb2 as pb
from .v1 import lease_service_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:9457"
TARGET_ENV = "LEASEKEEPER_TARGET"


def default_target() -> str:
    """The server address used when none is given: ``$LEASEKEEPER_TARGET``, else 127.0.0.1:9457."""
    return os.environ.get(TARGET_ENV) or DEFAULT_TARGET


DEFAULT_NAMESPACE = "default"
DEFAULT_CALL_TIMEOUT_S = 10.0
TOKEN_ENV = "LEASEKEEPER_TOKEN"
KEEPALIVE_TIME_S = 10.0
KEEPALIVE_TIMEOUT_S = 5.0
# The channel's own pings find a dead server, or a connection cut on the way
# without a reset, within KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S: its calls and
# streams (watch, hold's heartbeat) then fail UNAVAILABLE. A ping goes out after
# KEEPALIVE_TIME_S without a read, on idle connections too and however long a
# stream stays quiet (the server allows a ping a second). gRPC core waits for
# the ack for ``grpc.http2.ping_timeout_ms`` (60 s unset), not for
# ``grpc.keepalive_timeout_ms``, so both are set.
#
# A server that comes back (restarted on the same address) is reconnected to
# within RECONNECT_MAX_S (+-20% jitter), not after gRPC's default backoff, which
# grows x1.6 from 1 s to 120 s and, after a 20 s outage, waited 10 s more: far
# into a lease's ttl. The first retry comes after RECONNECT_INITIAL_S. The connect
# timeout (``grpc.min_reconnect_backoff_ms``, 20 s) stays gRPC's.
RECONNECT_INITIAL_S = 0.25
RECONNECT_MAX_S = 1.0
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", round(KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", round(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.http2.ping_timeout_ms", round(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", round(RECONNECT_INITIAL_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", round(RECONNECT_MAX_S * 1000)),
)

_Response = TypeVar("_Response")
_Item = TypeVar("_Item")


async def _every_page(
    fetch: Callable[[str], Awaitable[tuple[list[_Item], str]]],
) -> AsyncIterator[_Item]:
    """Every item of a paged listing: ``fetch(page_token)`` until the token comes back empty."""
    token = ""
    while True:
        items, token = await fetch(token)
        for item in items:
            yield item
        if not token:
            return


class LeaseClient:
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

    @property
    def target(self) -> str:
        """The server address given at construction."""
        return self._target

    @property
    def namespace(self) -> str:
        """The namespace of every task named by this client."""
        return self._namespace

    @property
    def owner_id(self) -> str:
        """This client's owner id (changes in a forked child when generated)."""
        return self._owner.value

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The metadata every call of this client carries (the bearer token), or None."""
        return self._metadata

    @property
    def clock(self) -> Clock:
        """The monotonic clock used for send times and trust deadlines."""
        return self._clock

    @property
    def stub(self) -> pb_grpc.LeaseServiceStub:
        """The generated stub (opens the channel on first use).

        Raises:
            RuntimeError: The client is closed.

        """
        if self._closed:
            raise RuntimeError("LeaseClient is closed")
        if self._stub is None:
            if self._channel is None:
                if self._credentials is not None:
                    self._channel = grpc.aio.secure_channel(
                        self._target, self._credentials, options=CHANNEL_OPTIONS
                    )
                else:
                    self._channel = grpc.aio.insecure_channel(self._target, options=CHANNEL_OPTIONS)
            # The generated stub module has no annotations (grpcio-tools writes none).
            self._stub = pb_grpc.LeaseServiceStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    async def close(self) -> None:
        """Close the channel if the client opened it; later calls fail. Idempotent.

        First lets the client's background work end: the best-effort release
        of a lost lease (see :meth:`hold`), waited for at most
        ``RELEASE_AFTER_LOSS_TIMEOUT_S`` (2 s), then cancelled; a lease it had no
        time to release ends by its ttl.
        """
        self._closing = True  # no new background work; what runs may still call
        background = list(self._background)
        try:
            if background:
                await asyncio.wait(background, timeout=_lease.RELEASE_AFTER_LOSS_TIMEOUT_S)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self._closed = True
        if self._fences is not None:
            await self._fences.close()
        if self._sessions is not None:
            await self._sessions.close()
        channel, self._stub = self._channel, None
        if channel is not None and self._owns_channel:
            self._channel = None
            await channel.close()

    async def __aenter__(self) -> LeaseClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _call(
        self,
        rpc: Callable[..., Awaitable[_Response]],
        request: Any,
        *,
        task_id: str | None = None,
        fence: int | None = None,
        timeout_s: float | None = None,
        server_wait_s: float = 0.0,
    ) -> _Response:
        """One unary call within the call timeout, or ``timeout_s`` seconds if that is shorter.

        ``server_wait_s``: seconds the server may wait before it decides (a Claim's
        wait); the call timeout then counts from the end of that wait.
        """
        if timeout_s is None or (
            self._call_timeout_s is not None and self._call_timeout_s < timeout_s
        ):
            timeout_s = self._call_timeout_s
        if timeout_s is not None:
            timeout_s += server_wait_s
        try:
            return await rpc(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error, task_id=task_id, fence=fence) from error

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` as a task the client owns: referenced until done, cancelled by close().

        ``work`` handles its own errors (a task's exception would be logged as
        never retrieved). On a closing or closed client it is not started.
        """
        if self._closing:
            work.close()
            return
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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

    async def get_lease(self, task_id: str) -> LeaseInfo:
        """The task's current state, never a cached one.

        Raises:
            TaskNotFound: NOT_FOUND, the task was never claimed.
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.GetLeaseRequest(namespace=self._namespace, task_id=task_id)
        response = await self._call(self.stub.GetLease, request, task_id=task_id)
        return _types.lease_info(response.lease)

    async def get_checkpoint(self, task_id: str) -> Checkpoint | None:
        """The task's stored checkpoint, with its data (GetLease). Read-only.

        For an operator or a reader; a worker receives it with its grant
        (``ClaimResult.checkpoint``, ``HeldLease.checkpoint``).

        Returns:
            The checkpoint, or None when none was ever saved.

        Raises:
            TaskNotFound: NOT_FOUND, the task was never claimed.
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.GetLeaseRequest(namespace=self._namespace, task_id=task_id)
        response = await self._call(self.stub.GetLease, request, task_id=task_id)
        return _checkpoint.optional_checkpoint(response, "checkpoint")

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

    async def cancel(self, task_id: str, reason: str) -> LeaseInfo:
        """Cancel a task (an operator's call; needs an admin token when auth is on).

        The task becomes CANCELLED, terminal: its holder's heartbeat ends at
        once (``hold()`` raises ``LeaseLost`` with reason ``TASK_CANCELLED``),
        every fence is refused from then on and claims raise
        :class:`~leasekeeper.TaskCancelled`. The checkpoint is kept.
        Cancelling a cancelled task answers OK and changes nothing.

        Args:
            task_id: The task.
            reason: Why (``LeaseInfo.cancel_reason``, recorded, audited); 1-1024 bytes.

        Returns:
            The task after the call.

        Raises:
            TaskNotFound: NOT_FOUND, the task was never claimed.
            TaskCompleted: FAILED_PRECONDITION TASK_COMPLETED: already ended.
            TaskFailed: FAILED_PRECONDITION TASK_FAILED: already ended.
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.CancelRequest(namespace=self._namespace, task_id=task_id, reason=reason)
        response = await self._call(self.stub.Cancel, request, task_id=task_id)
        return _types.lease_info(response.lease)

    async def retry(self, task_id: str, reason: str) -> LeaseInfo:
        """Put a QUARANTINED task back (an operator's call; needs an admin token when auth is on).

        The task becomes FREE with attempts 0; the next claim is granted with a
        higher fence and receives the kept checkpoint.

        Args:
            task_id: The task.
            reason: Why (recorded in its history and the audit log); 1-1024 bytes.

        Returns:
            The task after the call (FREE, attempts 0).

        Raises:
            TaskNotFound: NOT_FOUND, the task was never claimed.
            TaskNotQuarantined: FAILED_PRECONDITION TASK_NOT_QUARANTINED (its
                ``state`` says what the task is); nothing changed.
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.RetryRequest(namespace=self._namespace, task_id=task_id, reason=reason)
        response = await self._call(self.stub.Retry, request, task_id=task_id)
        return _types.lease_info(response.lease)

    async def list_task_history(
        self,
        task_id: str,
        page_size: int = 100,
        page_token: str = "",
        namespace: str | None = None,
    ) -> tuple[list[HistoryEntry], str]:
        """One page of a task's history, oldest first (see :mod:`leasekeeper.history`). Read-only.

        Args:
            task_id: The task.
            page_size: At most this many (server default 100, maximum 1000).
            page_token: From the previous page (bound to this task); empty for the first.
            namespace: The task's namespace; None for this client's.

        Returns:
            ``(entries, next_page_token)``; the token is empty on the last page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT (e.g. a token of another task).
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = history.list_request(
            self._namespace if namespace is None else namespace, task_id, page_size, page_token
        )
        response = await self._call(self.stub.ListTaskHistory, request, task_id=task_id)
        return history.page(response)

    async def iter_task_history(
        self, task_id: str, page_size: int = 100, namespace: str | None = None
    ) -> AsyncIterator[HistoryEntry]:
        """Every entry of a task's history, oldest first, page by page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE, on any page.

        """
        async for entry in _every_page(
            lambda token: self.list_task_history(task_id, page_size, token, namespace)
        ):
            yield entry

    async def list_leases(
        self, state: str | None = None, page_size: int = 100, page_token: str = ""
    ) -> tuple[list[LeaseInfo], str]:
        """One page of this namespace's tasks, ordered by task_id byte for byte.

        Args:
            state: Only tasks in this state (``"FREE"``, ``"HELD"``, ``"EXPIRED"``,
                ``"COMPLETED"``); None for all.
            page_size: At most this many (server maximum 1000).
            page_token: From the previous page; empty for the first.

        Returns:
            ``(leases, next_page_token)``; the token is empty on the last page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT (or locally for an unknown state).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.ListLeasesRequest(
            namespace=self._namespace,
            state=_types.task_state(state),  # type: ignore[arg-type]
            page_size=page_size,
            page_token=page_token,
        )
        response = await self._call(self.stub.ListLeases, request)
        return [_types.lease_info(lease) for lease in response.leases], response.next_page_token

    async def list_namespaces(
        self, page_size: int = 100, page_token: str = ""
    ) -> tuple[list[NamespaceInfo], str]:
        """One page of the namespaces that hold tasks, ordered by name byte for byte.

        Any namespace, not only this client's. A namespace is listed from its
        first claim on; limits or tokens alone do not make one. Each comes
        with its count of tasks (every state), counted up to 1000
        (``task_count_capped`` when there are more). An operator's call: it
        needs an admin token when the server requires tokens, and lists only
        the namespaces that token covers, so a page may hold fewer than
        ``page_size`` namespaces (even none) and still have a next page.

        Args:
            page_size: At most this many (server maximum 1000).
            page_token: From the previous page; empty for the first.

        Returns:
            ``(namespaces, next_page_token)``: :class:`~leasekeeper.NamespaceInfo`
            values; the token is empty on the last page.

        Raises:
            AccessDenied: UNAUTHENTICATED, or PERMISSION_DENIED (the token's
                role is not admin).
            InvalidArgument: INVALID_ARGUMENT (a page_size outside [0, 1000],
                a page_token of another listing).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.ListNamespacesRequest(page_size=page_size, page_token=page_token)
        response = await self._call(self.stub.ListNamespaces, request)
        namespaces = [_types.namespace_info(summary) for summary in response.namespaces]
        return namespaces, response.next_page_token

    async def iter_namespaces(self, page_size: int = 100) -> AsyncIterator[NamespaceInfo]:
        """Every namespace that holds tasks (that the token covers), page by page.

        Raises:
            AccessDenied: UNAUTHENTICATED, or PERMISSION_DENIED (the token's
                role is not admin).
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE, on any page.

        """
        async for namespace in _every_page(lambda token: self.list_namespaces(page_size, token)):
            yield namespace

    async def namespace_stats(self, namespace: str | None = None) -> NamespaceStats:
        """A namespace's figures now (GetNamespaceStats): an operator's view. Read-only.

        Leases held and expired, tasks quarantined, leases granted, stale
        fences refused and leases lost in the last 60 seconds, effects in
        doubt: see :class:`~leasekeeper.NamespaceStats`. Counted by the server
        in one statement on the database clock (``as_of``); each count stops
        at 1000 rows (its ``*_capped`` flag set when there were more), so a
        call's cost never follows the namespace's size. A namespace that holds no tasks
        answers with every count 0. An operator's call: it needs an admin
        token covering the namespace when the server requires tokens (the
        role of :meth:`list_leases`).

        Args:
            namespace: The namespace; None for this client's.

        Returns:
            The figures: :class:`~leasekeeper.NamespaceStats` (counts as
            ``int``, ``as_of`` a UTC ``datetime``).

        Raises:
            AccessDenied: UNAUTHENTICATED, or PERMISSION_DENIED (the token's
                role is not admin, or it does not cover the namespace).
            InvalidArgument: INVALID_ARGUMENT, the namespace breaks the rules
                of ids (field ``namespace``).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.GetNamespaceStatsRequest(
            namespace=self._namespace if namespace is None else namespace
        )
        response = await self._call(self.stub.GetNamespaceStats, request)
        return _types.namespace_stats(response)

    async def revoke(self, task_id: str, reason: str, fence: int = 0) -> tuple[bool, LeaseInfo]:
        """End the task's lease now (an operator's call; needs an admin token when auth is on).

        The fence stops validating at once, the holder's heartbeat ends ABORTED
        ``LEASE_REVOKED`` and the next claim gets a new fence.

        Args:
            task_id: The task.
            reason: Why (recorded, audited, shown to watchers); 1-1024 bytes.
            fence: Revoke only this fence; 0 for whatever lease is current.

        Returns:
            ``(revoked, lease)``: revoked is False when the task had no such
            lease (FREE, or superseded); lease is the task after the call.

        Raises:
            TaskNotFound: NOT_FOUND, the task was never claimed.
            TaskCompleted: FAILED_PRECONDITION, the task is terminal.
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.RevokeRequest(
            namespace=self._namespace, task_id=task_id, reason=reason, fence=fence
        )
        response = await self._call(self.stub.Revoke, request, task_id=task_id)
        return response.revoked, _types.lease_info(response.lease)

    async def watch(self, task_id: str | None = None) -> AsyncIterator[TaskEvent]:
        """The events of one task (or of this namespace), as the database commits them.

        Yields a ``SNAPSHOT`` first (for one task), then ``CLAIMED``,
        ``RELEASED``, ``EXPIRED``, ``COMPLETED`` and ``REVOKED`` events; a
        later ``SNAPSHOT`` means events may have been missed. Runs until the
        caller stops iterating (the stream is cancelled then). No call timeout
        applies.

        Raises:
            LeaseUnavailable: UNAVAILABLE (server shutting down): watch again.
            AccessDenied: UNAUTHENTICATED or PERMISSION_DENIED.
            InvalidArgument: INVALID_ARGUMENT.

        """
        request = pb.WatchRequest(namespace=self._namespace, task_id=task_id or "")
        call = self.stub.Watch(request, metadata=self._metadata)
        try:
            async for message in call:
                yield _types.task_event(message)
        except grpc.aio.AioRpcError as error:
            raise from_rpc_error(error, task_id=task_id) from error
        finally:
            call.cancel()

    async def iter_leases(
        self, state: str | None = None, page_size: int = 100
    ) -> AsyncIterator[LeaseInfo]:
        """Every task of this namespace (optionally in one state), page by page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE, on any page.

        """
        async for lease in _every_page(lambda token: self.list_leases(state, page_size, token)):
            yield lease

    async def begin_effect(
        self,
        task_id: str,
        fence: int,
        effect_key: str,
        *,
        policy: str,
        request_digest: bytes = b"",
        namespace: str | None = None,
    ) -> BeginResult:
        """Reserve an effect for ``fence`` in the effect ledger.

        One transaction on the database clock: the fence must be the task's
        current fence and its lease HELD; then ``(task, effect_key)`` is
        reserved. Of many concurrent calls for one new key, exactly one gets
        PROCEED. Prefer :meth:`HeldLease.effect <leasekeeper.HeldLease.effect>`,
        which runs the whole protocol.

        Not idempotent for the caller: if a reply is lost (DEADLINE_EXCEEDED),
        the retried call answers IN_DOUBT for the reservation it made itself.

        Args:
            task_id: The task.
            fence: The caller's fence; >= 1.
            effect_key: The effect's idempotency key, unique within the task
                (1-256 bytes UTF-8 by default, no control characters).
            policy: ``"ONCE"`` for an irreversible effect (send the email,
                charge the card): the first confirmed outcome stands for ever.
                ``"LATEST"`` for a replaceable one (write the draft, set the
                status): a newer fence does it again, and an older fence's
                completion is refused. Fixed for the key by its first reservation.
            request_digest: What the effect will do, digested (e.g.
                :func:`~leasekeeper.request_digest` of the request); at most 64
                bytes, may be empty.
            namespace: The task's namespace; None for this client's.

        Returns:
            ``decision`` PROCEED (do the effect now, then :meth:`complete_effect`),
            ALREADY_APPLIED (the confirmed outcome: do not repeat) or IN_DOUBT
            (the earlier, unconfirmed attempt: reconcile first), with the effect.

        Raises:
            LeaseLost: ABORTED: the fence may not act (LEASE_EXPIRED,
                LEASE_SUPERSEDED, ...); nothing is reserved.
            EffectKeyReused: FAILED_PRECONDITION EFFECT_KEY_REUSED: the key was
                reserved with another policy or request_digest.
            InvalidArgument: INVALID_ARGUMENT (or locally for an unknown policy).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.BeginEffectRequest(
            namespace=self._namespace if namespace is None else namespace,
            task_id=task_id,
            fence=fence,
            effect_key=effect_key,
            policy=_types.effect_policy(policy),  # type: ignore[arg-type]
            request_digest=request_digest,
        )
        response = await self._call(self.stub.BeginEffect, request, task_id=task_id, fence=fence)
        return _types.begin_result(response)

    async def complete_effect(
        self,
        task_id: str,
        fence: int,
        effect_key: str,
        *,
        outcome: str,
        retryable: bool = False,
        result: bytes = b"",
        namespace: str | None = None,
        external_operation_id: str = "",
        next_checkpoint: CheckpointLike | None = None,
    ) -> EffectRecord:
        """Record the outcome of a reserved effect (and the checkpoint after it).

        One transaction on the database clock: the fence must be the task's
        current fence, its lease HELD, and at least the reservation's fence (a
        replacement worker may record the outcome of an earlier attempt it
        reconciled). Idempotent: the same outcome, retryable flag and result
        recorded again answer OK. With ``next_checkpoint`` the checkpoint is
        saved in the same transaction, decided as :meth:`save_checkpoint`
        decides: both are stored or neither.

        Args:
            task_id: The task.
            fence: The caller's fence; >= 1.
            effect_key: The effect's idempotency key.
            outcome: ``"SUCCEEDED"`` (the effect happened) or ``"FAILED"`` (it
                did not).
            retryable: For FAILED: a new attempt may be reserved later. Must be
                False for SUCCEEDED.
            result: Opaque bytes kept with the outcome (e.g. the outside
                system's message id); at most the server's
                ``max_effect_result_bytes`` (64 KiB by default).
            namespace: The task's namespace; None for this client's.
            external_operation_id: The outside system's id for the operation
                (e.g. the payment's id), recorded with the outcome and in the
                task's history; at most 256 bytes, the rules of ids; may be empty.
            next_checkpoint: The checkpoint after this effect: a
                :class:`~leasekeeper.Checkpoint` or ``(version, data[,
                content_type])``; None: none.

        Returns:
            The effect as recorded; its ``checkpoint`` is the one saved with it
            (the data sent), None without ``next_checkpoint``.

        Raises:
            LeaseLost: ABORTED: the fence may not act; a step that outlived its
                lease cannot complete its effect (it stays RESERVED, in doubt).
            EffectNotBegun: FAILED_PRECONDITION EFFECT_NOT_BEGUN: no reservation
                for the key.
            EffectAlreadyCompleted: FAILED_PRECONDITION EFFECT_ALREADY_COMPLETED:
                another outcome is recorded.
            CheckpointNotNewer: FAILED_PRECONDITION CHECKPOINT_NOT_NEWER: the
                checkpoint does not move forward; the outcome is not recorded either.
            InvalidArgument: INVALID_ARGUMENT (or locally for an unknown outcome,
                ``retryable`` with SUCCEEDED, or a value that is not a checkpoint).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        outcome_value = _types.effect_outcome(outcome)
        if retryable and outcome_value == pb.EFFECT_STATE_SUCCEEDED:
            raise InvalidArgument(
                "retryable must be False for outcome SUCCEEDED",
                field_violations=[("retryable", "only a FAILED outcome is retryable")],
                code=None,
            )
        sent = (
            None
            if next_checkpoint is None
            else checkpoints.checkpoint_message(next_checkpoint, "next_checkpoint")
        )
        request = pb.CompleteEffectRequest(
            namespace=self._namespace if namespace is None else namespace,
            task_id=task_id,
            fence=fence,
            effect_key=effect_key,
            outcome=outcome_value,  # type: ignore[arg-type]
            retryable=retryable,
            result=result,
            external_operation_id=external_operation_id,
            next_checkpoint=sent,
        )
        response = await self._call(self.stub.CompleteEffect, request, task_id=task_id, fence=fence)
        return _types.completed_effect(response, sent, fence)

    async def list_effects(
        self,
        task_id: str,
        state: str | None = None,
        page_size: int = 100,
        page_token: str = "",
        namespace: str | None = None,
    ) -> tuple[list[EffectRecord], str]:
        """One page of a task's effects, ordered by effect_key byte for byte. Read-only.

        For reconciliation and for a replacement worker: what was reserved, by
        which fence, in which state. A task without effects (or never claimed)
        has none.

        Args:
            task_id: The task.
            state: Only effects in this state (``"RESERVED"``, ``"SUCCEEDED"``,
                ``"FAILED"``); None for all.
            page_size: At most this many (server maximum 1000).
            page_token: From the previous page; empty for the first.
            namespace: The task's namespace; None for this client's.

        Returns:
            ``(effects, next_page_token)``; the token is empty on the last page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT (or locally for an unknown state).
            LeaseUnavailable: UNAVAILABLE; safe to retry.

        """
        request = pb.ListEffectsRequest(
            namespace=self._namespace if namespace is None else namespace,
            task_id=task_id,
            state=_types.effect_state(state),  # type: ignore[arg-type]
            page_size=page_size,
            page_token=page_token,
        )
        response = await self._call(self.stub.ListEffects, request, task_id=task_id)
        effects = [_types.effect_record(effect) for effect in response.effects]
        return effects, response.next_page_token

    async def iter_effects(
        self,
        task_id: str,
        state: str | None = None,
        page_size: int = 100,
        namespace: str | None = None,
    ) -> AsyncIterator[EffectRecord]:
        """Every effect of a task (optionally in one state), page by page.

        Raises:
            InvalidArgument: INVALID_ARGUMENT.
            LeaseUnavailable: UNAVAILABLE, on any page.

        """
        async for effect in _every_page(
            lambda token: self.list_effects(task_id, state, page_size, token, namespace)
        ):
            yield effect

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
