"""The console in a real browser: Debian's Chromium, driven by Playwright, against real processes.

Every test here is marked ``browser`` (``pytest_collection_modifyitems``
below), and pyproject's ``addopts`` deselect that mark: ``make test`` runs
none of them; ``make test-browser`` runs them (``-m browser``).

The browser is ``/usr/bin/chromium`` (Debian's package ``chromium``),
launched by ``executable_path``: Playwright's own browser download is never
used. Without it the tests FAIL (a setup error saying so), they do not skip.

The server is a real ``leasekeeper serve`` process with its console on a free
loopback port, read from its log line ``leasekeeper console on http://...``.
Each test gets a fresh browser context (no cookies); every error the page
logs (console errors, uncaught exceptions, a CSP refusal) fails the test,
and so does any dialog (``alert()``). Each test saves full-page screenshots
of its key pages in ``build/screenshots/`` (``shoot``), and one of the page
it was on when it failed (``<test>-failed.png``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest
from playwright.async_api import Browser, ConsoleMessage, Dialog, Page, async_playwright, expect

from leasekeeper_server.security import tokens
from tests.fault.processes import ServerProcess, server_env, server_process
from tests.helpers import poll

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = ROOT / "build" / "screenshots"
CONSOLE_LINE = re.compile(r"leasekeeper console on (http://127\.0\.0\.1:\d+/)")
STEP_S = 20.0  # the longest one step may take on a loaded machine
EXPECT_TIMEOUT_MS = 15_000

expect.set_options(timeout=EXPECT_TIMEOUT_MS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks every test under tests/browser ``browser`` (before ``-m`` selects)."""
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.browser)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keeps each phase's report on the test, for the screenshot of a failure."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(scope="session", autouse=True)
def screenshots() -> Path:
    """``build/screenshots/``, emptied of the PNGs of an earlier run."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for old in SCREENSHOTS.glob("*.png"):
        old.unlink()
    return SCREENSHOTS


def _file_name(test_name: str) -> str:
    """A test's name as a file name: ``test_x[a-b]`` -> ``test_x-a-b``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", test_name).strip("-")


@dataclass
class Watched:
    """A page whose errors and dialogs are recorded.

    Attributes:
        page: The Playwright page.
        errors: Every console error and uncaught exception the page logged.
        dialogs: The message of every dialog that opened (none may).
        allowed: Patterns of console errors a test expects (e.g. a refused POST).
    """

    page: Page
    test_name: str
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    allowed: list[re.Pattern[str]] = field(default_factory=list)
    shots: list[Path] = field(default_factory=list)

    def allow(self, pattern: str) -> None:
        """A console error matching ``pattern`` does not fail the test."""
        self.allowed.append(re.compile(pattern))

    def unexpected(self) -> list[str]:
        """The errors no ``allow`` pattern covers."""
        return [e for e in self.errors if not any(p.search(e) for p in self.allowed)]

    async def shoot(self, what: str = "") -> Path:
        """A full-page screenshot: ``build/screenshots/<test>[-<what>].png``."""
        name = _file_name(self.test_name) + (f"-{what}" if what else "")
        path = SCREENSHOTS / f"{name}.png"
        await self.page.screenshot(path=str(path), full_page=True)
        self.shots.append(path)
        return path


def chromium_problem() -> str | None:
    """Why Debian's Chromium cannot be used; None when it can."""
    if not CHROMIUM.exists():
        return (
            f"{CHROMIUM} is missing: the browser tests need Debian's Chromium "
            "(apt-get install chromium; .ci/run installs it when run as root). Playwright's "
            "own browser download is not used."
        )
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} is not executable"
    return None


@pytest.fixture(scope="session", autouse=True)
def chromium() -> Path:
    """Debian's Chromium, checked before anything starts: a missing one fails (never a skip)."""
    problem = chromium_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    return CHROMIUM


@pytest.fixture
async def browser(chromium: Path) -> AsyncIterator[Browser]:
    """Debian's Chromium, headless, for one test."""
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=str(chromium), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
async def watched(browser: Browser, request: pytest.FixtureRequest) -> AsyncIterator[Watched]:
    """A page in a fresh context; console errors, page errors and dialogs fail the test."""
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    page = await context.new_page()
    page.set_default_timeout(EXPECT_TIMEOUT_MS)
    found = Watched(page, request.node.name)

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            found.errors.append(f"console: {message.text} at {message.location}")

    async def on_dialog(dialog: Dialog) -> None:
        found.dialogs.append(f"{dialog.type}: {dialog.message}")
        await dialog.dismiss()

    page.on("console", on_console)
    page.on("pageerror", lambda error: found.errors.append(f"pageerror: {error}"))
    page.on("dialog", on_dialog)
    try:
        yield found
        call = getattr(request.node, "report_call", None)
        if call is not None and call.failed:
            with contextlib.suppress(Exception):
                await found.shoot("failed")
    finally:
        await context.close()
    assert not found.dialogs, f"a dialog opened: {found.dialogs}"
    assert not found.unexpected(), "the page logged errors:\n" + "\n".join(found.unexpected())


@dataclass
class Served:
    """A ``leasekeeper serve`` process and its console's address."""

    process: ServerProcess
    url: str  # http://127.0.0.1:PORT/ (with the slash)

    @property
    def target(self) -> str:
        """The gRPC address, for API clients."""
        return self.process.target

    def at(self, path_and_query: str) -> str:
        """A console URL: ``at("/namespace?ns=x")``."""
        return self.url.rstrip("/") + path_and_query


@contextlib.asynccontextmanager
async def serve(log_dir: Path, database_url: str, **settings: object) -> AsyncIterator[Served]:
    """``leasekeeper serve`` with its console on a free loopback port; killed afterwards."""
    env = server_env(database_url, console_listen="127.0.0.1:0", **settings)
    async with server_process(log_dir, env) as process:

        def console_url() -> str | None:
            found = CONSOLE_LINE.search(process.logs())
            return found.group(1) if found else None

        url = await poll(console_url, "the console's log line", STEP_S, details=process.logs)
        yield Served(process, url)


@pytest.fixture
async def served(tmp_path: Path, database_url: str) -> AsyncIterator[Served]:
    """A real server (auth off: it listens on loopback) with its console."""
    async with serve(tmp_path, database_url) as running:
        yield running


@pytest.fixture
async def secured(tmp_path: Path, database_url: str) -> AsyncIterator[Served]:
    """A real server with auth on (tokens are asked for, also on loopback), with its console."""
    async with serve(tmp_path, database_url, auth="on") as running:
        yield running


async def make_token(database_url: str, role: str, *namespaces: str) -> str:
    """A new database token with ``role`` for ``namespaces`` (its text)."""
    conn = await asyncpg.connect(database_url)
    try:
        _record, token = await tokens.create_token(conn, f"browser-{role}", role, namespaces)
    finally:
        await conn.close()
    return token


@dataclass
class WorkerProcess:
    """``tests/browser/worker.py``: holds a task with ``hold()`` until it loses it."""

    proc: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)

    async def line(self, timeout_s: float = STEP_S) -> str:
        """The worker's next line on stdout ("" at its end)."""
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        text = raw.decode().rstrip("\n")
        self.lines.append(text)
        return text


@contextlib.asynccontextmanager
async def worker_process(target: str, namespace: str, task_id: str) -> AsyncIterator[WorkerProcess]:
    """Starts the worker; killed on exit if it still runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / "worker.py"),
        target,
        namespace,
        task_id,
        env=env,
        cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=None,
        start_new_session=True,
    )
    try:
        yield WorkerProcess(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
