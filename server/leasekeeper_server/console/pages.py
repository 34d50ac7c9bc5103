"""The read-only pages: namespaces (``/``), a namespace's tasks, one task; and ``/leases.json``.

Ids come in query parameters (``/namespace?ns=...``, ``/task?ns=...&id=...``);
listings page with the API's own page tokens (``page``, ``h`` for a task's
history, ``e`` for its effects): a "next page" link, no offsets, no counts.
A namespace that holds no tasks says so, with the namespaces that do when
the viewer may list them (ListNamespaces). ``/leases.json`` gives the pages
the current state and remaining ttl of the tasks they show (``refresh.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from leasekeeper import (
    Checkpoint,
    EffectRecord,
    HistoryEntry,
    HistoryKind,
    LeaseInfo,
    NamespaceStats,
)
from leasekeeper._types import TASK_STATES
from leasekeeper_server.console import chart
from leasekeeper_server.console.refresh import Key
from leasekeeper_server.console.render import NO_STORE, page, when
from leasekeeper_server.console.runtime import Console, console_of, session_of
from leasekeeper_server.console.service import Refusal, database_now

NAMESPACE_PAGE_SIZE = 50
HISTORY_PAGE_SIZE = 100
EFFECT_PAGE_SIZE = 100
HINT_NAMESPACES = 10  # namespaces named under "holds no tasks"
HINT_PAGE_SIZE = 100  # ListNamespaces pages read for them: at most HINT_PAGES
HINT_PAGES = 10
TERMINAL = frozenset({"COMPLETED", "CANCELLED", "FAILED"})
# The figures of GetNamespaceStats, as the pages label them (field, label, what it counts).
STATS = (
    ("leases_held", "held", "leases held now"),
    ("leases_expired", "expired", "leases past their expiry, not yet granted again"),
    ("tasks_quarantined", "quarantined", "tasks whose attempts are used up"),
    ("claims_last_minute", "claims / min", "grants in the last 60 s"),
    ("stale_fences_last_minute", "stale fences / min", "stale fences refused in the last 60 s"),
    ("leases_lost_last_minute", "lost / min", "expiries, revokes, runtime exceeded, last 60 s"),
    ("effects_in_doubt", "effects in doubt", "effects reserved by a fence that is no longer live"),
)


def param(request: Request, name: str, what: str) -> str:
    """A required query parameter.

    Raises:
        Refusal: it is missing or empty (400).
    """
    value = request.query_params.get(name, "")
    if not value:
        raise Refusal(400, "Not a valid request", f"name {what} with ?{name}=")
    return value


def figures(stats: NamespaceStats | Refusal) -> list[dict[str, Any]]:
    """The figures of a NamespaceStats to show, each with its label and whether it was capped."""
    if isinstance(stats, Refusal):
        return []
    shown = []
    for field, label, title in STATS:
        value = getattr(stats, field)
        capped = bool(getattr(stats, f"{field}_capped", False))
        shown.append(
            {"field": field, "label": label, "title": title, "value": value, "capped": capped}
        )
    return shown


def stats_note(stats: NamespaceStats | Refusal) -> str:
    """Why a namespace's figures are not shown; "" when they are."""
    if isinstance(stats, Refusal):
        return f"figures not shown: {stats.code or stats.status}: {stats.message}"
    return ""


async def namespaces(request: Request) -> Response:
    """``/``: the namespaces the viewer may list, with their figures; or a form to open one."""
    console = console_of(request)
    token = session_of(request).token
    page_token = request.query_params.get("page", "")
    denied = ""
    try:
        listed, next_token = await console.service.namespaces(
            token, page_token, NAMESPACE_PAGE_SIZE
        )
    except Refusal as refusal:
        if refusal.status != 403:
            raise
        listed, next_token, denied = [], "", refusal.message
    stats = await console.service.stats_of([n.namespace for n in listed], token)
    rows = [
        {
            "namespace": info.namespace,
            "tasks": f">{info.task_count}" if info.task_count_capped else str(info.task_count),
            "figures": figures(stats[info.namespace]),
            "note": stats_note(stats[info.namespace]),
        }
        for info in listed
    ]
    return page(
        request,
        "namespaces.html",
        rows=rows,
        columns=STATS,
        next_token=next_token,
        page_token=page_token,
        denied=denied,
    )


def task_row(lease: LeaseInfo) -> dict[str, Any]:
    """A task as a row of the namespace's table (and as a live update's data)."""
    live = lease.state == "HELD" and lease.remaining_ttl > 0
    return {
        "task_id": lease.task_id,
        "state": lease.state,
        "owner_id": lease.owner_id,
        "fence": lease.fence,
        "attempts": lease.attempts,
        "max_attempts": lease.max_attempts,
        "checkpoint_version": lease.checkpoint_version,
        "remaining_ttl": lease.remaining_ttl if live else None,
        "expire_time": lease.expire_time,
        "end_reason": lease.end_reason or "",
    }


