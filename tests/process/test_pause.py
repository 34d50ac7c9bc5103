"""The paused worker, on real processes: SIGSTOP after claim, expiry, replacement, SIGCONT.

The lease service runs in the test's event loop (the ``server`` fixture); the
effect gateway and both workers are subprocesses (``examples/``). Nothing
waits for expiry with a sleep: the test polls the lease service.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from demo import Child
from gateway import read_sends
from worker import Exit

from leasekeeper import LeaseClient
from tests.process.scene import EXAMPLES_DIR, STEP_TIMEOUT_S, Scene, poll_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

TASK_ID = "contract-summary-r42"
TTL_S = 1.0
WORK_S = 1.0


class PauseScene(Scene):
    """A scene whose workers send with a fence only (``examples/worker.py``)."""

    async def start_worker(self, name: str, work_s: float, wait_s: float | None = None) -> Child:
        argv = [sys.executable, str(EXAMPLES_DIR / "worker.py"), "--name", name]
        argv += ["--target", self.target, "--gateway", self.gateway_address]
        argv += ["--namespace", self.namespace, "--task-id", TASK_ID]
        argv += ["--ttl-s", str(TTL_S), "--work-s", str(work_s)]
        argv += ["--wait-s", str(wait_s)] if wait_s is not None else []
        return await self.spawn(f"worker-{name}", argv)


@contextlib.asynccontextmanager
async def scene(target: str, namespace: str, workdir: Path) -> AsyncIterator[PauseScene]:
    running = PauseScene(target, namespace, workdir)
    try:
        yield running
    finally:
        await running.close()


def heartbeat_endings(caplog: pytest.LogCaptureFixture, namespace: str) -> list[str]:
    """The server's log of heartbeat streams it ended (with ABORTED) in ``namespace``."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "leasekeeper_server.rpc.heartbeat"
        and r.getMessage().startswith("heartbeat ends:")
        and repr(namespace) in r.getMessage()
    ]


@pytest.mark.parametrize(
    ("ledger_only", "refused_by"),
    [(False, "leasekeeper check"), (True, "ledger")],
    ids=["interceptor-and-ledger", "ledger-only"],
)
async def test_paused_worker_resumed_after_replacement_sends_is_refused(
    server, namespace, tmp_path, caplog, ledger_only, refused_by
):
    caplog.set_level(logging.INFO, logger="leasekeeper_server.rpc.heartbeat")
    async with (
        scene(server.target, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace) as client,
    ):
        gateway = await s.start_gateway(*(["--ledger-only"] if ledger_only else []))

        a = await s.start_worker("A", work_s=WORK_S)
        claimed = await a.wait_for(r"claimed .*fence=(\d+)")
        assert claimed.group(1) == "1"

        async def renewed() -> bool:
            lease = await client.get_lease(TASK_ID)
            return lease.expire_time > lease.claim_time + timedelta(seconds=TTL_S)

        # Freeze A only once its heartbeat stream has renewed the lease: hold() returns
        # before the stream is open, and a worker frozen earlier has no stream to end.
        await poll_until(renewed)
        assert server.server.heartbeats.open_streams == 1
        a.signal(signal.SIGSTOP)

        # Expiry, judged by the database; the server ends A's heartbeat stream on its
        # own (A is frozen: it cannot have half-closed).
        async def expired() -> bool:
            return (await client.get_lease(TASK_ID)).state == "EXPIRED"

        async def no_heartbeat_streams() -> bool:
            return server.server.heartbeats.open_streams == 0

        await poll_until(expired)
        await poll_until(no_heartbeat_streams)
        endings = heartbeat_endings(caplog, namespace)
        assert len(endings) == 1 and "fence=1" in endings[0], endings
        assert re.match(r"heartbeat ends: LEASE_(EXPIRED|SUPERSEDED) ", endings[0])

        b = await s.start_worker("B", work_s=0.0, wait_s=STEP_TIMEOUT_S)
        assert await b.exit_code(STEP_TIMEOUT_S) == Exit.SENT, s.stderr_of(b)
        assert b.has(r"claimed .*fence=2")
        assert b.has(r"send accepted fence=2 send_id=1 status=accepted")

        a.signal(signal.SIGCONT)
        assert await a.exit_code(STEP_TIMEOUT_S) == Exit.REFUSED_LEASE_LOST, s.stderr_of(a)
        assert a.has(r"send REFUSED fence=1 code=ABORTED")
        lost = await a.wait_for(r"LeaseLost reason=(\S+)")
        assert lost.group(1) in {"LEASE_SUPERSEDED", "LEASE_EXPIRED"}
        # What A's client saw of its stream: the server's ABORTED if it read it before
        # its own trust deadline passed, otherwise nothing (the deadline decides alone).
        seen = await a.wait_for(r"heartbeat stream(?: ended code=(\S+)|: no end status read)")
        assert seen.group(1) in {None, "ABORTED"}

        check = await client.validate_fence(TASK_ID, 1)
        assert not check.valid
        assert check.reason == "LEASE_SUPERSEDED"
        assert check.current_fence == 2

        refusal = rf"REFUSED {re.escape(namespace)}/{TASK_ID} fence=1 by {refused_by}"
        assert gateway.has(refusal), gateway.lines
        accepted = [line for line in gateway.lines if "ACCEPTED" in line]
        assert len(accepted) == 1 and "fence=2" in accepted[0]

    sends = read_sends(s.ledger_path)
    assert [(row["namespace"], row["task_id"], row["fence"]) for row in sends] == [
        (namespace, TASK_ID, 2)
    ]
    assert "worker B" in sends[0]["message"]


