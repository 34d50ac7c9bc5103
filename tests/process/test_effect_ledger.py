"""The effect ledger's failure cases, on real processes.

The lease service runs in the test's event loop (the ``server`` fixture, so
its effect counters can be read); the effect gateway (``examples/gateway.py``,
with its leasekeeper fence check, without ``--dedupe``: it repeats a send as a
real vendor would) and the workers (``examples/ledger_worker.py``) are
subprocesses. A worker is stopped at a step with its own SIGSTOP
(``--stop-at``), then SIGKILLed, or resumed with SIGCONT once its lease has
expired. Nothing waits with a sleep: the test waits for output lines, exit
codes, and polls the lease service, each with a bounded timeout.

Every test checks what the outside system saw (the gateway's ``sends``
table: exactly one send, or none), what the ledger recorded (ListEffects),
the server's effect counters, and each worker's exit code and ledger calls.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from demo import Child
from gateway import read_sends
from ledger_worker import Exit

from leasekeeper import EffectRecord, LeaseClient
from tests.process.scene import EXAMPLES_DIR, STEP_TIMEOUT_S, Scene, poll_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]

TASK_ID = "contract-summary-r42"
EFFECT_KEY = "summary"
TTL_S = 1.0
LIVE_TTL_S = 5.0  # where no lease is meant to expire: a loaded machine cannot end it early
EFFECT_EVENTS = ("begun", "proceed", "already_applied", "in_doubt", "applied", "failed", "refused")


class LedgerScene(Scene):
    """A scene whose workers send through the effect ledger (``examples/ledger_worker.py``)."""

    async def start_worker(self, name: str, *flags: str, ttl_s: float = TTL_S) -> Child:
        """A ledger worker; it waits for the task as long as a step may take."""
        argv = [sys.executable, str(EXAMPLES_DIR / "ledger_worker.py"), "--name", name]
        argv += ["--target", self.target, "--gateway", self.gateway_address]
        argv += ["--namespace", self.namespace, "--task-id", TASK_ID]
        argv += ["--ttl-s", str(ttl_s), "--wait-s", str(STEP_TIMEOUT_S), *flags]
        return await self.spawn(f"worker-{name}", argv)

    async def finished(self, worker: Child) -> int:
        """The worker's exit code, waiting for it at most a step's timeout."""
        return await worker.exit_code(STEP_TIMEOUT_S)

    def sends(self) -> list[tuple[str, str, int, str]]:
        """The outside system's record: (namespace, task_id, fence, effect_key) per send."""
        return [
            (row["namespace"], row["task_id"], row["fence"], row["effect_key"])
            for row in read_sends(self.ledger_path)
        ]

    def gateway_lines(self, word: str) -> list[str]:
        assert self.gateway is not None
        return [line for line in self.gateway.lines if f"gateway: {word} " in line]


@contextlib.asynccontextmanager
async def scene(
    server, namespace: str, workdir: Path, *gateway_flags: str
) -> AsyncIterator[LedgerScene]:
    """A scene with its gateway started; every process is stopped on exit."""
    running = LedgerScene(server.target, namespace, workdir)
    try:
        await running.start_gateway(*gateway_flags)
        yield running
    finally:
        await running.close()


async def wait_expired(client: LeaseClient) -> None:
    """Poll the lease service until the task's lease is EXPIRED (database clock)."""

    async def expired() -> bool:
        return (await client.get_lease(TASK_ID)).state == "EXPIRED"

    await poll_until(expired)


async def the_effect(client: LeaseClient) -> EffectRecord:
    """The task's one effect, as ListEffects answers."""
    effects, token = await client.list_effects(TASK_ID)
    assert token == "" and [e.effect_key for e in effects] == [EFFECT_KEY]
    return effects[0]


def shape(effect: EffectRecord) -> tuple[str, int, int, int, bytes]:
    """(state, fence, complete_fence, attempts, result) of an effect record."""
    return (effect.state, effect.fence, effect.complete_fence, effect.attempts, effect.result)


def counters(server) -> dict[str, int]:
    """The server's effect counters that are not zero (the server is this test's own)."""
    metrics = server.server.metrics
    counts = {event: int(metrics.effects_count(event)) for event in EFFECT_EVENTS}
    return {event: count for event, count in counts.items() if count}


def ledger_calls(worker: Child) -> list[str]:
    """The worker's effect-ledger calls and answers, without the worker's name."""
    pattern = re.compile(r"^worker \w+: ((?:begin|complete) .*)$")
    return [m.group(1) for line in worker.lines if (m := pattern.match(line))]


