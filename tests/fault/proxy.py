"""A small asyncio TCP proxy for fault injection, per direction.

It runs in the test's event loop, listens on ``127.0.0.1:<free port>`` and
forwards every connection to a target: a gRPC server (HTTP/2 between a client
and the service) or PostgreSQL (between the service and its database). The
two directions of a connection are **upstream** (client to target) and
**downstream** (target to client); faults apply to one or both.

Faults, switched at any time from the test (``direction`` is ``"both"``,
``"upstream"`` or ``"downstream"``):

* ``restore()`` (the start state): forward bytes both ways, at once.
* ``cut()``: the target is gone. Every open connection is reset (RST, via
  ``SO_LINGER 0``); new connections are accepted and reset at once, so a
  client sees ``ConnectionResetError`` straight away (as from a host whose
  service is down, without giving the port away), until ``restore()``.
* ``reset()``: an event, not a state: every open connection is reset once;
  new connections are accepted and treated as the current faults say.
* ``black_hole(direction)``: the network swallows everything going that way,
  on open and new connections, without a reset, so only the endpoints' own
  timers can notice. A new connection while both ways are black-holed is
  accepted and hears nothing; the target never sees it.
* ``delay(seconds, direction)``: every chunk read going that way is held for
  ``seconds`` before it is forwarded, order kept (a buffered request that
  arrives late: a renewal after its lease's expiry, say).

Faults add up per direction (``black_hole("upstream")`` then
``delay(1, "downstream")`` does both); the last call naming a direction
decides for it. ``cut()`` replaces every other fault, and ``black_hole()`` or
``delay()`` end a cut. ``restore()`` clears everything: connections that lost
bytes while black-holed (or were never connected to the target) are reset,
since their streams cannot resume; the others go on. Chunks already held by a
delay keep their release time. ``stats`` counts the faults applied and what
they did.

Why our own proxy: no maintained fault proxy (toxiproxy and the like) installs
from the package registries this project can reach (Debian's and PyPI's carry
only clients of toxiproxy, whose server is a Go binary), and a pure-asyncio one
needs no daemon, no port of its own and no API to call. The asyncpg test
suite's fuzzer (``asyncpg/_testbase/fuzzer.py``) is the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

_CHUNK = 65536
UPSTREAM = "upstream"
DOWNSTREAM = "downstream"
Direction = Literal["both", "upstream", "downstream"]
DIRECTIONS: tuple[str, ...] = ("both", UPSTREAM, DOWNSTREAM)
STAT_NAMES: tuple[str, ...] = (
    # calls
    "cut",
    "reset",
    "black_hole",
    "delay",
    "restore",
    # effects
    "connections_accepted",
    "connections_reset",
    "chunks_dropped",
    "chunks_delayed",
)


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Closes a connection with RST rather than FIN."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _ways(direction: str) -> tuple[str, ...]:
    if direction == "both":
        return (UPSTREAM, DOWNSTREAM)
    if direction in (UPSTREAM, DOWNSTREAM):
        return (direction,)
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


@dataclass
class _Fault:
    """What happens to bytes going one way."""

    dropping: bool = False
    delay_s: float = 0.0


class _Link:
    """One client connection and its target connection (if any)."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.target: asyncio.StreamWriter | None = None
        self.lost = False  # bytes were swallowed: the streams cannot resume
        self.queued = 0  # chunks read and not yet forwarded
        self.tasks: set[asyncio.Task[None]] = set()

    def stop_tasks(self) -> None:
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        self.queued = 0

    def reset(self) -> None:
        self.stop_tasks()
        _reset(self.client)
        _reset(self.target)

    def close(self) -> None:
        self.stop_tasks()
        self.client.close()
        if self.target is not None:
            self.target.close()


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port``; see the module docstring.

    A ``target_host`` that is a path (starts with "/") names a Unix socket
    folder, as libpq's ``host`` does: the proxy then connects to
    ``{target_host}/.s.PGSQL.{target_port}`` (the embedded PostgreSQL listens
    only there). The target is read at each new connection, so it may be
    changed (a restarted server's new port) while the proxy runs.

    Attributes:
        stats: Counts by name (``STAT_NAMES``): each fault call, connections
            accepted and reset by the proxy, chunks dropped and delayed.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self._refusing = False
        self._faults = {UPSTREAM: _Fault(), DOWNSTREAM: _Fault()}
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
        tasks = [task for link in self._links for task in link.tasks]
        for link in list(self._links):
            link.reset()
        self._links.clear()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    # -- faults ---------------------------------------------------------------------

    def restore(self) -> None:
        """Forwards again, both ways, at once; connections that lost bytes are reset."""
        self.stats["restore"] += 1
        self._refusing = False
        for fault in self._faults.values():
            fault.dropping, fault.delay_s = False, 0.0
        self._reset_broken()

    def cut(self) -> None:
        """Resets every connection, and every new one until ``restore()``; clears other faults."""
        self.stats["cut"] += 1
        self._refusing = True
        for fault in self._faults.values():
            fault.dropping, fault.delay_s = False, 0.0
        self._reset_all()

    def reset(self) -> None:
        """Resets every open connection once; new ones are accepted. Changes no fault."""
        self.stats["reset"] += 1
        self._reset_all()

    def black_hole(self, direction: Direction = "both") -> None:
        """Forwards nothing going ``direction``, on old and new connections, until ``restore()``.

        Args:
            direction: ``"both"``, ``"upstream"`` (client to target) or
                ``"downstream"`` (target to client).

        Raises:
            ValueError: an unknown direction.
        """
        ways = _ways(direction)
        self.stats["black_hole"] += 1
        self._refusing = False
        for way in ways:
            self._faults[way].dropping = True

    def delay(self, seconds: float, direction: Direction = "both") -> None:
        """Holds every chunk going ``direction`` for ``seconds`` before forwarding it, in order.

        Ends a black hole in that direction (connections that lost bytes are
        reset). ``delay(0, direction)`` forwards that way at once again.

        Args:
            seconds: How long each chunk is held, from when the proxy read it; >= 0.
            direction: ``"both"``, ``"upstream"`` (client to target) or
                ``"downstream"`` (target to client).

        Raises:
            ValueError: a negative delay or an unknown direction.
        """
        ways = _ways(direction)
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self.stats["delay"] += 1
        self._refusing = False
        healed = False
        for way in ways:
            fault = self._faults[way]
            healed = healed or fault.dropping
            fault.dropping, fault.delay_s = False, float(seconds)
        if healed:
            self._reset_broken()

    @property
    def connections(self) -> int:
        """How many client connections are open through the proxy."""
        return len(self._links)

    @property
    def queued_chunks(self) -> int:
        """Chunks read and not yet forwarded (held by a delay), over all connections."""
        return sum(link.queued for link in self._links)

    def _reset_all(self) -> None:
        for link in list(self._links):
            self._reset_link(link)

    def _reset_broken(self) -> None:
        for link in [link for link in self._links if link.lost or link.target is None]:
            self._reset_link(link)

    def _reset_link(self, link: _Link) -> None:
        self.stats["connections_reset"] += 1
        link.reset()
        self._links.discard(link)

    # -- forwarding -----------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats["connections_accepted"] += 1
        if self._refusing:
            self.stats["connections_reset"] += 1
            _reset(writer)
            return
        link = _Link(writer)
        self._links.add(link)
        if all(fault.dropping for fault in self._faults.values()):
            # Nothing would get through: the target never hears of this connection.
            self._start_way(link, UPSTREAM, reader, None)
            return
        try:
            target_reader, target_writer = await self._connect_target()
        except OSError:
            if link in self._links:
                self._reset_link(link)
            return
        if link not in self._links:  # cut or reset while connecting
            _reset(target_writer)
            return
        link.target = target_writer
        self._start_way(link, UPSTREAM, reader, target_writer)
        self._start_way(link, DOWNSTREAM, target_reader, writer)

    async def _connect_target(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.target_host.startswith("/"):
            path = f"{self.target_host}/.s.PGSQL.{self.target_port}"
            return await asyncio.open_unix_connection(path)
        return await asyncio.open_connection(self.target_host, self.target_port)

    def _start_way(
        self,
        link: _Link,
        way: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter | None,
    ) -> None:
        """Starts carrying one direction: a reader task and a forwarding task, joined by a queue."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        for coro in (
            self._read_way(link, way, reader, queue),
            self._send_way(link, way, writer, queue),
        ):
            task = asyncio.get_running_loop().create_task(coro)
            link.tasks.add(task)
            task.add_done_callback(link.tasks.discard)

    async def _read_way(
        self,
        link: _Link,
        way: str,
        reader: asyncio.StreamReader,
        queue: asyncio.Queue[tuple[float, bytes]],
    ) -> None:
        """Reads one direction; each chunk (and the end, as b"") is dropped or queued."""
        loop = asyncio.get_running_loop()
        data = b"?"
        while data:
            try:
                data = await reader.read(_CHUNK)
            except OSError:
                data = b""  # the peer reset: end this side as if it had closed
            fault = self._faults[way]
            if fault.dropping:
                link.lost = True
                self.stats["chunks_dropped"] += 1
                continue
            if fault.delay_s > 0:
                self.stats["chunks_delayed"] += 1
            link.queued += 1
            queue.put_nowait((loop.time() + fault.delay_s, data))

    async def _send_way(
        self,
        link: _Link,
        way: str,
        writer: asyncio.StreamWriter | None,
        queue: asyncio.Queue[tuple[float, bytes]],
    ) -> None:
        """Forwards queued chunks in order, each at its release time; the end closes the link."""
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            if (wait_s := due - loop.time()) > 0:
                await asyncio.sleep(wait_s)
            link.queued = max(0, link.queued - 1)
            if self._faults[way].dropping or writer is None:  # black-holed while it was held
                link.lost = True
                self.stats["chunks_dropped"] += 1
                continue
            if not data:
                break
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                break
        # One side ended on its own: end the other one too.
        if link in self._links:
            self._links.discard(link)
            link.close()


@contextlib.asynccontextmanager
async def tcp_proxy(target_host: str, target_port: int) -> AsyncIterator[TcpProxy]:
    """A started proxy to the target, closed on exit."""
    proxy = TcpProxy(target_host, target_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