async def _stats_or_refusal(request: Request, ns: str) -> NamespaceStats | Refusal:
    try:
        return await console_of(request).service.stats(ns, session_of(request).token)
    except Refusal as refusal:
        return refusal


async def namespace(request: Request) -> Response:
    """``/namespace?ns=[&state=][&owner=][&page=]``: one page of the namespace's tasks."""
    console = console_of(request)
    token = session_of(request).token
    ns = param(request, "ns", "a namespace")
    state = request.query_params.get("state", "").upper() or None
    if state is not None and state not in TASK_STATES:
        raise Refusal(400, "Not a valid request", f"state must be one of {', '.join(TASK_STATES)}")
    owner = request.query_params.get("owner", "")
    page_token = request.query_params.get("page", "")
    stats_call = asyncio.ensure_future(_stats_or_refusal(request, ns))
    try:
        leases, next_token = await console.service.leases(
            ns,
            token,
            state=state,
            owner=owner,
            page_token=page_token,
            page_size=console.page_size,
        )
    except BaseException:
        stats_call.cancel()
        raise
    console.snapshots.allow(token, ns, "ListLeases")
    stats = await stats_call
    holds_none = not leases and state is None and not owner and not page_token
    others = await namespaces_with_tasks(console, token, ns) if holds_none else None
    return page(
        request,
        "namespace.html",
        ns=ns,
        state=state or "",
        owner=owner,
        states=TASK_STATES,
        rows=[task_row(lease) for lease in leases],
        figures=figures(stats),
        stats_note=stats_note(stats),
        as_of=None if isinstance(stats, Refusal) else stats.as_of,
        next_token=next_token,
        page_token=page_token,
        holds_none=holds_none,
        others=others,
        events={"ns": ns},
        refresh={"ns": ns, "state": state, "owner": owner, "page": page_token} if leases else None,
    )


async def namespaces_with_tasks(
    console: Console, token: str | None, ns: str
) -> dict[str, Any] | None:
    """The first namespaces that hold tasks, for "namespace X holds no tasks" (as the CLI says).

    With a token, the service leaves out of each page of ListNamespaces the
    namespaces the token does not cover (a page may be short, even empty), so
    this reads up to ``HINT_PAGES`` pages to find ``HINT_NAMESPACES``. None
    when the viewer may not list namespaces (or the call failed): the page
    then says only that the namespace holds no tasks.
    """
    found: list[dict[str, str]] = []
    page_token = ""
    try:
        for _ in range(HINT_PAGES):
            listed, page_token = await console.service.namespaces(token, page_token, HINT_PAGE_SIZE)
            found += [
                {
                    "namespace": info.namespace,
                    "tasks": f">{info.task_count}"
                    if info.task_count_capped
                    else str(info.task_count),
                }
                for info in listed
                if info.namespace != ns
            ]
            if len(found) > HINT_NAMESPACES or not page_token:
                break
    except Refusal:
        return None
    return {
        "shown": found[:HINT_NAMESPACES],
        "more": len(found) > HINT_NAMESPACES or bool(page_token),
    }


def effect_row(effect: EffectRecord, lease: LeaseInfo) -> dict[str, Any]:
    """An effect as a row; ``in_doubt``: RESERVED by a fence that is not the live lease's."""
    live_fence = lease.fence if lease.state == "HELD" else None
    return {
        **{f.name: getattr(effect, f.name) for f in dataclasses.fields(effect)},
        "result_size": len(effect.result),
        "in_doubt": effect.state == "RESERVED" and effect.fence != live_fence,
    }