def begin(fence: int, answer: str) -> str:
    return f"begin effect_key='summary' fence={fence} -> {answer}"


def complete(outcome: str, fence: int, answer: str) -> str:
    return f"complete {outcome} effect_key='summary' fence={fence} -> {answer}"


def record(state: str, fence: int, complete_fence: int, attempts: int, result: str) -> str:
    return (
        f"state={state} fence={fence} complete_fence={complete_fence} "
        f"attempts={attempts} result={result!r}"
    )


RECONCILED_ABSENT = "reconciled: the outside system has no record of the effect"


# --- 1. paused after PROCEED, replaced, resumed ----------------------------------------------


async def test_worker_paused_after_begin_is_replaced_and_its_late_send_and_completion_are_refused(
    server, namespace, tmp_path
):
    async with (
        scene(server, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace) as client,
    ):
        a = await s.start_worker("A", "--stop-at", "after-begin")
        await a.wait_for(r"at after-begin$")
        assert ledger_calls(a) == [begin(1, "PROCEED " + record("RESERVED", 1, 0, 1, ""))]
        await wait_expired(client)  # A is frozen: its lease ends by its ttl

        b = await s.start_worker("B")
        assert await s.finished(b) == Exit.RESENT, s.stderr_of(b)
        assert ledger_calls(b) == [
            begin(2, "IN_DOUBT " + record("RESERVED", 1, 0, 1, "")),
            complete("FAILED", 2, "recorded " + record("FAILED", 1, 2, 1, RECONCILED_ABSENT)),
            begin(2, "PROCEED " + record("RESERVED", 2, 0, 2, "")),
            complete("SUCCEEDED", 2, "recorded " + record("SUCCEEDED", 2, 2, 2, "1")),
        ]
        assert b.has(r"reconcile: not found$")
        assert b.has(r"send accepted fence=2 send_id=1 status=accepted$")

        a.signal(signal.SIGCONT)
        assert await s.finished(a) == Exit.FENCED, s.stderr_of(a)
        # Which fence check refused A, exactly: the gateway's leasekeeper check refused
        # the send, then the ledger refused the FAILED outcome A tried to record.
        assert a.has(r"send REFUSED fence=1 code=ABORTED reason=LEASE_SUPERSEDED$")
        assert ledger_calls(a)[1:] == [
            complete("FAILED", 1, "REFUSED code=ABORTED reason=LEASE_SUPERSEDED")
        ]
        refusals = s.gateway_lines("REFUSED")
        assert len(refusals) == 1, refusals
        assert f"{namespace}/{TASK_ID} fence=1 by leasekeeper check: ABORTED" in refusals[0]
        assert len(s.gateway_lines("LOOKUP")) == 1

        assert shape(await the_effect(client)) == ("SUCCEEDED", 2, 2, 2, b"1")
    assert s.sends() == [(namespace, TASK_ID, 2, EFFECT_KEY)]
    assert counters(server) == {
        "begun": 3,
        "proceed": 2,
        "in_doubt": 1,
        "failed": 1,
        "applied": 1,
        "refused": 1,
    }


async def test_old_attempt_cannot_land_between_the_replacements_lookup_and_its_send(
    server, namespace, tmp_path
):
    """Reconciling must be a fenced read: once B was told "not found", A's send is refused.

    The gateway runs with --ledger-only: its fence table is the only check, so
    nothing but the fenced Lookup can refuse A's late send.
    """
    async with (
        scene(server, namespace, tmp_path, "--ledger-only") as s,
        LeaseClient(server.target, namespace=namespace) as client,
    ):
        a = await s.start_worker("A", "--stop-at", "after-begin")
        await a.wait_for(r"at after-begin$")
        await wait_expired(client)
        b = await s.start_worker("B", "--stop-at", "after-reconcile")
        await b.wait_for(r"at after-reconcile$")  # B was told: not found

        a.signal(signal.SIGCONT)  # A's attempt arrives after B's lookup, before B's send
        assert await s.finished(a) == Exit.FENCED, s.stderr_of(a)
        assert a.has(r"send REFUSED fence=1 code=ABORTED reason=FENCE_BELOW_ACCEPTED$")
        b.signal(signal.SIGCONT)
        assert await s.finished(b) == Exit.RESENT, s.stderr_of(b)
    assert s.sends() == [(namespace, TASK_ID, 2, EFFECT_KEY)]


