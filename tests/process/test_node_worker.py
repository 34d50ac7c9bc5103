"""The Node.js worker (``examples/node/worker.mjs``) against the real server and gateway.

The proto is the contract for every language: the worker loads
``protos/leasekeeper/v1/lease_service.proto`` with ``@grpc/proto-loader`` and
``@grpc/grpc-js``, claims, heartbeats, sends its fence to the demo gateway
(``examples/gateway.py``, a process), runs steps with a checkpoint saved after
each, and after its lease is taken away sends (and saves a checkpoint) once more
with its old fence, which the gateway (and the lease service) refuses. A worker
killed after step 2 is followed by another owner that resumes at step 3 from the
checkpoint its grant carries. The lease service runs in the test's event loop;
nothing waits with a fixed sleep.

Node and the example's npm packages are required: ``make test`` installs the
packages (``npm ci`` in ``examples/node``) before it runs the tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from demo import Child
from gateway import read_sends

from leasekeeper import LeaseClient
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.process.scene import EXAMPLES_DIR, STEP_TIMEOUT_S, Scene, poll_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

NODE_DIR = EXAMPLES_DIR / "node"
WORKER = NODE_DIR / "worker.mjs"
TASK_ID = "report-r7"
TTL_S = 1.0
HOLD_S = 60.0  # the worker's "work" outlasts the test: only the loss ends it
LOSS_REASONS = {"LEASE_SUPERSEDED", "LEASE_EXPIRED"}
REFUSED_AFTER_LOSS = 3  # the worker's EXIT.REFUSED_AFTER_LOSS
DONE = 0
NOT_ACQUIRED = 7
STEPS = 4


def node_binary() -> str:
    """The node executable; fails the test (no skip) when it or the npm packages are missing."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node (v20+) is not on PATH: the Node.js worker test needs it")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail(
            "examples/node/node_modules is missing: run `make test` (it installs the npm "
            "packages first) or `npm ci --prefix examples/node`"
        )
    return node


def events(child: Child, name: str) -> list[dict[str, Any]]:
    """The worker's JSON event lines named ``name``, in order."""
    parsed = (json.loads(line) for line in child.lines if line.startswith("{"))
    return [event for event in parsed if event.get("event") == name]


class NodeScene(Scene):
    """A scene with the gateway and one Node.js worker."""

    async def start_node_worker(
        self, *flags: str, env: dict[str, str] | None = None, label: str = "node"
    ) -> Child:
        """Start the worker on ``TASK_ID``; its stderr goes to ``<workdir>/<label>.stderr``."""
        argv = [node_binary(), str(WORKER), "--target", self.target]
        argv += ["--gateway", self.gateway_address, "--namespace", self.namespace]
        argv += ["--task-id", TASK_ID, "--ttl-s", str(TTL_S), *flags]
        child = await Child.start(
            label, argv, dict(os.environ, **(env or {})), self.workdir / f"{label}.stderr"
        )
        self.children.append(child)
        return child


@contextlib.asynccontextmanager
async def scene(target: str, namespace: str, workdir: Path) -> AsyncIterator[NodeScene]:
    running = NodeScene(target, namespace, workdir)
    try:
        yield running
    finally:
        await running.close()


async def claimed_and_sent(s: NodeScene, worker: Child) -> None:
    """Wait until the worker claimed fence 1, sent (accepted) and had a renewal confirmed."""
    claimed = json.loads((await worker.wait_for(r'"event":"claimed"')).string)
    assert claimed["fence"] == 1, s.stderr_of(worker)
    sent = json.loads((await worker.wait_for(r'"event":"send"')).string)
    assert sent["accepted"] is True and sent["status"] == "accepted", sent
    await worker.wait_for(r'"event":"heartbeat".*"renewed":true')


