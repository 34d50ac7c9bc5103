"""The operator console against a real server: pages, escaping, paging, CSRF, roles, SSE.

The console runs as it does in production: uvicorn on a loopback port
(``ConsoleServer``), in this test's event loop, calling a real server on
PostgreSQL through the Python client. Requests are made over HTTP with
httpx; a ``Viewer`` keeps the session cookie, sends this console's Origin
on POSTs, and records every URL and body it saw (for "no token anywhere").
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import os
import re
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import httpx
import pytest

from leasekeeper import CHANNEL_OPTIONS, LeaseClient, LeaseLost
from leasekeeper_server.console.runtime import Console
from leasekeeper_server.console.serving import ConsoleServer, address_problem, serve_beside
from leasekeeper_server.security import tokens
from tests.conftest import RunningServer, make_settings, running_server
from tests.fault.processes import leasekeeper_command
from tests.helpers import poll, seed_task_story
from tests.integration.test_tls import Authority

pytestmark = pytest.mark.timeout(90)

HOSTILE = "<script>alert(1)</script>"
ESCAPED = html.escape(HOSTILE)
CSRF_FIELD = re.compile(r'name="csrf" value="([^"]+)"')
HIDDEN = re.compile(r'<input type="hidden" name="(\w+)" value="([^"]*)"')
ROWS = re.compile(r'data-testid="task-row" data-task-id="([^"]*)"')
NEXT = re.compile(r'href="([^"]+)" rel="next" data-testid="next-page"')


@contextlib.asynccontextmanager
async def running_console(
    target: str,
    *,
    token: str | None = None,
    page_size: int = 100,
    linger_s: float = 0.2,
    recheck_s: float = 60.0,
    fresh_s: float = 2.0,
    cert: tuple[Path, Path] | None = None,
) -> AsyncIterator[ConsoleServer]:
    """A console on a free loopback port, calling ``target``; stopped afterwards."""
    channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    console = Console(
        channel,
        target=target,
        token=token,
        page_size=page_size,
        linger_s=linger_s,
        recheck_s=recheck_s,
        fresh_s=fresh_s,
        secure=cert is not None,
    )
    cert_file, key_file = cert or (None, None)
    server = ConsoleServer(
        console, "127.0.0.1:0", channel=channel, cert_file=cert_file, key_file=key_file
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class Viewer:
    """A browser without JavaScript: a cookie jar, this console's Origin, a record of all seen."""

    def __init__(self, console: ConsoleServer, verify: ssl.SSLContext | bool = True) -> None:
        self.base = console.url.rstrip("/")
        self.http = httpx.AsyncClient(base_url=self.base, timeout=20, verify=verify)
        self.seen: list[str] = []  # every URL, response header and response body

    async def close(self) -> None:
        await self.http.aclose()

    def _record(self, response: httpx.Response) -> httpx.Response:
        self.seen += [str(response.request.url), str(response.headers), response.text]
        return response

    async def get(self, path: str, **params: str) -> httpx.Response:
        return self._record(await self.http.get(path, params=params or None))

    async def csrf(self) -> str:
        found = CSRF_FIELD.search((await self.get("/signin")).text)
        assert found, "no CSRF field on the sign-in page"
        return html.unescape(found.group(1))

    async def post(
        self, path: str, data: dict[str, str], *, origin: str | None = "same"
    ) -> httpx.Response:
        headers = {} if origin is None else {"origin": self.base if origin == "same" else origin}
        return self._record(await self.http.post(path, data=data, headers=headers))

    async def sign_in(self, token: str) -> httpx.Response:
        return await self.post("/signin", {"csrf": await self.csrf(), "token": token, "next": "/"})


@pytest.fixture
async def console(server: RunningServer) -> AsyncIterator[ConsoleServer]:
    async with running_console(server.target) as running:
        yield running


@pytest.fixture
async def viewer(console: ConsoleServer) -> AsyncIterator[Viewer]:
    browser = Viewer(console)
    yield browser
    await browser.close()


def hidden_fields(page: str) -> dict[str, str]:
    return {name: html.unescape(value) for name, value in HIDDEN.findall(page)}


