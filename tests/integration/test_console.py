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
from tests.helpers import poll
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
        first = await client.claim("job-1", ttl=30)
        assert first.lease is not None
        await client.save_checkpoint("job-1", first.lease.fence, 1, b"step 1", "text/plain")
        await client.revoke("job-1", "moved to another host")
        second = await client.claim("job-1", ttl=30)
        assert second.lease is not None
        await client.validate_fence("job-1", first.lease.fence)  # a stale fence, refused
        await client.begin_effect("job-1", second.lease.fence, "email:welcome", policy="ONCE")
        await client.claim("job-2", ttl=30)

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
    pages.append(await viewer.post("/action", hidden_fields(confirm.text)))
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
        result = await viewer.post("/action", hidden_fields(confirm.text))
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
