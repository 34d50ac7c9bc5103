"""The ``leasekeeper`` command: serve, migrate, and inspect leases.

::

    leasekeeper serve                 start the service (embedded PostgreSQL if no URL is set)
    leasekeeper migrate               apply the schema migrations and exit
    leasekeeper leases list [-n NS] [--state STATE]
    leasekeeper leases get TASK_ID [-n NS]
    leasekeeper effects list TASK_ID [-n NS] [--state STATE]

Settings come from ``LEASEKEEPER_*`` environment variables (see settings.py);
``leases`` and ``effects`` commands talk to a running server at ``--target`` and
print JSON (one object per line for lists).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .app import LeaseServer
    from .settings import Settings

SERVER_EXTRA_HINT = "the service needs its extras: pip install 'leasekeeper[server]'"

log = logging.getLogger("leasekeeper")


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # pgserver narrates every pg_ctl call at INFO; its warnings and errors still show.
    logging.getLogger("pgserver").setLevel(max(logging.WARNING, logging.getLogger().level))
    # platformdirs warns when XDG_RUNTIME_DIR is unset (containers); pgserver asks it anyway.
    warnings.filterwarnings("ignore", module="platformdirs")


STARTUP_RETRY_INITIAL_S = 0.2
STARTUP_RETRY_MAX_S = 5.0


async def _start_when_database_answers(settings: Settings, dsn: str) -> LeaseServer | None:
    """Starts a LeaseServer, retrying while the database is out of reach.

    Each failed attempt is undone (pool, listener) and logged on one line; the
    wait between attempts doubles from 0.2 s up to 5 s. Gives up after
    ``settings.startup_wait_s`` seconds.

    Returns:
        The serving server, or None when the database never answered in time.
    """
    from .app import LeaseServer
    from .errors import DatabaseUnavailable

    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + settings.startup_wait_s
    delay_s = STARTUP_RETRY_INITIAL_S
    while True:
        server = LeaseServer(settings, dsn)
        try:
            await server.start()
            return server
        except DatabaseUnavailable as exc:
            await server.stop(0)
            left_s = give_up_at - loop.time()
            if left_s <= 0:
                log.error(
                    "database unavailable for %.1f s at start (%s); giving up "
                    "(LEASEKEEPER_STARTUP_WAIT_S)",
                    settings.startup_wait_s,
                    exc,
                )
                return None
            delay_s = min(delay_s, left_s)
            log.warning("database unavailable at start (%s); retrying in %.1f s", exc, delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, STARTUP_RETRY_MAX_S)


async def _serve(settings: Settings) -> int:
    from .app import resolve_database

    dsn, embedded = resolve_database(settings)
    try:
        server = await _start_when_database_answers(settings, dsn)
        if server is None:
            return 1
        port = server.port
        assert port is not None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        host = settings.listen.rpartition(":")[0]
        print(f"leasekeeper listening on {host}:{port}", flush=True)
        await stop.wait()
        log.info("signal received: draining (grace %.1f s)", settings.shutdown_grace_s)
        await server.stop()
        return 0
    finally:
        if embedded is not None:
            embedded.stop()


async def _migrate(settings: Settings) -> None:
    from .app import resolve_database
    from .migrate import migrate

    dsn, embedded = resolve_database(settings)
    try:
        applied = await migrate(dsn)
        print(f"applied {len(applied)} migration(s): {applied}" if applied else "schema up to date")
    finally:
        if embedded is not None:
            embedded.stop()


LEASE_FIELDS = (
    "namespace",
    "task_id",
    "owner_id",
    "fence",
    "state",
    "expire_time",
    "remaining_ttl",
    "runtime_deadline",
    "claim_time",
    "end_reason",
)
EFFECT_FIELDS = (
    "namespace",
    "task_id",
    "effect_key",
    "policy",
    "state",
    "fence",
    "complete_fence",
    "retryable",
    "attempts",
    "begin_time",
    "complete_time",
    "request_digest",
    "result",
)


def _as_json(record: object, fields: Sequence[str]) -> dict[str, object]:
    """The named attributes of a client record, as JSON values.

    Instants become ISO 8601 text; a digest becomes hex; a result becomes
    UTF-8 text (undecodable bytes as backslash escapes).
    """
    out: dict[str, object] = {}
    for name in fields:
        value = getattr(record, name, None)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, bytes):
            value = (
                value.hex() if name == "request_digest" else value.decode(errors="backslashreplace")
            )
        out[name] = value
    return out


async def _leases(args: argparse.Namespace) -> int:
    from leasekeeper import LeaseClient, LeaseError, TaskNotFound

    async with LeaseClient(args.target, namespace=args.namespace) as client:
        try:
            if args.leases_command == "get":
                info = await client.get_lease(args.task_id)
                print(json.dumps(_as_json(info, LEASE_FIELDS), indent=2))
            else:
                async for info in client.iter_leases(state=args.state):
                    print(json.dumps(_as_json(info, LEASE_FIELDS)))
        except TaskNotFound:
            print(
                f"task {args.task_id!r} not found in namespace {args.namespace!r}", file=sys.stderr
            )
            return 1
        except LeaseError as error:  # bad input, server unreachable: one line, no traceback
            print(f"leasekeeper: {error}", file=sys.stderr)
            return 2 if error.retryable else 1
    return 0


async def _effects(args: argparse.Namespace) -> int:
    from leasekeeper import LeaseClient, LeaseError

    async with LeaseClient(args.target, namespace=args.namespace) as client:
        try:
            async for record in client.iter_effects(args.task_id, state=args.state):
                print(json.dumps(_as_json(record, EFFECT_FIELDS)))
        except LeaseError as error:  # bad input, server unreachable: one line, no traceback
            print(f"leasekeeper: {error}", file=sys.stderr)
            return 2 if error.retryable else 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line grammar."""
    parser = argparse.ArgumentParser(prog="leasekeeper", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="start the service")
    commands.add_parser("migrate", help="apply schema migrations and exit")
    leases = commands.add_parser("leases", help="inspect leases on a running server")
    sub = leases.add_subparsers(dest="leases_command", required=True)
    # Options after the verb, as the README shows: `leases list -n NS --target ADDR`.
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--target", default="127.0.0.1:9457", help="server address host:port")
    where.add_argument("-n", "--namespace", default="default", help="namespace (default: default)")
    listing = sub.add_parser("list", help="list a namespace's tasks", parents=[where])
    listing.add_argument("--state", choices=["FREE", "HELD", "EXPIRED", "COMPLETED"])
    get = sub.add_parser("get", help="show one task", parents=[where])
    get.add_argument("task_id")
    effects = commands.add_parser("effects", help="inspect a task's effects (effect ledger)")
    effects_sub = effects.add_subparsers(dest="effects_command", required=True)
    effects_list = effects_sub.add_parser(
        "list", help="list a task's effects, by effect_key", parents=[where]
    )
    effects_list.add_argument("task_id")
    effects_list.add_argument("--state", choices=["RESERVED", "SUCCEEDED", "FAILED"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``leasekeeper`` command."""
    # The embedded PostgreSQL is driven through subprocesses; grpc's fork
    # handlers have nothing to do for fork+exec and only log noise about it.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    args = build_parser().parse_args(argv)
    if args.command == "leases":
        return asyncio.run(_leases(args))
    if args.command == "effects":
        return asyncio.run(_effects(args))
    # `leases` and `effects` need only the thin client; serve and migrate need the extras.
    try:
        from .settings import Settings
    except ImportError as exc:
        print(f"leasekeeper: {SERVER_EXTRA_HINT} ({exc})", file=sys.stderr)
        return 2
    settings = Settings()
    _configure_logging(settings.log_level)
    if args.command == "serve":
        return asyncio.run(_serve(settings))
    elif args.command == "migrate":
        asyncio.run(_migrate(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
