"""`leasekeeper serve` at start: what it retries, and what it refuses at once.

A database restarting or a failover settling must not make a replica that
starts meanwhile crash with a traceback: it retries for
``LEASEKEEPER_STARTUP_WAIT_S`` seconds and serves as soon as the database
answers, or exits with status 1 and one clear line when it never does.

What no retry can fix is refused at once, in one line and no traceback: a
database URL asyncpg cannot parse, a role or database PostgreSQL does not
know (status 2, as any setting that can never work); a listen address another
process holds (status 1, naming the address and its variable, before the
database is touched). ``serve --workers 2`` says the same, in the same line.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.fault.dburl import database_address, proxied, replaced
from tests.fault.processes import server_env, spawn_server
from tests.fault.proxy import tcp_proxy
from tests.helpers import poll

pytestmark = [pytest.mark.timeout(60)]

# A start that can never succeed ends within this many seconds: well under the
# 60 s (LEASEKEEPER_STARTUP_WAIT_S's default) a database out of reach is retried.
REFUSED_WITHIN_S = 15.0


async def test_serve_waits_for_an_unreachable_database_then_serves(
    database_url: str, tmp_path: Path
) -> None:
    async with tcp_proxy(*database_address(database_url)) as proxy:
        proxy.cut()
        env = server_env(proxied(database_url, proxy.port), startup_wait_s=30, connect_timeout_s=1)
        server = await spawn_server(tmp_path, env)
        try:

            async def retried_twice() -> bool:
                assert server.proc.returncode is None, server.logs()
                return server.logs().count("database unavailable at start") >= 2

            await poll(retried_twice, "two start attempts logged", 15, 0.05)
            proxy.restore()
            await server.wait_serving(20)
        finally:
            await server.kill()
    assert "Traceback" not in server.logs()


async def test_serve_gives_up_after_startup_wait_with_one_line_and_status_1(
    database_url: str, tmp_path: Path
) -> None:
    async with tcp_proxy(*database_address(database_url)) as proxy:
        proxy.cut()
        env = server_env(proxied(database_url, proxy.port), startup_wait_s=1, connect_timeout_s=1)
        server = await spawn_server(tmp_path, env)
        try:
            code = await server.wait_exit(20)
        finally:
            await server.kill()
    logs = server.logs()
    assert code == 1, logs
    assert "Traceback" not in logs
    assert "giving up (LEASEKEEPER_STARTUP_WAIT_S)" in logs


async def _failed_start(tmp_path: Path, env: dict[str, str]) -> tuple[int, str]:
    """Runs `leasekeeper serve`, which must exit within REFUSED_WITHIN_S; (status, output)."""
    server = await spawn_server(tmp_path, env)
    try:
        code = await server.wait_exit(REFUSED_WITHIN_S)
    finally:
        await server.kill()
    return code, server.logs()


def assert_one_line(output: str, *names: str) -> None:
    """``output`` is one line, no traceback, naming each of ``names``."""
    assert "Traceback" not in output, output
    assert output.count("\n") == 1, output
    for name in names:
        assert name in output, output


@pytest.mark.parametrize("url", ["postgres://u@h:notaport/db", "nonsense", "mysql://x"])
async def test_serve_with_a_malformed_database_url_exits_2_at_once(
    url: str, tmp_path: Path
) -> None:
    code, output = await _failed_start(tmp_path, server_env(url))
    assert code == 2, output
    assert_one_line(output, "LEASEKEEPER_DATABASE_URL")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"role": "nosuchrole"}, 'role "nosuchrole" does not exist'),
        ({"database": "nosuchdatabase"}, 'database "nosuchdatabase" does not exist'),
    ],
    ids=["role", "database"],
)
@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_refused_by_the_database_exits_2_with_its_message(
    database_url: str, tmp_path: Path, change: dict[str, str], message: str, workers: int
) -> None:
    # At WARNING, so the start's INFO lines (authentication off on loopback) stay out.
    env = server_env(replaced(database_url, **change), log_level="WARNING", workers=workers)
    code, output = await _failed_start(tmp_path, env)
    assert code == 2, output
    assert_one_line(output, "LEASEKEEPER_DATABASE_URL", message)


@pytest.mark.parametrize("setting", ["listen", "health_listen", "metrics_listen"])
@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_on_a_taken_port_exits_1_naming_the_address(
    database_url: str, tmp_path: Path, setting: str, workers: int
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        # At the default INFO level, on a database that would refuse the start (exit 2):
        # the port is checked before the database is touched (no migration logged).
        env = server_env(
            replaced(database_url, role="nosuchrole"), workers=workers, **{setting: address}
        )
        code, output = await _failed_start(tmp_path, env)
    assert code == 1, output
    assert_one_line(output, f"cannot listen on {address}", f"LEASEKEEPER_{setting.upper()}")


@pytest.mark.parametrize(
    ("parameter", "message"),
    [
        ("foo=bar", 'unrecognized configuration parameter "foo"'),
        ("statement_timeout=abc", 'invalid value for parameter "statement_timeout": "abc"'),
    ],
    ids=["unknown", "bad-value"],
)
@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_with_a_url_parameter_postgres_refuses_exits_2_with_its_message(
    database_url: str, tmp_path: Path, parameter: str, message: str, workers: int
) -> None:
    # asyncpg sends a URL's unknown query parameters to PostgreSQL as settings.
    separator = "&" if "?" in database_url else "?"
    url = f"{database_url}{separator}{parameter}"
    env = server_env(url, log_level="WARNING", workers=workers)
    code, output = await _failed_start(tmp_path, env)
    assert code == 2, output
    assert_one_line(output, "LEASEKEEPER_DATABASE_URL", message)
