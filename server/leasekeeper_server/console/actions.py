"""The operator's actions: revoke, cancel, retry; each with a reason and a confirmation.

``POST /action`` without ``confirm``: checks the form (CSRF token, Origin),
reads the task and shows what the action will do, with a button that sends
the same form again with ``confirm=yes``; a revoke is pinned to the fence
shown (a lease granted meanwhile is not revoked). With ``confirm=yes`` the
action is sent to the service with the viewer's token, its outcome is kept
in the viewer's session under a new random id, and the answer is a 303 to
``GET /result?r=<id>`` (POST-redirect-GET: Back and Reload show the result
again and never send the action again). The result page says what changed
and, when a worker held the lease, what it sees: the loss reason
(LEASE_REVOKED, TASK_CANCELLED), never the operator's reason, which goes to
the task's history and the audit log. The service decides who may act: a
refusal (PERMISSION_DENIED without the admin role) is shown as a 403 page;
every error page of an action links back to its task.
"""

from __future__ import annotations

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from leasekeeper import LeaseInfo
from leasekeeper_server.console.csrf import checked_form
from leasekeeper_server.console.render import page, url
from leasekeeper_server.console.runtime import console_of, session_of
from leasekeeper_server.console.service import Refusal
from leasekeeper_server.console.sessions import MAX_RESULTS

ACTIONS = ("revoke", "cancel", "retry")
MAX_REASON_BYTES = 1024  # the service's limit on a reason


def _holder(lease: LeaseInfo) -> str:
    return f"its holder (owner {lease.owner_id}, fence {lease.fence})"


def preview(action: str, lease: LeaseInfo) -> list[str]:
    """What the action will do to the task and its worker, before it is confirmed."""
    state, fence = lease.state, lease.fence
    if action == "revoke":
        if state == "HELD":
            return [
                f"The lease of fence {fence} ends at once: {_holder(lease)} hears it on its "
                "heartbeat, which ends ABORTED LEASE_REVOKED (hold() raises LeaseLost "
                "LEASE_REVOKED). Your reason is not sent to it: it goes to the task's history "
                "and the audit log.",
                f"Fence {fence} is refused from then on (ValidateFence, BeginEffect, "
                "CompleteEffect, SaveCheckpoint); the next claim gets a new fence.",
                _attempt_note(lease),
            ]
        if state == "EXPIRED":
            return [
                f"The lease of fence {fence} has expired already; the revoke records it as "
                "revoked, with your reason. The next claim gets a new fence.",
            ]
        return [f"The task holds no lease to revoke (state {state}): nothing will change."]
    if action == "cancel":
        sentences = [
            "The task becomes CANCELLED, for good: every fence of it is refused from then on "
            "and claims are refused (TASK_CANCELLED). Its checkpoint is kept."
        ]
        if state == "HELD":
            sentences.insert(
                0,
                f"{_holder(lease).capitalize()} hears it at once: its heartbeat ends ABORTED "
                "TASK_CANCELLED (hold() raises LeaseLost TASK_CANCELLED). Your reason is not "
                "sent to it: it goes to the task's history and the audit log.",
            )
        if state == "CANCELLED":
            return ["The task is cancelled already: nothing will change (its reason stays)."]
        if state in ("COMPLETED", "FAILED"):
            return [f"The task has ended ({state}): the service refuses to cancel it."]
        return sentences
    if state != "QUARANTINED":
        return [f"The task is not quarantined (state {state}): the service refuses a retry."]
    return [
        f"The task becomes FREE with attempts used reset to 0 (now {lease.attempts}). No worker "
        "holds it; the next claim is granted with a higher fence and receives the kept "
        "checkpoint."
    ]


def _attempt_note(lease: LeaseInfo) -> str:
    if lease.max_attempts and lease.attempts + 1 >= lease.max_attempts:
        return (
            f"The revoked grant counts as an attempt ({lease.attempts + 1} of "
            f"{lease.max_attempts}): the task becomes QUARANTINED until a retry."
        )
    return "The revoked grant counts as an attempt."


def _reason_note(action: str, before: LeaseInfo) -> str:
    """Where the operator's reason goes: never to the worker (it sees only the loss reason)."""
    entry = {"revoke": "REVOKED", "cancel": "CANCELLED", "retry": "RETRIED"}[action]
    where = f"the task's history (its {entry} entry) and the service's audit log"
    if action != "retry" and before.state == "HELD":
        loss = "LEASE_REVOKED" if action == "revoke" else "TASK_CANCELLED"
        return f"The worker is not sent your reason: it sees only {loss}. The reason is in {where}."
    return f"Your reason is in {where}."


