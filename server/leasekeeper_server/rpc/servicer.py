"""Thin RPC handlers: validate, call one store method, convert back.

Errors leave through ``handling.unary`` / ``handling.streaming`` as rich
statuses; what is counted, traced and audited is derived from each call by
the interceptor (``observability/observe.py``), so nothing here calls metrics.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.core.errors import LeaseLost, TaskNotFound
from leasekeeper_server.core.limits import LimitsCache
from leasekeeper_server.core.model import ClaimOutcome, TaskKey
from leasekeeper_server.rpc import convert, validate
from leasekeeper_server.rpc.handling import parse_or_malformed, streaming, unary
from leasekeeper_server.rpc.heartbeat import HeartbeatService
from leasekeeper_server.rpc.paging import PageTokens
from leasekeeper_server.rpc.service import SERVICE_NAME
from leasekeeper_server.rpc.session import SessionService
from leasekeeper_server.rpc.validate_stream import ValidateFencesService, fence_answer
from leasekeeper_server.rpc.waiting import TIMER_SLACK_S, Woken, first_of, guarding_credentials
from leasekeeper_server.rpc.watch import WatchService
from leasekeeper_server.security import caller as auth
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage.protocol import ChangeFeed, EffectStore, LeaseStore


class LeaseServicer:
    """The leasekeeper.v1.LeaseService handlers."""

    def __init__(
        self,
        store: LeaseStore,
        ledger: EffectStore,
        heartbeats: HeartbeatService,
        settings: Settings,
        *,
        events: ChangeFeed,
        limits: LimitsCache,
        watches: WatchService,
        page_tokens: PageTokens,
        shutdown: asyncio.Event,
        sessions: SessionService | None = None,
        validations: ValidateFencesService | None = None,
    ) -> None:
        """The handlers; ``shutdown`` is the server-wide signal (``app.py`` sets it when stopping).

        A Claim waiting when it is set ends UNAVAILABLE (SHUTTING_DOWN).
        """
        self._store = store
        self._ledger = ledger
        self._heartbeats = heartbeats
        self._settings = settings
        self._events = events
        self._limits = limits
        self._watches = watches
        self._page_tokens = page_tokens
        self._shutdown = shutdown
        # None: one of its own (app.py passes the ones it exposes, the sessions' with its metrics).
        self._validations = validations or ValidateFencesService(store, settings, shutdown=shutdown)
        self._sessions = sessions or SessionService(store, events, settings, shutdown=shutdown)

    @unary
    async def Claim(self, request: pb.ClaimRequest, context: Any) -> pb.ClaimResponse:
        """Claims a task, waiting up to ``wait`` for it (see the proto for outcomes and codes)."""
        s = self._settings
        key = validate.task_key(request, s)
        owner_id = validate.identifier("owner_id", request.owner_id, s.max_id_bytes)
        ttl = validate.ttl(request, s)
        max_runtime = validate.max_runtime(request, s)
        request_id = validate.request_id(request.request_id, s.max_id_bytes)
        wait = validate.claim_wait(request, s)
        limits = self._limits.get(key.namespace)
        max_attempts = validate.max_attempts(request, limits.max_attempts)

        # A partial, not a closure: no frame between the handler and Store.claim.
        claim = functools.partial(
            self._store.claim,
            key,
            owner_id,
            ttl,
            max_runtime,
            request_id,
            limits,
            max_attempts=max_attempts,
        )
        if wait > timedelta(0):
            outcome = await self._claim_waiting(key, claim, wait)
        else:
            outcome = await claim()
        if outcome.acquired:
            return pb.ClaimResponse(
                acquired=True,
                lease=convert.lease(outcome.lease),
                checkpoint=convert.checkpoint(outcome.checkpoint),
            )
        return pb.ClaimResponse(
            acquired=False,
            holder_remaining_ttl=convert.duration(outcome.lease.remaining_ttl),
            holder_expire_time=convert.timestamp(outcome.lease.expire_time),
            retry_after=convert.duration(outcome.retry_after),
        )

    async def _claim_waiting(
        self,
        key: TaskKey,
        claim: Callable[..., Awaitable[ClaimOutcome]],
        wait: timedelta,
    ) -> ClaimOutcome:
        """Claims, and while the task is held, claims again when it may have become free.

        Woken by the database's announcement of a change to the task (a
        release, a revoke, a completion, an announced expiry) or by a timer at
        the instant the database said the task could be granted (the
        holder's expire_time plus the lock delay); each wake-up is one claim
        decided on the database clock. The monotonic clock only bounds the
        wait.

        Raises:
            ShuttingDown: the server began to shut down while the claim waited
                (UNAVAILABLE: wait again on another replica).
            Unauthenticated: the caller's token was revoked meanwhile.
        """
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + wait.total_seconds()
        # A token revoked while the claim waits ends the wait (UNAUTHENTICATED).
        async with guarding_credentials(key.namespace) as credentials:
            with self._events.watch(key) as changed:  # watching before the first claim
                outcome = await claim()
                while not outcome.acquired:
                    left_s = give_up_at - loop.time()
                    if left_s <= 0:
                        break
                    timer_s = max(outcome.retry_after.total_seconds(), 0.0) + TIMER_SLACK_S
                    woken = await first_of(
                        changed=changed,
                        shutdown=self._shutdown,
                        credentials=credentials,
                        timeout_s=min(left_s, timer_s),
                        then="claim again on a replica",
                    )
                    if woken is Woken.CHANGED:
                        changed.clear()
                    outcome = await claim(take_token=False)
        return outcome

    @unary
    async def Renew(self, request: pb.RenewRequest, context: Any) -> pb.RenewResponse:
        """Renews a live lease; ABORTED with the reason otherwise."""
        ref = validate.lease_ref(request, self._settings)
        ttl = validate.ttl(request, self._settings)
        return pb.RenewResponse(lease=convert.lease(await self._store.renew(ref, ttl)))

    @unary
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        """Releases or completes a lease; idempotent for the same fence."""
        ref = validate.lease_ref(request, self._settings)
        fail_reason = validate.fail_reason(request)
        lease = await self._store.release(ref, request.complete, request.fail, fail_reason)
        return pb.ReleaseResponse(lease=convert.lease(lease))

    @unary
    async def ValidateFence(
        self, request: pb.ValidateFenceRequest, context: Any
    ) -> pb.ValidateFenceResponse:
        """Says whether a fence may act now; always OK (the decision: validate_stream.py)."""
        key = validate.task_key(request, self._settings)
        fence = validate.fence("fence", request.fence)
        return await fence_answer(self._store, key, fence)

    @unary
    async def GetLease(self, request: pb.GetLeaseRequest, context: Any) -> pb.GetLeaseResponse:
        """The task's current state; NOT_FOUND when never claimed."""
        key = validate.task_key(request, self._settings)
        lease = await self._store.get_lease(key)
        if lease is None:
            raise TaskNotFound(
                f"task {key.task_id!r} in namespace {key.namespace!r} was never claimed"
            )
        saved = await self._store.get_checkpoint(key) if lease.checkpoint_version else None
        return pb.GetLeaseResponse(lease=convert.lease(lease), checkpoint=convert.checkpoint(saved))

    @unary
    async def ListLeases(
        self, request: pb.ListLeasesRequest, context: Any
    ) -> pb.ListLeasesResponse:
        """One page of a namespace's tasks, by task_id."""
        s = self._settings
        namespace = validate.identifier("namespace", request.namespace, s.max_id_bytes)
        state = validate.task_state_filter(request.state)
        size = validate.page_size(request.page_size)
        owner_id = validate.optional_identifier("owner_id", request.owner_id, s.max_id_bytes)
        listing = ("ListLeases", namespace, state.value if state else None, owner_id)
        after = self._page_tokens.position(listing, request.page_token)
        tasks, read_up_to = await self._store.list_leases(
            namespace, after, size + 1, state, owner_id
        )
        page, token = self._page_tokens.page(listing, tasks, size, lambda t: t.task_id)
        if read_up_to is not None:  # a short page of a rare filter: go on after what was read
            token = self._page_tokens.issue(listing, read_up_to)
        return pb.ListLeasesResponse(leases=[convert.lease(t) for t in page], next_page_token=token)

    @unary
    async def ListNamespaces(
        self, request: pb.ListNamespacesRequest, context: Any
    ) -> pb.ListNamespacesResponse:
        """One page of the namespaces that hold tasks, by name; only those the token covers.

        The page is cut from the namespaces read, then those the caller's token
        does not cover are left out: a page may be short, even empty, and not
        the last.
        """
        size = validate.page_size(request.page_size)
        listing = ("ListNamespaces",)
        after = self._page_tokens.position(listing, request.page_token)
        read = await self._store.list_namespaces(after, size + 1)
        page, token = self._page_tokens.page(listing, read, size, lambda n: n.namespace)
        return pb.ListNamespacesResponse(
            namespaces=[convert.namespace_summary(n) for n in page if auth.covers(n.namespace)],
            next_page_token=token,
        )

    @unary
    async def GetNamespaceStats(
        self, request: pb.GetNamespaceStatsRequest, context: Any
    ) -> pb.GetNamespaceStatsResponse:
        """A namespace's figures now: one read-only statement, each count bounded (the proto)."""
        namespace = validate.identifier("namespace", request.namespace, self._settings.max_id_bytes)
        return convert.namespace_stats(await self._store.namespace_stats(namespace))

    @unary
    async def BeginEffect(
        self, request: pb.BeginEffectRequest, context: Any
    ) -> pb.BeginEffectResponse:
        """Reserves an effect for a live fence (see ledger.py and effect_rules.py)."""
        begin = validate.begin_request(request, self._settings)
        try:
            decision, record = await self._ledger.begin(begin)
        except LeaseLost as lost:  # a stale fence: into the task's history, then refused
            task = TaskKey(begin.key.namespace, begin.key.task_id)
            await self._store.record_refusal(task, begin.fence, lost.loss, "BeginEffect")
            raise
        return pb.BeginEffectResponse(
            decision=convert.DECISION[decision], effect=convert.effect(record)
        )

    @unary
    async def CompleteEffect(
        self, request: pb.CompleteEffectRequest, context: Any
    ) -> pb.CompleteEffectResponse:
        """Records an effect's outcome by a live fence; idempotent for the same outcome."""
        key = validate.effect_key(request, self._settings)
        fence = validate.fence("fence", request.fence)
        outcome = validate.outcome(request, self._settings)
        if not request.HasField("next_checkpoint"):
            record = await self._ledger.complete(key, fence, outcome)
            return pb.CompleteEffectResponse(effect=convert.effect(record))
        checkpoint = validate.checkpoint("next_checkpoint", request.next_checkpoint, self._settings)
        auth.authorize_method("SaveCheckpoint", "next_checkpoint")
        record, saved = await self._ledger.complete_and_save(key, fence, outcome, checkpoint)
        return pb.CompleteEffectResponse(
            effect=convert.effect(record), checkpoint=convert.checkpoint(saved, with_data=False)
        )

    @unary
    async def ListEffects(
        self, request: pb.ListEffectsRequest, context: Any
    ) -> pb.ListEffectsResponse:
        """One page of a task's effects, by effect_key."""
        s = self._settings
        task = validate.task_key(request, s)
        state = validate.effect_state_filter(request.state)
        size = validate.page_size(request.page_size)
        listing = ("ListEffects", task.namespace, task.task_id, state.value if state else None)
        after = self._page_tokens.position(listing, request.page_token)
        records = await self._ledger.list(task, after, size + 1, state)
        page, token = self._page_tokens.page(listing, records, size, lambda r: r.effect_key)
        return pb.ListEffectsResponse(
            effects=[convert.effect(r) for r in page], next_page_token=token
        )

    @unary
    async def Revoke(self, request: pb.RevokeRequest, context: Any) -> pb.RevokeResponse:
        """Ends the task's lease now (an operator's call; see the proto)."""
        key = validate.task_key(request, self._settings)
        reason = validate.revoke_reason(request.reason)
        fence = validate.optional_fence("fence", request.fence)
        revoked, lease = await self._store.revoke(key, reason, fence)
        return pb.RevokeResponse(revoked=revoked, lease=convert.lease(lease))

    @unary
    async def SaveCheckpoint(
        self, request: pb.SaveCheckpointRequest, context: Any
    ) -> pb.SaveCheckpointResponse:
        """Saves the task's checkpoint under the caller's live lease (see the proto)."""
        ref = validate.lease_ref(request, self._settings)
        checkpoint = validate.checkpoint("checkpoint", request.checkpoint, self._settings)
        saved, lease = await self._store.save_checkpoint(ref, checkpoint)
        return pb.SaveCheckpointResponse(
            checkpoint=convert.checkpoint(saved, with_data=False), lease=convert.lease(lease)
        )

    @unary
    async def Cancel(self, request: pb.CancelRequest, context: Any) -> pb.CancelResponse:
        """Cancels a task for good (an operator's call; see the proto)."""
        key = validate.task_key(request, self._settings)
        reason = validate.revoke_reason(request.reason)
        cancelled, lease = await self._store.cancel(key, reason)
        return pb.CancelResponse(lease=convert.lease(lease), cancelled=cancelled)

    @unary
    async def Retry(self, request: pb.RetryRequest, context: Any) -> pb.RetryResponse:
        """Puts a quarantined task back (an operator's call; see the proto)."""
        key = validate.task_key(request, self._settings)
        reason = validate.revoke_reason(request.reason)
        return pb.RetryResponse(lease=convert.lease(await self._store.retry(key, reason)))

    @unary
    async def ListTaskHistory(
        self, request: pb.ListTaskHistoryRequest, context: Any
    ) -> pb.ListTaskHistoryResponse:
        """One page of a task's history, oldest first."""
        key = validate.task_key(request, self._settings)
        size = validate.page_size(request.page_size)
        listing = ("ListTaskHistory", key.namespace, key.task_id)
        after = self._page_tokens.position(listing, request.page_token)
        entries = await self._store.list_history(key, int(after or 0), size + 1)
        page, token = self._page_tokens.page(listing, entries, size, lambda e: str(e.sequence))
        return pb.ListTaskHistoryResponse(
            entries=[convert.history_entry(e) for e in page], next_page_token=token
        )

    @streaming
    async def Heartbeat(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """The heartbeat stream; see heartbeat.py."""
        await self._heartbeats.serve(context)

    @streaming
    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """The Session stream (many leases on one stream); see session.py."""
        await self._sessions.serve(context)

    @streaming
    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """The Watch stream; see watch.py."""
        await self._watches.serve(request, context)

    @streaming
    async def ValidateFences(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> None:
        """The ValidateFences stream; see validate_stream.py."""
        await self._validations.serve(context)


def method_handlers(servicer: LeaseServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, with deserializers that never raise."""

    def unary_handler(name: str, req: Any, resp: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=parse_or_malformed(req),
            response_serializer=resp.SerializeToString,
        )

    handlers = {
        "Claim": unary_handler("Claim", pb.ClaimRequest, pb.ClaimResponse),
        "Renew": unary_handler("Renew", pb.RenewRequest, pb.RenewResponse),
        "Release": unary_handler("Release", pb.ReleaseRequest, pb.ReleaseResponse),
        "ValidateFence": unary_handler(
            "ValidateFence", pb.ValidateFenceRequest, pb.ValidateFenceResponse
        ),
        "GetLease": unary_handler("GetLease", pb.GetLeaseRequest, pb.GetLeaseResponse),
        "ListLeases": unary_handler("ListLeases", pb.ListLeasesRequest, pb.ListLeasesResponse),
        "ListNamespaces": unary_handler(
            "ListNamespaces", pb.ListNamespacesRequest, pb.ListNamespacesResponse
        ),
        "GetNamespaceStats": unary_handler(
            "GetNamespaceStats", pb.GetNamespaceStatsRequest, pb.GetNamespaceStatsResponse
        ),
        "BeginEffect": unary_handler("BeginEffect", pb.BeginEffectRequest, pb.BeginEffectResponse),
        "CompleteEffect": unary_handler(
            "CompleteEffect", pb.CompleteEffectRequest, pb.CompleteEffectResponse
        ),
        "ListEffects": unary_handler("ListEffects", pb.ListEffectsRequest, pb.ListEffectsResponse),
        "Revoke": unary_handler("Revoke", pb.RevokeRequest, pb.RevokeResponse),
        "SaveCheckpoint": unary_handler(
            "SaveCheckpoint", pb.SaveCheckpointRequest, pb.SaveCheckpointResponse
        ),
        "Cancel": unary_handler("Cancel", pb.CancelRequest, pb.CancelResponse),
        "Retry": unary_handler("Retry", pb.RetryRequest, pb.RetryResponse),
        "ListTaskHistory": unary_handler(
            "ListTaskHistory", pb.ListTaskHistoryRequest, pb.ListTaskHistoryResponse
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            servicer.Watch,
            request_deserializer=parse_or_malformed(pb.WatchRequest),
            response_serializer=pb.TaskEvent.SerializeToString,
        ),
        "Heartbeat": grpc.stream_stream_rpc_method_handler(
            servicer.Heartbeat,
            request_deserializer=parse_or_malformed(pb.HeartbeatRequest),
            response_serializer=pb.HeartbeatResponse.SerializeToString,
        ),
        "Session": grpc.stream_stream_rpc_method_handler(
            servicer.Session,
            request_deserializer=parse_or_malformed(pb.SessionRequest),
            response_serializer=pb.SessionResponse.SerializeToString,
        ),
        "ValidateFences": grpc.stream_stream_rpc_method_handler(
            servicer.ValidateFences,
            request_deserializer=parse_or_malformed(pb.ValidateFencesRequest),
            response_serializer=pb.ValidateFencesResponse.SerializeToString,
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
