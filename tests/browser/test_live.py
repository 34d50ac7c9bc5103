"""Live updates: a change made by another client shows on an open page, without a reload."""

from __future__ import annotations

import re
from urllib.parse import quote

from playwright.async_api import expect

from leasekeeper import LeaseClient
from tests.browser.conftest import Served, Watched


async def test_a_claim_by_another_client_shows_without_reload(
    served: Served, watched: Watched, namespace: str
) -> None:
    async with LeaseClient(served.target, namespace=namespace) as client:
        first = await client.claim("import-batch", ttl=60)
        assert first.lease is not None
        await client.release("import-batch", first.lease.fence)

    page = watched.page
    await page.goto(served.at(f"/namespace?ns={quote(namespace, safe='')}"))
    row = page.get_by_test_id("task-row")
    await expect(row.get_by_test_id("state")).to_have_text("FREE")
    await expect(row.get_by_test_id("fence")).to_have_text("1")
    await expect(row.get_by_test_id("ttl-countdown")).to_have_text("—")
    # Subscribed: from here on every change is sent to the page.
    await expect(page.locator("#live-status")).to_have_text("Live: changes appear as they happen.")
    # The page is never loaded again: a reload would show as a second "load".
    loads: list[str] = []
    page.on("load", lambda _page: loads.append(page.url))

    async with LeaseClient(served.target, namespace=namespace) as other:
        second = await other.claim("import-batch", ttl=60)
        assert second.lease is not None and second.lease.fence == 2
        await expect(row.get_by_test_id("state")).to_have_text("HELD")
        await expect(row.get_by_test_id("fence")).to_have_text("2")
        await expect(row.locator('[data-col="owner_id"]')).to_have_text(second.lease.owner_id)
        await expect(row.get_by_test_id("ttl-countdown")).to_have_text(re.compile(r"^\d+\.\d s$"))

        # A task that was not on the page when it loaded is announced (a reload lists it).
        await other.claim("import-batch-2", ttl=60)
        await expect(page.locator("#live-status")).to_have_text(
            re.compile(r"^1 change\(s\) to tasks not on this page\. Reload to see them\.$")
        )
        await expect(page.get_by_test_id("task-row")).to_have_count(1)
        await watched.shoot()
    assert loads == []


async def test_a_renewed_lease_keeps_counting_from_its_renewed_ttl(
    served: Served, watched: Watched, namespace: str
) -> None:
    """Renewals are not live-update events: the page asks for the remaining ttls itself.

    The countdown is watched in the page for two ttls (an observation window, not
    a wait for a result): it must never say "expiry due" while the worker renews.
    """
    ttl_s = 6.0  # a heartbeat every 2 s
    async with LeaseClient(served.target, namespace=namespace) as worker:
        async with worker.hold("renewed", ttl=ttl_s):
            page = watched.page
            await page.goto(served.at(f"/namespace?ns={quote(namespace, safe='')}"))
            countdown = page.get_by_test_id("ttl-countdown")
            await expect(countdown).to_have_text(re.compile(r"^\d+\.\d s$"))
            # Watch the countdown for two ttls, in the page: any "expiry due" is kept.
            seen = await page.evaluate(
                """([el, ms]) => new Promise((resolve) => {
                    const seen = new Set();
                    const start = performance.now();
                    const look = () => {
                        seen.add(el.textContent.includes("expiry due") ? "due" : "running");
                        if (performance.now() - start >= ms) {
                            resolve(Array.from(seen));
                        } else {
                            setTimeout(look, 50);
                        }
                    };
                    look();
                })""",
                [await countdown.element_handle(), 2 * ttl_s * 1000],
            )
            assert seen == ["running"], "the countdown of a renewed lease reached expiry due"
            await expect(page.get_by_test_id("task-row").get_by_test_id("state")).to_have_text(
                "HELD"
            )
            await watched.shoot()
