"""The console's HTTP server: uvicorn, run in the caller's event loop.

``leasekeeper serve`` starts it after the gRPC port serves, pointed at that
port on loopback (``serve_beside``), and stops it first in the drain on
SIGTERM; ``leasekeeper console`` runs it alone. The console's port is bound
here, before uvicorn starts, so a taken address is an ``OSError`` naming it.
uvicorn's own signal handling is left out: the process's handlers (which
drain the gRPC server too) stay in place.

The loopback rule (``address_problem``): off loopback, the console needs
HTTPS (a certificate and key) or an explicit ``insecure``, because sign-in
tokens and session cookies would otherwise cross the network in clear text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import uvicorn

from leasekeeper import CHANNEL_OPTIONS
from leasekeeper_server.console.app import create_app
from leasekeeper_server.console.runtime import Console
from leasekeeper_server.security.mode import is_loopback
from leasekeeper_server.settings import Settings

log = logging.getLogger("leasekeeper")

GRACE_S = 3  # seconds open requests may take to finish at stop (live updates end at once)
STARTED_POLL_S = 0.01


def is_off(listen: str | None) -> bool:
    """Whether a console address means "no console" (``off``, empty, None)."""
    return listen is None or listen.strip().lower() in ("", "off")


def split(listen: str) -> tuple[str, int]:
    """(host without brackets, port) of ``host:port``."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def address_problem(
    listen: str, *, tls: bool, insecure: bool, option: str = "LEASEKEEPER_CONSOLE_LISTEN"
) -> str | None:
    """Why the console may not serve on ``listen`` as configured; None when it may.

    Args:
        listen: The console's ``host:port``.
        tls: A certificate and key are set (HTTPS).
        insecure: Plain HTTP off loopback is allowed explicitly.
        option: How the address was given, for the message.
    """
    if is_off(listen) or tls or insecure or is_loopback(listen):
        return None
    return (
        f"{option}={listen} is not loopback: the console would send sign-in tokens and session "
        "cookies in clear text; set LEASEKEEPER_CONSOLE_TLS_CERT_FILE and "
        "LEASEKEEPER_CONSOLE_TLS_KEY_FILE (HTTPS), or LEASEKEEPER_CONSOLE_INSECURE=true"
    )


def settings_problem(settings: Settings) -> str | None:
    """``address_problem`` of the settings' console address."""
    return address_problem(
        settings.console_listen,
        tls=settings.console_tls_cert_file is not None,
        insecure=settings.console_insecure,
    )


def loopback_target(listen: str, port: int) -> str:
    """The gRPC address a console beside the server calls: its own port, on loopback.

    A wildcard host (``0.0.0.0``, ``::``, empty) is reached on loopback; a
    named host is reached as named (it is where the server listens).
    """
    host = listen.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "*"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind(listen: str) -> socket.socket:
    """A listening TCP socket on ``listen`` (port 0: any free port).

    Raises:
        OSError: the address is taken or cannot be bound; the message names it.
    """
    host, port = split(listen)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {listen}: {exc.strerror or exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {listen}: {exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock


def check_tls_files(cert_file: Path, key_file: Path) -> None:
    """Loads the console's certificate and key once, to say at start what is wrong with them.

    Raises:
        ValueError: a file cannot be read, or they are not a certificate and its key.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"LEASEKEEPER_CONSOLE_TLS_CERT_FILE/KEY_FILE ({cert_file}, {key_file}): {exc}"
        ) from exc


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers (the process keeps its own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ConsoleServer:
    """A console app served over HTTP(S) on one address, in the running event loop."""

    def __init__(
        self,
        console: Console,
        listen: str,
        *,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        """A server, not started.

        Args:
            console: The console to serve.
            listen: ``host:port`` (port 0: any free port).
            cert_file: PEM certificate chain for HTTPS (with ``key_file``).
            key_file: Its private key.
            channel: A gRPC channel closed with the server (the console's own).
        """
        self.console = console
        self.listen = listen
        self._cert_file = cert_file
        self._key_file = key_file
        self._channel = channel
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """The console's address, e.g. ``http://127.0.0.1:9460/``."""
        host = split(self.listen)[0] or "0.0.0.0"
        host = f"[{host}]" if ":" in host else host
        scheme = "https" if self._cert_file is not None else "http"
        return f"{scheme}://{host}:{self.port}/"

    async def start(self) -> None:
        """Binds the address and serves.

        Raises:
            OSError: the address is taken or cannot be bound.
            ValueError: the certificate or key cannot be used.
        """
        if self._cert_file is not None and self._key_file is not None:
            check_tls_files(self._cert_file, self._key_file)
        sock = _bind(self.listen)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(self.console),
            log_config=None,
            access_log=False,
            lifespan="off",
            http="h11",
            ws="none",
            server_header=False,
            timeout_graceful_shutdown=GRACE_S,
            ssl_certfile=self._cert_file,
            ssl_keyfile=self._key_file,
        )
        # uvicorn says "Started server process" and "Shutting down" at INFO: the
        # console's own start line is enough.
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        self._server = server = _Server(config)
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="leasekeeper-console")
        while not server.started:
            if self._task.done():
                sock.close()
                await self._task  # its error, if it failed
                raise OSError(f"the console stopped at start on {self.listen}")
            await asyncio.sleep(STARTED_POLL_S)

    async def stop(self) -> None:
        """Ends live updates and sessions, stops serving, closes the console's channel."""
        await self.console.close()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


async def serve_beside(
    settings: Settings, grpc_listen: str, grpc_port: int
) -> ConsoleServer | None:
    """The console of ``serve``: started beside the gRPC port, or None when there is none.

    None when ``console_listen`` is off; when the gRPC port uses TLS (the
    console beside it would need a CA to trust it: run ``leasekeeper
    console`` instead); or when its address cannot be bound (a warning: with
    the default address, another console may hold it). The caller has
    checked the loopback rule (``settings_problem``) and, for an address set
    explicitly, that it was free.

    Args:
        settings: The server's settings.
        grpc_listen: The gRPC listen address (its host is used for the target).
        grpc_port: The port the gRPC server bound.

    Raises:
        ValueError: the console's certificate or key cannot be used.
    """
    if is_off(settings.console_listen):
        return None
    if settings.tls_cert_file is not None:
        log.info(
            "no console: the gRPC port uses TLS (LEASEKEEPER_TLS_CERT_FILE); run `leasekeeper "
            "console --target HOST:PORT --tls-ca FILE` beside it, or set "
            "LEASEKEEPER_CONSOLE_LISTEN=off"
        )
        return None
    target = loopback_target(grpc_listen, grpc_port)
    channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    cert = settings.console_tls_cert_file
    console = Console(channel, target=target, secure=cert is not None)
    server = ConsoleServer(
        console,
        settings.console_listen,
        cert_file=cert,
        key_file=settings.console_tls_key_file,
        channel=channel,
    )
    try:
        await server.start()
    except (OSError, ValueError) as exc:
        await server.stop()
        if isinstance(exc, ValueError):
            raise
        log.warning("no console: %s (LEASEKEEPER_CONSOLE_LISTEN)", exc.strerror or exc)
        return None
    announce(server, settings.console_insecure)
    return server


def announce(server: ConsoleServer, insecure: bool) -> None:
    """Logs the console's address, and a warning for plain HTTP off loopback."""
    log.info("leasekeeper console on %s", server.url)
    if insecure and server.url.startswith("http:") and not is_loopback(server.listen):
        log.warning(
            "console on %s over plain HTTP (LEASEKEEPER_CONSOLE_INSECURE): sign-in tokens and "
            "session cookies travel in clear text",
            server.listen,
        )