def test_demo_runs_the_scenario_and_exits_zero():
    env = {k: v for k, v in os.environ.items() if k != "LEASEKEEPER_DATABASE_URL"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / "demo.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for key_line in (
        r"worker A: claimed task=\S+ fence=1",
        r"frozen with SIGSTOP",
        r"state EXPIRED",
        r"worker B: claimed task=\S+ fence=2",
        r"gateway: ACCEPTED \S+ fence=2",
        r"gateway: REFUSED \S+ fence=1 by leasekeeper check: ABORTED",
        r"worker A: send REFUSED fence=1",
        r"worker A: LeaseLost reason=LEASE_(SUPERSEDED|EXPIRED)",
        r"valid=False reason=LEASE_SUPERSEDED current_fence=2",
        r"table \| send_id=1 \S+ fence=2",
        # Act 2: A killed after its send, before CompleteEffect; B reconciles, sends nothing.
        r"worker A: begin effect_key='summary' fence=1 -> PROCEED",
        r"worker A: at after-effect",
        r"worker B: begin effect_key='summary' fence=2 -> IN_DOUBT",
        r"worker B: reconcile: found send_id=2 fence=1 count=1",
        r"worker B: exit 5 \(RECONCILED\)",
        r"ledger \| effect_key='summary' state=SUCCEEDED fence=1 complete_fence=2 ",
        # Act 3: A saves checkpoints 1-2, is killed in step 3; B resumes at 3 from checkpoint 2.
        r"worker A: step 2 done: .* checkpoint 2 saved with it \(fence 1\)",
        r"worker A: in step 3",
        r"worker B: claimed task=\S+ fence=2 .*checkpoint=2 -> starting at step 3",
        r"SaveCheckpoint fence=1 -> (LEASE_SUPERSEDED|TASK_COMPLETED)",
        r"worker B: exit 0 \(COMPLETED\)",
        r"history \| COMPLETED +fence=2",
        r"demo OK",
    ):
        assert re.search(key_line, out), f"missing /{key_line}/ in:\n{out}"
    assert "FAILED" not in out
    # Exactly one send per act: act 1's by fence 2, act 2's by A's fence 1 (not repeated by B).
    sends = re.findall(r"table \| send_id=\d+ task=\S+/(\S+) fence=(\d+)", out)
    run = "quarterly-report-r44"  # act 3: parts 1-2 by A's fence, 3-4 by B's, each once
    assert sends == [
        ("contract-summary-r42", "2"),
        ("contract-summary-r43", "1"),
        *[(run, "1"), (run, "1"), (run, "2"), (run, "2")],
    ], out
    assert not re.search(r"worker B: send ", out.split("Act 2")[1].split("Act 3")[0])
    assert not re.search(r"worker B: step [12] done", out.split("Act 3")[1])
