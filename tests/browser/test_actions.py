"""Operator actions from the page: a revoke reaches a real worker; without admin, refused."""

from __future__ import annotations

from urllib.parse import quote

from playwright.async_api import expect

from leasekeeper import LeaseClient
from tests.browser.conftest import Served, Watched, make_token, worker_process


def task_url(served: Served, namespace: str, task_id: str) -> str:
    return served.at(f"/task?ns={quote(namespace, safe='')}&id={quote(task_id, safe='')}")


async def test_a_revoke_from_the_page_reaches_the_worker(
    served: Served, watched: Watched, namespace: str
) -> None:
    async with worker_process(served.target, namespace, "nightly-report") as worker:
        assert await worker.line() == "held 1"
        page = watched.page
        await page.goto(task_url(served, namespace, "nightly-report"))
        await expect(page.locator("section.summary").get_by_test_id("state")).to_have_text("HELD")

        await page.get_by_test_id("action-reason").fill("the report host is being drained")
        await page.get_by_test_id("action-revoke").click()
        # The confirmation page says what will happen, before anything does.
        await expect(page.locator("h1")).to_contain_text("nightly-report")
        await expect(page.locator("ul.consequences")).to_contain_text("LEASE_REVOKED")
        await expect(page.get_by_test_id("action-confirm")).to_have_text("Revoke fence 1")
        assert worker.proc.returncode is None  # not revoked yet

        await page.get_by_test_id("action-confirm").click()
        result = page.get_by_test_id("action-result")
        await expect(result).to_have_attribute("data-changed", "yes")
        await expect(result.locator("h1")).to_have_text("Revoked fence 1 of task nightly-report")
        await expect(result).to_contain_text("LeaseLost LEASE_REVOKED")
        await expect(result).to_contain_text("Fence 1 is refused from now on")
        await watched.shoot()

        # The real worker process hears it on its heartbeat and stops.
        assert await worker.line() == "LeaseLost LEASE_REVOKED"
        assert await worker.proc.wait() == 0

    async with LeaseClient(served.target, namespace=namespace) as client:
        lease = await client.get_lease("nightly-report")
    assert lease.revoke_reason == "the report host is being drained"
    assert lease.end_reason == "LEASE_REVOKED"


async def test_a_viewer_without_the_admin_role_cannot_act(
    secured: Served, watched: Watched, namespace: str, database_url: str
) -> None:
    admin = await make_token(database_url, "admin", "*")
    worker = await make_token(database_url, "worker", namespace)
    async with LeaseClient(secured.target, namespace=namespace, token=admin) as client:
        claimed = await client.claim("payroll", ttl=120)
        assert claimed.lease is not None

    page = watched.page
    await page.goto(secured.at("/signin"))
    await page.get_by_test_id("signin-token").fill(worker)
    await page.get_by_test_id("signin-submit").click()
    await expect(page.get_by_test_id("signout")).to_be_visible()
    assert worker not in page.url

    # The worker role may read the task (GetLease, ListTaskHistory, ListEffects)...
    await page.goto(task_url(secured, namespace, "payroll"))
    await expect(page.locator("section.summary").get_by_test_id("fence")).to_have_text("1")

    # ...but not revoke it, even with the form posted by hand with the page's own CSRF token.
    watched.allow(r"Failed to load resource: .* 403 \(Forbidden\)")
    answer = await page.evaluate(
        """async ([ns, id]) => {
            const csrf = document.querySelector('input[name="csrf"]').value;
            const body = new URLSearchParams({
                csrf, action: "revoke", ns, id, reason: "posted by hand", fence: "1",
                confirm: "yes",
            });
            const response = await fetch("/action", {method: "POST", body});
            return {status: response.status, text: await response.text()};
        }""",
        [namespace, "payroll"],
    )
    assert answer["status"] == 403, answer["text"]
    assert "PERMISSION_DENIED" in answer["text"]
    assert 'data-testid="action-result"' not in answer["text"]

    # The same through the page's own buttons: the service's refusal is what is shown.
    await page.get_by_test_id("action-reason").fill("through the buttons")
    await page.get_by_test_id("action-revoke").click()
    await page.get_by_test_id("action-confirm").click()
    error = page.get_by_test_id("error")
    await expect(error.locator("h1")).to_have_text("Not allowed")
    await expect(error).to_contain_text("PERMISSION_DENIED")
    await expect(error).to_contain_text("HTTP 403")
    await watched.shoot()

    # The lease is as it was: same holder, same fence, no revoke recorded.
    async with LeaseClient(secured.target, namespace=namespace, token=admin) as client:
        lease = await client.get_lease("payroll")
        history = [entry async for entry in client.iter_task_history("payroll")]
    assert (lease.state, lease.fence, lease.owner_id) == ("HELD", 1, claimed.lease.owner_id)
    assert lease.revoke_reason == ""
    assert [entry.kind.value for entry in history] == ["GRANTED"]
