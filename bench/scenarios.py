"""The measured calls: one Op per scenario, the same for leasekeeper and its no-op twin.

Every scenario goes through the real client (``leasekeeper.LeaseClient``),
one client per load worker (each its own owner) on one shared channel, so a
no-op server of the same service (``bench/noop_server.py``) and the real one
are driven by exactly the same code. The heartbeat scenario drives a raw
bidirectional stream per worker (one write, one read per call), as the bidi
echo reference does. The streamed ValidateFence (``validate_stream``) is an
effect gateway's: every worker checks its fence through one shared client,
whose ``validate_fence`` sends the checks on its one ValidateFences stream
(concurrent checks share a message); ``validate`` is the same check as a
unary ValidateFence per call, so the two side by side give the stream's
gain. The session scenario gives each worker one Session stream carrying
``LEASES_PER_SESSION`` leases; a call is one beat (renewing them all) and its
answer, and it counts as that many renewals (``RENEWALS_PER_CALL``), against
the no-op server's echo of the same messages. The scenarios of runs
(``RUN_SCENARIOS``: SaveCheckpoint, ListTaskHistory) call the generated stub,
with the same requests whatever the client library's version; the suite
measures them over growing tables (``bench/run.py``) and side by side
(``bench/runs.py``), not against the no-op server.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import duration_pb2

from leasekeeper import LeaseClient
from leasekeeper.v1 import lease_service_pb2 as pb

from .loadgen import Op

# Leases in the benchmark outlive every measured window (seconds).
TTL_S = 120.0

UNARY = ("claim", "claim_hot", "renew", "validate", "effect")
# The streamed ValidateFence right after the unary one: side by side in a run.
SCENARIOS = (
    "claim",
    "claim_hot",
    "renew",
    "validate",
    "validate_stream",
    "effect",
    "heartbeat",
    "session",
)
RUN_SCENARIOS = ("checkpoint", "history")
HOLDING = ("renew", "validate", "validate_stream", "effect", "heartbeat", *RUN_SCENARIOS)

# The checkpoint every SaveCheckpoint of the benchmark writes: 4 KiB that do
# not compress (as encoded state often does not), so PostgreSQL stores it out
# of line, in the table's TOAST, as it would a real one of that size.
CHECKPOINT_BYTES = 4096
CHECKPOINT_DATA = random.Random(4096).randbytes(CHECKPOINT_BYTES)
CHECKPOINT_TYPE = "application/octet-stream"
# Checkpoints a "history" scenario's task has saved before it is listed: its
# history is its grant and these, the same at every table size.
HISTORY_CHECKPOINTS = 3

TITLES = {
    "claim": "Claim (distinct tasks)",
    "claim_hot": "Claim (one hot task)",
    "renew": "Renew",
    "validate": "ValidateFence",
    "validate_stream": "ValidateFence (stream)",
    "effect": "BeginEffect+CompleteEffect",
    "heartbeat": "Heartbeat renewal",
    "session": "Session renewal",
    "checkpoint": "SaveCheckpoint (4 KiB)",
    "history": "ListTaskHistory (one task)",
}


# A worker's leases on its one Session stream: each beat renews them all.
LEASES_PER_SESSION = 10
# Renewals one call of a scenario makes: its rate and costs are counted per renewal.
RENEWALS_PER_CALL = {"session": LEASES_PER_SESSION}


@dataclass
class Held:
    """A lease a load worker holds for the scenarios that need one."""

    task_id: str
    fence: int


@contextlib.asynccontextmanager
async def scenario_op(
    scenario: str, target: str, namespace: str, concurrency: int, run_id: str
) -> AsyncIterator[Op]:
    """The Op of ``scenario`` against ``target``, with its setup done (leases claimed).

    Args:
        scenario: one of SCENARIOS.
        target: the server's ``host:port``.
        namespace: the namespace the scenario's tasks live in.
        concurrency: how many load workers will call the Op (one client each).
        run_id: unique among runs on one database, so task ids never repeat.
    """
    async with grpc.aio.insecure_channel(target) as channel:
        clients = [
            LeaseClient(
                namespace=namespace,
                owner_id=f"{run_id}-w{i}",
                channel=channel,
                validate_stream=scenario == "validate_stream",
            )
            for i in range(concurrency)
        ]
        if scenario == "session":
            async with _sessions(channel, namespace, clients, run_id) as op:
                yield op
            return
        held: list[Held] = []
        if scenario in HOLDING:
            for i, client in enumerate(clients):
                result = await client.claim(f"{run_id}-held-{i}", ttl=TTL_S)
                assert result.acquired and result.lease is not None, result
                held.append(Held(result.lease.task_id, result.lease.fence))
        if scenario == "heartbeat":
            async with _streams(channel, namespace, clients, held) as op:
                yield op
            return
        if scenario in RUN_SCENARIOS:
            yield await _run_op(scenario, namespace, clients, held)
            return
        yield _unary_op(scenario, clients, held, run_id)


def save_checkpoint_request(
    namespace: str, owner_id: str, lease: Held, version: int
) -> pb.SaveCheckpointRequest:
    """SaveCheckpoint of ``CHECKPOINT_DATA`` at ``version`` under ``lease``."""
    return pb.SaveCheckpointRequest(
        namespace=namespace,
        task_id=lease.task_id,
        owner_id=owner_id,
        fence=lease.fence,
        checkpoint=pb.Checkpoint(
            version=version, data=CHECKPOINT_DATA, content_type=CHECKPOINT_TYPE
        ),
    )


async def _run_op(
    scenario: str, namespace: str, clients: list[LeaseClient], held: list[Held]
) -> Op:
    """SaveCheckpoint (versions 1, 2, 3, ... per worker) or ListTaskHistory of the held task."""
    stub = clients[0].stub
    if scenario == "checkpoint":

        async def checkpoint(w: int, c: int) -> object:
            request = save_checkpoint_request(namespace, clients[w].owner_id, held[w], c + 1)
            return await stub.SaveCheckpoint(request)

        return checkpoint
    for w, lease in enumerate(held):
        for version in range(1, HISTORY_CHECKPOINTS + 1):
            await stub.SaveCheckpoint(
                save_checkpoint_request(namespace, clients[w].owner_id, lease, version)
            )
    requests = [pb.ListTaskHistoryRequest(namespace=namespace, task_id=h.task_id) for h in held]

    async def history(w: int, c: int) -> object:
        reply = await stub.ListTaskHistory(requests[w])
        if len(reply.entries) != 1 + HISTORY_CHECKPOINTS:
            raise AssertionError(f"{len(reply.entries)} history entries: {reply}")
        return reply

    return history


def _unary_op(scenario: str, clients: list[LeaseClient], held: list[Held], run_id: str) -> Op:
    if scenario == "claim":

        async def claim(w: int, c: int) -> object:
            return await clients[w].claim(f"{run_id}-{w}-{c}", ttl=TTL_S)

        return claim
    if scenario == "claim_hot":
        hot = f"{run_id}-hot"

        async def claim_hot(w: int, c: int) -> object:
            return await clients[w].claim(hot, ttl=TTL_S)

        return claim_hot
    if scenario == "renew":

        async def renew(w: int, c: int) -> object:
            lease = held[w]
            return await clients[w].renew(lease.task_id, lease.fence, ttl=TTL_S)

        return renew
    if scenario == "validate":

        async def validate(w: int, c: int) -> object:
            lease = held[w]
            check = await clients[w].validate_fence(lease.task_id, lease.fence)
            if not check.valid:
                raise AssertionError(f"fence {lease.fence} refused: {check}")
            return check

        return validate
    if scenario == "validate_stream":
        gateway = clients[0]  # one client, one ValidateFences stream, as an effect gateway has

        async def validate_stream(w: int, c: int) -> object:
            lease = held[w]
            check = await gateway.validate_fence(lease.task_id, lease.fence)
            if not check.valid:
                raise AssertionError(f"fence {lease.fence} refused: {check}")
            return check

        return validate_stream
    if scenario == "effect":

        async def effect(w: int, c: int) -> object:
            lease, client = held[w], clients[w]
            key = f"e-{c}"
            await client.begin_effect(lease.task_id, lease.fence, key, policy="ONCE")
            return await client.complete_effect(
                lease.task_id, lease.fence, key, outcome="SUCCEEDED"
            )

        return effect
    raise ValueError(f"unknown scenario {scenario!r}")


@contextlib.asynccontextmanager
async def _streams(
    channel: grpc.aio.Channel, namespace: str, clients: list[LeaseClient], held: list[Held]
) -> AsyncIterator[Op]:
    """One open Heartbeat stream per worker; a call is one beat and its answer."""
    stub = clients[0].stub
    ttl = duration_pb2.Duration(seconds=int(TTL_S))
    calls: list[Any] = []
    try:
        for client, lease in zip(clients, held, strict=True):
            call = stub.Heartbeat()
            await call.write(
                pb.HeartbeatRequest(
                    namespace=namespace,
                    task_id=lease.task_id,
                    owner_id=client.owner_id,
                    fence=lease.fence,
                    ttl=ttl,
                )
            )
            first = await call.read()
            assert first.fence == lease.fence, first
            calls.append(call)
        beat = pb.HeartbeatRequest()

        async def heartbeat(w: int, c: int) -> object:
            call = calls[w]
            await call.write(beat)
            reply = await call.read()
            if reply is grpc.aio.EOF or not reply.renewed:
                raise AssertionError(f"beat not renewed: {reply}")
            return reply

        yield heartbeat
    finally:
        for call in calls:
            with contextlib.suppress(Exception):
                await call.done_writing()
            call.cancel()


@contextlib.asynccontextmanager
async def _sessions(
    channel: grpc.aio.Channel, namespace: str, clients: list[LeaseClient], run_id: str
) -> AsyncIterator[Op]:
    """One open Session stream per worker with LEASES_PER_SESSION leases; a call is one beat.

    Every beat must come back with each of the worker's leases renewed.
    """
    stub = clients[0].stub
    ttl = duration_pb2.Duration(seconds=int(TTL_S))
    calls: list[Any] = []
    sequences: list[int] = []
    try:
        for w, client in enumerate(clients):
            adds = []
            for i in range(LEASES_PER_SESSION):
                result = await client.claim(f"{run_id}-s{w}-{i}", ttl=TTL_S)
                assert result.acquired and result.lease is not None, result
                adds.append(
                    pb.SessionRequest.Add(
                        id=i + 1,
                        namespace=namespace,
                        task_id=result.lease.task_id,
                        owner_id=client.owner_id,
                        fence=result.lease.fence,
                        ttl=ttl,
                    )
                )
            call = stub.Session()
            await call.write(pb.SessionRequest(sequence=1, add=adds))
            first = await call.read()
            assert len(first.held) == LEASES_PER_SESSION, first
            calls.append(call)
            sequences.append(1)

        async def session(w: int, c: int) -> object:
            call = calls[w]
            sequences[w] += 1
            await call.write(pb.SessionRequest(sequence=sequences[w], beat=True))
            reply = await call.read()
            if (
                reply is grpc.aio.EOF
                or reply.sequence != sequences[w]
                or len(reply.held) != LEASES_PER_SESSION
                or not all(held.renewed for held in reply.held)
            ):
                raise AssertionError(f"beat not renewed: {reply}")
            return reply

        yield session
    finally:
        for call in calls:
            with contextlib.suppress(Exception):
                await call.done_writing()
            call.cancel()
