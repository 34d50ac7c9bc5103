"""The console in real processes: beside `leasekeeper serve`, alone with `leasekeeper console`.

Ports are never guessed: every address is port 0, read back from the
process's own log line (``leasekeeper console on http://HOST:PORT/``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from leasekeeper import LeaseClient
from tests.fault.processes import (
    ServerProcess,
    leasekeeper_command,
    server_env,
    server_process,
    spawn_server,
)
from tests.helpers import poll

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

CONSOLE_LINE = re.compile(r"leasekeeper console on (http://127\.0\.0\.1:(\d+)/)")
STEP_S = 20.0


def console_url(logs: str) -> str | None:
    found = CONSOLE_LINE.search(logs)
    return found.group(1) if found else None


async def tasks_shown(url: str, namespace: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        page = await http.get("/namespace", params={"ns": namespace})
    assert page.status_code == 200, page.text
    return re.findall(r'data-testid="task-row" data-task-id="([^"]*)"', page.text)


async def test_serve_logs_the_console_address_and_the_page_answers(
    tmp_path: Path, database_url: str, namespace: str
) -> None:
    env = server_env(database_url, console_listen="127.0.0.1:0")
    async with server_process(tmp_path, env) as server:
        url = await poll(lambda: console_url(server.logs()), "the console's line", STEP_S)
        assert server.logs().count("leasekeeper console on") == 1
        async with LeaseClient(server.target, namespace=namespace) as client:
            await client.claim("seen-in-the-browser", ttl=30)
        assert await tasks_shown(url, namespace) == ["seen-in-the-browser"]
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            home = await http.get("/")
            assert home.status_code == 200 and "<h1>Namespaces</h1>" in home.text
            css = await http.get("/static/console.css")
            assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
            # A viewer's live updates are open when SIGTERM comes: they end, the drain goes on.
            async with http.stream("GET", "/events", params={"ns": namespace}) as live:
                lines = live.aiter_lines()
                assert await anext(lines) == "event: ready"
                server.send_signal(signal.SIGTERM)
                rest = [line async for line in lines]
                assert "event: end" in rest and any("the console is stopping" in r for r in rest)
        assert await server.wait_exit(STEP_S) == 0, server.logs()
        assert "leasekeeper stopped" in server.logs()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            await http.get("/")


async def test_serve_without_a_console(tmp_path: Path, database_url: str) -> None:
    env = server_env(database_url, console_listen="off")
    async with server_process(tmp_path, env) as server:
        assert "leasekeeper console on" not in server.logs()


@contextlib.asynccontextmanager
async def console_process(
    log_dir: Path, env: dict[str, str], *args: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, Path]]:
    """``leasekeeper console ARGS``, its output in a file; killed on exit if still running."""
    log_path = log_dir / f"console-{time.monotonic_ns()}.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            *leasekeeper_command(),
            "console",
            *args,
            env=env,
            cwd=log_dir,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
        )
    try:
        yield proc, log_path
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_leasekeeper_console_serves_a_running_server(
    tmp_path: Path, database_url: str, namespace: str
) -> None:
    env = server_env(database_url, console_listen="off")
    async with server_process(tmp_path, env) as server:
        async with LeaseClient(server.target, namespace=namespace) as client:
            await client.claim("alone", ttl=30)
        console_env = {k: v for k, v in env.items() if k != "LEASEKEEPER_DATABASE_URL"}
        async with console_process(
            tmp_path, console_env, "--target", server.target, "--listen", "127.0.0.1:0"
        ) as (proc, log_path):
            url = await poll(
                lambda: console_url(log_path.read_text()),
                "the console's line",
                STEP_S,
                details=log_path.read_text,
            )
            assert await tasks_shown(url, namespace) == ["alone"]
            assert f"console calls the server at {server.target}" in log_path.read_text()
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), STEP_S) == 0, log_path.read_text()


async def test_a_taken_console_address_exits_1(tmp_path: Path, database_url: str) -> None:
    env = server_env(database_url, console_listen="127.0.0.1:0")
    async with server_process(tmp_path, env) as server:
        url = await poll(lambda: console_url(server.logs()), "the console's line", STEP_S)
        taken = url.removeprefix("http://").rstrip("/")
        async with console_process(tmp_path, dict(env), "--listen", taken) as (proc, log_path):
            assert await asyncio.wait_for(proc.wait(), STEP_S) == 1
            assert f"cannot listen on {taken}" in log_path.read_text()


async def test_serve_with_workers_runs_one_console_in_the_supervisor(
    tmp_path: Path, database_url: str, namespace: str
) -> None:
    env = server_env(database_url, console_listen="127.0.0.1:0", workers=2)
    server: ServerProcess = await spawn_server(tmp_path, env)
    try:
        url = await poll(lambda: console_url(server.logs()), "the console's line", 40.0)
        logs = server.logs()
        assert logs.count("leasekeeper console on") == 1
        assert re.search(r"with 2 workers", logs), logs
        target = re.search(r"leasekeeper listening on (\S+)", logs)
        assert target is not None
        async with LeaseClient(target.group(1), namespace=namespace) as client:
            await client.claim("w", ttl=30)
        assert await tasks_shown(url, namespace) == ["w"]
        server.send_signal(signal.SIGTERM)
        assert await server.wait_exit(STEP_S + 10) == 0, server.logs()
    finally:
        await server.kill()