async def assert_refused_after_loss(s: NodeScene, worker: Child) -> None:
    """The worker's stream ended ABORTED with a loss reason; its late send was refused."""
    assert await worker.exit_code(STEP_TIMEOUT_S) == REFUSED_AFTER_LOSS, s.stderr_of(worker)
    (lost,) = events(worker, "lost")
    assert lost["fence"] == 1
    ends = events(worker, "stream_end")
    assert ends and ends[0]["code"] == "ABORTED" and ends[0]["reason"] in LOSS_REASONS, ends
    if lost["by"] == "stream":
        assert lost["reason"] == ends[0]["reason"]
    else:  # the paused worker's trust deadline passed before it read the server's status
        assert (lost["by"], lost["reason"]) == ("trust_deadline", "TRUST_DEADLINE_PASSED")
    (late,) = events(worker, "late_send")
    assert late["fence"] == 1 and late["accepted"] is False, late
    assert late["code"] == "ABORTED" and late["reason"] == "LEASE_SUPERSEDED", late
    (done,) = events(worker, "exit")
    assert done == {"event": "exit", "code": REFUSED_AFTER_LOSS, "outcome": "REFUSED_AFTER_LOSS"}


async def stored(stub: rpc.LeaseServiceStub, namespace: str) -> pb.GetLeaseResponse:
    """The task's lease and checkpoint as the server reads them now."""
    return await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id=TASK_ID))


def assert_one_send_with_fence_1(s: NodeScene, gateway: Child, namespace: str) -> None:
    assert gateway.has(rf"REFUSED {namespace}/{TASK_ID} fence=1 by leasekeeper check: ABORTED")
    accepted = [line for line in gateway.lines if "ACCEPTED" in line]
    assert len(accepted) == 1 and "fence=1" in accepted[0], gateway.lines
    sends = read_sends(s.ledger_path)
    assert [(row["namespace"], row["task_id"], row["fence"]) for row in sends] == [
        (namespace, TASK_ID, 1)
    ]
    assert "(after loss)" not in sends[0]["message"]


async def test_node_worker_claims_sends_and_releases(server, namespace, tmp_path):
    async with (
        scene(server.target, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace) as client,
    ):
        await s.start_gateway()
        # The token is sent as `authorization: Bearer ...`; harmless while auth is off.
        worker = await s.start_node_worker("--work-s", "0.5", env={"LEASEKEEPER_TOKEN": "t0k"})

        assert await worker.exit_code(STEP_TIMEOUT_S) == DONE, s.stderr_of(worker)
        assert [e["fence"] for e in events(worker, "claimed")] == [1]
        (sent,) = events(worker, "send")
        assert sent["accepted"] is True and sent["send_id"] == 1
        assert events(worker, "released") == [{"event": "released", "fence": 1}]
        # Half-closed by the worker before its release: the stream ended OK, not a loss.
        assert [end["code"] for end in events(worker, "stream_end")] in ([], ["OK"])
        assert events(worker, "lost") == []
        lease = await client.get_lease(TASK_ID)
        assert (lease.state, lease.fence) == ("FREE", 1)
    assert [row["fence"] for row in read_sends(s.ledger_path)] == [1]


async def test_node_worker_superseded_by_new_incarnation_is_refused_after_loss(
    server, namespace, tmp_path, stub
):
    owner_id = f"node-worker-{namespace}"
    async with (
        scene(server.target, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace, owner_id=owner_id) as successor,
    ):
        gateway = await s.start_gateway()
        steps = ("--steps", "3", "--step-s", "0", "--hold-after-step", "1")
        worker = await s.start_node_worker("--owner-id", owner_id, "--send-after-loss", *steps)
        await claimed_and_sent(s, worker)
        await worker.wait_for(r'"event":"holding"')  # step 1 saved; the lease is still held

        # A restarted process with the same owner id claims again (a new request id): the
        # next fence, and the server ends the node worker's stream at once.
        taken = await successor.claim(TASK_ID, ttl=30.0)
        assert taken.acquired and taken.lease is not None and taken.lease.fence == 2

        await assert_refused_after_loss(s, worker)
        (lost,) = events(worker, "lost")
        assert (lost["by"], lost["reason"]) == ("stream", "LEASE_SUPERSEDED")
        # Its late checkpoint (step 2, fence 1) is refused with the loss reason: step 1 stays.
        (late,) = events(worker, "late_checkpoint")
        assert (late["fence"], late["version"], late["stored"]) == (1, 2, False), late
        assert (late["code"], late["reason"]) == ("ABORTED", "LEASE_SUPERSEDED"), late
        checkpoint = (await stored(stub, namespace)).checkpoint
        assert (checkpoint.version, checkpoint.fence) == (1, 1)
        assert json.loads(checkpoint.data) == {"step": 1}
    assert_one_send_with_fence_1(s, gateway, namespace)


