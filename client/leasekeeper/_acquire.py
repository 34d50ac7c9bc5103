"""hold()'s acquisition: claim a task, letting the server wait for it when asked to.

While another owner holds the task, ``hold(wait=...)`` sends one ``Claim`` with
``wait`` set to the time it has left: the server answers when the task is
granted (woken by the database's announcement of a release, revoke, completion
or expiry) or when that wait is over. The client does not poll. A caller's wait
longer than one Claim may ask for (:data:`CLAIM_WAIT_MAX_S`, or less when the
server refuses it) is covered by a fresh Claim as each one's wait runs out.

Retried with exponential backoff and full jitter, within the caller's wait:

* UNAVAILABLE (a server restarting, or shutting down: a waiting Claim ends
  SHUTTING_DOWN and waits again on whichever replica answers), DEADLINE_EXCEEDED
  and CANCELLED, after which the outcome is unknown: every attempt carries the
  acquisition's one request id, so a claim that was granted (its reply lost)
  comes back as the same lease and fence;
* a not-acquired answer that came before the wait it asked for was over: that
  server did not wait (one older than ``ClaimRequest.wait``), so the client polls
  as such a server needs, never sleeping past the holder's remaining ttl;
* a task this client already holds in another ``hold()``: counted as held by
  another owner without asking the server (see ``LeaseHold``).

A grant that came out of a wait is confirmed before it is used when the wait
took more than half of its remaining ttl: the client measures its trust in a
lease from the instant it sent the Claim (the grant happened somewhere inside
the wait, and only the send time is certainly before it), so a long wait
would leave the lease too little trust, or none (a grant after a holder's
1 s lease ran out, answered a second after the Claim was sent, is already
past its trust deadline). The confirmation is a Claim without ``wait`` and with
the same request id: the server hands the same lease back, read now, and the
trust counts from its send time.
"""

from __future__ import annotations

import asyncio

import grpc

from ._backoff import Backoff
from ._owner import new_request_id
from ._ports import HoldingClient
from ._types import ClaimResult
from .errors import ClaimTimeout, InvalidArgument, LeaseError, LeaseUnavailable, NotAcquired

CLAIM_BACKOFF_INITIAL_S = 0.05
"""Upper bound of the first retry delay, in seconds (doubling up to CLAIM_BACKOFF_MAX_S)."""
CLAIM_BACKOFF_MAX_S = 2.0
"""Upper bound of every retry delay, in seconds."""
CLAIM_WAIT_MAX_S = 60.0
"""The longest wait one Claim asks the server for, in seconds: the server's default
``max_claim_wait_s``. A server configured lower refuses it (INVALID_ARGUMENT on ``wait``):
the acquisition then asks for half as long, down to CLAIM_WAIT_MIN_S."""
CLAIM_WAIT_MIN_S = 1.0
"""Below this many seconds, a server that refused every wait is polled instead (no wait)."""
# Codes after which a claim's outcome is unknown or it never ran: retried with
# the same request id (a granted claim comes back as the same lease). CANCELLED:
# a replica shutting down cancels calls it had not yet handed to the service.
_CLAIM_RETRY_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