# --- 2. killed between the effect and CompleteEffect -----------------------------------------


async def test_worker_killed_after_the_send_is_reconciled_by_its_replacement_not_repeated(
    server, namespace, tmp_path
):
    async with (
        scene(server, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace) as client,
    ):
        a = await s.start_worker("A", "--stop-at", "after-effect")
        await a.wait_for(r"at after-effect$")
        assert a.has(r"send accepted fence=1 send_id=1 status=accepted$")
        a.signal(signal.SIGKILL)
        assert await s.finished(a) == -signal.SIGKILL

        b = await s.start_worker("B")  # waits out A's ttl
        assert await s.finished(b) == Exit.RECONCILED, s.stderr_of(b)
        assert ledger_calls(b) == [
            begin(2, "IN_DOUBT " + record("RESERVED", 1, 0, 1, "")),
            complete("SUCCEEDED", 2, "recorded " + record("SUCCEEDED", 1, 2, 1, "1")),
        ]
        assert b.has(r"reconcile: found send_id=1 fence=1 count=1$")
        assert not b.has(r": send ")  # B sent nothing
        assert len(s.gateway_lines("LOOKUP")) == 1

        assert shape(await the_effect(client)) == ("SUCCEEDED", 1, 2, 1, b"1")
    assert s.sends() == [(namespace, TASK_ID, 1, EFFECT_KEY)]
    assert counters(server) == {"begun": 2, "proceed": 1, "in_doubt": 1, "applied": 1}


# --- 3. a send that times out after the outside system may have accepted it ------------------


@pytest.mark.parametrize(
    ("fault", "exit_code", "calls", "sends", "final"),
    [
        pytest.param(
            ["--lose-reply"],
            Exit.RECONCILED,
            [
                begin(1, "PROCEED " + record("RESERVED", 1, 0, 1, "")),
                begin(1, "IN_DOUBT " + record("RESERVED", 1, 0, 1, "")),
                complete("SUCCEEDED", 1, "recorded " + record("SUCCEEDED", 1, 1, 1, "1")),
            ],
            1,
            ("SUCCEEDED", 1, 1, 1, b"1"),
            id="reply-lost-found",
        ),
        pytest.param(
            ["--lose-request"],
            Exit.RESENT,
            [
                begin(1, "PROCEED " + record("RESERVED", 1, 0, 1, "")),
                begin(1, "IN_DOUBT " + record("RESERVED", 1, 0, 1, "")),
                complete("FAILED", 1, "recorded " + record("FAILED", 1, 1, 1, RECONCILED_ABSENT)),
                begin(1, "PROCEED " + record("RESERVED", 1, 0, 2, "")),
                complete("SUCCEEDED", 1, "recorded " + record("SUCCEEDED", 1, 1, 2, "1")),
            ],
            1,
            ("SUCCEEDED", 1, 1, 2, b"1"),
            id="request-lost-not-found-one-more-attempt",
        ),
        pytest.param(
            ["--lose-request", "2"],
            Exit.IN_DOUBT,
            [
                begin(1, "PROCEED " + record("RESERVED", 1, 0, 1, "")),
                begin(1, "IN_DOUBT " + record("RESERVED", 1, 0, 1, "")),
                complete("FAILED", 1, "recorded " + record("FAILED", 1, 1, 1, RECONCILED_ABSENT)),
                begin(1, "PROCEED " + record("RESERVED", 1, 0, 2, "")),
            ],
            0,
            ("RESERVED", 1, 0, 2, b""),
            id="request-lost-twice-no-third-attempt",
        ),
    ],
)
async def test_send_timed_out_is_reconciled_before_at_most_one_more_attempt(
    server, namespace, tmp_path, fault, exit_code, calls, sends, final
):
    async with (
        scene(server, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace) as client,
    ):
        a = await s.start_worker("A", *fault, ttl_s=LIVE_TTL_S)
        assert await s.finished(a) == exit_code, s.stderr_of(a)
        assert ledger_calls(a) == calls
        assert len(s.gateway_lines("LOOKUP")) == sum("IN_DOUBT" in call for call in calls)
        assert shape(await the_effect(client)) == final
    assert s.sends() == [(namespace, TASK_ID, 1, EFFECT_KEY)] * sends


