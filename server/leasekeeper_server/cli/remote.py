"""The ``leasekeeper`` commands that call a running server.

::

    leasekeeper leases list [NS] [--state STATE | --expired] [--owner OWNER] [--limit N]
    leasekeeper leases get [NS] TASK_ID
    leasekeeper leases stats [NS]
    leasekeeper effects list [NS] TASK_ID [--state STATE]
    leasekeeper tasks history [NS] TASK_ID [--limit N]
    leasekeeper tasks cancel [NS] TASK_ID --reason TEXT
    leasekeeper tasks retry [NS] TASK_ID --reason TEXT
    leasekeeper revoke [NS] TASK_ID --reason TEXT [--fence N]
    leasekeeper watch [NS [TASK_ID]] [--count N] [--timeout S]
    leasekeeper namespaces [--limit N]

The namespace comes first, positionally, or with ``-n NS`` (``--namespace``);
unnamed it is ``default``. With ``-n``, the names that follow are the rest:
``revoke TASK_ID -n NS``, ``watch TASK_ID -n NS``. Each command takes
``--target`` (default ``$LEASEKEEPER_TARGET``, else 127.0.0.1:9457),
``--token`` (default ``$LEASEKEEPER_TOKEN``; sent as ``authorization: Bearer
<token>``), ``--tls-ca FILE`` for a TLS server (``--tls-cert``/``--tls-key``
for mutual TLS) and ``--json`` (JSON Lines: exactly one JSON object per line
on standard output, nothing else; keys are the proto's field names).

A failed call prints one line, its gRPC status code and message, and exits 1
(``cancel`` of a completed task, ``retry`` of a task that is not quarantined:
FAILED_PRECONDITION; a task never claimed: NOT_FOUND). A call that changed
nothing exits 3 and says why on standard error: ``revoke`` of a task holding
no lease to revoke (FREE, QUARANTINED, or another fence than ``--fence``),
``tasks cancel`` of a task cancelled already. ``leases list`` of a namespace
that holds no tasks says so on standard error, with the namespaces that do.

Only the thin client's dependencies are needed (grpcio, protobuf).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import grpc
from google.protobuf.message import Message

from leasekeeper import CHANNEL_OPTIONS
from leasekeeper._types import EFFECT_STATES
from leasekeeper.channel import default_target
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as pb_grpc
from leasekeeper_server.cli import output as out
from leasekeeper_server.rpc.paging import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE

CALL_TIMEOUT_S = 10.0
DEFAULT_NAMESPACE = "default"

# Each command's synopsis, as `leasekeeper --help` lists it (cli/main.py's epilog).
SYNOPSIS = (
    "leases list [NS] [--state STATE | --expired] [--owner OWNER] [--limit N]",
    "leases get [NS] TASK_ID",
    "leases stats [NS]",
    "effects list [NS] TASK_ID [--state STATE]",
    "tasks history [NS] TASK_ID [--limit N]",
    "tasks cancel [NS] TASK_ID --reason TEXT",
    "tasks retry [NS] TASK_ID --reason TEXT",
    "revoke [NS] TASK_ID --reason TEXT [--fence N]",
    "watch [NS [TASK_ID]] [--count N] [--timeout S]",
    "namespaces [--limit N]",
)

# Every TaskState but UNSPECIFIED, as --state takes them (HELD, QUARANTINED, ...).
TASK_STATES = tuple(
    name.removeprefix("TASK_STATE_") for name, number in pb.TaskState.items() if number
)
# A task's row in `leases list`; attempts and checkpoint as output.task_shown joins them.
LEASE_COLUMNS = (
    "task_id",
    "state",
    "fence",
    "owner_id",
    "remaining_ttl",
    "expire_time",
    "claim_time",
    "attempts",
    "checkpoint",
    "end_reason",
)
# One task in `leases get`, `revoke`, `cancel` and `retry`.
TASK_FIELDS = (
    "namespace",
    "task_id",
    "state",
    "fence",
    "owner_id",
    "remaining_ttl",
    "expire_time",
    "runtime_deadline",
    "claim_time",
    "attempts",
    "end_reason",
    "revoke_reason",
    "cancel_reason",
    "fail_reason",
    "checkpoint",
)
# The checkpoint's fields in `leases get --json` (its data is left out: opaque bytes).
CHECKPOINT_FIELDS = ("version", "size", "content_type", "fence", "write_time")
HISTORY_COLUMNS = ("sequence", "event_time", "kind", "fence", "owner_id", "attempt", "details")
EFFECT_COLUMNS = (
    "effect_key",
    "policy",
    "state",
    "fence",
    "complete_fence",
    "attempts",
    "begin_time",
    "complete_time",
    "result",
)
NAMESPACE_COLUMNS = ("namespace", "tasks")
# A namespace's figures in `leases stats`, in the answer's order (each count
# with its *_capped flag, shown as "N+").
STATS_COUNTS = (
    "leases_held",
    "leases_expired",
    "tasks_quarantined",
    "claims_last_minute",
    "stale_fences_last_minute",
    "leases_lost_last_minute",
    "effects_in_doubt",
)
# How many namespaces the hint of an empty `leases list` names.
HINT_NAMESPACES = 10

# What a command's names are: [NS] only, [NS] TASK_ID, or [NS [TASK_ID]].
Names = Literal["namespace", "task", "namespace_then_task"]
_NAMES_USAGE: dict[Names, str] = {
    "namespace": "[NAMESPACE]",
    "task": "[NAMESPACE] TASK_ID",
    "namespace_then_task": "[NAMESPACE [TASK_ID]]",
}
_NAMES_AFTER_OPTION: dict[Names, str] = {
    "namespace": "no name",
    "task": "TASK_ID",
    "namespace_then_task": "[TASK_ID]",
}


class UsageError(Exception):
    """Options that do not fit together; the command exits 2."""


def server_options() -> argparse.ArgumentParser:
    """The options every server-calling command shares (a parent parser): server and --json."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("server")
    group.add_argument(
        "--target",
        default=default_target(),
        help="server address host:port (default: $LEASEKEEPER_TARGET, else 127.0.0.1:9457)",
    )
    group.add_argument(
        "--token",
        default=os.environ.get("LEASEKEEPER_TOKEN") or None,
        help="access token, sent as 'authorization: Bearer TOKEN' (default: $LEASEKEEPER_TOKEN)",
    )
    group.add_argument("--tls-ca", type=Path, metavar="FILE", help="CA bundle (PEM): use TLS")
    group.add_argument(
        "--tls-cert", type=Path, metavar="FILE", help="client certificate (PEM) for mutual TLS"
    )
    group.add_argument("--tls-key", type=Path, metavar="FILE", help="its private key (PEM)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON Lines: one JSON object per line on stdout, nothing else",
    )
    return parser


