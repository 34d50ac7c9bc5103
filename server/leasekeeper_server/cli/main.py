"""The ``leasekeeper`` command: serve, migrate, inspect and operate.

::

    leasekeeper --version             print the installed version
    leasekeeper serve [--workers N]   start the service (embedded PostgreSQL if no URL is set),
                                      and its operator console (console_listen)
    leasekeeper console [--target HOST:PORT] [--listen HOST:PORT] [--token TOKEN]
                                      the operator console alone, calling a running server
    leasekeeper migrate               apply the schema migrations and exit
    leasekeeper leases list [NS] [--state STATE | --expired] [--owner OWNER] [--limit N]
    leasekeeper leases get [NS] TASK_ID
    leasekeeper effects list [NS] TASK_ID [--state STATE]
    leasekeeper tasks history [NS] TASK_ID [--limit N]
    leasekeeper tasks cancel [NS] TASK_ID --reason TEXT
    leasekeeper tasks retry [NS] TASK_ID --reason TEXT
    leasekeeper revoke [NS] TASK_ID --reason TEXT [--fence N]
    leasekeeper watch [NS [TASK_ID]] [--count N] [--timeout S]
    leasekeeper namespaces [--limit N]
    leasekeeper tokens create|list|revoke ...
    leasekeeper limits set|clear|list ...

Settings come from ``LEASEKEEPER_*`` environment variables (see settings.py).
``leases``, ``effects``, ``tasks``, ``revoke``, ``watch`` and ``namespaces``
call a running server at ``--target`` (``$LEASEKEEPER_TARGET``) with
``--token`` (``$LEASEKEEPER_TOKEN``) and need only the thin client; their
namespace comes first (``[NS]``, default ``default``) or with ``-n NS``.
``tokens`` and ``limits`` write the database directly, found as ``migrate``
finds it. ``console`` serves the operator console (a web app) for the
server at ``--target`` (cli/console.py); ``serve`` serves the same console
beside its gRPC port (``LEASEKEEPER_CONSOLE_LISTEN``, 127.0.0.1:9460 by
default; ``off`` for none) and logs ``leasekeeper console on URL``.
Listings print aligned tables by default (instants ISO 8601 UTC,
durations in seconds). Every command that prints a result takes ``--json``:
JSON Lines, exactly one JSON object per line on standard output and nothing
else (keys the proto's field names, or the table's columns); notes and
errors go to standard error.

Exit codes (``EXIT_CODES``, also shown by ``leasekeeper --help``), each
failure and each note reported in one line on standard error:

- 0: done.
- 1: it failed, and may work later: a failed call (the gRPC status code and
  message; a refusal such as ``tasks retry`` of a task that is not
  quarantined, FAILED_PRECONDITION, is one), an unknown token id, a database
  out of reach (``serve``: for ``startup_wait_s``), a listen address another
  process holds (named, with its variable).
- 2: it can never work as given: a usage error, an invalid ``LEASEKEEPER_*``
  setting (a ``database_url`` asyncpg cannot parse included), a database that
  refuses the connection for good (PostgreSQL's message: an unknown role, a
  wrong password, a missing database; ``serve``: a pooler in transaction or
  statement mode), a console address off loopback without HTTPS or
  ``LEASEKEEPER_CONSOLE_INSECURE``. Retrying or restarting cannot help. ``serve --workers``
  says each of these once, as ``serve`` does.
- 3: done, and it changed nothing (``nothing changed: WHY`` on standard
  error; the result is printed as for a change): ``revoke`` of a task that
  holds no lease to revoke, ``tasks cancel`` of a cancelled task, ``limits
  set`` of the values already set, ``limits clear`` of limits not set,
  ``tokens revoke`` of a revoked token. ``migrate`` with the schema up to
  date exits 0: it is run at every deployment.
- 130: interrupted (Ctrl-C) during a call; ``watch`` ends 0 on Ctrl-C.
- 141: standard output's reader went away (``| head``), as after SIGPIPE.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from leasekeeper_server.cli.startup import (
    configure_logging,
    run_service,
    settings_errors,
    start_when_database_answers,
)

if TYPE_CHECKING:
    from leasekeeper_server.core.errors import DatabaseUnavailable
    from leasekeeper_server.settings import Settings

SERVER_EXTRA_HINT = (
    "the service needs its extras: pip install '/path/to/leasekeeper[server]' (from a checkout)"
)

log = logging.getLogger("leasekeeper")


# The settings naming an address a lone server listens on.
LISTEN_SETTINGS = ("listen", "health_listen", "metrics_listen")


def _check_listen_free(settings: Settings) -> None:
    """Checks that every listen address of ``settings`` can be bound now.

    Done before the database is touched, so a taken port is said at once in
    one line (gRPC would only fail after the migrations, with its own noise).

    Raises:
        OSError: an address is taken or cannot be bound; the message names it
            and its ``LEASEKEEPER_*`` variable.
    """
    from leasekeeper_server.cli.supervisor import check_free

    names = list(LISTEN_SETTINGS)
    # The console's address only when set explicitly: the default one, taken
    # (by another server's console), leaves this server without a console.
    if settings.console_listen != "off" and "console_listen" in settings.model_fields_set:
        names.append("console_listen")
    for name in names:
        listen = getattr(settings, name)
        if listen:
            try:
                check_free(listen)
            except OSError as exc:
                variable = f"LEASEKEEPER_{name.upper()}"
                raise OSError(exc.errno, f"{exc.strerror} ({variable})") from exc


async def _serve(settings: Settings) -> int:
    from leasekeeper_server.app import resolve_database
    from leasekeeper_server.console.serving import serve_beside

    dsn, embedded = resolve_database(settings)
    try:
        server = await start_when_database_answers(settings, dsn)
        if server is None:
            return 1
        port = server.port
        assert port is not None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            console = await serve_beside(settings, settings.listen, port)
        except ValueError as exc:  # the console's certificate or key
            log.error("cannot start: %s", exc)
            await server.stop(0)
            return 2
        host = settings.listen.rpartition(":")[0]
        print(f"leasekeeper listening on {host}:{port}", flush=True)
        await stop.wait()
        log.info("signal received: draining (grace %.1f s)", settings.shutdown_grace_s)
        if console is not None:
            await console.stop()
        await server.stop()
        return 0
    finally:
        if embedded is not None:
            embedded.stop()


async def _migrate(settings: Settings, json: bool) -> int:
    from leasekeeper_server.app import direct_database, resolve_database
    from leasekeeper_server.cli import output as out
    from leasekeeper_server.storage.migrate import migrate

    dsn, embedded = resolve_database(settings)
    try:
        applied = await migrate(direct_database(settings, dsn))  # its lock needs a session
        if json:
            print(out.to_json({"applied": applied}))
        else:
            print(
                f"applied {len(applied)} migration(s): {applied}"
                if applied
                else "schema up to date"
            )
        return 0
    finally:
        if embedded is not None:
            embedded.stop()


def _worker_count(text: str) -> int:
    """``--workers``'s value: an integer, at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of workers (>= 1)")
    return int(text)


