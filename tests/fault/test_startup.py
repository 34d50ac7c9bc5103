"""`leasekeeper serve` started while the database is out of reach: it waits, then serves or exits 1.

A database restarting or a failover settling must not make a replica that
starts meanwhile crash with a traceback: it retries for
``LEASEKEEPER_STARTUP_WAIT_S`` seconds and serves as soon as the database
answers, or exits with status 1 and one clear line when it never does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fault.dburl import database_address, proxied
from tests.fault.processes import server_env, spawn_server
from tests.fault.proxy import tcp_proxy
from tests.helpers import poll

pytestmark = [pytest.mark.timeout(60)]


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
