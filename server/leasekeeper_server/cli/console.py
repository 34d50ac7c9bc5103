"""``leasekeeper console``: the operator console alone, calling a running server.

::

    leasekeeper console [--target HOST:PORT] [--listen HOST:PORT] [--token TOKEN]
                        [--tls-ca FILE] [--tls-cert FILE --tls-key FILE]

The same web app ``serve`` runs beside its gRPC port, for a deployment where
the console runs apart (any replica's address, or several in one target).
``--target``, ``--tls-ca``, ``--tls-cert`` and ``--tls-key`` are the gRPC
side, as for the other commands that call a server. ``--token`` (default
``$LEASEKEEPER_TOKEN``) is the console's own token, used only to open the
shared Watch stream of each namespace with viewers; every page and action
uses the viewer's own token (signed in) or none. ``--listen`` defaults to
``LEASEKEEPER_CONSOLE_LISTEN`` (else 127.0.0.1:9460); HTTPS and plain HTTP
off loopback follow ``LEASEKEEPER_CONSOLE_TLS_CERT_FILE``/``_KEY_FILE`` and
``LEASEKEEPER_CONSOLE_INSECURE``.

Logs ``leasekeeper console on http(s)://HOST:PORT/`` once it serves; runs
until SIGTERM or SIGINT (exit 0). Exit 1: the listen address is taken.
Exit 2: a usage error, an invalid setting, an address off loopback without
HTTPS or ``LEASEKEEPER_CONSOLE_INSECURE``, a certificate or key that cannot
be used.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leasekeeper.channel import default_target

if TYPE_CHECKING:
    from leasekeeper_server.settings import Settings

log = logging.getLogger("leasekeeper")

SYNOPSIS = (
    "console [--target HOST:PORT] [--listen HOST:PORT] [--token TOKEN] "
    "[--tls-ca FILE] [--tls-cert FILE --tls-key FILE]",
)
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_command(commands: Any) -> None:
    """Adds ``console`` to the ``leasekeeper`` parser."""
    parser = commands.add_parser(
        "console",
        help="serve the operator console (a web app) for a running server",
        description="Serve the operator console, a web app, calling the server at --target "
        "with each viewer's token. Logs 'leasekeeper console on URL' once it serves and runs "
        "until SIGTERM or SIGINT (exit 0). HTTPS and plain HTTP off loopback follow "
        "LEASEKEEPER_CONSOLE_TLS_CERT_FILE, LEASEKEEPER_CONSOLE_TLS_KEY_FILE and "
        "LEASEKEEPER_CONSOLE_INSECURE; an address off loopback without either exits 2.",
    )
    parser.add_argument(
        "--target",
        default=default_target(),
        metavar="HOST:PORT",
        help="server address host:port (default: $LEASEKEEPER_TARGET, else 127.0.0.1:9457)",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="the console's address (default: $LEASEKEEPER_CONSOLE_LISTEN, else "
        "127.0.0.1:9460; port 0: any free port)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("LEASEKEEPER_TOKEN") or None,
        help="the console's own token, used only for the shared Watch streams (default: "
        "$LEASEKEEPER_TOKEN; none: each stream uses a viewer's token); pages and actions "
        "always use the viewer's",
    )
    parser.add_argument("--tls-ca", type=Path, metavar="FILE", help="CA bundle (PEM): use TLS")
    parser.add_argument(
        "--tls-cert", type=Path, metavar="FILE", help="client certificate (PEM) for mutual TLS"
    )
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="its private key (PEM)")


def _listen(settings: Settings, args: argparse.Namespace) -> tuple[str, str]:
    """The console's address, and how it was given (for messages).

    Raises:
        ValueError: ``--listen`` is not host:port, or the address is off.
    """
    from leasekeeper_server.console.serving import is_off

    if args.listen is not None:
        host, sep, port = args.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"--listen {args.listen!r} is not host:port with a port in 0..65535")
        return args.listen, "--listen"
    if is_off(settings.console_listen):
        raise ValueError("LEASEKEEPER_CONSOLE_LISTEN is off: give --listen HOST:PORT")
    return settings.console_listen, "LEASEKEEPER_CONSOLE_LISTEN"


async def _serve(settings: Settings, args: argparse.Namespace, listen: str) -> int:
    from leasekeeper_server.cli.remote import UsageError, _channel
    from leasekeeper_server.console.runtime import Console
    from leasekeeper_server.console.serving import ConsoleServer, announce

    try:
        channel = _channel(args)
    except UsageError as exc:
        print(f"leasekeeper: {exc}", file=sys.stderr)
        return EXIT_USAGE
    cert = settings.console_tls_cert_file
    console = Console(channel, target=args.target, token=args.token, secure=cert is not None)
    server = ConsoleServer(
        console, listen, cert_file=cert, key_file=settings.console_tls_key_file, channel=channel
    )
    try:
        await server.start()
    except ValueError as exc:
        await server.stop()
        print(f"leasekeeper: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        await server.stop()
        log.error("cannot start: %s (--listen, LEASEKEEPER_CONSOLE_LISTEN)", exc.strerror or exc)
        return EXIT_FAILED
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    announce(server, settings.console_insecure)
    log.info("console calls the server at %s", args.target)
    await stop.wait()
    log.info("signal received: stopping the console")
    await server.stop()
    return EXIT_OK


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Runs ``leasekeeper console`` until a signal; returns its exit code (module docstring)."""
    from leasekeeper_server.cli.startup import run_service
    from leasekeeper_server.console.serving import address_problem

    try:
        listen, given = _listen(settings, args)
    except ValueError as exc:
        print(f"leasekeeper: {exc}", file=sys.stderr)
        return EXIT_USAGE
    problem = address_problem(
        listen,
        tls=settings.console_tls_cert_file is not None,
        insecure=settings.console_insecure,
        option=given,
    )
    if problem is not None:
        print(f"leasekeeper: {problem}", file=sys.stderr)
        return EXIT_USAGE
    return run_service(_serve(settings, args, listen))