def outcome(
    action: str, before: LeaseInfo, after: LeaseInfo, changed: bool, fence: int = 0
) -> tuple[str, str, list[str]]:
    """The result page's headline, its sub-heading ("" when nothing changed), and its lines."""
    task = after.task_id
    held = before.state == "HELD"
    heading = ("What the worker sees" if held else "What changed") if changed else ""
    if action == "revoke":
        if not changed:
            return (
                "Nothing changed",
                "",
                [
                    f"Task {task} held no lease of fence {fence or before.fence} to revoke "
                    f"(state {after.state}, current fence {after.fence})."
                ],
            )
        lines = [f"Fence {fence or before.fence} is refused from now on."]
        if held:
            lines.insert(
                0,
                f"{_holder(before).capitalize()} sees its heartbeat end ABORTED LEASE_REVOKED "
                "(hold() raises LeaseLost LEASE_REVOKED); it must stop and commit nothing.",
            )
        lines.append(
            f"The task is {after.state} (attempts used {after.attempts}"
            + (f" of {after.max_attempts}" if after.max_attempts else "")
            + ")."
            + (" No claim is granted until a retry." if after.state == "QUARANTINED" else "")
            + (" The next claim gets a new fence." if after.state == "FREE" else "")
        )
        lines.append(_reason_note(action, before))
        return f"Revoked fence {fence or before.fence} of task {task}", heading, lines
    if action == "cancel":
        if not changed:
            return (
                "Nothing changed",
                "",
                [f"Task {task} was cancelled already; its reason stays: {after.cancel_reason}"],
            )
        lines = [
            "The task is CANCELLED for good: every fence of it is refused and claims are "
            "refused TASK_CANCELLED. Its checkpoint is kept."
        ]
        if held:
            lines.insert(
                0,
                f"{_holder(before).capitalize()} sees its heartbeat end ABORTED TASK_CANCELLED "
                "(hold() raises LeaseLost TASK_CANCELLED).",
            )
        lines.append(_reason_note(action, before))
        return f"Cancelled task {task}", heading, lines
    checkpoint = (
        f"the kept checkpoint (version {after.checkpoint_version})"
        if after.checkpoint_version
        else "no checkpoint (none was saved)"
    )
    return (
        f"Put task {task} back",
        "What happens next",
        [
            f"The task is {after.state} with attempts used {after.attempts}. No worker holds it: "
            f"the next claim is granted with a higher fence than {after.fence} and receives "
            f"{checkpoint}.",
            _reason_note(action, before),
        ],
    )


async def act(request: Request) -> Response:
    """``POST /action``: the confirmation page, or (``confirm=yes``) the action, then a 303."""
    form = await checked_form(request)
    ns = str(form.get("ns", ""))
    task_id = str(form.get("id", ""))
    try:
        return await _act(request, form, ns, task_id)
    except Refusal as refusal:
        if refusal.back is None and ns and task_id:
            refusal.back = (url("/task", ns=ns, id=task_id), "Back to the task")
        raise


async def _act(request: Request, form: FormData, ns: str, task_id: str) -> Response:
    console = console_of(request)
    session = session_of(request)
    token = session.token
    action = str(form.get("action", ""))
    reason = str(form.get("reason", "")).strip()
    if action not in ACTIONS or not ns or not task_id:
        raise Refusal(400, "Not a valid request", "the form names no action, namespace or task")
    if not reason:
        raise Refusal(
            400,
            "A reason is needed",
            f"Say why you {action} the task (spaces alone are no reason): the reason is "
            "recorded in the task's history and the audit log.",
        )
    if len(reason.encode()) > MAX_REASON_BYTES:
        raise Refusal(400, "Reason too long", f"at most {MAX_REASON_BYTES} bytes of UTF-8")
    try:
        fence = int(str(form.get("fence", "0")) or "0")
    except ValueError as exc:
        raise Refusal(400, "Not a valid request", "fence must be a whole number") from exc
    service = console.service
    before = await service.lease(ns, task_id, token)
    if form.get("confirm") != "yes":
        return page(
            request,
            "confirm.html",
            action=action,
            ns=ns,
            task_id=task_id,
            reason=reason,
            lease=before,
            fence=before.fence if action == "revoke" else 0,
            preview=preview(action, before),
        )
    if action == "revoke":
        changed, after = await service.revoke(ns, task_id, token, reason, fence)
    elif action == "cancel":
        after = await service.cancel(ns, task_id, token, reason)
        changed = before.state != "CANCELLED"
    else:
        after = await service.retry(ns, task_id, token, reason)
        changed = True
    headline, heading, lines = outcome(action, before, after, changed, fence)
    result_id = session.keep_result(
        {
            "action": action,
            "ns": ns,
            "task_id": task_id,
            "changed": changed,
            "headline": headline,
            "heading": heading,
            "lines": lines,
            "after": {
                "state": after.state,
                "fence": after.fence,
                "attempts": after.attempts,
                "max_attempts": after.max_attempts,
            },
        }
    )
    # POST-redirect-GET: Back and Reload show the result again; they never send the action again.
    return RedirectResponse(url("/result", r=result_id), status_code=303)


async def result(request: Request) -> Response:
    """``GET /result?r=``: the result of one of this session's actions, as recorded."""
    result_id = request.query_params.get("r", "")
    kept = session_of(request).results.get(result_id) if result_id else None
    if kept is None:
        raise Refusal(
            404,
            "No such result",
            "The console keeps the result of an action only in the session that did it (its "
            f"newest {MAX_RESULTS}): this one is not kept (another browser, a sign-in or "
            "sign-out since, or a restart of the console). The task's page shows its state now.",
        )
    return page(request, "result.html", **kept)
