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
    assert not ledger.lookup("ns", "t", "other").found


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
    assert ledger.lookup("ns", "t", "summary") == LookupOutcome(False, None, None, None, 0)
    first = ledger.record_send(FenceRef("ns", "t", 1), "summary", "once")
    ledger.record_send(FenceRef("ns", "t", 2), "summary", "twice")
    ledger.record_send(FenceRef("ns", "other", 1), "summary", "another task")
    assert ledger.lookup("ns", "t", "summary") == LookupOutcome(True, first.send_id, 1, "once", 2)
    assert not ledger.lookup("ns", "t", "unknown").found
    assert not ledger.lookup("ns2", "t", "summary").found


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


async def test_lookup_over_grpc_answers_a_lower_fence_without_refusing_it(ledger, ledger_path):
    async with gateway_channel(ledger, None) as channel:
        sent = await call(
            channel,
            SEND_METHOD,
            {"effect_key": "summary", "message": "hi"},
            FenceRef("ns", "t", 2).metadata(),
        )
        assert sent == {"status": "accepted", "send_id": 1, "fence": 2}

        older = FenceRef("ns", "t", 1).metadata()  # a replacement asks about an older attempt
        found = await call(channel, LOOKUP_METHOD, {"effect_key": "summary"}, older)
        assert found == {"found": True, "send_id": 1, "fence": 2, "message": "hi", "count": 1}
        missing = await call(channel, LOOKUP_METHOD, {"effect_key": "draft"}, older)
        assert missing == {
            "found": False,
            "send_id": None,
            "fence": None,
            "message": None,
            "count": 0,
        }

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(channel, SEND_METHOD, {"effect_key": "summary", "message": "stale"}, older)
        assert refused.value.code() is grpc.StatusCode.ABORTED
        assert reason_of(refused.value) == "FENCE_BELOW_ACCEPTED"

        with pytest.raises(grpc.aio.AioRpcError) as no_lease:
            await call(channel, LOOKUP_METHOD, {"effect_key": "summary"})
        assert no_lease.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert reason_of(no_lease.value) == "FENCE_MISSING"
    assert [row["message"] for row in read_sends(ledger_path)] == ["hi"]


@pytest.mark.process
async def test_lookup_with_stale_fence_passes_the_fence_interceptor_send_does_not(
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

            found = await call(channel, LOOKUP_METHOD, {"effect_key": "summary"}, stale)
            assert (found["found"], found["fence"]) == (True, second.lease.fence)
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