async def test_send_reply_lost_left_in_doubt_is_reconciled_by_the_replacement(
    server, namespace, tmp_path
):
    async with (
        scene(server, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace) as client,
    ):
        a = await s.start_worker("A", "--lose-reply", "--retries", "0", ttl_s=LIVE_TTL_S)
        assert await s.finished(a) == Exit.IN_DOUBT, s.stderr_of(a)
        assert a.has(r"send accepted fence=1 send_id=1 status=accepted$")
        assert a.has(r"released$")
        assert shape(await the_effect(client)) == ("RESERVED", 1, 0, 1, b"")

        b = await s.start_worker("B", ttl_s=LIVE_TTL_S)
        assert await s.finished(b) == Exit.RECONCILED, s.stderr_of(b)
        assert ledger_calls(b) == [
            begin(2, "IN_DOUBT " + record("RESERVED", 1, 0, 1, "")),
            complete("SUCCEEDED", 2, "recorded " + record("SUCCEEDED", 1, 2, 1, "1")),
        ]
        assert b.has(r"reconcile: found send_id=1 fence=1 count=1$")
        assert shape(await the_effect(client)) == ("SUCCEEDED", 1, 2, 1, b"1")
    assert s.sends() == [(namespace, TASK_ID, 1, EFFECT_KEY)]
    assert counters(server) == {"begun": 2, "proceed": 1, "in_doubt": 1, "applied": 1}


# --- 4. killed at every step in turn ---------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "b_exit", "b_begins", "sent_by", "final"),
    [
        ("before-begin", Exit.SENT, ["PROCEED"], 2, ("SUCCEEDED", 2, 2, 1, b"1")),
        ("after-begin", Exit.RESENT, ["IN_DOUBT", "PROCEED"], 2, ("SUCCEEDED", 2, 2, 2, b"1")),
        ("after-effect", Exit.RECONCILED, ["IN_DOUBT"], 1, ("SUCCEEDED", 1, 2, 1, b"1")),
        (
            "after-complete",
            Exit.ALREADY_APPLIED,
            ["ALREADY_APPLIED"],
            1,
            ("SUCCEEDED", 1, 1, 1, b"1"),
        ),
    ],
    ids=["before-begin", "after-begin", "after-effect", "after-complete"],
)
async def test_worker_killed_at_each_step_the_outside_system_sees_one_send(
    server, namespace, tmp_path, step, b_exit, b_begins, sent_by, final
):
    async with (
        scene(server, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace) as client,
    ):
        a = await s.start_worker("A", "--stop-at", step)
        await a.wait_for(rf"at {step}$")
        a.signal(signal.SIGKILL)
        assert await s.finished(a) == -signal.SIGKILL

        b = await s.start_worker("B")  # A never released: B waits out its ttl
        assert await s.finished(b) == b_exit, s.stderr_of(b)
        assert b.has(r"claimed task=\S+ fence=2 ")
        decisions = [
            call.split(" -> ")[1].split()[0] for call in ledger_calls(b) if "begin" in call
        ]
        assert decisions == b_begins
        assert b.has(r": send accepted fence=2 ") == (sent_by == 2)
        assert len(s.gateway_lines("LOOKUP")) == b_begins.count("IN_DOUBT")
        assert shape(await the_effect(client)) == final
    assert s.sends() == [(namespace, TASK_ID, sent_by, EFFECT_KEY)]


# --- 5. a step that outlives its lease -------------------------------------------------------


async def test_step_outliving_its_lease_cannot_complete_its_effect(server, namespace, tmp_path):
    async with (
        scene(server, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace) as client,
    ):
        a = await s.start_worker("A", "--stop-at", "after-effect")
        await a.wait_for(r"at after-effect$")
        await wait_expired(client)  # no replacement: the fence is still the current one

        a.signal(signal.SIGCONT)
        assert await s.finished(a) == Exit.FENCED, s.stderr_of(a)
        assert ledger_calls(a) == [
            begin(1, "PROCEED " + record("RESERVED", 1, 0, 1, "")),
            complete("SUCCEEDED", 1, "REFUSED code=ABORTED reason=LEASE_EXPIRED"),
        ]
        assert a.has(r"LeaseLost reason=LEASE_EXPIRED$")

        assert shape(await the_effect(client)) == ("RESERVED", 1, 0, 1, b"")
        lease = await client.get_lease(TASK_ID)
        assert (lease.state, lease.fence) == ("FREE", 1)  # released by its hold, expired
    assert s.sends() == [(namespace, TASK_ID, 1, EFFECT_KEY)]
    assert counters(server) == {"begun": 1, "proceed": 1, "refused": 1}
