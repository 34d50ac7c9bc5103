"""The ``leasekeeper`` commands that call a running server.

::

    leasekeeper leases list [-n NS] [--state STATE | --expired] [--owner OWNER] [--limit N]
    leasekeeper leases get TASK_ID [-n NS]
    leasekeeper effects list TASK_ID [-n NS] [--state STATE]
    leasekeeper tasks history [NS] TASK_ID [--limit N] [--json]
    leasekeeper revoke TASK_ID -n NS --reason TEXT [--fence N]
    leasekeeper tasks cancel [NS] TASK_ID --reason TEXT
    leasekeeper tasks retry [NS] TASK_ID --reason TEXT
    leasekeeper watch [TASK_ID] -n NS [--count N] [--timeout S]

Each takes ``--target`` (default ``$LEASEKEEPER_TARGET``, else 127.0.0.1:9457),
``--token`` (default ``$LEASEKEEPER_TOKEN``; sent as ``authorization: Bearer
<token>``), ``--tls-ca FILE`` for a TLS server (``--tls-cert``/``--tls-key``
for mutual TLS) and ``--json``. A failed call prints one line, its gRPC status
code and message, and exits 1 (``cancel`` of a completed task, ``retry`` of a
task that is not quarantined: FAILED_PRECONDITION; a task never claimed:
NOT_FOUND).

Only the thin client's dependencies are needed (grpcio, protobuf).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from leasekeeper import CHANNEL_OPTIONS
from leasekeeper._types import EFFECT_STATES
from leasekeeper.client import default_target
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as pb_grpc
from leasekeeper_server.cli import output as out
from leasekeeper_server.rpc.paging import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE

CALL_TIMEOUT_S = 10.0

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


class UsageError(Exception):
    """Options that do not fit together; the command exits 2."""


def connection_options() -> argparse.ArgumentParser:
    """The options every server-calling command shares (a parent parser)."""
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
        "-n", "--namespace", default="default", help="namespace (default: %(default)s)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON (one object per line for lists)"
    )
    return parser


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
    page: Callable[[str, int], Awaitable[tuple[Sequence[Message], str]]], args: argparse.Namespace
) -> AsyncIterator[out.Record]:
    """The items of a paged listing as records, in order; at most ``args.limit`` (None: all).

    Args:
        page: calls for one page: (page token, page size) -> (its items, the
            next page token, empty on the last page).
        args: ``limit`` and ``page_size`` (None: the server's default).
    """
    limit = args.limit
    page_size = args.page_size or DEFAULT_PAGE_SIZE
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

    return _paged(page, args)


async def _leases(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    if args.leases_command == "get":
        request = pb.GetLeaseRequest(namespace=args.namespace, task_id=args.task_id)
        response = await stub.GetLease(request, **_call_options(args))
        lease = out.record_of(response.lease)
        if args.json:
            print(out.to_json(lease, indent=2))
            return 0
        checkpoint: out.Record | None = None
        if response.HasField("checkpoint"):
            size = len(response.checkpoint.data)
            checkpoint = {**out.record_of(response.checkpoint), "size": size}
        print(out.details(out.task_shown(lease, checkpoint), TASK_FIELDS))
        return 0
    if args.json:
        async for lease in _list_leases(stub, args):
            print(out.to_json(lease), flush=True)
    else:
        leases = [out.task_shown(lease, table=True) async for lease in _list_leases(stub, args)]
        print(out.table(leases, LEASE_COLUMNS))
    return 0


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
    return 0


async def _revoke(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    request = pb.RevokeRequest(
        namespace=args.namespace, task_id=args.task_id, reason=args.reason, fence=args.fence
    )
    response = await stub.Revoke(request, **_call_options(args))
    answer = out.record_of(response)
    if args.json:
        print(out.to_json(answer))
        return 0
    lease = answer["lease"] or {}
    if response.revoked:
        print(f"revoked: {args.task_id} fence {lease.get('fence')}")
    else:
        fence = f" fence {args.fence}" if args.fence else ""
        print(
            f"not revoked: {args.task_id}{fence} holds no lease to revoke "
            f"(state {lease.get('state')}, current fence {lease.get('fence')})"
        )
    print(out.details(out.task_shown(lease), TASK_FIELDS))
    return 0


async def _cancel(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    request = pb.CancelRequest(namespace=args.namespace, task_id=args.task_id, reason=args.reason)
    response = await stub.Cancel(request, **_call_options(args))
    return _print_task("cancelled", response, args)


async def _retry(stub: pb_grpc.LeaseServiceStub, args: argparse.Namespace) -> int:
    request = pb.RetryRequest(namespace=args.namespace, task_id=args.task_id, reason=args.reason)
    response = await stub.Retry(request, **_call_options(args))
    return _print_task("retried", response, args)


def _print_task(
    done: str, response: pb.CancelResponse | pb.RetryResponse, args: argparse.Namespace
) -> int:
    """``DONE: TASK_ID`` and the task after the call; --json: the answer as one object."""
    answer = out.record_of(response)
    if args.json:
        print(out.to_json(answer))
        return 0
    print(f"{done}: {out.cell(args.task_id)}")
    print(out.details(out.task_shown(answer["lease"] or {}), TASK_FIELDS))
    return 0


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

    return _paged(page, args)


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
    return 0


# The longest TaskEventType name without its prefix (QUARANTINED): watch lines stay aligned.
_EVENT_TYPE_WIDTH = max(
    len(name.removeprefix("TASK_EVENT_TYPE_")) for name in pb.TaskEventType.keys()
)


def _watch_line(event: out.Record) -> str:
    """``TIME  TYPE  TASK_ID  fence=N  owner=O  state=S [reason=R]``, time and type aligned.

    The reason is the operator's (revoke, cancel) or the owner's (a failed run).
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
    reason = lease.get("cancel_reason") or lease.get("fail_reason") or lease.get("revoke_reason")
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
    return 0


async def _tasks(stub: Any, args: argparse.Namespace) -> int:
    """``tasks history|cancel|retry [NAMESPACE] TASK_ID``."""
    names = args.names
    if len(names) > 2:
        print(
            f"leasekeeper: tasks {args.tasks_command} takes [NAMESPACE] TASK_ID, "
            f"got {len(names)} names",
            file=sys.stderr,
        )
        return 2
    if len(names) == 2:
        args.namespace = names[0]
    args.task_id = names[-1]
    run = {"history": _history, "cancel": _cancel, "retry": _retry}[args.tasks_command]
    return await run(stub, args)


def _task_names(parser: argparse.ArgumentParser) -> None:
    """``[NAMESPACE] TASK_ID``: the namespace positionally, or with -n (default 'default')."""
    parser.usage = f"leasekeeper tasks {parser.prog.split()[-1]} [NAMESPACE] TASK_ID [options]"
    parser.add_argument(
        "names",
        nargs="+",
        metavar="NAME",
        help="[NAMESPACE] TASK_ID: the task, after its namespace (or give it with -n)",
    )


_COMMANDS = {
    "leases": _leases,
    "effects": _effects,
    "tasks": _tasks,
    "revoke": _revoke,
    "watch": _watch,
}
COMMANDS = frozenset(_COMMANDS)
"""The commands this module runs."""


async def run(args: argparse.Namespace) -> int:
    """Runs one server-calling command; returns its exit code.

    Returns:
        0 on success; 1 when the call failed (one line on stderr: the gRPC
        status code and message); 2 for options that do not fit together.
    """
    try:
        channel = _channel(args)
    except UsageError as exc:
        print(f"leasekeeper: {exc}", file=sys.stderr)
        return 2
    async with channel:
        # The generated gRPC stub (scripts/gen_protos.py) has an unannotated constructor;
        # `mypy server` alone does not flag the call (`make lint` checks server and client).
        stub = pb_grpc.LeaseServiceStub(channel)  # type: ignore[no-untyped-call, unused-ignore]
        try:
            return await _COMMANDS[args.command](stub, args)
        except grpc.aio.AioRpcError as error:
            print(_error_line(error), file=sys.stderr)
            return 1


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


def add_commands(commands: Any) -> None:
    """Adds the server-calling commands (module docstring) to the ``leasekeeper`` parser."""
    conn = connection_options()
    table_note = "Prints an aligned table; --json prints one JSON object per line."

    leases = commands.add_parser("leases", help="inspect leases on a running server")
    sub = leases.add_subparsers(dest="leases_command", required=True)
    listing = sub.add_parser(
        "list",
        help="list a namespace's tasks",
        parents=[conn],
        description="List a namespace's tasks, ordered by task_id. " + table_note,
    )
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
    listing.add_argument("--limit", type=positive_int, metavar="N", help="print at most N tasks")
    listing.add_argument(
        "--page-size",
        type=positive_int,
        metavar="N",
        help=f"tasks per ListLeases call (default {DEFAULT_PAGE_SIZE}; the server allows at "
        f"most {MAX_PAGE_SIZE})",
    )
    get = sub.add_parser(
        "get",
        help="show one task",
        parents=[conn],
        description="Show one task's lease; --json prints it as one JSON object.",
    )
    get.add_argument("task_id")

    effects = commands.add_parser("effects", help="inspect a task's effects (effect ledger)")
    effects_sub = effects.add_subparsers(dest="effects_command", required=True)
    effects_list = effects_sub.add_parser(
        "list",
        help="list a task's effects, by effect_key",
        parents=[conn],
        description="List a task's effects, by effect_key. " + table_note,
    )
    effects_list.add_argument("task_id")
    effects_list.add_argument("--state", choices=EFFECT_STATES)

    tasks = commands.add_parser(
        "tasks", help="a task's run: its history; cancel it, retry it when quarantined"
    )
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True)
    history = tasks_sub.add_parser(
        "history",
        help="print a task's history, oldest first",
        parents=[conn],
        description="Print a task's history, oldest first: grants, releases, expiries, "
        "revokes, quarantines, retries, cancellations, completions, failures, checkpoint "
        "writes, effects and refused fences. A table (sequence, time, kind, fence, owner, "
        "attempt, and the kind's details); --json prints one JSON object per line.",
    )
    _task_names(history)
    history.add_argument(
        "--limit", type=positive_int, metavar="N", help="print at most N entries (the oldest)"
    )
    history.add_argument(
        "--page-size",
        type=positive_int,
        metavar="N",
        help=f"entries per ListTaskHistory call (default {DEFAULT_PAGE_SIZE}; the server "
        f"allows at most {MAX_PAGE_SIZE})",
    )

    cancel = tasks_sub.add_parser(
        "cancel",
        help="end a task for good (admin)",
        parents=[conn],
        description="Cancel a task: it becomes CANCELLED, terminal; its holder's heartbeat "
        "ends ABORTED TASK_CANCELLED, every fence of it is refused and no claim is granted "
        "again. Its checkpoint is kept. Cancelling a cancelled task changes nothing. Prints "
        "the task.",
    )
    _task_names(cancel)
    cancel.add_argument("--reason", required=True, help="why (recorded in the task's history)")

    retry = tasks_sub.add_parser(
        "retry",
        help="put a quarantined task back (admin)",
        parents=[conn],
        description="Retry a QUARANTINED task (its attempts used up): it becomes FREE with "
        "attempts 0 and the next claim gets a new fence; its checkpoint is kept. A task that "
        "is not quarantined is refused (FAILED_PRECONDITION, exit 1). Prints the task.",
    )
    _task_names(retry)
    retry.add_argument("--reason", required=True, help="why (recorded in the task's history)")

    revoke = commands.add_parser(
        "revoke",
        help="end a task's lease at once (admin)",
        parents=[conn],
        description="Revoke a task's lease: its fence stops validating, its heartbeat ends "
        "ABORTED LEASE_REVOKED, and the next claim gets a new fence. Prints whether a lease "
        "was revoked, and the task.",
    )
    revoke.add_argument("task_id")
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
        help="print a task's (or a namespace's) events as they happen",
        parents=[conn],
        description="Print one line per event (time, type, task, fence, owner, state) until "
        "Ctrl-C, --count or --timeout (all exit 0). With a TASK_ID the first event is a "
        "SNAPSHOT of the task.",
    )
    watch.add_argument("task_id", nargs="?", help="one task (default: the whole namespace)")
    watch.add_argument("--count", type=positive_int, metavar="N", help="stop after N events")
    watch.add_argument("--timeout", type=positive_seconds, metavar="S", help="stop after S seconds")