async def test_pages_render_namespaces_tasks_and_one_task(
    server: RunningServer, viewer: Viewer, namespace: str
) -> None:
    async with LeaseClient(server.target, namespace=namespace) as client:
        await seed_task_story(client, ttl=30)

    home = await viewer.get("/")
    assert home.status_code == 200
    assert 'data-testid="namespace-row"' in home.text

    listing = await viewer.get("/namespace", ns=namespace)
    assert listing.status_code == 200, listing.text
    assert ROWS.findall(listing.text) == ["job-1", "job-2"]
    assert listing.text.count('data-testid="ttl-countdown" data-expire="') == 2
    assert 'data-field="leases_held">2<' in listing.text  # GetNamespaceStats
    assert 'data-field="stale_fences_last_minute">1<' in listing.text
    assert f'data-events="/events?ns={namespace}"' in listing.text

    task = await viewer.get("/task", ns=namespace, id="job-1")
    assert task.status_code == 200, task.text
    text = task.text
    assert '<span class="state state-HELD" data-testid="state"' in text
    assert 'data-testid="fence" data-col="fence">2<' in text
    assert 'data-testid="fence-chart"' in text
    assert '<rect class="bar bar-revoked" data-fence="1"' in text
    assert '<rect class="bar bar-held" data-fence="2"' in text
    assert "revoked: moved to another host" in text  # the loss marker's label
    assert "refused LEASE_SUPERSEDED at ValidateFence" in text
    kinds = re.findall(r'data-testid="timeline-entry" class="kind-(\w+)"', text)
    assert kinds == [
        "GRANTED",
        "CHECKPOINT_SAVED",
        "REVOKED",
        "GRANTED",
        "FENCE_REFUSED",
        "EFFECT_RESERVED",
    ]
    assert 'data-testid="checkpoint"' in text and "text/plain" in text
    assert 'data-testid="effect-row"' in text and "email:welcome" in text
    for action in ("revoke", "cancel"):
        assert f'data-testid="action-{action}"' in text
    assert 'data-testid="action-retry"' not in text  # not quarantined


async def test_a_hostile_task_id_is_text_on_every_page(
    server: RunningServer, viewer: Viewer, namespace: str
) -> None:
    async with LeaseClient(server.target, namespace=namespace) as client:
        claimed = await client.claim(HOSTILE, ttl=30)
        assert claimed.lease is not None
        await client.revoke(HOSTILE, HOSTILE)
        await client.claim(HOSTILE, ttl=30)
    pages = [
        await viewer.get("/namespace", ns=namespace),
        await viewer.get("/task", ns=namespace, id=HOSTILE),
        await viewer.get("/task", ns=HOSTILE, id=HOSTILE),  # a namespace never used: 404
        await viewer.get("/events", ns=HOSTILE, id=HOSTILE),
    ]
    csrf = await viewer.csrf()
    form = {"csrf": csrf, "action": "revoke", "ns": namespace, "id": HOSTILE, "reason": HOSTILE}
    confirm = await viewer.post("/action", form)
    pages.append(confirm)
    done = await viewer.post("/action", hidden_fields(confirm.text))
    assert done.status_code == 303, done.text
    pages.append(await viewer.get(done.headers["location"]))
    assert [page.status_code for page in pages] == [200, 200, 404, 404, 200, 200]
    for page in pages:
        assert HOSTILE not in page.text
        assert ESCAPED in page.text, page.text
    assert 'data-testid="action-result"' in pages[-1].text


async def test_paging_follows_the_page_token(server: RunningServer, namespace: str) -> None:
    ids = [f"task-{n:02d}" for n in range(12)]
    async with LeaseClient(server.target, namespace=namespace) as client:
        await asyncio.gather(*(client.claim(task_id, ttl=30) for task_id in ids))
    async with running_console(server.target, page_size=5) as console:
        browser = Viewer(console)
        try:
            shown: list[list[str]] = []
            page = await browser.get("/namespace", ns=namespace)
            while True:
                assert page.status_code == 200
                shown.append(ROWS.findall(page.text))
                found = NEXT.search(page.text)
                if found is None:
                    break
                link = html.unescape(found.group(1))
                assert "page=" in link and "offset" not in link
                page = browser._record(await browser.http.get(link))
        finally:
            await browser.close()
    assert [len(rows) for rows in shown] == [5, 5, 2]
    assert [task_id for rows in shown for task_id in rows] == ids


async def test_a_post_without_csrf_token_is_refused_and_changes_nothing(
    server: RunningServer, viewer: Viewer, namespace: str
) -> None:
    async with LeaseClient(server.target, namespace=namespace) as client:
        await client.claim("t", ttl=30)
        before = await client.get_lease("t")
        form = {
            "action": "revoke",
            "ns": namespace,
            "id": "t",
            "reason": "forged",
            "confirm": "yes",
            "fence": str(before.fence),
        }
        no_token = await viewer.post("/action", form)
        wrong_token = await viewer.post("/action", {**form, "csrf": "x" * 43})
        csrf = await viewer.csrf()
        other_site = await viewer.post(
            "/action", {**form, "csrf": csrf}, origin="http://evil.example"
        )
        no_origin = await viewer.post("/action", {**form, "csrf": csrf}, origin=None)
        for response in (no_token, wrong_token, other_site, no_origin):
            assert response.status_code == 403, response.text
            assert 'data-testid="error"' in response.text
            assert "Nothing was done" in response.text
        after = await client.get_lease("t")
        assert (after.state, after.fence, after.revoke_reason) == ("HELD", before.fence, "")
        history = [entry.kind.value async for entry in client.iter_task_history("t")]
        assert history == ["GRANTED"]


