"""The effect gateway: its ledger, its Send and Lookup methods, its --dedupe flag.

The ledger keeps leasekeeper's fence table (``leasekeeper.fence_table``) next to
its sends; without ``--dedupe`` it repeats an effect as a real vendor would.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from demo import Child
from gateway import LOOKUP_METHOD, SEND_METHOD, Ledger, LookupOutcome, build_server, read_sends
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from leasekeeper import FenceRef, LeaseClient

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
CALL_TIMEOUT_S = 10.0


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.sqlite3"


@contextlib.contextmanager
def opened(path: Path, dedupe: bool = False) -> Iterator[Ledger]:
    ledger = Ledger(path, dedupe=dedupe)
    try:
        yield ledger
    finally:
        ledger.close()


@pytest.fixture
def ledger(ledger_path: Path) -> Iterator[Ledger]:
    with opened(ledger_path) as made:
        yield made


def accepted_fence(path: Path, namespace: str, task_id: str) -> int | None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        row = db.execute(
            "SELECT fence FROM leasekeeper_accepted_fences WHERE namespace = ? AND task_id = ?",
            (namespace, task_id),
        ).fetchone()
    return None if row is None else row[0]


def test_record_send_lower_fence_after_higher_is_refused_and_records_nothing(ledger, ledger_path):
    assert ledger.record_send(FenceRef("ns", "t", 2), "summary", "from B").status == "accepted"
    refused = ledger.record_send(FenceRef("ns", "t", 1), "other", "from A")
    assert (refused.status, refused.send_id, refused.highest_fence) == ("refused", None, 2)
    assert [row["fence"] for row in read_sends(ledger_path)] == [2]
    assert accepted_fence(ledger_path, "ns", "t") == 2
    assert ledger.lookup(FenceRef("ns", "t", 1), "other") is None  # stale: refused
    assert not ledger.lookup(FenceRef("ns", "t", 2), "other").found


def test_record_send_same_effect_key_twice_without_dedupe_sends_twice(ledger, ledger_path):
    first = ledger.record_send(FenceRef("ns", "t", 1), "summary", "once")
    again = ledger.record_send(FenceRef("ns", "t", 2), "summary", "twice")
    assert (first.status, again.status) == ("accepted", "accepted")
    assert again.send_id != first.send_id
    assert [row["message"] for row in read_sends(ledger_path)] == ["once", "twice"]


def test_record_send_same_effect_key_twice_with_dedupe_is_duplicate(ledger_path):
    with opened(ledger_path, dedupe=True) as ledger:
        first = ledger.record_send(FenceRef("ns", "t", 1), "summary", "once")
        again = ledger.record_send(FenceRef("ns", "t", 3), "summary", "twice")
        other = ledger.record_send(FenceRef("ns", "t", 3), "another", "new effect")
        assert (again.status, again.send_id, again.highest_fence) == ("duplicate", first.send_id, 1)
        assert other.status == "accepted"
        refused = ledger.record_send(FenceRef("ns", "t", 2), "summary", "stale")
        assert (refused.status, refused.highest_fence) == ("refused", 3)
    assert [row["message"] for row in read_sends(ledger_path)] == ["once", "new effect"]


@pytest.mark.parametrize(
    ("first", "second", "status"),
    [(1, 1, "accepted"), (1, 2, "accepted"), (3, 2, "refused")],
)
@pytest.mark.parametrize("dedupe", [False, True], ids=["plain", "dedupe"])
def test_record_send_fence_order_decides(ledger_path, dedupe, first, second, status):
    with opened(ledger_path, dedupe=dedupe) as ledger:
        ledger.record_send(FenceRef("ns", "t", first), "a", "first")
        assert ledger.record_send(FenceRef("ns", "t", second), "b", "second").status == status


def test_record_send_fences_are_per_task(ledger):
    ledger.record_send(FenceRef("ns", "t1", 5), "a", "first")
    assert ledger.record_send(FenceRef("ns", "t2", 1), "a", "other task").status == "accepted"
    assert ledger.record_send(FenceRef("ns2", "t1", 1), "a", "other ns").status == "accepted"


def test_lookup_finds_the_tasks_first_send_and_counts_repeats(ledger):
    fence_2 = FenceRef("ns", "t", 2)
    assert ledger.lookup(FenceRef("ns", "t", 1), "summary") == LookupOutcome(
        False, None, None, None, 0
    )
    first = ledger.record_send(FenceRef("ns", "t", 1), "summary", "once")
    ledger.record_send(fence_2, "summary", "twice")
    ledger.record_send(FenceRef("ns", "other", 1), "summary", "another task")
    assert ledger.lookup(fence_2, "summary") == LookupOutcome(True, first.send_id, 1, "once", 2)
    assert not ledger.lookup(fence_2, "unknown").found
    assert not ledger.lookup(FenceRef("ns2", "t", 2), "summary").found


def test_lookup_is_a_fenced_read_an_older_attempt_cannot_land_after_it(ledger, ledger_path):
    """The reconcile window: A (fence 1) was paused before its send; B (fence 2) looks it up."""
    assert ledger.record_send(FenceRef("ns", "t", 1), "warm-up", "A's earlier send").status == (
        "accepted"
    )
    assert not ledger.lookup(FenceRef("ns", "t", 2), "summary").found  # B: not found
    late = ledger.record_send(FenceRef("ns", "t", 1), "summary", "A, resumed")
    assert (late.status, late.highest_fence) == ("refused", 2)
    assert ledger.record_send(FenceRef("ns", "t", 2), "summary", "B").status == "accepted"
    assert [r["message"] for r in read_sends(ledger_path) if r["effect_key"] == "summary"] == ["B"]


# --- over gRPC: the gateway's methods, as workers call them ---------------------------------


@contextlib.asynccontextmanager
async def gateway_channel(
    ledger: Ledger, leases: LeaseClient | None
) -> AsyncIterator[grpc.aio.Channel]:
    server, port = build_server(ledger, leases, "127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(0.5)


async def call(
    channel: grpc.aio.Channel, method: str, body: dict[str, Any], metadata: Any = None
) -> dict[str, Any]:
    reply = await channel.unary_unary(method)(
        json.dumps(body).encode(), metadata=metadata, timeout=CALL_TIMEOUT_S
    )
    return json.loads(reply)


def reason_of(error: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(error)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info.reason


async def test_lookup_over_grpc_raises_the_fence_and_refuses_a_lower_one(ledger, ledger_path):
    async with gateway_channel(ledger, None) as channel:
        older, newer = FenceRef("ns", "t", 1).metadata(), FenceRef("ns", "t", 2).metadata()
        sent = await call(channel, SEND_METHOD, {"effect_key": "summary", "message": "hi"}, older)
        assert sent == {"status": "accepted", "send_id": 1, "fence": 1}

        # A replacement (fence 2) asks about the older attempt.
        found = await call(channel, LOOKUP_METHOD, {"effect_key": "summary"}, newer)
        assert found == {"found": True, "send_id": 1, "fence": 1, "message": "hi", "count": 1}
        missing = await call(channel, LOOKUP_METHOD, {"effect_key": "draft"}, newer)
        assert missing == {
            "found": False,
            "send_id": None,
            "fence": None,
            "message": None,
            "count": 0,
        }

        for method, body in [
            (SEND_METHOD, {"effect_key": "draft", "message": "stale"}),
            (LOOKUP_METHOD, {"effect_key": "draft"}),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(channel, method, body, older)
            assert refused.value.code() is grpc.StatusCode.ABORTED
            assert reason_of(refused.value) == "FENCE_BELOW_ACCEPTED"
        assert [row["fence"] for row in read_sends(ledger_path)] == [1]


@pytest.mark.process
async def test_lookup_skips_the_fence_interceptor_but_the_ledger_refuses_a_stale_fence(
    server, namespace, ledger, ledger_path
):
    async with LeaseClient(server.target, namespace=namespace) as client:
        first = await client.claim("t", ttl=5.0)
        assert first.lease is not None
        await client.release("t", first.lease.fence)
        second = await client.claim("t", ttl=5.0)
        assert second.lease is not None and second.lease.fence == first.lease.fence + 1
        stale = FenceRef(namespace, "t", first.lease.fence).metadata()
        current = FenceRef(namespace, "t", second.lease.fence).metadata()

        async with gateway_channel(ledger, client) as channel:
            await call(channel, SEND_METHOD, {"effect_key": "summary", "message": "new"}, current)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(channel, SEND_METHOD, {"effect_key": "x", "message": "old"}, stale)
            assert refused.value.code() is grpc.StatusCode.ABORTED
            assert reason_of(refused.value) == "LEASE_SUPERSEDED"  # the interceptor's refusal

            found = await call(channel, LOOKUP_METHOD, {"effect_key": "summary"}, current)
            assert (found["found"], found["fence"]) == (True, second.lease.fence)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(channel, LOOKUP_METHOD, {"effect_key": "summary"}, stale)
            assert refused.value.code() is grpc.StatusCode.ABORTED
            assert reason_of(refused.value) == "FENCE_BELOW_ACCEPTED"  # the ledger's refusal
    assert [row["message"] for row in read_sends(ledger_path)] == ["new"]


# --- the process: the --dedupe flag ------------------------------------------------------------


@pytest.mark.process
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "statuses", "sends"),
    [([], ["accepted", "accepted"], 2), (["--dedupe"], ["accepted", "duplicate"], 1)],
    ids=["default-no-dedupe", "dedupe"],
)
async def test_gateway_process_repeats_an_effect_unless_dedupe(tmp_path, flags, statuses, sends):
    ledger_path = tmp_path / "gateway.sqlite3"
    argv = [sys.executable, str(EXAMPLES_DIR / "gateway.py"), "--ledger-only"]
    argv += ["--db", str(ledger_path), *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    gateway = await Child.start("gateway", argv, env, tmp_path / "gateway.stderr", echo=False)
    try:
        address = (await gateway.wait_for(r"listening on (\S+)")).group(1)
        metadata = FenceRef("ns", "t", 1).metadata()
        async with grpc.aio.insecure_channel(address) as channel:
            replies = [
                await call(channel, SEND_METHOD, {"effect_key": "summary", "message": m}, metadata)
                for m in ("first", "second")
            ]
            found = await call(channel, LOOKUP_METHOD, {"effect_key": "summary"}, metadata)
        await gateway.wait_for(r"LOOKUP ns/t effect_key='summary' found=True")
    finally:
        await gateway.stop()
    assert [reply["status"] for reply in replies] == statuses
    assert (found["send_id"], found["count"]) == (1, sends)
    assert len(read_sends(ledger_path)) == sends
    assert len([line for line in gateway.lines if "ACCEPTED" in line]) == sends