def namespace_option() -> argparse.ArgumentParser:
    """``-n/--namespace`` (a parent parser): the namespace, when not given positionally."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "-n",
        "--namespace",
        default=None,
        metavar="NS",
        help=f"the namespace, instead of the first name (default: {DEFAULT_NAMESPACE})",
    )
    return parser


def _add_names(parser: argparse.ArgumentParser, names: Names, command: str, more: str) -> None:
    """The command's positional names (``[NAMESPACE] TASK_ID`` ...), resolved by ``_resolve``."""
    parser.usage = f"leasekeeper {command} {_NAMES_USAGE[names]}{more} [options]"
    parser.set_defaults(names_kind=names, names_command=command)
    what = {
        "namespace": "[NAMESPACE]: the namespace (or give it with -n)",
        "task": "[NAMESPACE] TASK_ID: the task, after its namespace (or give it with -n)",
        "namespace_then_task": "[NAMESPACE [TASK_ID]]: the namespace (or give it with -n), "
        "and one task of it (default: every task)",
    }[names]
    metavar = "NAMESPACE" if names == "namespace" else "NAME"
    parser.add_argument("names", nargs="+" if names == "task" else "*", metavar=metavar, help=what)


def _resolve(args: argparse.Namespace) -> None:
    """Sets ``args.namespace`` and ``args.task_id`` from the positional names and ``-n``.

    Without ``-n`` the first name is the namespace (``[NAMESPACE] TASK_ID``:
    when there is only one name, it is the task); with ``-n`` the names are
    what follows the namespace. The namespace defaults to ``default``.

    Raises:
        UsageError: too many names, or too few (exit 2).
    """
    kind: Names = args.names_kind
    names: list[str] = list(args.names or [])
    option = args.namespace
    task_id: str | None = None
    if option is not None:
        most = 0 if kind == "namespace" else 1
        fits = len(names) <= most and (kind != "task" or len(names) == 1)
        namespace = option
        task_id = names[0] if names and kind != "namespace" else None
    elif kind == "task":
        fits = 1 <= len(names) <= 2
        namespace = names[0] if len(names) == 2 else DEFAULT_NAMESPACE
        task_id = names[-1] if names else None
    else:
        fits = len(names) <= (1 if kind == "namespace" else 2)
        namespace = names[0] if names else DEFAULT_NAMESPACE
        task_id = names[1] if len(names) > 1 else None
    if not fits:
        given = f"-n and {len(names)} name(s)" if option is not None else f"{len(names)} names"
        raise UsageError(
            f"{args.names_command} takes {_NAMES_USAGE[kind]}, or -n NAMESPACE and "
            f"{_NAMES_AFTER_OPTION[kind]}; got {given}"
        )
    args.namespace = namespace
    args.task_id = task_id


