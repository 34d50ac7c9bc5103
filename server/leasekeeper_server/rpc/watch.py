"""The Watch stream: a task's (or a namespace's) events as the database commits them.

A worker waiting for another's task to complete subscribes instead of
polling. Events come from the task table's trigger (``events.py``), so they
arrive in commit order, whichever replica made the change; an expiry is
announced once: by the elected sweeper (``sweeper.py``), at most a sweep
interval late, or just before the claim, release or revoke that ends the
expired lease first.

For one task the stream starts with a SNAPSHOT (the task read after
subscribing, so no later change can be missed), then delivers each event
that the snapshot does not already show. When events may have been lost
(the server's listening connection was interrupted, or the client read too
slowly) it sends a fresh SNAPSHOT; a namespace stream sends a SNAPSHOT with
no lease instead, meaning "re-read what you care about". The stream ends
UNAVAILABLE when the server shuts down: watch again, on any replica.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

import grpc

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper_server.core.model import Lease, TaskKey, lease_from_row
from leasekeeper_server.rpc import convert, validate
from leasekeeper_server.rpc.waiting import first_of, guarding_credentials
from leasekeeper_server.security import caller as auth
from leasekeeper_server.settings import Settings
from leasekeeper_server.storage.protocol import ChangeFeed, LeaseStore

_EVENT_TYPE = {
    "claimed": pb.TASK_EVENT_TYPE_CLAIMED,
    "released": pb.TASK_EVENT_TYPE_RELEASED,
    "expired": pb.TASK_EVENT_TYPE_EXPIRED,
    "completed": pb.TASK_EVENT_TYPE_COMPLETED,
    "revoked": pb.TASK_EVENT_TYPE_REVOKED,
    "quarantined": pb.TASK_EVENT_TYPE_QUARANTINED,
    "retried": pb.TASK_EVENT_TYPE_RETRIED,
    "cancelled": pb.TASK_EVENT_TYPE_CANCELLED,
    "failed": pb.TASK_EVENT_TYPE_FAILED,
}


def lease_of_event(data: dict[str, Any]) -> Lease:
    """The task as a notification payload describes it, judged at the event's instant.

    The payload is the row (migrations/0005_operations.sql) with its instants as
    JSON text; the event's instant stands in for the database clock.
    """
    row = dict(data)
    for name in ("expire_time", "runtime_deadline", "claim_time"):
        row[name] = datetime.fromisoformat(data[name])
    row["db_now"] = datetime.fromisoformat(data["event_time"])
    return lease_from_row(row)


def event_message(data: dict[str, Any]) -> pb.TaskEvent | None:
    """The TaskEvent for a notification payload; None for one of an unknown kind."""
    kind = _EVENT_TYPE.get(data.get("event", ""))
    if kind is None:
        return None
    lease = lease_of_event(data)
    return pb.TaskEvent(
        type=kind, lease=convert.lease(lease), event_time=convert.timestamp(lease.db_now)
    )


def snapshot_message(lease: Lease | None, key: TaskKey | None) -> pb.TaskEvent:
    """A SNAPSHOT event: the task as read (or a never-claimed task; or no lease at all)."""
    message = pb.TaskEvent(type=pb.TASK_EVENT_TYPE_SNAPSHOT)
    if lease is not None:
        message.lease.CopyFrom(convert.lease(lease))
        message.event_time.CopyFrom(convert.timestamp(lease.db_now))
    elif key is not None:
        message.lease.namespace = key.namespace
        message.lease.task_id = key.task_id
        message.lease.state = pb.TASK_STATE_FREE
    return message


class WatchService:
    """Serves Watch streams; the server's shutdown ends them all (UNAVAILABLE)."""

    def __init__(
        self, store: LeaseStore, events: ChangeFeed, settings: Settings, *, shutdown: asyncio.Event
    ) -> None:
        """The service; ``shutdown``, the server-wide signal, ends every stream when set."""
        self._store = store
        self._events = events
        self._settings = settings
        self._shutdown = shutdown

    async def serve(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Runs one Watch stream until it fails (the handler is wrapped by ``handling.streaming``).

        Raises:
            ShuttingDown: the server is shutting down (UNAVAILABLE): watch again.
            InvalidArgument: the request is malformed.
            Unauthenticated, PermissionDenied: the token is refused or revoked.
            DatabaseUnavailable: the snapshot could not be read (UNAVAILABLE).
        """
        s = self._settings
        namespace = validate.identifier("namespace", request.namespace, s.max_id_bytes)
        key = None
        if request.task_id:
            key = TaskKey(
                namespace, validate.identifier("task_id", request.task_id, s.max_id_bytes)
            )
        auth.authorize_namespace(namespace)
        with self._events.subscribe(namespace, key.task_id if key else None) as sub:
            # Subscribed first, then read: a change after the read is queued.
            shown = await self._snapshot(context, key) if key is not None else None
            # Ends the stream if the caller's token is revoked while it runs.
            async with guarding_credentials(namespace) as credentials:
                while True:
                    await first_of(
                        changed=sub.ready,
                        shutdown=self._shutdown,
                        credentials=credentials,
                        timeout_s=None,
                        then="watch again",
                    )
                    gap, events = sub.take()  # clears sub.ready
                    if gap:
                        if key is not None:
                            shown = await self._snapshot(context, key)
                        else:
                            await context.write(snapshot_message(None, None))
                        continue
                    for data in events:
                        if shown is not None and _already_shown(shown, data):
                            continue
                        shown = None  # from the first new event on, every one is news
                        message = event_message(data)
                        if message is not None:
                            await context.write(message)

    async def _snapshot(self, context: grpc.aio.ServicerContext, key: TaskKey) -> Lease | None:
        lease = await self._store.get_lease(key)
        await context.write(snapshot_message(lease, key))
        return lease


def _already_shown(snapshot: Lease, data: dict[str, Any]) -> bool:
    """True for an event the snapshot already reflects (it committed before the read).

    A later change would show another fence or another state, except an
    expiry announcement, which is always delivered.
    """
    return (
        data.get("event") != "expired"
        and int(data.get("fence", -1)) == snapshot.fence
        and data.get("state") == snapshot.row_state
    )