async def test_revoke_from_the_console_reaches_the_held_lease(
    server: RunningServer, viewer: Viewer, namespace: str
) -> None:
    held = asyncio.Event()

    async def work(client: LeaseClient) -> None:
        async with client.hold("job", ttl=10) as lease:
            assert lease.fence
            held.set()
            await asyncio.sleep(60)

    async with LeaseClient(server.target, namespace=namespace) as client:
        worker = asyncio.create_task(work(client))
        await asyncio.wait_for(held.wait(), 10)
        page = await viewer.get("/task", ns=namespace, id="job")
        form = {
            **hidden_fields(page.text.split('<section class="actions">')[1]),
            "action": "revoke",
            "reason": "stuck on a bad host",
        }
        confirm = await viewer.post("/action", form)
        assert confirm.status_code == 200
        assert 'data-testid="action-confirm"' in confirm.text
        assert "LEASE_REVOKED" in confirm.text
        assert worker.done() is False  # the confirmation changes nothing
        done = await viewer.post("/action", hidden_fields(confirm.text))
        assert done.status_code == 303, done.text
        result = await viewer.get(done.headers["location"])
        assert result.status_code == 200, result.text
        assert 'data-testid="action-result" data-changed="yes"' in result.text
        assert "sees its heartbeat end ABORTED LEASE_REVOKED" in result.text
        assert "Fence 1 is refused from now on." in result.text
        with pytest.raises(LeaseLost) as lost:
            await asyncio.wait_for(worker, 10)
        assert lost.value.reason == "LEASE_REVOKED"
        lease = await client.get_lease("job")
        assert lease.revoke_reason == "stuck on a bad host"


async def test_a_task_never_claimed_is_a_404_page_not_a_traceback(
    viewer: Viewer, namespace: str
) -> None:
    page = await viewer.get("/task", ns=namespace, id="nothing-here")
    assert page.status_code == 404
    assert 'data-testid="error"' in page.text and "NOT_FOUND" in page.text
    assert "Traceback" not in page.text
    missing = await viewer.get("/namespace")
    assert missing.status_code == 400 and 'data-testid="error"' in missing.text


async def _open_stream(
    http: httpx.AsyncClient, stack: contextlib.AsyncExitStack, path: str
) -> AsyncIterator[str]:
    response = await stack.enter_async_context(http.stream("GET", path))
    assert response.status_code == 200, await response.aread()
    lines = response.aiter_lines()
    async for line in lines:
        if line == "event: ready":
            break
    return lines


async def _next_event(lines: AsyncIterator[str], name: str) -> dict[str, Any]:
    import json

    async for line in lines:
        if line == f"event: {name}":
            data = await anext(lines)
            return dict(json.loads(data.removeprefix("data: ")))
    raise AssertionError(f"the stream ended before an event {name!r}")


async def test_fifty_viewers_share_one_watch_stream_closed_after_the_last_leaves(
    server: RunningServer, console: ConsoleServer, namespace: str
) -> None:
    hub = console.console.hub
    registry = server.server.metrics.registry

    def gauge() -> float | None:
        return registry.get_sample_value("leasekeeper_watch_streams_open")

    limits = httpx.Limits(max_connections=60, max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(base_url=console.url, timeout=20, limits=limits) as http,
        contextlib.AsyncExitStack() as stack,
    ):
        streams = await asyncio.gather(
            *(_open_stream(http, stack, f"/events?ns={namespace}") for _ in range(50))
        )
        assert hub.subscribers(namespace) == 50
        assert hub.streams_open == 1
        await poll(lambda: gauge() == 1, "the server to count one Watch stream")
        async with LeaseClient(server.target, namespace=namespace) as client:
            await client.claim("live", ttl=30)
        events = await asyncio.gather(*(_next_event(lines, "task") for lines in streams))
        assert {(e["type"], e["task_id"], e["state"], e["fence"]) for e in events} == {
            ("CLAIMED", "live", "HELD", 1)
        }
        assert gauge() == 1
    # Every viewer has gone: the stream lingers linger_s (0.2 s), then closes.
    await poll(lambda: hub.subscribers(namespace) == 0, "the viewers to leave")
    await poll(lambda: hub.streams_open == 0, "the hub to close its stream")
    await poll(lambda: gauge() == 0, "the server to count no Watch stream")


async def test_events_for_one_task_check_access_and_filter(
    server: RunningServer, console: ConsoleServer, namespace: str
) -> None:
    async with LeaseClient(server.target, namespace=namespace) as client:
        await client.claim("mine", ttl=30)
        async with (
            httpx.AsyncClient(base_url=console.url, timeout=20) as http,
            contextlib.AsyncExitStack() as stack,
        ):
            lines = await _open_stream(http, stack, f"/events?ns={namespace}&id=mine")
            await client.claim("other", ttl=30)
            await client.revoke("mine", "test")
            event = await _next_event(lines, "task")
            assert (event["type"], event["task_id"]) == ("REVOKED", "mine")


