"""How a server process starts (``serve``, and each ``serve --workers`` worker).

Logging from the settings, pydantic's errors as ``LEASEKEEPER_*`` lines, the
event loop (uvloop) and the collector's tuning, and the start that retries
while the database is out of reach. Only the standard library is imported at
module level: ``cli/main.py`` imports this module and must start without the
server's extras for the thin-client commands.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leasekeeper_server.app import LeaseServer
    from leasekeeper_server.settings import Settings

log = logging.getLogger("leasekeeper")


def configure_logging(settings: Settings) -> None:
    """Sets up logging from the settings (level, text or JSON, the audit log): see logs.py."""
    from leasekeeper_server.observability.logs import configure

    configure(settings.log_level, settings.log_format, settings.audit_log)


STARTUP_RETRY_INITIAL_S = 0.2
STARTUP_RETRY_MAX_S = 5.0


async def when_database_answers(
    settings: Settings, attempt: Callable[[], Awaitable[object]]
) -> bool:
    """Runs ``attempt`` (a coroutine function), retrying while the database is out of reach.

    Each failure is logged on one line; the wait between attempts doubles
    from 0.2 s up to 5 s. Gives up after ``settings.startup_wait_s`` seconds.
    Any error other than DatabaseUnavailable leaves at once, and so does
    DatabaseRefused (a role, password or database no retry fixes).

    Returns:
        Whether it succeeded.

    Raises:
        DatabaseRefused: the database refuses the connection for good.
    """
    from leasekeeper_server.core.errors import DatabaseRefused, DatabaseUnavailable

    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + settings.startup_wait_s
    delay_s = STARTUP_RETRY_INITIAL_S
    while True:
        try:
            await attempt()
            return True
        except DatabaseRefused:
            raise
        except DatabaseUnavailable as exc:
            left_s = give_up_at - loop.time()
            if left_s <= 0:
                log.error(
                    "database unavailable for %.1f s at start (%s); giving up "
                    "(LEASEKEEPER_STARTUP_WAIT_S)",
                    settings.startup_wait_s,
                    exc,
                )
                return False
            delay_s = min(delay_s, left_s)
            log.warning("database unavailable at start (%s); retrying in %.1f s", exc, delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, STARTUP_RETRY_MAX_S)


async def start_when_database_answers(settings: Settings, dsn: str) -> LeaseServer | None:
    """Starts a LeaseServer, retrying while the database is out of reach (when_database_answers).

    Each failed attempt is undone (pool, listener).

    Returns:
        The serving server, or None when the database never answered in time,
        a token file or certificate cannot be used, or a listen address
        cannot be bound (each logged in one line).

    Raises:
        DatabaseRefused: the database refuses the connection for good.
    """
    from leasekeeper_server.app import LeaseServer

    started: list[LeaseServer] = []

    async def attempt() -> None:
        server = LeaseServer(settings, dsn)
        try:
            await server.start()
        except BaseException:
            await server.stop(0)
            raise
        started.append(server)

    try:
        if not await when_database_answers(settings, attempt):
            return None
    # A token file or certificate that cannot be used (ValueError); an address
    # taken since cli._check_listen_free (gRPC: RuntimeError, metrics: OSError).
    except (ValueError, RuntimeError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return None
    return started[0]


def settings_errors(exc: ValueError) -> str:
    """'LEASEKEEPER_FIELD: problem' for each error of a pydantic ValidationError."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    return "; ".join(
        f"LEASEKEEPER_{'_'.join(str(part) for part in e['loc']).upper() or 'SETTINGS'}: "
        f"{e['msg'].removeprefix('Value error, ')}"
        for e in errors()
    )


def run_service(main: Coroutine[Any, Any, int]) -> int:
    """Runs a server process's main coroutine on uvloop's event loop.

    uvloop (libuv) runs the loop's callbacks and the database driver's
    socket I/O in C; gRPC polls on its own. Every server process (``serve``,
    each ``serve --workers`` worker) runs on it.
    """
    import uvloop  # the server extra's: the thin client does not need it

    tune_gc()
    return uvloop.run(main)


# Young-generation allocations between collections, and how many collections
# of each generation before the next older one is collected.
GC_THRESHOLDS = (100_000, 50, 1000)


def tune_gc() -> None:
    """Makes the cyclic garbage collector rare, and leaves the objects of start-up out of it.

    A server holding many heartbeat streams keeps millions of long-lived
    objects; with CPython's default thresholds (700, 10, 10) a full collection
    walks all of them every few seconds and stops every stream for up to a
    second or two (measured: 20,000 streams, beat p99 1.35 s; with these
    thresholds 43-78 ms). ``gc.freeze()`` moves what exists at start-up
    (modules, settings) to a generation no collection walks (the approach the
    ``gc`` module documents for long-running servers).
    """
    import gc

    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