def _channel(args: argparse.Namespace) -> grpc.aio.Channel:
    """An insecure channel, or a TLS one when a CA or client certificate is given.

    With the client's CHANNEL_OPTIONS: ``watch`` ends UNAVAILABLE on a dead server.
    """
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.tls_ca is None and args.tls_cert is None:
        return grpc.aio.insecure_channel(args.target, options=CHANNEL_OPTIONS)
    try:
        root = args.tls_ca.read_bytes() if args.tls_ca is not None else None
        cert = args.tls_cert.read_bytes() if args.tls_cert is not None else None
        key = args.tls_key.read_bytes() if args.tls_key is not None else None
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    credentials = grpc.ssl_channel_credentials(root, key, cert)
    return grpc.aio.secure_channel(args.target, credentials, options=CHANNEL_OPTIONS)


def _call_options(args: argparse.Namespace, timeout: float | None = CALL_TIMEOUT_S) -> Any:
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    return {"metadata": metadata, "timeout": timeout}


def _error_line(error: grpc.aio.AioRpcError) -> str:
    details = " ".join((error.details() or "").split())
    return f"leasekeeper: {error.code().name}: {details}"


async def _paged(
    page: Callable[[str, int], Awaitable[tuple[Sequence[Message], str]]],
    limit: int | None,
    page_size: int | None,
) -> AsyncIterator[out.Record]:
    """The items of a paged listing as records, in order; at most ``limit`` (None: all).

    Args:
        page: calls for one page: (page token, page size) -> (its items, the
            next page token, empty on the last page).
        limit: the most items to yield; None for all.
        page_size: items asked per call; None for the server's default.
    """
    page_size = page_size or DEFAULT_PAGE_SIZE
    if limit is not None:
        page_size = min(page_size, limit)
    shown = 0
    token = ""
    while True:
        items, token = await page(token, page_size)
        for item in items:
            if limit is not None and shown >= limit:
                return
            shown += 1
            yield out.record_of(item)
        if not token or (limit is not None and shown >= limit):
            return


def _list_leases(
    stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace
) -> AsyncIterator[out.Record]:
    """The namespace's leases (of one owner, with --owner), page by page; at most --limit."""
    state = f"TASK_STATE_{args.state}" if args.state else None

    async def page(token: str, page_size: int) -> tuple[Sequence[Message], str]:
        request = pb.ListLeasesRequest(
            namespace=args.namespace,
            state=state,
            page_size=page_size,
            page_token=token,
            owner_id=args.owner or "",
        )
        response = await stub.ListLeases(request, **_call_options(args))
        return response.leases, response.next_page_token

    return _paged(page, args.limit, args.page_size)


def _list_namespaces(
    stub: pb_grpc.LeaseServiceStub,
    args: argparse.Namespace,
    limit: int | None,
    page_size: int | None = None,
) -> AsyncIterator[out.Record]:
    """The namespaces that hold tasks (those the token covers), page by page; at most ``limit``."""

    async def page(token: str, size: int) -> tuple[Sequence[Message], str]:
        request = pb.ListNamespacesRequest(page_size=size, page_token=token)
        response = await stub.ListNamespaces(request, **_call_options(args))
        return response.namespaces, response.next_page_token

    return _paged(page, limit, page_size)