async def test_static_files_make_no_session(viewer: Viewer) -> None:
    css = await viewer.get("/static/console.css")
    js = await viewer.get("/static/console.js")
    assert css.status_code == js.status_code == 200
    assert "set-cookie" not in css.headers and "set-cookie" not in js.headers
    assert "default-src 'none'" in css.headers["content-security-policy"]
    assert (await viewer.get("/static/nothing.css")).status_code == 404
    page = await viewer.get("/")
    cookie = page.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie
    assert (await viewer.get("/")).headers.get("set-cookie") is None  # the same session


async def test_https_console_sends_a_secure_cookie_and_checks_its_own_origin(
    server: RunningServer, tmp_path: Path
) -> None:
    authority = Authority.make("console-ca")
    key_pem, cert_pem = authority.issue("console", server=True)
    (tmp_path / "console.pem").write_bytes(cert_pem)
    (tmp_path / "console.key").write_bytes(key_pem)
    trust = ssl.create_default_context(cadata=authority.pem.decode())
    cert = (tmp_path / "console.pem", tmp_path / "console.key")
    async with running_console(server.target, cert=cert) as console:
        assert console.url.startswith("https://127.0.0.1:")
        viewer = Viewer(console, verify=trust)
        try:
            page = await viewer.get("/signin")
            assert page.status_code == 200
            assert "Secure" in page.headers["set-cookie"]
            csrf = await viewer.csrf()
            plain = viewer.base.replace("https://", "http://")
            refused = await viewer.post("/signout", {"csrf": csrf}, origin=plain)
            assert refused.status_code == 403
            assert (await viewer.post("/signout", {"csrf": csrf})).status_code == 303
        finally:
            await viewer.close()


# --- tokens and roles ------------------------------------------------------------------------


@pytest.fixture
async def secured(database_url: str) -> AsyncIterator[RunningServer]:
    """A server on loopback with auth=on: tokens are enforced."""
    async with running_server(database_url, auth="on") as running:
        yield running


async def test_sign_in_with_a_bad_token_fails_and_no_token_shows_anywhere(
    secured: RunningServer, db: asyncpg.Connection, namespace: str
) -> None:
    _record, admin = await tokens.create_token(db, "console-admin", "admin", ["*"])
    async with LeaseClient(secured.target, namespace=namespace, token=admin) as client:
        await client.claim("t", ttl=30)
    async with running_console(secured.target) as console:
        viewer = Viewer(console)
        try:
            anonymous = await viewer.get("/namespace", ns=namespace)
            assert anonymous.status_code == 401
            assert 'data-testid="error"' in anonymous.text and "UNAUTHENTICATED" in anonymous.text
            bogus = "lk_AAAAAAAAAA_" + "x" * 43
            refused = await viewer.sign_in(bogus)
            assert refused.status_code == 401
            assert 'data-testid="error"' in refused.text
            assert (await viewer.get("/namespace", ns=namespace)).status_code == 401

            signed = await viewer.sign_in(admin)
            assert signed.status_code == 303 and signed.headers["location"] == "/"
            listing = await viewer.get("/namespace", ns=namespace)
            assert listing.status_code == 200 and ROWS.findall(listing.text) == ["t"]
            task = await viewer.get("/task", ns=namespace, id="t")
            assert task.status_code == 200

            csrf = await viewer.csrf()
            out = await viewer.post("/signout", {"csrf": csrf})
            assert out.status_code == 303
            assert (await viewer.get("/namespace", ns=namespace)).status_code == 401
        finally:
            await viewer.close()
    # URLs (redirects included), response headers (cookies) and bodies.
    assert len(viewer.seen) >= 30
    for text in viewer.seen:
        assert admin not in text and bogus not in text


async def test_a_viewer_without_the_admin_role_gets_the_service_refusal(
    secured: RunningServer, db: asyncpg.Connection, namespace: str
) -> None:
    _record, admin = await tokens.create_token(db, "console-admin", "admin", ["*"])
    _record, worker = await tokens.create_token(db, "console-worker", "worker", [namespace])
    async with LeaseClient(secured.target, namespace=namespace, token=admin) as client:
        await client.claim("t", ttl=30)
        before = await client.get_lease("t")
        async with running_console(secured.target) as console:
            viewer = Viewer(console)
            try:
                assert (await viewer.sign_in(worker)).status_code == 303
                listing = await viewer.get("/namespace", ns=namespace)
                assert listing.status_code == 403  # ListLeases is the admin's
                assert "PERMISSION_DENIED" in listing.text
                home = await viewer.get("/")
                assert home.status_code == 200 and "Open a namespace" in home.text
                task = await viewer.get("/task", ns=namespace, id="t")
                assert task.status_code == 200  # GetLease, history, effects: the worker's too
                form = {
                    "csrf": await viewer.csrf(),
                    "action": "revoke",
                    "ns": namespace,
                    "id": "t",
                    "reason": "by hand",
                    "confirm": "yes",
                    "fence": str(before.fence),
                }
                refused = await viewer.post("/action", form)
            finally:
                await viewer.close()
        assert refused.status_code == 403, refused.text
        assert 'data-testid="error"' in refused.text
        assert "PERMISSION_DENIED" in refused.text and "Revoke" in refused.text
        after = await client.get_lease("t")
        assert (after.state, after.fence, after.revoke_reason) == ("HELD", before.fence, "")


