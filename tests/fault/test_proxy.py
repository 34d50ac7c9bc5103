"""The fault proxy itself, against a tiny echo server: each fault, each direction.

The echo server sends back what it reads and can also push bytes on its own,
so each direction can be watched alone: a byte the client sends travels
upstream, an echo or a push travels downstream. Whether a byte went through
is polled on real state (what the server received, what the client read, the
proxy's counters), never slept for. Where the point is that nothing arrives,
the test first waits until the proxy has counted the chunk as dropped (so it
is gone for good) and then checks that the other end has nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests import helpers
from tests.fault.proxy import TcpProxy, tcp_proxy

pytestmark = [pytest.mark.timeout(15)]

DIRECTIONS = ["both", "upstream", "downstream"]
DELAY_S = 0.5
# A side that is not delayed must arrive sooner than this (a loaded machine may
# take a few hundred ms); a delayed side takes at least DELAY_S.
PROMPT_S = DELAY_S * 0.8
STEP_TIMEOUT_S = 5.0


class EchoServer:
    """Echoes every byte; remembers, per connection, what it received."""

    def __init__(self, echo: bool = True) -> None:
        self.echo = echo
        self.received: list[bytearray] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        buffer = bytearray()
        self.received.append(buffer)
        self.writers.append(writer)
        try:
            while data := await reader.read(65536):
                buffer += data
                if self.echo:
                    writer.write(data)
                    await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)

    async def push(self, data: bytes, connection: int = -1) -> None:
        """Sends ``data`` to a client on the server's own initiative."""
        writer = self.writers[connection]
        writer.write(data)
        await writer.drain()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()


@contextlib.asynccontextmanager
async def echo_server(echo: bool = True) -> AsyncIterator[tuple[EchoServer, int]]:
    server = EchoServer(echo)
    server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    try:
        yield server, server.server.sockets[0].getsockname()[1]
    finally:
        await server.close()


@pytest.fixture
async def echo() -> AsyncIterator[tuple[EchoServer, TcpProxy]]:
    async with echo_server() as (server, port), tcp_proxy("127.0.0.1", port) as proxy:
        yield server, proxy


