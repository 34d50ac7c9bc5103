"""``GET /events?ns=[&id=]``: live updates of a namespace (or one task), as Server-Sent Events.

The viewer's access is checked first with the viewer's own token: ListLeases
(one task) for a namespace, GetLease for a task; a refusal is answered with
its status (401, 403), before any stream. Then the viewer shares the
namespace's one Watch stream (``hub.py``). Events:

- ``ready``: subscribed; updates follow.
- ``task``: a task changed: JSON with the event ``type`` and the task's row
  (``task_id``, ``state``, ``owner_id``, ``fence``, ``attempts``,
  ``max_attempts``, ``checkpoint_version``, ``remaining_ttl`` seconds or
  null, ``end_reason``).
- ``gap``: events may have been missed (the stream was reopened, or this
  viewer read too slowly): reload to see the current state.
- ``end``: the updates end (JSON ``reason``): the viewer signed out, the
  service refused the token, or the console is stopping.

Every ``recheck_s`` seconds (60 by default) the stream checks again that
the viewer's session exists (a sign-out ends it; an open stream counts as
use of the session) and that the service still allows the viewer's token
the same read; otherwise it ends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from leasekeeper_server.console.pages import param, task_row
from leasekeeper_server.console.runtime import console_of, session_of
from leasekeeper_server.console.service import Refusal

PING_S = 15


async def events(request: Request) -> Response:
    """The stream of updates (see the module docstring)."""
    console = console_of(request)
    session = session_of(request)
    token = session.token
    ns = param(request, "ns", "a namespace")
    task_id = request.query_params.get("id", "")

    async def check() -> None:
        if task_id:
            await console.service.lease(ns, task_id, token)
        else:
            await console.service.leases(
                ns, token, state=None, owner="", page_token="", page_size=1
            )

    async def still_allowed() -> str:
        """Why the stream must end now; "" when it may go on."""
        if console.sessions.get(session.id) is None:
            return "the session ended (signed out, or unused too long)"
        try:
            await check()
        except Refusal as refusal:
            return f"{refusal.code or refusal.status}: {refusal.message}"
        return ""

    await check()
    hub = console.hub

    async def stream() -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        async with hub.subscribe(ns, token) as subscription:
            yield {"event": "ready", "data": json.dumps({"namespace": ns})}
            check_at = loop.time() + console.recheck_s
            while True:
                try:
                    update = await asyncio.wait_for(
                        anext(subscription), max(check_at - loop.time(), 0.0)
                    )
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    why = await still_allowed()
                    if why:
                        yield {"event": "end", "data": json.dumps({"reason": why})}
                        return
                    check_at = loop.time() + console.recheck_s
                    continue
                if update.ended:
                    yield {"event": "end", "data": json.dumps({"reason": update.ended})}
                    return
                event = update.event
                if event is None or event.lease is None:
                    yield {"event": "gap", "data": "{}"}
                    continue
                if task_id and event.lease.task_id != task_id:
                    continue
                row = task_row(event.lease)
                row.pop("expire_time")
                yield {"event": "task", "data": json.dumps({"type": event.type, **row})}

    return EventSourceResponse(stream(), ping=PING_S, headers={"Cache-Control": "no-store"})