def ordinal(number: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``..."""
    if number % 100 in (11, 12, 13):
        return f"{number}th"
    return f"{number}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(number % 10, 'th') }"


def _attempt_detail(entry: HistoryEntry) -> tuple[str, str, str]:
    """The ``attempt`` field as its kind means it (the proto's HistoryEntry.attempt)."""
    number = entry.attempt
    if entry.kind is HistoryKind.GRANTED:
        return "attempt", str(number), f"the {ordinal(number)} attempt: 1 + attempts used before it"
    if entry.kind is HistoryKind.QUARANTINED:
        return "attempts used", str(number), "the attempts used when the task was quarantined"
    if entry.kind is HistoryKind.EFFECT_RESERVED:
        return "effect attempts", str(number), "the effect's attempts"
    return "attempt", str(number), ""


def entry_details(entry: HistoryEntry) -> list[tuple[str, str, str]]:
    """The fields of a history entry that say something for its kind: (name, value, tooltip)."""
    details = []
    if entry.attempt:
        details.append(_attempt_detail(entry))
    if entry.checkpoint_version:
        details.append(("checkpoint version", str(entry.checkpoint_version), ""))
        details.append(("size", f"{entry.checkpoint_size} B", ""))
    if entry.effect_key:
        details.append(("effect", entry.effect_key, ""))
    if entry.effect_outcome:
        details.append(("outcome", entry.effect_outcome, ""))
    if entry.external_operation_id:
        details.append(("external operation", entry.external_operation_id, ""))
    if entry.reason:
        details.append(("reason", entry.reason, ""))
    if entry.method:
        details.append(("refused at", entry.method, ""))
    return details


def actions_for(lease: LeaseInfo) -> list[str]:
    """The operator actions that apply to the task's state (the service decides anyway)."""
    shown = []
    if lease.state in ("HELD", "EXPIRED"):
        shown.append("revoke")
    if lease.state not in TERMINAL:
        shown.append("cancel")
    if lease.state == "QUARANTINED":
        shown.append("retry")
    return shown


async def task(request: Request) -> Response:
    """``/task?ns=&id=[&h=][&e=]``: one task, its checkpoint, chart, timeline and effects."""
    console = console_of(request)
    token = session_of(request).token
    ns = param(request, "ns", "a namespace")
    task_id = param(request, "id", "a task")
    history_token = request.query_params.get("h", "")
    effects_token = request.query_params.get("e", "")
    service = console.service
    answers = await asyncio.gather(
        service.task(ns, task_id, token),
        service.history(ns, task_id, token, history_token, HISTORY_PAGE_SIZE),
        service.chart_entries(ns, task_id, token),
        service.effects(ns, task_id, token, effects_token, EFFECT_PAGE_SIZE),
        return_exceptions=True,
    )
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    found, timeline, charted, listed = answers
    assert not isinstance(found, BaseException)
    assert not isinstance(timeline, BaseException)
    assert not isinstance(charted, BaseException)
    assert not isinstance(listed, BaseException)
    lease, checkpoint = found
    console.snapshots.allow(token, ns, "GetLease")
    entries, next_history = timeline
    chart_entries, chart_cut = charted
    effects, next_effects = listed
    svg, spans = chart.fence_chart(chart_entries, database_now(lease))
    return page(
        request,
        "task.html",
        ns=ns,
        task_id=task_id,
        lease=lease,
        row=task_row(lease),
        checkpoint=_checkpoint(checkpoint),
        svg=svg,
        legend=chart.legend(spans),
        chart_cut=chart_cut,
        fences_left_out=spans.fences_left_out,
        entries=[(entry, entry_details(entry)) for entry in entries],
        history_token=history_token,
        next_history=next_history,
        effects=[effect_row(effect, lease) for effect in effects],
        effects_token=effects_token,
        next_effects=next_effects,
        actions=actions_for(lease),
        terminal=lease.state in TERMINAL,
        events={"ns": ns, "id": task_id},
        refresh=None if lease.state in TERMINAL else {"ns": ns, "id": task_id},
    )


def _checkpoint(checkpoint: Checkpoint | None) -> dict[str, Any] | None:
    if checkpoint is None:
        return None
    return {
        "version": checkpoint.version,
        "size": len(checkpoint.data),
        "content_type": checkpoint.content_type,
        "fence": checkpoint.fence,
        "write_time": checkpoint.write_time,
    }


def task_state(lease: LeaseInfo, age_s: float) -> dict[str, Any]:
    """A task as ``/leases.json`` gives it: its remaining ttl less ``age_s`` (seconds)."""
    row = task_row(lease)
    remaining = row["remaining_ttl"]
    row["remaining_ttl"] = None if remaining is None else round(max(remaining - age_s, 0.0), 3)
    row["expire_time"] = when(lease.expire_time) if lease.expire_time is not None else None
    return row


async def leases_json(request: Request) -> Response:
    """``GET /leases.json?ns=[&id=][&state=][&owner=][&page=]``: see ``refresh.py``."""
    console = console_of(request)
    token = session_of(request).token
    query = request.query_params
    task_id = query.get("id", "")
    service = console.service
    try:
        ns = param(request, "ns", "a namespace")
        if task_id:

            async def one() -> list[LeaseInfo]:
                return [await service.lease(ns, task_id, token)]

            key: Key = ("GetLease", ns, task_id)
            leases, age_s = await console.snapshots.get(key, token, ns, "GetLease", one)
        else:
            state = query.get("state", "").upper()
            if state and state not in TASK_STATES:
                raise Refusal(
                    400, "Not a valid request", f"state must be one of {', '.join(TASK_STATES)}"
                )
            owner = query.get("owner", "")
            page_token = query.get("page", "")

            async def listed() -> list[LeaseInfo]:
                found, _next = await service.leases(
                    ns,
                    token,
                    state=state or None,
                    owner=owner,
                    page_token=page_token,
                    page_size=console.page_size,
                )
                return found

            key = ("ListLeases", ns, state, owner, page_token)
            leases, age_s = await console.snapshots.get(key, token, ns, "ListLeases", listed)
    except Refusal as refusal:
        return JSONResponse(
            {"error": refusal.message, "code": refusal.code},
            status_code=refusal.status,
            headers=NO_STORE,
        )
    return JSONResponse(
        {"age_s": round(age_s, 3), "tasks": [task_state(lease, age_s) for lease in leases]},
        headers=NO_STORE,
    )