def _task_count(summary: out.Record) -> str:
    """A namespace's task count as shown: ``3``, or ``>1000`` when the server stopped counting."""
    count = summary.get("task_count") or 0
    return f">{count}" if summary.get("task_count_capped") else str(count)


async def _leases(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    if args.leases_command == "get":
        return await _get(stub, args)
    if args.leases_command == "stats":
        return await _stats(stub, args)
    shown = 0
    if args.json:
        async for lease in _list_leases(stub, args):
            print(out.to_json(lease), flush=True)
            shown += 1
    else:
        leases = [out.task_shown(lease, table=True) async for lease in _list_leases(stub, args)]
        print(out.table(leases, LEASE_COLUMNS))
        shown = len(leases)
    if not shown and args.state is None and args.owner is None:
        print(await _empty_namespace_hint(stub, args), file=sys.stderr)
    return out.EXIT_OK


async def _empty_namespace_hint(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> str:
    """``leasekeeper: namespace "NS" holds no tasks; namespaces with tasks: a (3), b (1)``.

    The namespaces are the first few by name (with a token, of those it
    covers); the hint ends after the first clause when the server cannot
    list them.
    """
    hint = f"leasekeeper: namespace {out.quoted(args.namespace)} holds no tasks"
    try:
        found = [s async for s in _list_namespaces(stub, args, HINT_NAMESPACES + 1)]
    except grpc.aio.AioRpcError:  # a server without ListNamespaces, or a token that may not
        return hint
    named = [f"{out.detail(s['namespace'])} ({_task_count(s)})" for s in found[:HINT_NAMESPACES]]
    if len(found) > HINT_NAMESPACES:
        named.append("... (leasekeeper namespaces lists them all)")
    # With a token, the server lists only the namespaces it covers.
    which = "namespaces with tasks that the token covers" if args.token else "namespaces with tasks"
    return f"{hint}; {which}: {', '.join(named) or 'none'}"


async def _get(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    """``leases get``: the task's details and its checkpoint (without its data)."""
    request = pb.GetLeaseRequest(namespace=args.namespace, task_id=args.task_id)
    response = await stub.GetLease(request, **_call_options(args))
    lease = out.record_of(response.lease)
    checkpoint: out.Record | None = None
    if response.HasField("checkpoint"):
        saved = {**out.record_of(response.checkpoint), "size": len(response.checkpoint.data)}
        checkpoint = {name: saved[name] for name in CHECKPOINT_FIELDS}
    if args.json:
        print(out.to_json({**lease, "checkpoint": checkpoint}))
    else:
        print(out.details(out.task_shown(lease, checkpoint), TASK_FIELDS))
    return out.EXIT_OK


async def _stats(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    """``leases stats``: the namespace's figures, one per line (a count that stopped: ``N+``)."""
    request = pb.GetNamespaceStatsRequest(namespace=args.namespace)
    response = await stub.GetNamespaceStats(request, **_call_options(args))
    stats = out.record_of(response)
    if args.json:
        print(out.to_json(stats))
        return out.EXIT_OK
    shown = {
        "namespace": stats["namespace"],
        "as_of": stats["as_of"],
        **{
            name: f"{stats[name]}+" if stats[f"{name}_capped"] else stats[name]
            for name in STATS_COUNTS
        },
    }
    print(out.details(shown))
    return out.EXIT_OK


async def _namespaces(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    """``namespaces``: the namespaces that hold tasks, with their task counts."""
    listing = _list_namespaces(stub, args, args.limit, args.page_size)
    if args.json:
        async for summary in listing:
            print(out.to_json(summary), flush=True)
        return out.EXIT_OK
    rows = [{**s, "tasks": _task_count(s)} async for s in listing]
    print(out.table(rows, NAMESPACE_COLUMNS))
    return out.EXIT_OK


async def _effects(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    state = f"EFFECT_STATE_{args.state}" if args.state else None
    records: list[out.Record] = []
    token = ""
    while True:
        request = pb.ListEffectsRequest(
            namespace=args.namespace, task_id=args.task_id, state=state, page_token=token
        )
        response = await stub.ListEffects(request, **_call_options(args))
        for effect in response.effects:
            record = out.record_of(effect)
            if args.json:
                print(out.to_json(record), flush=True)
            else:
                records.append(record)
        token = response.next_page_token
        if not token:
            break
    if not args.json:
        print(out.table(records, EFFECT_COLUMNS))
    return out.EXIT_OK


async def _revoke(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    """``revoke``; exits 3 when the task held no lease to revoke (nothing changed)."""
    request = pb.RevokeRequest(
        namespace=args.namespace, task_id=args.task_id, reason=args.reason, fence=args.fence
    )
    response = await stub.Revoke(request, **_call_options(args))
    answer = out.record_of(response)
    lease = answer["lease"] or {}
    if args.json:
        print(out.to_json(answer))
    else:
        if response.revoked:
            print(f"revoked: {out.cell(args.task_id)} fence {lease.get('fence')}")
        print(out.details(out.task_shown(lease), TASK_FIELDS))
    if response.revoked:
        return out.EXIT_OK
    fence = f" fence {args.fence}" if args.fence else ""
    return out.unchanged(
        f"{out.cell(args.task_id)}{fence} holds no lease to revoke "
        f"(state {lease.get('state')}, current fence {lease.get('fence')})"
    )


async def _cancel(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    """``tasks cancel``; exits 3 when the task was cancelled already (nothing changed)."""
    request = pb.CancelRequest(namespace=args.namespace, task_id=args.task_id, reason=args.reason)
    response = await stub.Cancel(request, **_call_options(args))
    _print_task("cancelled" if response.cancelled else None, response, args)
    if response.cancelled:
        return out.EXIT_OK
    reason = out.detail(response.lease.cancel_reason)
    return out.unchanged(
        f"{out.cell(args.task_id)} was cancelled already (its reason stays: {reason})"
    )


async def _retry(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    """``tasks retry``; a task that is not quarantined is refused (FAILED_PRECONDITION, exit 1)."""
    request = pb.RetryRequest(namespace=args.namespace, task_id=args.task_id, reason=args.reason)
    response = await stub.Retry(request, **_call_options(args))
    _print_task("retried", response, args)
    return out.EXIT_OK


def _print_task(
    done: str | None, response: pb.CancelResponse | pb.RetryResponse, args: argparse.Namespace
) -> None:
    """``DONE: TASK_ID`` (when it changed) and the task; --json: the answer as one object."""
    answer = out.record_of(response)
    if args.json:
        print(out.to_json(answer))
        return
    if done is not None:
        print(f"{done}: {out.cell(args.task_id)}")
    print(out.details(out.task_shown(answer["lease"] or {}), TASK_FIELDS))


def _history_entries(
    stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace
) -> AsyncIterator[out.Record]:
    """The task's history, oldest first, page by page; at most --limit entries."""

    async def page(token: str, page_size: int) -> tuple[Sequence[Message], str]:
        request = pb.ListTaskHistoryRequest(
            namespace=args.namespace, task_id=args.task_id, page_size=page_size, page_token=token
        )
        response = await stub.ListTaskHistory(request, **_call_options(args))
        return response.entries, response.next_page_token

    return _paged(page, args.limit, args.page_size)


async def _history(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    entries = [entry async for entry in _history_entries(stub, args)]
    if not entries:  # a task never claimed (a mistyped id or namespace) is NOT_FOUND, exit 1
        request = pb.GetLeaseRequest(namespace=args.namespace, task_id=args.task_id)
        await stub.GetLease(request, **_call_options(args))
    if args.json:
        for entry in entries:
            print(out.to_json(entry), flush=True)
    else:
        print(out.table([out.history_shown(entry) for entry in entries], HISTORY_COLUMNS))
    return out.EXIT_OK


# The longest TaskEventType name without its prefix (QUARANTINED): watch lines stay aligned.
_EVENT_TYPE_WIDTH = max(
    len(name.removeprefix("TASK_EVENT_TYPE_")) for name in pb.TaskEventType.keys()
)
# The reason an event carries, by its type: the operator's (REVOKED, CANCELLED) or
# the owner's (FAILED). Other events carry none of their own: a lease's
# revoke_reason outlives its revoke (a RETRIED task still holds it).
_EVENT_REASON = {
    "REVOKED": "revoke_reason",
    "CANCELLED": "cancel_reason",
    "FAILED": "fail_reason",
}
# A SNAPSHOT shows the reason of the state it finds, when the state has one.
_STATE_REASON = {"CANCELLED": "cancel_reason", "FAILED": "fail_reason"}


def _watch_line(event: out.Record) -> str:
    """``TIME  TYPE  TASK_ID  fence=N  owner=O  state=S [reason=R]``, time and type aligned.

    The reason is the event's own (``_EVENT_REASON``; a SNAPSHOT's, its
    state's), never one left on the lease by an earlier event.
    """
    lease = event.get("lease") or {}
    parts = [
        out.cell(event.get("event_time")).ljust(24),
        out.cell(event.get("type")).ljust(_EVENT_TYPE_WIDTH),
        out.cell(lease.get("task_id")),
        f"fence={out.cell(lease.get('fence'))}",
        f"owner={out.cell(lease.get('owner_id'))}",
        f"state={out.cell(lease.get('state'))}",
    ]
    field = _EVENT_REASON.get(str(event.get("type")))
    if event.get("type") == "SNAPSHOT":
        field = _STATE_REASON.get(str(lease.get("state")))
    reason = lease.get(field) if field else None
    if reason:
        parts.append(f"reason={out.detail(reason)}")
    return "  ".join(parts)


async def _watch(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    """Prints events until --count, --timeout, Ctrl-C (all exit 0) or a server error (1)."""
    request = pb.WatchRequest(namespace=args.namespace, task_id=args.task_id or "")
    call = stub.Watch(request, **_call_options(args, timeout=None))
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    assert me is not None
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        me.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    seen = 0
    try:
        async with asyncio.timeout(args.timeout):
            async for event in call:
                record = out.record_of(event)
                print(out.to_json(record) if args.json else _watch_line(record), flush=True)
                seen += 1
                if args.count is not None and seen >= args.count:
                    break
    except TimeoutError:
        pass
    except asyncio.CancelledError:
        if not stopped:
            raise
    finally:
        call.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return out.EXIT_OK


async def _tasks(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    """``tasks history|cancel|retry [NAMESPACE] TASK_ID``."""
    run = {"history": _history, "cancel": _cancel, "retry": _retry}[args.tasks_command]
    return await run(stub, args)


_COMMANDS: dict[str, Callable[[pb_grpc.LeaseServiceStub, argparse.Namespace], Awaitable[int]]] = {
    "leases": _leases,
    "effects": _effects,
    "tasks": _tasks,
    "revoke": _revoke,
    "watch": _watch,
    "namespaces": _namespaces,
}
COMMANDS = frozenset(_COMMANDS)
"""The commands this module runs."""


async def run(args: argparse.Namespace) -> int:
    """Runs one server-calling command; returns its exit code.

    Returns:
        0 on success; 1 when the call failed (one line on stderr: the gRPC
        status code and message); 2 for names or options that do not fit
        together; 3 when the call changed nothing (one line on stderr says
        why).
    """
    try:
        if hasattr(args, "names_kind"):
            _resolve(args)
        channel = _channel(args)
    except UsageError as exc:
        print(f"leasekeeper: {exc}", file=sys.stderr)
        return out.EXIT_USAGE
    async with channel:
        # The generated gRPC stub (scripts/gen_protos.py) has an unannotated constructor;
        # `mypy server` alone does not flag the call (`make lint` checks server and client).
        stub = pb_grpc.LeaseServiceStub(channel)  # type: ignore[no-untyped-call, unused-ignore]
        try:
            return await _COMMANDS[args.command](stub, args)
        except grpc.aio.AioRpcError as error:
            print(_error_line(error), file=sys.stderr)
            return out.EXIT_FAILED


def positive_int(text: str) -> int:
    """An option's whole number >= 1 (argparse names the option in the error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {text!r})")
    return value


def positive_seconds(text: str) -> float:
    """An option's finite number of seconds > 0 (argparse names the option in the error)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (got {text!r})")
    return value


def _page_options(parser: argparse.ArgumentParser, things: str, rpc: str) -> None:
    """``--limit N`` and ``--page-size N`` of a paged listing."""
    parser.add_argument("--limit", type=positive_int, metavar="N", help=f"print at most N {things}")
    parser.add_argument(
        "--page-size",
        type=positive_int,
        metavar="N",
        help=f"{things} per {rpc} call (default {DEFAULT_PAGE_SIZE}; the server allows at "
        f"most {MAX_PAGE_SIZE})",
    )


# Where a revoke, cancel or retry is suggested, it is shown with its --reason.
_OPERATOR_COMMANDS = """\
operator commands (admin):
  leasekeeper revoke [NS] TASK_ID --reason TEXT        end a task's lease at once
  leasekeeper tasks cancel [NS] TASK_ID --reason TEXT  end a task for good
  leasekeeper tasks retry [NS] TASK_ID --reason TEXT   put a quarantined task back"""


def _wrapped(text: str) -> str:
    """A description wrapped as argparse wraps one, for a parser whose epilog keeps its lines."""
    return textwrap.fill(text, 79)


def add_commands(commands: Any) -> None:
    """Adds the server-calling commands (module docstring) to the ``leasekeeper`` parser."""
    conn = server_options()
    ns = namespace_option()
    table_note = "Prints an aligned table; --json prints one JSON object per line."

    leases = commands.add_parser(
        "leases",
        help="inspect a namespace's tasks: leases list [NS], leases get [NS] TASK_ID, leases "
        "stats [NS]",
        description="Inspect a namespace's tasks and their leases.",
        epilog=_OPERATOR_COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = leases.add_subparsers(dest="leases_command", required=True)
    listing = sub.add_parser(
        "list",
        help="list a namespace's tasks",
        parents=[conn, ns],
        description=_wrapped(
            "List a namespace's tasks, ordered by task_id. " + table_note + " A namespace "
            "that holds no tasks is said on stderr, with the namespaces that do (exit 0)."
        ),
        epilog=_OPERATOR_COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_names(listing, "namespace", "leases list", "")
    which = listing.add_mutually_exclusive_group()
    which.add_argument("--state", choices=TASK_STATES, help="only tasks in this state")
    which.add_argument(
        "--expired",
        dest="state",
        action="store_const",
        const="EXPIRED",
        help="only expired leases (--state EXPIRED)",
    )
    listing.add_argument(
        "--owner",
        help="only tasks whose current (or last) lease is this owner_id's",
    )
    _page_options(listing, "tasks", "ListLeases")
    get = sub.add_parser(
        "get",
        help="show one task",
        parents=[conn, ns],
        description=_wrapped(
            "Show one task's lease and its checkpoint (version, size, content type, the "
            "fence that wrote it, when). --json prints one JSON object: the lease's fields "
            "and 'checkpoint' (null, or its version, size, content_type, fence and "
            "write_time; its data is not printed)."
        ),
        epilog=_OPERATOR_COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_names(get, "task", "leases get", "")
    stats = sub.add_parser(
        "stats",
        help="show a namespace's figures (admin)",
        parents=[conn, ns],
        description=_wrapped(
            "Show a namespace's figures, read at one instant on the database clock (as_of): "
            "leases held and expired, tasks quarantined, leases granted, stale fences refused "
            "and leases lost in the last 60 seconds, effects in doubt (reserved by a fence that "
            "is not the task's live lease: reconcile them). Each count stops at 1000; one "
            "that stopped shows as N+ (at least N). Prints one figure per line; --json prints "
            "one JSON object: namespace, as_of, and each count with its *_capped flag."
        ),
        epilog=_OPERATOR_COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_names(stats, "namespace", "leases stats", "")

    effects = commands.add_parser(
        "effects", help="inspect a task's effects (effect ledger): effects list [NS] TASK_ID"
    )
    effects_sub = effects.add_subparsers(dest="effects_command", required=True)
    effects_list = effects_sub.add_parser(
        "list",
        help="list a task's effects, by effect_key",
        parents=[conn, ns],
        description="List a task's effects, by effect_key. " + table_note,
    )
    _add_names(effects_list, "task", "effects list", "")
    effects_list.add_argument("--state", choices=EFFECT_STATES)

    tasks = commands.add_parser(
        "tasks",
        help="a task's run: tasks history [NS] TASK_ID; tasks cancel|retry [NS] TASK_ID "
        "--reason TEXT (admin)",
        description="A task's run: its history; cancel it, or retry it when quarantined.",
    )
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True)
    history = tasks_sub.add_parser(
        "history",
        help="print a task's history, oldest first",
        parents=[conn, ns],
        description="Print a task's history, oldest first: grants, releases, expiries, "
        "revokes, quarantines, retries, cancellations, completions, failures, checkpoint "
        "writes, effects and refused fences. A table (sequence, time, kind, fence, owner, "
        "attempt, and the kind's details); --json prints one JSON object per line.",
    )
    _add_names(history, "task", "tasks history", "")
    _page_options(history, "entries", "ListTaskHistory")

    cancel = tasks_sub.add_parser(
        "cancel",
        help="end a task for good (admin): tasks cancel [NS] TASK_ID --reason TEXT",
        parents=[conn, ns],
        description="Cancel a task: it becomes CANCELLED, terminal; its holder's heartbeat "
        "ends ABORTED TASK_CANCELLED, every fence of it is refused and no claim is granted "
        "again. Its checkpoint is kept. Prints the task; --json prints one JSON object "
        "(cancelled, lease). Cancelling a cancelled task changes nothing (its first reason "
        "stays): it says so and exits 3.",
    )
    _add_names(cancel, "task", "tasks cancel", " --reason TEXT")
    cancel.add_argument("--reason", required=True, help="why (recorded in the task's history)")

    retry = tasks_sub.add_parser(
        "retry",
        help="put a quarantined task back (admin): tasks retry [NS] TASK_ID --reason TEXT",
        parents=[conn, ns],
        description="Retry a QUARANTINED task (its attempts used up): it becomes FREE with "
        "attempts 0 and the next claim gets a new fence; its checkpoint is kept. A task that "
        "is not quarantined is refused (FAILED_PRECONDITION, exit 1). Prints the task; "
        "--json prints one JSON object (lease).",
    )
    _add_names(retry, "task", "tasks retry", " --reason TEXT")
    retry.add_argument("--reason", required=True, help="why (recorded in the task's history)")

    revoke = commands.add_parser(
        "revoke",
        help="end a task's lease at once (admin): revoke [NS] TASK_ID --reason TEXT",
        parents=[conn, ns],
        description="Revoke a task's lease: its fence stops validating, its heartbeat ends "
        "ABORTED LEASE_REVOKED, and the next claim gets a new fence. Prints whether a lease "
        "was revoked, and the task; --json prints one JSON object (revoked, lease). A task "
        "holding no lease to revoke (FREE, QUARANTINED, or another fence than --fence) is "
        "left alone: it says so and exits 3.",
    )
    _add_names(revoke, "task", "revoke", " --reason TEXT")
    revoke.add_argument("--reason", required=True, help="why (recorded and shown to watchers)")
    revoke.add_argument(
        "--fence",
        type=positive_int,
        default=0,
        metavar="N",
        help="revoke only this fence (default: the current lease)",
    )

    watch = commands.add_parser(
        "watch",
        help="print a namespace's (or a task's) events as they happen: watch [NS [TASK_ID]]",
        parents=[conn, ns],
        description="Print one line per event (time, type, task, fence, owner, state, and "
        "the event's own reason: a revoke's, a cancel's, a failure's) until Ctrl-C, --count "
        "or --timeout (all exit 0); --json prints one JSON object per event. With a TASK_ID "
        "the first event is a SNAPSHOT of the task. With -n NS, a single name is the task.",
    )
    _add_names(watch, "namespace_then_task", "watch", "")
    watch.add_argument("--count", type=positive_int, metavar="N", help="stop after N events")
    watch.add_argument("--timeout", type=positive_seconds, metavar="S", help="stop after S seconds")

    namespaces = commands.add_parser(
        "namespaces",
        help="list the namespaces that hold tasks, with their task counts (admin)",
        parents=[conn],
        description="List the namespaces that hold tasks, by name, with how many tasks each "
        "holds (every state; counted up to 1000: more shows as >1000). With tokens, only "
        "the namespaces the token covers. " + table_note + " JSON objects: namespace, "
        "task_count, task_count_capped.",
    )
    _page_options(namespaces, "namespaces", "ListNamespaces")