class Client:
    """One client connection through the proxy."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.got = bytearray()

    @classmethod
    async def open(cls, port: int) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def read_exactly(self, size: int) -> bytes:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            while len(self.got) < size:
                data = await self.reader.read(65536)
                assert data, f"connection ended after {bytes(self.got)!r}"
                self.got += data
        return bytes(self.got[:size])

    async def nothing_pending(self) -> bool:
        """True when no byte is waiting to be read (a zero-length wait on the socket)."""
        try:
            data = await asyncio.wait_for(self.reader.read(65536), 0.05)
        except TimeoutError:
            return True
        self.got += data
        return False

    async def ended(self) -> bool:
        """Waits until the other side resets (or closes) the connection; True then."""
        with contextlib.suppress(ConnectionResetError):
            async with asyncio.timeout(STEP_TIMEOUT_S):
                while data := await self.reader.read(65536):
                    self.got += data
        return True

    def close(self) -> None:
        self.writer.close()


async def roundtrip(server: EchoServer, proxy: TcpProxy, payload: bytes = b"ping") -> Client:
    client = await Client.open(proxy.port)
    await client.send(payload)
    assert await client.read_exactly(len(payload)) == payload
    return client


async def test_proxy_forward_roundtrip_counts_connection(echo):
    server, proxy = echo
    client = await roundtrip(server, proxy)
    assert proxy.connections == 1 and proxy.stats["connections_accepted"] == 1
    assert bytes(server.received[0]) == b"ping"
    client.close()
    await helpers.poll(
        lambda: proxy.connections == 0,
        "the proxy to drop the closed connection",
        STEP_TIMEOUT_S,
        0.005,
    )


async def test_proxy_cut_resets_open_and_refuses_new_until_restore(echo):
    server, proxy = echo
    client = await roundtrip(server, proxy)

    proxy.cut()

    with pytest.raises(ConnectionResetError):
        await client.read_exactly(5)
    refused = await Client.open(proxy.port)
    with pytest.raises(ConnectionResetError):
        await refused.read_exactly(1)
    assert len(server.received) == 1, "a refused connection reached the target"
    assert proxy.stats["cut"] == 1 and proxy.stats["connections_reset"] == 2

    proxy.restore()
    (await roundtrip(server, proxy, b"again")).close()
    client.close()
    refused.close()


async def test_proxy_reset_resets_open_once_and_forwards_new(echo):
    server, proxy = echo
    first, second = await roundtrip(server, proxy), await roundtrip(server, proxy)

    proxy.reset()

    for client in (first, second):
        with pytest.raises(ConnectionResetError):
            await client.read_exactly(5)
        client.close()
    assert proxy.connections == 0
    # No restore(): the next connection simply goes through.
    (await roundtrip(server, proxy, b"fresh")).close()
    assert proxy.stats["reset"] == 1 and proxy.stats["connections_reset"] == 2


@pytest.mark.parametrize("direction", DIRECTIONS)
async def test_proxy_black_hole_direction_swallows_only_that_way(echo, direction):
    server, proxy = echo
    client = await roundtrip(server, proxy)

    proxy.black_hole(direction)

    await client.send(b"up")
    if direction == "downstream":
        # Upstream goes through; the echo coming back is swallowed.
        await helpers.poll(
            lambda: bytes(server.received[0]) == b"pingup",
            "the upstream bytes",
            STEP_TIMEOUT_S,
            0.005,
        )
    await helpers.poll(
        lambda: proxy.stats["chunks_dropped"] >= 1,
        "the proxy to drop a chunk",
        STEP_TIMEOUT_S,
        0.005,
    )
    assert await client.nothing_pending()
    if direction != "downstream":
        assert bytes(server.received[0]) == b"ping", "upstream bytes got through"
    await server.push(b"down")
    if direction == "upstream":
        assert await client.read_exactly(8) == b"pingdown"
    else:
        await helpers.poll(
            lambda: proxy.stats["chunks_dropped"] >= 2,
            "the proxy to drop the push",
            STEP_TIMEOUT_S,
            0.005,
        )
        assert await client.nothing_pending()
    assert proxy.connections == 1, "a black hole must not close the connection"
    assert proxy.stats["connections_reset"] == 0
    client.close()


async def test_proxy_black_hole_both_new_connection_never_reaches_target(echo):
    server, proxy = echo
    proxy.black_hole()
    client = await Client.open(proxy.port)
    await client.send(b"hello?")
    await helpers.poll(
        lambda: proxy.stats["chunks_dropped"] >= 1,
        "the proxy to drop a chunk",
        STEP_TIMEOUT_S,
        0.005,
    )
    assert server.received == [], "the target saw a black-holed connection"
    assert await client.nothing_pending()
    proxy.restore()  # never connected to the target: it cannot resume
    assert await client.ended()
    client.close()


@pytest.mark.parametrize("direction", ["upstream", "downstream"])
async def test_proxy_restore_after_black_hole_resets_only_connections_that_lost_bytes(
    echo, direction
):
    server, proxy = echo
    idle, busy = await roundtrip(server, proxy), await roundtrip(server, proxy)
    proxy.black_hole(direction)
    await busy.send(b"lost")
    await helpers.poll(
        lambda: proxy.stats["chunks_dropped"] >= 1,
        "the proxy to drop a chunk",
        STEP_TIMEOUT_S,
        0.005,
    )

    proxy.restore()

    assert await busy.ended()
    await idle.send(b"still")
    assert await idle.read_exactly(9) == b"pingstill"
    assert proxy.stats["connections_reset"] == 1 and proxy.connections == 1
    idle.close()
    busy.close()


@pytest.mark.parametrize("direction", DIRECTIONS)
async def test_proxy_delay_direction_holds_chunks_in_order(echo, direction):
    server, proxy = echo
    client = await roundtrip(server, proxy)

    proxy.delay(DELAY_S, direction)

    start = time.monotonic()
    for part in (b"a", b"b", b"c"):  # three chunks, in order
        await client.send(part)
        await asyncio.sleep(0)
    await helpers.poll(
        lambda: bytes(server.received[0]) == b"pingabc", "the upstream bytes", STEP_TIMEOUT_S, 0.005
    )
    upstream_s = time.monotonic() - start
    assert await client.read_exactly(7) == b"pingabc"
    roundtrip_s = time.monotonic() - start
    if direction == "downstream":
        assert upstream_s < PROMPT_S, upstream_s
    else:
        assert upstream_s >= DELAY_S, upstream_s
    expected_s = DELAY_S * (2 if direction == "both" else 1)
    assert roundtrip_s >= expected_s, roundtrip_s
    assert proxy.stats["delay"] == 1 and proxy.stats["chunks_delayed"] >= 1
    client.close()


async def test_proxy_delay_upstream_push_downstream_is_prompt(echo):
    server, proxy = echo
    client = await roundtrip(server, proxy)
    proxy.delay(DELAY_S * 10, "upstream")
    await client.send(b"late")
    await helpers.poll(
        lambda: proxy.queued_chunks == 1, "the chunk to be held", STEP_TIMEOUT_S, 0.005
    )
    start = time.monotonic()
    await server.push(b"now")
    assert await client.read_exactly(7) == b"pingnow"
    assert time.monotonic() - start < PROMPT_S
    assert bytes(server.received[0]) == b"ping" and proxy.queued_chunks == 1
    client.close()


async def test_proxy_restore_keeps_release_time_of_held_chunks(echo):
    server, proxy = echo
    client = await roundtrip(server, proxy)
    proxy.delay(DELAY_S, "upstream")
    start = time.monotonic()
    await client.send(b"held")
    await helpers.poll(
        lambda: proxy.queued_chunks == 1, "the chunk to be held", STEP_TIMEOUT_S, 0.005
    )

    proxy.restore()

    await client.send(b"next")  # forwarded at once, but after the held chunk
    await helpers.poll(
        lambda: bytes(server.received[0]) == b"pingheldnext",
        "both chunks, in order",
        STEP_TIMEOUT_S,
        0.005,
    )
    assert time.monotonic() - start >= DELAY_S
    assert proxy.queued_chunks == 0 and proxy.connections == 1
    client.close()


async def test_proxy_delay_ends_black_hole_and_resets_broken_connections(echo):
    server, proxy = echo
    client = await roundtrip(server, proxy)
    proxy.black_hole("upstream")
    await client.send(b"lost")
    await helpers.poll(
        lambda: proxy.stats["chunks_dropped"] >= 1,
        "the proxy to drop a chunk",
        STEP_TIMEOUT_S,
        0.005,
    )

    proxy.delay(0, "upstream")

    assert await client.ended()
    (await roundtrip(server, proxy, b"new")).close()
    client.close()


async def test_proxy_cut_clears_black_hole_and_delay(echo):
    server, proxy = echo
    proxy.black_hole("upstream")
    proxy.delay(DELAY_S * 10, "downstream")
    proxy.cut()
    proxy.restore()
    start = time.monotonic()
    (await roundtrip(server, proxy)).close()
    assert time.monotonic() - start < PROMPT_S
    assert {name: proxy.stats[name] for name in ("black_hole", "delay", "cut", "restore")} == {
        "black_hole": 1,
        "delay": 1,
        "cut": 1,
        "restore": 1,
    }


@pytest.mark.parametrize(
    ("call", "args"),
    [("black_hole", ("sideways",)), ("delay", (1.0, "up")), ("delay", (-1.0, "both"))],
)
def test_proxy_bad_fault_arguments_raise_value_error(call, args):
    proxy = TcpProxy("127.0.0.1", 1)
    with pytest.raises(ValueError):
        getattr(proxy, call)(*args)
    assert proxy.stats[call] == 0


async def test_proxy_unix_socket_folder_target_forwards():
    # A Unix socket path must stay under ~107 bytes: a short folder of its own.
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        server = EchoServer()
        path = Path(folder) / ".s.PGSQL.5999"
        server.server = await asyncio.start_unix_server(server._serve, str(path))
        try:
            async with tcp_proxy(folder, 5999) as proxy:
                (await roundtrip(server, proxy)).close()
        finally:
            await server.close()


async def test_proxy_unreachable_target_resets_client():
    async with echo_server() as (_, port):
        pass  # the port is free again: nothing listens there
    async with tcp_proxy("127.0.0.1", port) as proxy:
        client = await Client.open(proxy.port)
        assert await client.ended()
        assert proxy.connections == 0
        client.close()