def installed_version() -> str:
    """The ``leasekeeper`` distribution's version, from its installed metadata."""
    from importlib import metadata

    try:
        return metadata.version("leasekeeper")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


# The exit codes, as `leasekeeper --help` ends (the module docstring says more).
EXIT_CODES = """\
exit codes:
  0    done
  1    failed, may work later: a failed call (its gRPC status code and message), a
       refusal (FAILED_PRECONDITION, NOT_FOUND), an unknown token id, a database or
       server out of reach, a listen address in use
  2    can never work as given: a usage error, an invalid LEASEKEEPER_* setting, a
       database that refuses the connection for good, a console address off loopback
       without HTTPS or LEASEKEEPER_CONSOLE_INSECURE
  3    done, and changed nothing (said on stderr): revoke of a task holding no lease
       to revoke, tasks cancel of a cancelled task, limits set of the values already
       set, limits clear of limits not set, tokens revoke of a revoked token
  130  interrupted (Ctrl-C) during a call (watch ends 0)
  141  stdout's reader went away (| head)"""


def _epilog() -> str:
    """The top-level help's end: every command's synopsis, output, and the exit codes."""
    from leasekeeper_server.cli import admin as cli_admin
    from leasekeeper_server.cli import console as cli_console
    from leasekeeper_server.cli import remote as cli_remote

    lines = [
        "commands:",
        "  serve [--workers N]",
        "  migrate",
        *(
            "  " + synopsis.replace("\n", "\n  ")
            for synopsis in (*cli_remote.SYNOPSIS, *cli_admin.SYNOPSIS, *cli_console.SYNOPSIS)
        ),
        "",
        "NS is a namespace (default: default), first or with -n NS. Listings print aligned",
        "tables; --json prints JSON Lines (one JSON object per line on stdout, nothing",
        "else). Notes and errors go to stderr, one line each.",
        "",
        EXIT_CODES,
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command-line grammar."""
    from leasekeeper_server.cli import admin as cli_admin
    from leasekeeper_server.cli import console as cli_console
    from leasekeeper_server.cli import remote as cli_remote

    parser = argparse.ArgumentParser(
        prog="leasekeeper",
        description="The leasekeeper command: serve, migrate, inspect and operate.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="start the service, and its operator console (LEASEKEEPER_CONSOLE_LISTEN)",
    )
    serve.add_argument(
        "--workers",
        type=_worker_count,
        metavar="N",
        help="server processes sharing the listen port (SO_REUSEPORT) and the database, "
        "supervised by this one (default: $LEASEKEEPER_WORKERS, else 1: serve in this process)",
    )
    migrate = commands.add_parser(
        "migrate",
        help="apply schema migrations and exit",
        description="Apply the schema migrations not applied yet, and exit (0 also when the "
        "schema is up to date). --json prints one JSON object: applied (their names).",
    )
    migrate.add_argument(
        "--json",
        action="store_true",
        help="print JSON Lines: one JSON object per line on stdout, nothing else",
    )
    # Options after the verb, as the README shows: `leases list -n NS --target ADDR`.
    cli_remote.add_commands(commands)
    cli_admin.add_commands(commands)
    cli_console.add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``leasekeeper`` command; returns its exit code (module docstring)."""
    try:
        code = _command(argv)
        sys.stdout.flush()  # here, where a reader that went away can still be answered
        return code
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """Ends quietly when standard output's reader went away (``leasekeeper ... | head``).

    Standard output is pointed at /dev/null so the interpreter's last flush
    cannot raise again (Python's own advice, in the ``signal`` module's
    documentation); the exit code is that of a tool killed by SIGPIPE.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _command(argv: Sequence[str] | None) -> int:
    # The embedded PostgreSQL is driven through subprocesses; grpc's fork
    # handlers have nothing to do for fork+exec and only log noise about it.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from leasekeeper_server.cli import remote as cli_remote

    args = build_parser().parse_args(argv)
    if args.command in cli_remote.COMMANDS:
        try:
            return asyncio.run(cli_remote.run(args))
        except KeyboardInterrupt:  # Ctrl-C during a call (watch handles its own): no traceback
            return 130
    # Server calls need only the thin client; the rest needs the extras.
    try:
        from leasekeeper_server.settings import Settings
    except ImportError as exc:
        print(f"leasekeeper: {SERVER_EXTRA_HINT} ({exc})", file=sys.stderr)
        return 2
    try:
        settings = Settings()
    except ValueError as exc:  # pydantic's ValidationError: one line per bad setting
        print(
            f"leasekeeper: invalid settings (LEASEKEEPER_*): {settings_errors(exc)}",
            file=sys.stderr,
        )
        return 2
    configure_logging(settings)
    if args.command == "console":  # no database: a client of a running server
        from leasekeeper_server.cli import console as cli_console

        return cli_console.run(settings, args)
    from leasekeeper_server.core.errors import DatabaseUnavailable

    try:
        return _database_command(settings, args)
    except DatabaseUnavailable as exc:
        return _database_failed(settings, exc)


def _database_command(settings: Settings, args: argparse.Namespace) -> int:
    """Runs ``serve``, ``migrate``, ``tokens`` or ``limits``; returns the exit code.

    Raises:
        DatabaseUnavailable: the database could not be used (DatabaseRefused: for good).
    """
    from leasekeeper_server.cli import admin as cli_admin

    if args.command == "serve":
        if args.workers is not None:
            settings = settings.model_copy(update={"workers": args.workers})
        # Before the database is touched, with workers or without.
        from leasekeeper_server.console.serving import check_tls_files, settings_problem

        problem = settings_problem(settings)
        cert, key = settings.console_tls_cert_file, settings.console_tls_key_file
        if problem is None and cert is not None and key is not None:
            try:
                check_tls_files(cert, key)
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            print(f"leasekeeper: {problem}", file=sys.stderr)
            return 2
        try:
            _check_listen_free(settings)
        except OSError as exc:
            log.error("cannot start: %s", exc.strerror or exc)
            return 1
        if settings.workers > 1:
            from leasekeeper_server.cli.supervisor import supervise

            return asyncio.run(supervise(settings))
        return run_service(_serve(settings))
    if args.command == "migrate":
        return asyncio.run(_migrate(settings, args.json))
    assert args.command in cli_admin.COMMANDS, args.command
    return asyncio.run(cli_admin.run(settings, args))


def _database_failed(settings: Settings, exc: DatabaseUnavailable) -> int:
    """Says in one line why the database could not be used; returns the exit code.

    2 for a refusal no retry fixes (DatabaseRefused: PostgreSQL's message, an
    unknown role, a wrong password, a missing database), as for any setting
    that can never work; 1 for a database out of reach, which may come back.
    """
    from leasekeeper_server.core.errors import DatabaseRefused

    refused = isinstance(exc, DatabaseRefused)
    setting = getattr(exc, "setting", "database_url")  # direct_database_url's errors say so
    variable = f"LEASEKEEPER_{setting.upper()}: " if refused and getattr(settings, setting) else ""
    print(f"leasekeeper: {variable}{exc}", file=sys.stderr)
    return 2 if refused else 1


if __name__ == "__main__":
    sys.exit(main())