async def acquire(
    client: HoldingClient,
    task_id: str,
    *,
    ttl_s: float | None,
    max_runtime_s: float | None,
    wait_s: float | None,
    max_attempts: int = 0,
) -> ClaimResult:
    """Claim ``task_id`` for ``client``, waiting up to ``wait_s`` seconds for it.

    On return the task is marked held by this client (``client._mark_held``);
    the caller unmarks it when the lease ends. Every exception leaves it unmarked.

    Args:
        client: The client (its claim and its set of tasks held).
        task_id: The task.
        ttl_s: The lease's ttl in seconds; None for the server's default.
        max_runtime_s: The runtime budget in seconds; None for the server's maximum.
        wait_s: Seconds to wait while another owner holds the task; None: one attempt.
        max_attempts: The attempt limit the grant carries; 0: the namespace's default.

    Returns:
        The granted claim (``acquired`` True).

    Raises:
        NotAcquired: ``wait_s`` None and the task is held by another owner.
        ClaimTimeout: Still held by another owner after ``wait_s`` seconds.
        LeaseUnavailable: UNAVAILABLE on the last attempt allowed.
        LeaseError: DEADLINE_EXCEEDED or CANCELLED on the last attempt allowed,
            or another refusal (TaskEnded, TaskQuarantined, InvalidArgument,
            LimitExceeded, ...).

    """
    clock = client.clock
    deadline = None if wait_s is None else clock() + wait_s
    backoff = Backoff(CLAIM_BACKOFF_INITIAL_S, CLAIM_BACKOFF_MAX_S)
    # One logical claim, however many attempts: a retry of an attempt that was
    # granted (reply lost) gets that lease back instead of superseding it.
    request_id = new_request_id()
    asked_max_s: float | None = CLAIM_WAIT_MAX_S  # None: the server refuses waits, poll
    confirming = False  # the next Claim confirms a grant that came out of a long wait
    while True:
        hint_s: float | None = None
        back_off = True
        if client._mark_held(task_id):
            server_wait_s = None if confirming else _server_wait_s(deadline, clock(), asked_max_s)
            try:
                result = await client._claim(
                    task_id,
                    ttl_s,
                    max_runtime_s,
                    request_id=request_id,
                    wait=server_wait_s,
                    deadline_past_wait=True,
                    max_attempts=max_attempts,
                )
            except InvalidArgument as error:
                client._unmark_held(task_id)
                if server_wait_s is None or error.field != "wait":
                    raise
                # The server's max_claim_wait_s is below this wait; nothing was claimed.
                halved_s = server_wait_s / 2
                asked_max_s = halved_s if halved_s >= CLAIM_WAIT_MIN_S else None
                back_off = False
            except LeaseError as error:
                client._unmark_held(task_id)
                unknown = isinstance(error, LeaseUnavailable) or error.code in _CLAIM_RETRY_CODES
                if not unknown or deadline is None or clock() >= deadline:
                    raise
            except BaseException:
                client._unmark_held(task_id)
                raise
            else:
                if result.acquired:
                    if server_wait_s is None or not _waited_long(result, clock()):
                        return result
                    # Confirm it at once, without waiting (module docstring), even
                    # past the caller's deadline: the task is this client's.
                    client._unmark_held(task_id)
                    confirming = True
                    continue
                confirming = False
                client._unmark_held(task_id)
                hint_s = result.holder_remaining_ttl
                # A server that waited its whole wait answers after it: ask again at once.
                waited = server_wait_s is not None and clock() - result.send_time >= server_wait_s
                back_off = not waited
        if deadline is None:
            raise NotAcquired(
                f"task {task_id!r} is held by another owner",
                task_id=task_id,
                holder_remaining_ttl=hint_s,
            )
        left_s = deadline - clock()
        if left_s <= 0:
            raise ClaimTimeout(
                f"task {task_id!r} still held by another owner after {wait_s} s",
                task_id=task_id,
                holder_remaining_ttl=hint_s,
            )
        if back_off:
            await asyncio.sleep(min(backoff.next_delay_s(hint_s), left_s))


def _waited_long(result: ClaimResult, now: float) -> bool:
    """True when a granted Claim's reply came after half of the lease's remaining ttl.

    The trust deadline counts from the send time (``_trust``), so such a grant
    leaves less than half its ttl to act on, or nothing.
    """
    assert result.lease is not None
    return now - result.send_time > result.lease.remaining_ttl / 2


def _server_wait_s(deadline: float | None, now: float, asked_max_s: float | None) -> float | None:
    """Seconds the next Claim asks the server to wait: what is left, at most ``asked_max_s``.

    None (answer at once) without a deadline, once it has passed, or when the
    server refuses every wait (``asked_max_s`` None).
    """
    if deadline is None or asked_max_s is None or deadline <= now:
        return None
    return min(deadline - now, asked_max_s)
