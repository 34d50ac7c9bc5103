"""A small asyncio TCP proxy for fault injection between the service and PostgreSQL.

It runs in the test's event loop, listens on ``127.0.0.1:<free port>`` and
forwards every connection to a target. Three modes, switched at any time:

* ``restore()`` (the start mode): forward bytes both ways.
* ``cut()``: the database is gone. Every open connection is reset (RST, via
  ``SO_LINGER 0``); new connections are accepted and reset at once, so a
  client sees ``ConnectionResetError`` straight away (as it would from a host
  whose PostgreSQL is down, without giving the port away).
* ``black_hole()``: the network swallows everything. Open connections stay
  open but no byte goes through either way; new connections are accepted
  and then hear nothing, not even a reset. Only the client's own timers can
  notice.

``restore()`` resets the connections that were black-holed (bytes were lost
in the middle of their streams, so they cannot resume) and forwards again.
The asyncpg test suite's fuzzer (``asyncpg/_testbase/fuzzer.py``) is the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import struct
from collections.abc import AsyncIterator

_CHUNK = 65536


class Mode(enum.Enum):
    FORWARD = "forward"
    CUT = "cut"
    BLACK_HOLE = "black_hole"


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes a connection with RST rather than FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Link:
    """One client connection and its upstream connection (if any)."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.dropping = False  # black-holed: read and discard, forward nothing
        self.tasks: list[asyncio.Task[None]] = []

    def reset(self) -> None:
        for task in self.tasks:
            task.cancel()
        _reset(self.client)
        if self.upstream is not None:
            _reset(self.upstream)


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port``; see the module docstring.

    A ``target_host`` that is a path (starts with "/") names a Unix socket
    folder, as libpq's ``host`` does: the proxy then connects to
    ``{target_host}/.s.PGSQL.{target_port}`` (the embedded PostgreSQL listens
    only there).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.mode = Mode.FORWARD
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()

    async def start(self) -> int:
        """Starts listening; returns the proxy's port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stops listening and resets every connection."""
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.reset()
        self._links.clear()
        if self._server is not None:
            await self._server.wait_closed()

    def cut(self) -> None:
        """Resets every connection and every new one until ``restore()``."""
        self.mode = Mode.CUT
        for link in list(self._links):
            link.reset()
        self._links.clear()

    def black_hole(self) -> None:
        """Forwards nothing, either way, on old and new connections, until ``restore()``."""
        self.mode = Mode.BLACK_HOLE
        for link in self._links:
            link.dropping = True

    def restore(self) -> None:
        """Forwards again; connections black-holed so far are reset."""
        self.mode = Mode.FORWARD
        for link in [link for link in self._links if link.dropping]:
            link.reset()
            self._links.discard(link)

    @property
    def connections(self) -> int:
        """How many client connections are open through the proxy."""
        return len(self._links)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode is Mode.CUT:
            _reset(writer)
            return
        link = _Link(writer)
        self._links.add(link)
        if self.mode is Mode.BLACK_HOLE:
            link.dropping = True
            link.tasks.append(asyncio.current_task())  # type: ignore[arg-type]
            await self._pump(reader, None, link)
            return
        try:
            up_reader, up_writer = await self._connect_upstream()
        except OSError:
            self._links.discard(link)
            _reset(writer)
            return
        link.upstream = up_writer
        if link not in self._links:  # cut while we were connecting
            link.reset()
            return
        link.tasks = [
            asyncio.create_task(self._pump(reader, up_writer, link)),
            asyncio.create_task(self._pump(up_reader, writer, link)),
        ]

    async def _connect_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.target_host.startswith("/"):
            path = f"{self.target_host}/.s.PGSQL.{self.target_port}"
            return await asyncio.open_unix_connection(path)
        return await asyncio.open_connection(self.target_host, self.target_port)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, link: _Link
    ) -> None:
        try:
            while data := await reader.read(_CHUNK):
                if link.dropping or writer is None:
                    continue
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            # One side ended on its own: end the other one too.
            if link in self._links and not link.dropping:
                self._links.discard(link)
                link.client.close()
                if link.upstream is not None:
                    link.upstream.close()


@contextlib.asynccontextmanager
async def tcp_proxy(target_host: str, target_port: int) -> AsyncIterator[TcpProxy]:
    """A started proxy to the target, closed on exit."""
    proxy = TcpProxy(target_host, target_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
