"""The ``leasekeeper`` commands that manage the database directly: tokens and limits.

::

    leasekeeper tokens create --name NAME --role worker|effect|admin --namespace NS
                              [--namespace NS2 ...] [--expires-in SECONDS]
    leasekeeper tokens list
    leasekeeper tokens revoke TOKEN_ID
    leasekeeper limits set NS [--max-leases N] [--claims-per-second R] [--burst B]
                              [--lock-delay SECONDS] [--max-attempts N]
    leasekeeper limits clear NS (--max-leases | --claims-per-second | --burst |
                                 --lock-delay | --max-attempts | --all) ...
    leasekeeper limits list

They find the database as ``serve`` and ``migrate`` do: ``LEASEKEEPER_DATABASE_URL``,
else the embedded PostgreSQL in the data directory. Every server applies a
change at once (the database announces it on channel ``leasekeeper_config``).
Listings print an aligned table; every command prints JSON Lines with
``--json`` (one object per line, nothing else on stdout). A bad option value
exits 2; an unknown token id exits 1; a database that cannot be used exits
1, or 2 when it refuses the connection for good (cli/main.py says why, in
one line). A command that changed nothing exits 3 and says why on stderr:
``tokens revoke`` of a token revoked already, ``limits set`` of the values
already set, ``limits clear`` of limits not set.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from leasekeeper_server.cli import output as out

if TYPE_CHECKING:
    import asyncpg

    from leasekeeper_server.settings import Settings

TOKEN_COLUMNS = (
    "token_id",
    "name",
    "role",
    "namespaces",
    "status",
    "create_time",
    "expire_time",
    "revoke_time",
)
LIMIT_COLUMNS = (
    "namespace",
    "max_leases",
    "claims_per_second",
    "burst",
    "lock_delay",
    "max_attempts",
    "update_time",
)
# Field names (as limits_admin and tokens name them) -> the options that set them.
OPTION_OF = {
    "max_leases": "--max-leases",
    "claims_per_second": "--claims-per-second",
    "burst": "--burst",
    "lock_delay_s": "--lock-delay",
    "max_attempts": "--max-attempts",
    "name": "--name",
    "role": "--role",
    "namespaces": "--namespace",
    "expire_time": "--expires-in",
}
COMMANDS = frozenset({"tokens", "limits"})
"""The commands this module runs."""

# Each command's synopsis, as `leasekeeper --help` lists it (cli/main.py's epilog;
# a long one goes on over indented lines).
SYNOPSIS = (
    "tokens create --name NAME --role worker|effect|admin --namespace NS [--expires-in S]",
    "tokens list",
    "tokens revoke TOKEN_ID",
    "limits set NS [--max-leases N] [--claims-per-second R] [--burst B]\n"
    "    [--lock-delay S] [--max-attempts N]",
    "limits clear NS (--max-leases | --claims-per-second | --burst | --lock-delay |\n"
    "    --max-attempts | --all) ...",
    "limits list",
)


class UsageError(Exception):
    """A bad option value; the command exits 2."""


def _usage(field: str, message: str) -> UsageError:
    return UsageError(f"{OPTION_OF.get(field, field)}: {message}")


def _from_value_error(exc: ValueError) -> UsageError:
    """``ValueError("role: must be ...")`` -> ``--role: must be ...``."""
    field, _, message = str(exc).partition(": ")
    return _usage(field, message) if message else UsageError(str(exc))


def _print_records(records: list[out.Record], columns: tuple[str, ...], json: bool) -> None:
    if json:
        for record in records:
            print(out.to_json(record))
    else:
        print(out.table(records, columns))


def _token_status(record: Any, db_now: datetime) -> str:
    if record.revoke_time is not None:
        return "revoked"
    if record.expire_time is not None and record.expire_time <= db_now:
        return "expired"
    return "active"


async def _token_records(conn: asyncpg.Connection) -> list[out.Record]:
    """Every database token with its status, judged on the database clock (as servers do)."""
    from leasekeeper_server.security import tokens

    db_now = await conn.fetchval("SELECT clock_timestamp()")
    return [
        {**dataclasses.asdict(record), "status": _token_status(record, db_now)}
        for record in await tokens.list_tokens(conn)
    ]


async def _revoke_token(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
    """``tokens revoke``: 0 revoked now, 3 revoked already (nothing changed), 1 unknown id."""
    from leasekeeper_server.security import tokens

    revoked = await tokens.revoke_token(conn, args.token_id)
    record = next((r for r in await _token_records(conn) if r["token_id"] == args.token_id), None)
    if record is None:
        print(f"leasekeeper: no token with id {args.token_id!r}", file=sys.stderr)
        return out.EXIT_FAILED
    if args.json:
        print(out.to_json(record))
    elif revoked:
        print(f"revoked token {args.token_id}")
    if revoked:
        return out.EXIT_OK
    when = out.cell(record["revoke_time"])
    return out.unchanged(f"token {args.token_id} was revoked already ({when})")


async def _tokens(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
    from leasekeeper_server.security import tokens

    if args.tokens_command == "create":
        expire_time = None
        if args.expires_in is not None:
            expire_time = await conn.fetchval(
                "SELECT clock_timestamp() + make_interval(secs => $1::float8)", args.expires_in
            )
        try:
            record, token = await tokens.create_token(
                conn, args.name, args.role, args.namespace, expire_time
            )
        except ValueError as exc:
            raise _from_value_error(exc) from exc
        shown = {**dataclasses.asdict(record), "status": "active"}
        if args.json:
            print(out.to_json({**shown, "token": token}))
        else:
            print(out.details(shown, TOKEN_COLUMNS[:-1]))
            print(f"token        {token}")
        print(
            "leasekeeper: the token is shown this once and is not stored (only its SHA-256 "
            "digest is): keep it now",
            file=sys.stderr,
        )
        return 0
    if args.tokens_command == "revoke":
        return await _revoke_token(conn, args)
    _print_records(await _token_records(conn), TOKEN_COLUMNS, args.json)
    return out.EXIT_OK


async def _limits(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
    from leasekeeper_server.cli import limits as limits_admin

    row: Any
    try:
        if args.limits_command == "set":
            changed, row = await limits_admin.set_limits(
                conn,
                args.namespace,
                max_leases=args.max_leases,
                claims_per_second=args.claims_per_second,
                burst=args.burst,
                lock_delay_s=args.lock_delay,
                max_attempts=args.max_attempts,
            )
        elif args.limits_command == "clear":
            every = args.all
            changed, row = await limits_admin.clear_limits(
                conn,
                args.namespace,
                max_leases=every or args.max_leases,
                claims_per_second=every or args.claims_per_second,
                burst=every or args.burst,
                lock_delay=every or args.lock_delay,
                max_attempts=every or args.max_attempts,
            )
        else:
            rows = [dataclasses.asdict(row) for row in await limits_admin.list_limits(conn)]
            _print_records(rows, LIMIT_COLUMNS, args.json)
            return out.EXIT_OK
    except limits_admin.LimitsError as exc:
        if exc.field == "limits":
            raise UsageError(f"limits {args.limits_command}: {exc.message}") from exc
        raise _usage(exc.field, exc.message) from exc
    if row is None:
        shown: out.Record = {"namespace": args.namespace, "limits": None}
        print(out.to_json(shown) if args.json else f"{out.cell(args.namespace)}: no limits")
    else:
        record = dataclasses.asdict(row)
        print(out.to_json(record) if args.json else out.details(record, LIMIT_COLUMNS))
    if changed:
        return out.EXIT_OK
    if args.limits_command == "set":
        return out.unchanged(f"the limits of {out.quoted(args.namespace)} have these values")
    return out.unchanged(f"{out.quoted(args.namespace)} has none of these limits set")


_COMMANDS: dict[str, Callable[[asyncpg.Connection, argparse.Namespace], Awaitable[int]]] = {
    "tokens": _tokens,
    "limits": _limits,
}


async def run(settings: Settings, args: argparse.Namespace) -> int:
    """Runs one database command; returns its exit code.

    Returns:
        0 on success; 1 when the database is not migrated, or (``tokens
        revoke``) no token has that id; 2 for a bad option value (one line on
        stderr naming the option); 3 when the command changed nothing (one
        line on stderr says why).

    Raises:
        DatabaseUnavailable: the database cannot be used (DatabaseRefused: for good).
    """
    import asyncpg

    from leasekeeper_server.app import direct_database, resolve_database
    from leasekeeper_server.storage.driver_errors import translate_errors
    from leasekeeper_server.storage.store import connection_settings

    session = {**connection_settings(settings), "application_name": "leasekeeper-cli"}
    try:
        dsn, embedded = resolve_database(settings)
    except Exception as exc:  # the embedded PostgreSQL did not start: one line, no traceback
        print(f"leasekeeper: no database: {exc}", file=sys.stderr)
        return 1
    if embedded is not None:  # easy to miss: a shared service's tokens are not here
        print(
            f"leasekeeper: LEASEKEEPER_DATABASE_URL is unset: using the embedded PostgreSQL "
            f"in {settings.data_dir}",
            file=sys.stderr,
        )
    try:
        with translate_errors(connecting=True):
            conn = await asyncpg.connect(  # a session of its own: never a transaction pooler
                direct_database(settings, dsn),
                server_settings=session,
                timeout=settings.connect_timeout_s,
            )
        try:
            with translate_errors():
                return await _COMMANDS[args.command](conn, args)
        finally:
            await conn.close()
    except UsageError as exc:
        print(f"leasekeeper: {exc}", file=sys.stderr)
        return out.EXIT_USAGE
    except asyncpg.UndefinedTableError:
        print(
            "leasekeeper: the database schema is not up to date: run `leasekeeper migrate`",
            file=sys.stderr,
        )
        return out.EXIT_FAILED
    except asyncpg.PostgresError as exc:  # one line, no traceback
        print(f"leasekeeper: the database refused the change: {exc}", file=sys.stderr)
        return out.EXIT_FAILED
    finally:
        if embedded is not None:
            embedded.stop()


def _number(kind: type, low: float, low_open: bool) -> Callable[[str], Any]:
    """An argparse type: a finite number of ``kind`` above ``low`` (argparse names the option)."""
    bound = f"> {low:g}" if low_open else f">= {low:g}"
    noun = "whole number" if kind is int else "number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (
            value is None
            or value != value  # NaN
            or value in (float("inf"), float("-inf"))
            or (value <= low if low_open else value < low)
        ):
            raise argparse.ArgumentTypeError(f"must be a {noun} {bound} (got {text!r})")
        return value

    return parse


def add_commands(commands: Any) -> None:
    """Adds ``tokens`` and ``limits`` to the ``leasekeeper`` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json",
        action="store_true",
        help="print JSON Lines: one JSON object per line on stdout, nothing else",
    )

    tokens = commands.add_parser(
        "tokens",
        help="access tokens kept in the database",
        description="Create, list and revoke access tokens (in the database). Only a "
        "token's SHA-256 digest is stored; `create` prints the token once.",
    )
    sub = tokens.add_subparsers(dest="tokens_command", required=True)
    create = sub.add_parser("create", help="create a token (printed once)", parents=[common])
    create.add_argument("--name", required=True, help="who or what it is for (shown in logs)")
    create.add_argument("--role", required=True, choices=("worker", "effect", "admin"))
    create.add_argument(
        "--namespace",
        action="append",
        required=True,
        help="a namespace it covers: exact, '*' for all, or a prefix ending in '*'; repeat",
    )
    create.add_argument(
        "--expires-in",
        type=_number(float, 0, low_open=True),
        metavar="SECONDS",
        help="seconds until it stops being accepted (database clock; default: never)",
    )
    sub.add_parser(
        "list",
        help="list tokens (never their secrets)",
        parents=[common],
        description="List tokens: an aligned table; --json prints one object per line.",
    )
    revoke = sub.add_parser(
        "revoke",
        help="revoke a token (servers refuse it at once)",
        parents=[common],
        description="Revoke a token: every server refuses it within about a second. A "
        "token revoked already is left as it is: it says so and exits 3; an unknown id "
        "exits 1. --json prints the token as one JSON object.",
    )
    revoke.add_argument("token_id", help="the token's id (the part after 'lk_')")

    limits = commands.add_parser(
        "limits",
        help="per-namespace limits (live leases, claim rate, lock delay, attempts)",
        description="Set, clear and list per-namespace limits (in the database); every "
        "server applies a change at once.",
    )
    sub = limits.add_subparsers(dest="limits_command", required=True)
    setting = sub.add_parser(
        "set",
        help="set some of a namespace's limits",
        parents=[common],
        description="Set some of a namespace's limits, keeping the others; prints them "
        "(--json: one JSON object). Values already set change nothing: it says so and "
        "exits 3.",
    )
    setting.add_argument("namespace")
    setting.add_argument(
        "--max-leases",
        type=_number(int, 0, low_open=False),
        metavar="N",
        help="most live leases at once",
    )
    setting.add_argument(
        "--claims-per-second",
        type=_number(float, 0, low_open=True),
        metavar="R",
        help="claim rate limit (a token bucket across every server)",
    )
    setting.add_argument(
        "--burst",
        type=_number(float, 1, low_open=False),
        metavar="B",
        help="the bucket's size in claims (default: max(1, R))",
    )
    setting.add_argument(
        "--lock-delay",
        type=_number(float, 0, low_open=False),
        metavar="SECONDS",
        help="how long an expired lease's task stays unclaimable",
    )
    setting.add_argument(
        "--max-attempts",
        type=_number(int, 1, low_open=False),
        metavar="N",
        help="the attempt limit of claims that set none: after N leases of a task end "
        "without a release, it is QUARANTINED until `leasekeeper tasks retry` or `tasks cancel`",
    )
    clear = sub.add_parser(
        "clear",
        help="clear some of a namespace's limits",
        parents=[common],
        description="Clear some of a namespace's limits; prints those left (--json: one "
        "JSON object; 'limits': null when none are left). Limits not set change nothing: "
        "it says so and exits 3.",
    )
    clear.add_argument("namespace")
    for flag, what in (
        ("--max-leases", "the live-lease limit"),
        ("--claims-per-second", "the claim rate limit (and its burst)"),
        ("--burst", "the burst (back to max(1, R))"),
        ("--lock-delay", "the lock delay (back to 0)"),
        ("--max-attempts", "the default attempt limit (claims without one carry none)"),
        ("--all", "every limit (removes the namespace's row)"),
    ):
        clear.add_argument(flag, action="store_true", help=f"clear {what}")
    sub.add_parser(
        "list",
        help="list namespaces with limits",
        parents=[common],
        description="List namespaces with limits: an aligned table; --json: one object a line.",
    )
