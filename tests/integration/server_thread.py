"""A real server on an event loop in a thread of its own, for synchronous tests.

Hypothesis state machines are synchronous: they call the server through a
synchronous channel while the server (and a direct database connection for
looking behind it) runs on a loop in this thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import asyncpg
import grpc

from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import running_server
from tests.helpers import error_info

T = TypeVar("T")

CALL_TIMEOUT_S = 10.0


class ServerThread:
    """A LeaseServer and a database connection, on an event loop in a thread of their own.

    Args:
        database_url: the test database.
        **overrides: settings for the server (see ``tests.conftest.make_settings``).
    """

    def __init__(self, database_url: str, **overrides: Any) -> None:
        self._url = database_url
        self._overrides = overrides
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="model-server", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.port = 0
        self.db: asyncpg.Connection | None = None

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start() or stop()
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with running_server(self._url, **self._overrides) as running:
            self.db = await asyncpg.connect(self._url)
            try:
                self.port = running.port
                self._ready.set()
                await self._stop.wait()
            finally:
                await self.db.close()

    @property
    def target(self) -> str:
        """The server's address."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Starts the thread and waits until the server listens."""
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise RuntimeError("the server did not start") from self._error
        assert self.port, "the server did not start in time"

    def run(self, make: Callable[[asyncpg.Connection], Coroutine[Any, Any, T]]) -> T:
        """Runs ``make(db)`` on the server's loop; returns its result."""
        assert self._loop is not None and self.db is not None
        future = asyncio.run_coroutine_threadsafe(make(self.db), self._loop)
        return future.result(CALL_TIMEOUT_S)

    def stop(self) -> None:
        """Stops the server and joins the thread; raises what the thread raised."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the server thread did not stop"
        if self._error is not None:
            raise RuntimeError("the server thread failed") from self._error


@contextlib.contextmanager
def serving_thread(database_url: str, **overrides: Any) -> Iterator[ServerThread]:
    """A started :class:`ServerThread`, stopped on exit."""
    server = ServerThread(database_url, **overrides)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def sync_stub_of(server: ServerThread) -> Iterator[rpc.LeaseServiceStub]:
    """A stub on a synchronous channel to ``server``, closed on exit."""
    with grpc.insecure_channel(server.target) as channel:
        yield rpc.LeaseServiceStub(channel)


def expect_ok(answer: T | grpc.RpcError) -> T:
    """The reply; an error (kept by a model's ``call``) fails with its code and reason."""
    if isinstance(answer, grpc.RpcError):
        reason = error_info(answer).reason  # type: ignore[arg-type]
        raise AssertionError(f"expected OK, got {answer.code()} {reason}: {answer.details()}")
    return answer