async def test_sign_out_ends_the_live_stream(
    secured: RunningServer, db: asyncpg.Connection, namespace: str
) -> None:
    _record, admin = await tokens.create_token(db, "console-admin", "admin", ["*"])
    async with LeaseClient(secured.target, namespace=namespace, token=admin) as client:
        await client.claim("t", ttl=30)
    async with running_console(secured.target, recheck_s=0.2) as console:
        viewer = Viewer(console)
        try:
            assert (await viewer.sign_in(admin)).status_code == 303
            async with contextlib.AsyncExitStack() as stack:
                lines = await _open_stream(viewer.http, stack, f"/events?ns={namespace}")
                assert console.console.hub.streams_open == 1
                csrf = await viewer.csrf()
                assert (await viewer.post("/signout", {"csrf": csrf})).status_code == 303
                ended = await asyncio.wait_for(_next_event(lines, "end"), 10)
                assert "signed out" in ended["reason"]
            refused = await viewer.get("/events", ns=namespace)
            assert refused.status_code == 401
        finally:
            await viewer.close()
    assert admin not in "\n".join(viewer.seen)


# --- where the console may listen --------------------------------------------------------------


async def test_serve_starts_no_console_when_its_grpc_port_uses_tls(
    database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(
        database_url,
        console_listen="127.0.0.1:0",
        tls_cert_file=tmp_path / "server.pem",
        tls_key_file=tmp_path / "server.key",
    )
    with caplog.at_level(logging.INFO, logger="leasekeeper"):
        assert await serve_beside(settings, "127.0.0.1:0", 9457) is None
    assert "no console: the gRPC port uses TLS" in caplog.text
    assert await serve_beside(make_settings(database_url, console_listen="off"), "x:1", 1) is None


def test_off_loopback_needs_https_or_insecure() -> None:
    assert address_problem("127.0.0.1:9460", tls=False, insecure=False) is None
    assert address_problem("localhost:0", tls=False, insecure=False) is None
    assert address_problem("[::1]:9460", tls=False, insecure=False) is None
    assert address_problem("off", tls=False, insecure=False) is None
    assert address_problem("0.0.0.0:9460", tls=True, insecure=False) is None
    assert address_problem("0.0.0.0:9460", tls=False, insecure=True) is None
    problem = address_problem("0.0.0.0:9460", tls=False, insecure=False)
    assert problem is not None
    for name in (
        "LEASEKEEPER_CONSOLE_LISTEN",
        "LEASEKEEPER_CONSOLE_TLS_CERT_FILE",
        "LEASEKEEPER_CONSOLE_TLS_KEY_FILE",
        "LEASEKEEPER_CONSOLE_INSECURE",
    ):
        assert name in problem


@pytest.mark.parametrize(
    ("command", "environment"),
    [
        (["serve"], {"LEASEKEEPER_CONSOLE_LISTEN": "0.0.0.0:0"}),
        (["console", "--listen", "0.0.0.0:0"], {}),
    ],
)
def test_off_loopback_start_is_refused(
    tmp_path: Path, command: list[str], environment: dict[str, str]
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    env.update(environment, LEASEKEEPER_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none")
    done = subprocess.run(
        [*leasekeeper_command(), *command],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "0.0.0.0:0 is not loopback" in lines[0]
    assert "LEASEKEEPER_CONSOLE_TLS_CERT_FILE" in lines[0]
    assert ("LEASEKEEPER_CONSOLE_LISTEN" if command == ["serve"] else "--listen") in lines[0]


def test_the_leasekeeper_command_lists_console() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "leasekeeper_server.cli.main", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "console [--target HOST:PORT] [--listen HOST:PORT]" in done.stdout


# --- what a first-time user ran into ----------------------------------------------------------


def calls_of(server: RunningServer, method: str, code: str = "OK") -> float:
    """How many unary calls of ``method`` the server answered with ``code`` (its own metric)."""
    value = server.server.metrics.registry.get_sample_value(
        "leasekeeper_rpc_duration_seconds_count", {"method": method, "code": code}
    )
    return value or 0.0


async def test_the_remaining_ttl_follows_renewals(server: RunningServer, namespace: str) -> None:
    """Renewals are not Watch events: the pages ask /leases.json for the remaining ttl."""
    async with LeaseClient(server.target, namespace=namespace) as client:
        claimed = await client.claim("renewed", ttl=10)
        assert claimed.lease is not None
        fence = claimed.lease.fence
        async with running_console(server.target, fresh_s=0.2) as console:
            viewer = Viewer(console)
            try:
                listing = await viewer.get("/namespace", ns=namespace)
                assert f'data-refresh="/leases.json?ns={namespace}"' in listing.text
                task = await viewer.get("/task", ns=namespace, id="renewed")
                assert f'data-refresh="/leases.json?ns={namespace}&amp;id=renewed"' in task.text
                assert 'data-col="expire_time"' in task.text
                first = await viewer.get("/leases.json", ns=namespace, id="renewed")
                assert first.status_code == 200, first.text
                assert first.headers["cache-control"] == "no-store"
                await asyncio.sleep(1.5)
                before = (await viewer.get("/leases.json", ns=namespace)).json()["tasks"]
                await client.renew("renewed", fence, ttl=10)  # no Watch event
                await asyncio.sleep(0.3)  # longer than fresh_s: a new answer
                after = (await viewer.get("/leases.json", ns=namespace)).json()["tasks"]
                one = (await viewer.get("/leases.json", ns=namespace, id="renewed")).json()
            finally:
                await viewer.close()
    first_task = first.json()["tasks"][0]
    assert 5.0 < first_task["remaining_ttl"] <= 10.0
    assert [t["task_id"] for t in before] == ["renewed"]
    # Counted down on the service's clock: 1.5 s at least passed between the two answers.
    assert before[0]["remaining_ttl"] <= first_task["remaining_ttl"] - 1.4
    assert [(t["task_id"], t["state"], t["fence"]) for t in after] == [("renewed", "HELD", fence)]
    # Renewed for 10 s, asked 0.3 s later: back up, above where it was before the renewal.
    assert after[0]["remaining_ttl"] >= before[0]["remaining_ttl"] + 1.0
    assert after[0]["remaining_ttl"] > 5.0
    assert one["tasks"][0]["remaining_ttl"] > 5.0
    # The expiry as the task page writes it moved on with the renewal.
    assert one["tasks"][0]["expire_time"] > first_task["expire_time"]


async def test_fifty_open_pages_cost_about_one_list_leases_per_refresh(
    server: RunningServer, console: ConsoleServer, namespace: str
) -> None:
    async with LeaseClient(server.target, namespace=namespace) as client:
        await client.claim("a", ttl=30)
        await client.claim("b", ttl=30)
    viewers = [Viewer(console) for _ in range(50)]
    try:
        for viewer in viewers:  # each page checks its viewer's access with a ListLeases
            assert (await viewer.get("/namespace", ns=namespace)).status_code == 200
        assert calls_of(server, "ListLeases") >= 50
        calls = calls_of(server, "ListLeases")
        answers = await asyncio.gather(
            *(viewer.get("/leases.json", ns=namespace) for viewer in viewers)
        )
        made = calls_of(server, "ListLeases") - calls
    finally:
        for viewer in viewers:
            await viewer.close()
    assert [answer.status_code for answer in answers] == [200] * 50
    for answer in answers:
        assert [task["task_id"] for task in answer.json()["tasks"]] == ["a", "b"]
    assert made <= 2, f"{made} ListLeases calls for 50 refreshes"


async def test_shared_answers_go_only_to_viewers_the_service_allowed(
    secured: RunningServer, db: asyncpg.Connection, namespace: str
) -> None:
    _record, admin = await tokens.create_token(db, "console-admin", "admin", ["*"])
    _record, elsewhere = await tokens.create_token(db, "console-else", "admin", ["elsewhere-*"])
    _record, worker = await tokens.create_token(db, "console-worker", "worker", [namespace])
    async with LeaseClient(secured.target, namespace=namespace, token=admin) as client:
        await client.claim("secret-task", ttl=30)
    # The shared answer stays fresh all through the test: whoever may not read it must not get it.
    async with running_console(secured.target, fresh_s=60.0) as console:
        viewers = [Viewer(console) for _ in range(4)]
        admin_v, elsewhere_v, worker_v, anonymous_v = viewers
        try:
            for viewer, token in ((admin_v, admin), (elsewhere_v, elsewhere), (worker_v, worker)):
                assert (await viewer.sign_in(token)).status_code == 303
            shared = await admin_v.get("/leases.json", ns=namespace)
            one = await admin_v.get("/leases.json", ns=namespace, id="secret-task")
            refused = [
                await elsewhere_v.get("/leases.json", ns=namespace),
                await worker_v.get("/leases.json", ns=namespace),
                await anonymous_v.get("/leases.json", ns=namespace),
                await elsewhere_v.get("/leases.json", ns=namespace, id="secret-task"),
                await anonymous_v.get("/leases.json", ns=namespace, id="secret-task"),
            ]
            worker_one = await worker_v.get("/leases.json", ns=namespace, id="secret-task")
        finally:
            for viewer in viewers:
                await viewer.close()
    assert shared.status_code == one.status_code == 200
    assert [t["task_id"] for t in shared.json()["tasks"]] == ["secret-task"]
    assert [r.status_code for r in refused] == [403, 403, 401, 403, 401]
    for answer in refused:
        assert "secret-task" not in answer.text and "tasks" not in answer.json()
    assert refused[1].json()["code"] == "PERMISSION_DENIED"
    assert refused[2].json()["error"].startswith("This service needs a token.")
    # The worker role may read one task (GetLease), not list the namespace (ListLeases).
    assert worker_one.status_code == 200
    assert worker_one.json()["tasks"][0]["task_id"] == "secret-task"
    for viewer in viewers:
        for text in viewer.seen:
            assert admin not in text and elsewhere not in text and worker not in text


async def test_sign_in_when_the_service_asks_for_no_token(viewer: Viewer) -> None:
    form = await viewer.get("/signin")
    assert 'data-testid="no-token-needed"' in form.text
    assert "This service asks for no token" in form.text
    assert "<summary>Check a token anyway</summary>" in form.text
    answer = await viewer.sign_in("any-string-at-all")
    assert answer.status_code == 200, answer.text
    assert "this one was not needed: the console did not keep it" in answer.text
    assert 'class="signed"' not in answer.text
    home = await viewer.get("/")
    assert 'class="signed"' not in home.text and 'data-testid="signin-link"' in home.text


async def test_a_page_that_needs_a_token_says_how_to_get_one(
    secured: RunningServer, db: asyncpg.Connection, namespace: str
) -> None:
    _record, revoked = await tokens.create_token(db, "console-gone", "admin", ["*"])
    async with running_console(secured.target) as console:
        viewer = Viewer(console)
        try:
            anonymous = await viewer.get("/namespace", ns=namespace)
            assert (await viewer.sign_in(revoked)).status_code == 303
            token_id = tokens.token_id_of(revoked)
            assert token_id is not None and await tokens.revoke_token(db, token_id)

            async def refused_now() -> httpx.Response | None:
                page = await viewer.get("/namespace", ns=namespace)
                return page if page.status_code == 401 else None

            refused = await poll(refused_now, "the service to refuse the revoked token", 10)
            # Sign-in checks a token with a real call: a well-formed revoked one is refused.
            again = await viewer.sign_in(revoked)
        finally:
            await viewer.close()
    assert anonymous.status_code == 401
    text = anonymous.text
    assert "This service needs a token." in text
    assert f'<a href="/signin?next=%2Fnamespace%3Fns%3D{namespace}">Sign in</a> with one' in text
    assert "<code>leasekeeper tokens create</code>" in text and "Tokens and roles" in text
    assert "authorization: Bearer" not in text
    assert "UNAUTHENTICATED" in text  # the service's status, under the message
    # Signed in with a token the service no longer takes: it says so, with the service's reason.
    assert f"The service refused your token (token {token_id} is unknown" in refused.text
    assert again.status_code == 401
    assert "The service refused this token (UNAUTHENTICATED)" in again.text
    for page in (refused, again):
        assert revoked not in page.text


async def test_sign_out_goes_to_the_sign_in_page_with_a_note(viewer: Viewer) -> None:
    out = await viewer.post("/signout", {"csrf": await viewer.csrf()})
    assert out.status_code == 303 and out.headers["location"] == "/signin"
    page = await viewer.get("/signin")
    assert page.status_code == 200
    assert 'data-testid="notice"' in page.text and "Signed out." in page.text
    assert 'data-testid="error"' not in page.text
    assert "Signed out." not in (await viewer.get("/signin")).text  # said once


async def test_an_action_redirects_to_its_result_which_a_reload_does_not_repeat(
    server: RunningServer, console: ConsoleServer, viewer: Viewer, namespace: str
) -> None:
    reason = "host drained at 03:00"
    async with LeaseClient(server.target, namespace=namespace) as client:
        await client.claim("job", ttl=30)
        base = {"csrf": await viewer.csrf(), "ns": namespace, "id": "job", "reason": reason}
        confirm = await viewer.post("/action", {**base, "action": "revoke"})
        assert confirm.status_code == 200
        assert '<h1>Revoke the lease of task <span class="id">job</span>?</h1>' in confirm.text
        assert "Your reason is not sent to it" in confirm.text
        done = await viewer.post("/action", hidden_fields(confirm.text))
        assert done.status_code == 303, done.text
        location = done.headers["location"]
        assert location.startswith("/result?r=") and "job" not in location
        result = await viewer.get(location)
        reloaded = await viewer.get(location)
        for page in (result, reloaded):
            assert page.status_code == 200
            assert 'data-testid="action-result" data-changed="yes"' in page.text
            assert "<h2>What the worker sees</h2>" in page.text
            assert "The worker is not sent your reason: it sees only LEASE_REVOKED." in page.text
            assert reason not in page.text
        history = [entry async for entry in client.iter_task_history("job")]
        assert [entry.kind.value for entry in history] == ["GRANTED", "REVOKED"]
        assert history[1].reason == reason  # the reason is in the history

        # Another session cannot see this session's result.
        other = Viewer(console)
        try:
            elsewhere = await other.get(location)
        finally:
            await other.close()
        assert elsewhere.status_code == 404 and 'data-testid="error"' in elsewhere.text

        # A revoke that changes nothing: no "What the worker sees".
        again = await viewer.post("/action", {**base, "action": "revoke"})
        done = await viewer.post("/action", hidden_fields(again.text))
        unchanged = await viewer.get(done.headers["location"])
        assert 'data-testid="action-result" data-changed="no"' in unchanged.text
        assert "<h2>" not in unchanged.text

        cancel = await viewer.post("/action", {**base, "action": "cancel"})
        assert '<h1>Cancel task <span class="id">job</span> for good?</h1>' in cancel.text
        retry = await viewer.post("/action", {**base, "action": "retry"})
        assert '<h1>Put task <span class="id">job</span> back (retry)?</h1>' in retry.text
        lease = await client.get_lease("job")
        assert lease.state == "FREE"  # no confirmation was sent: nothing else changed


async def test_a_reason_of_only_spaces_links_back_to_the_task(
    server: RunningServer, viewer: Viewer, namespace: str
) -> None:
    async with LeaseClient(server.target, namespace=namespace) as client:
        await client.claim("job", ttl=30)
    form = {"csrf": await viewer.csrf(), "action": "revoke", "ns": namespace, "id": "job"}
    answer = await viewer.post("/action", {**form, "reason": "   "})
    assert answer.status_code == 400
    assert "A reason is needed" in answer.text
    back = f'<a href="/task?ns={namespace}&amp;id=job" data-testid="error-back">'
    assert f"{back}Back to the task</a>" in answer.text


async def test_the_task_page_says_attempts_used_and_last_owner(
    server: RunningServer, viewer: Viewer, namespace: str
) -> None:
    async with LeaseClient(server.target, namespace=namespace) as client:
        first = await client.claim("job", ttl=30)
        assert first.lease is not None
        await client.revoke("job", "moved")  # counts as an attempt
        second = await client.claim("job", ttl=30)
        assert second.lease is not None
        held = (await viewer.get("/task", ns=namespace, id="job")).text
        await client.release("job", second.lease.fence)
    free = (await viewer.get("/task", ns=namespace, id="job")).text
    assert "<dt data-owner-label>Owner</dt>" in held
    assert "<dt data-owner-label>Last owner</dt>" in free
    assert second.lease.owner_id in free
    assert ">Attempts used</dt>" in free and ">Attempts</dt>" not in free
    for number, nth in ((1, "1st"), (2, "2nd")):
        detail = (
            f'<span class="detail" title="the {nth} attempt: 1 + attempts used before it">'
            f'<span class="muted">attempt</span> {number}</span>'
        )
        assert detail in free


async def test_a_namespace_without_tasks_names_the_ones_with_tasks(
    secured: RunningServer, db: asyncpg.Connection, namespace: str
) -> None:
    # ListNamespaces reads namespaces by name and leaves out those the token does not cover:
    # a name that sorts before the other tests' keeps the first page of the hint about it.
    first = f"000-{namespace}"
    patterns = [first, f"{first}-*"]
    _record, admin = await tokens.create_token(db, "console-admin", "admin", patterns)
    async with LeaseClient(secured.target, namespace=first, token=admin) as client:
        await client.claim("job", ttl=30)
    async with running_console(secured.target) as console:
        viewer = Viewer(console)
        try:
            assert (await viewer.sign_in(admin)).status_code == 303
            typo = await viewer.get("/namespace", ns=f"{first}-typo")
            filtered = await viewer.get("/namespace", ns=first, state="EXPIRED")
        finally:
            await viewer.close()
    assert typo.status_code == 200
    text = typo.text
    assert 'data-testid="empty-namespace"' in text
    assert f'Namespace <span class="id">{first}-typo</span> holds no tasks.' in text
    assert "Namespaces with tasks that your token covers:" in text
    assert f'<a href="/namespace?ns={first}" class="id">{first}</a> (1)' in text
    # A filter that matches nothing is not an empty namespace.
    assert 'data-testid="empty-namespace"' not in filtered.text
    assert "No tasks match the filter" in filtered.text


async def test_a_favicon_is_served_and_linked(viewer: Viewer) -> None:
    page = await viewer.get("/")
    assert '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">' in page.text
    for path in ("/static/favicon.svg", "/favicon.ico"):
        icon = await viewer.get(path)
        assert icon.status_code == 200, path
        assert icon.headers["content-type"].startswith("image/svg+xml")
        assert icon.text.startswith("<svg") and "set-cookie" not in icon.headers
