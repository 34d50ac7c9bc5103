"""The console's pages in Chromium: they load, count down, and keep a hostile id as text."""

from __future__ import annotations

import re
import time
from urllib.parse import quote

from playwright.async_api import expect

from leasekeeper import LeaseClient
from tests.browser.conftest import Served, Watched
from tests.helpers import seed_task_story

HOSTILE = "<script>alert(1)</script>"
SECONDS = re.compile(r"^(\d+\.\d) s$")


async def test_namespaces_tasks_and_one_task_load(
    served: Served, watched: Watched, namespace: str
) -> None:
    async with LeaseClient(served.target, namespace=namespace) as client:
        await seed_task_story(client, ttl=120)
        third = await client.claim("job-3", ttl=120)
        assert third.lease is not None
        await client.release("job-3", third.lease.fence, complete=True)
        fourth = await client.claim("job-4", ttl=120)
        assert fourth.lease is not None
        await client.release("job-4", fourth.lease.fence)

    page = watched.page
    await page.goto(served.url)
    await expect(page.locator("h1")).to_have_text("Namespaces")
    row = page.locator(f'[data-testid="namespace-row"][data-namespace="{namespace}"]')
    await expect(row).to_have_count(1)
    await expect(row.locator('[data-field="leases_held"]')).to_have_text("2")
    await expect(row.locator('[data-field="stale_fences_last_minute"]')).to_have_text("1")
    await watched.shoot("namespaces")

    await row.get_by_role("link", name=namespace).click()
    await expect(page).to_have_url(served.at(f"/namespace?ns={quote(namespace, safe='')}"))
    rows = page.get_by_test_id("task-row")
    await expect(rows.get_by_test_id("task-id")).to_have_text(["job-1", "job-2", "job-3", "job-4"])
    await expect(rows.get_by_test_id("state")).to_have_text(["HELD", "HELD", "COMPLETED", "FREE"])
    await expect(rows.get_by_test_id("fence")).to_have_text(["2", "1", "1", "1"])
    await expect(page.locator("#live-status")).to_contain_text("Live")
    await watched.shoot("namespace")

    await rows.get_by_test_id("task-id").get_by_text("job-1", exact=True).click()
    await expect(page.locator("h1 [data-testid=task-id]")).to_have_text("job-1")
    summary = page.locator("section.summary")
    await expect(summary.get_by_test_id("state")).to_have_text("HELD")
    await expect(summary.get_by_test_id("fence")).to_have_text("2")
    await expect(page.get_by_test_id("checkpoint")).to_contain_text("text/plain")
    chart = page.get_by_test_id("fence-chart")
    await expect(chart.locator("svg rect.bar")).to_have_count(2)
    await expect(chart).to_contain_text("revoked: moved to another host")
    entries = page.get_by_test_id("timeline-entry")
    await expect(entries.locator(".kind")).to_have_text(
        [
            "granted",
            "checkpoint saved",
            "revoked",
            "granted",
            "fence refused",
            "effect reserved",
        ]
    )
    await expect(page.get_by_test_id("effect-row")).to_contain_text("email:welcome")
    await expect(page.get_by_test_id("action-revoke")).to_be_visible()
    await expect(page.get_by_test_id("action-cancel")).to_be_visible()
    await expect(page.get_by_test_id("action-retry")).to_have_count(0)  # not quarantined
    await expect(page.locator("#live-status")).to_contain_text("Live")
    await watched.shoot("task")


async def test_a_held_lease_counts_down_in_real_time(
    served: Served, watched: Watched, namespace: str
) -> None:
    async with LeaseClient(served.target, namespace=namespace) as client:
        claimed = await client.claim("ticking", ttl=60)  # no heartbeat: nothing renews it
        assert claimed.acquired

    page = watched.page
    await page.goto(served.at(f"/namespace?ns={quote(namespace, safe='')}"))
    countdown = page.get_by_test_id("ttl-countdown")
    await expect(countdown).to_have_text(SECONDS)
    first_text = await countdown.text_content()
    started = time.monotonic()
    assert first_text is not None
    first = float(first_text.removesuffix(" s"))
    assert 50.0 < first <= 60.0, first_text

    # Wait on the element itself until it shows at least two seconds less.
    await page.wait_for_function(
        "([el, from]) => parseFloat(el.textContent) <= from - 2.0",
        arg=[await countdown.element_handle(), first],
        polling=100,
    )
    later_text = await countdown.text_content()
    elapsed = time.monotonic() - started
    assert later_text is not None and SECONDS.match(later_text), later_text
    later = float(later_text.removesuffix(" s"))
    # It went down by about the time that passed, not faster than the real clock (the
    # first reading may be a tick old, and each is rounded to 0.1 s: a second of slack).
    assert 2.0 <= first - later <= elapsed + 1.0, (first_text, later_text, elapsed)
    await watched.shoot()


async def test_a_hostile_task_id_stays_text(
    served: Served, watched: Watched, namespace: str
) -> None:
    async with LeaseClient(served.target, namespace=namespace) as client:
        claimed = await client.claim(HOSTILE, ttl=120)
        assert claimed.lease is not None
        await client.revoke(HOSTILE, HOSTILE)  # the reason is shown too: chart and timeline
        await client.claim(HOSTILE, ttl=120)

    page = watched.page
    await page.goto(served.at(f"/namespace?ns={quote(namespace, safe='')}"))
    shown = page.get_by_test_id("task-row").get_by_test_id("task-id")
    await expect(shown).to_have_count(1)
    assert await shown.evaluate("el => el.textContent") == HOSTILE
    assert await page.locator("script").count() == 1  # console.js only
    await expect(page.locator("#live-status")).to_contain_text("Live")

    await shown.click()
    title = page.locator("h1 [data-testid=task-id]")
    await expect(title).to_have_count(1)
    assert await title.evaluate("el => el.textContent") == HOSTILE
    assert await page.locator("script").count() == 1
    await expect(page.get_by_test_id("fence-chart")).to_contain_text(f"revoked: {HOSTILE}")
    await expect(page.get_by_test_id("timeline-entry").nth(1)).to_contain_text(HOSTILE)
    await expect(page.locator("#live-status")).to_contain_text("Live")
    assert watched.dialogs == []
    await watched.shoot()