async def test_node_worker_killed_after_step_2_is_resumed_at_step_3_by_another_owner(
    server, namespace, tmp_path, stub
):
    steps = ("--steps", str(STEPS), "--step-s", "0", "--work-s", "0")
    async with scene(server.target, namespace, tmp_path) as s:
        await s.start_gateway()
        first = await s.start_node_worker(*steps, "--hold-after-step", "2", label="node-first")
        await first.wait_for(r'"event":"holding"')
        first.signal(signal.SIGKILL)  # no release, no half-close: the lease is left to expire
        assert await first.exit_code(STEP_TIMEOUT_S) == -signal.SIGKILL
        assert [(e["step"], e["fence"]) for e in events(first, "step")] == [(1, 1), (2, 1)]
        assert events(first, "resumed") == []

        async def expired() -> bool:
            return (await stored(stub, namespace)).lease.state == pb.TASK_STATE_EXPIRED

        await poll_until(expired)
        checkpoint = (await stored(stub, namespace)).checkpoint
        assert (checkpoint.version, checkpoint.fence) == (2, 1)

        second = await s.start_node_worker(*steps, label="node-second")
        assert await second.exit_code(STEP_TIMEOUT_S) == DONE, s.stderr_of(second)
        (was,) = events(first, "claimed")
        (now,) = events(second, "claimed")
        assert now["fence"] == 2 and now["owner_id"] != was["owner_id"], (was, now)
        assert events(second, "resumed") == [
            {
                "event": "resumed",
                "checkpoint_version": 2,
                "checkpoint_fence": 1,
                "checkpoint_data": {"step": 2},
                "next_step": 3,
            }
        ]
        assert [(e["step"], e["fence"]) for e in events(second, "step")] == [(3, 2), (4, 2)]
        assert events(second, "checkpoint_refused") == [] and events(second, "lost") == []

        after = await stored(stub, namespace)
        assert (after.lease.state, after.lease.fence) == (pb.TASK_STATE_FREE, 2)
        assert (after.checkpoint.version, after.checkpoint.fence) == (STEPS, 2)
        assert json.loads(after.checkpoint.data) == {"step": STEPS}
        assert after.checkpoint.content_type == "application/json"
    assert [row["fence"] for row in read_sends(s.ledger_path)] == [1, 2]


async def test_node_worker_paused_past_its_ttl_is_refused_after_loss(server, namespace, tmp_path):
    async with (
        scene(server.target, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace) as other,
    ):
        gateway = await s.start_gateway()
        worker = await s.start_node_worker("--work-s", str(HOLD_S), "--send-after-loss")
        await claimed_and_sent(s, worker)
        worker.signal(signal.SIGSTOP)

        async def expired() -> bool:
            return (await other.get_lease(TASK_ID)).state == "EXPIRED"

        async def no_heartbeat_streams() -> bool:
            return server.server.heartbeats.open_streams == 0

        await poll_until(expired)
        await poll_until(no_heartbeat_streams)  # the server ended the frozen worker's stream
        taken = await other.claim(TASK_ID, ttl=30.0)
        assert taken.acquired and taken.lease is not None and taken.lease.fence == 2

        worker.signal(signal.SIGCONT)
        await assert_refused_after_loss(s, worker)
    assert_one_send_with_fence_1(s, gateway, namespace)


async def test_node_worker_task_held_by_another_is_not_acquired(server, namespace, tmp_path):
    async with (
        scene(server.target, namespace, tmp_path) as s,
        LeaseClient(server.target, namespace=namespace) as holder,
    ):
        held = await holder.claim(TASK_ID, ttl=30.0)
        assert held.acquired
        await s.start_gateway()
        worker = await s.start_node_worker("--work-s", "0")

        assert await worker.exit_code(STEP_TIMEOUT_S) == NOT_ACQUIRED, s.stderr_of(worker)
        (refused,) = events(worker, "not_acquired")
        assert 0 < refused["retry_after_s"] <= 30.0
        assert events(worker, "claimed") == [] and events(worker, "send") == []
    assert read_sends(s.ledger_path) == []
