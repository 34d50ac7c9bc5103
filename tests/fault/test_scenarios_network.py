"""Network faults around a held lease, each with one exact outcome.

a. The holder's network to the server is black-holed (no RST): its client
   stops the work before the lease's expire_time, and a replacement gets the
   next fence. The holder and the replacement are real worker processes
   (``hold_worker.py``, using ``client.hold()``); the holder reaches the
   server through a :class:`~tests.fault.proxy.TcpProxy`.
b. Renewals fail while reads work (the server's connections to PostgreSQL
   cut mid-stream, or writes refused as by a standby mid-failover): the
   server ends the heartbeat stream UNAVAILABLE at once (at the next beat),
   the holder's ``HeldLease.renewal_error`` says so, and the lease is not
   lost: the client resumes with the same fence until its trust deadline,
   as guarantees.md and the client docs promise. With a 30 s ttl, told within
   a few seconds.
c. A renewal held back in the network (``delay`` upstream) arrives after the
   lease expired and another owner claimed the task: refused ABORTED
   LEASE_SUPERSEDED (a beat on a stream that already ended renews nothing),
   and the new owner's row is untouched.

Servers run in process (a process would add nothing to these: the faults are
in the network, not in the server). Waits poll real state: the database row,
the proxy's counters, the worker's reports; the only waits on real time are
ttl expiries, which are the point of scenarios a and c.

How scenario a compares instants: the worker stamps its reports with
``time.monotonic()``, which on Linux is ``CLOCK_MONOTONIC``, one clock for all
processes of the host, so the test can compare them with its own. The
database's clock (``clock_timestamp()``, the realtime clock of the same host,
running at the same rate) is mapped onto it by one query made right after the
worker reported the cancellation: ``expire_time - clock_timestamp()`` is the
time the lease had left when the query ran, which was after the test read
the report, so ``query_sent + left`` is the earliest monotonic instant the
lease can expire. The cancellation must come before that. Independently of
any clock mapping, the same query finding the lease still HELD proves it by
causality: the worker stopped, then reported, then the test asked, and the
database still said HELD.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from leasekeeper import LeaseClient, LeaseUnavailable
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import RunningServer, running_server
from tests.fault.dburl import database_address, proxied
from tests.fault.processes import QUICK_OUTAGE_SETTINGS
from tests.fault.proxy import TcpProxy, tcp_proxy
from tests.helpers import dur, error_info, poll

pytestmark = [pytest.mark.timeout(45)]

HOLD_WORKER = Path(__file__).with_name("hold_worker.py")
STEP_TIMEOUT_S = 15.0
POLL_INTERVAL_S = 0.01


def safety_margin_s(ttl_s: float) -> float:
    """The client's default safety margin (``leasekeeper._trust.default_safety_margin``)."""
    return min(1.0, ttl_s / 10)


async def task_row(db: asyncpg.Connection, namespace: str, task_id: str) -> asyncpg.Record:
    """The task's row, with the database clock and whether the lease is live on it."""
    row = await db.fetchrow(
        "SELECT owner_id, fence, state, expire_time, claim_time, update_time,"
        " clock_timestamp() AS db_now, expire_time - clock_timestamp() AS left_ttl,"
        " state = 'held' AND expire_time > clock_timestamp() AS live"
        " FROM leasekeeper_tasks WHERE namespace = $1 AND task_id = $2",
        namespace,
        task_id,
    )
    assert row is not None, f"no row for task {task_id!r}"
    return row


async def renewed_after(
    db: asyncpg.Connection, namespace: str, task_id: str, expire_time: Any, by_s: float = 0.0
) -> None:
    """Waits until a renewal moved the expire_time more than ``by_s`` past ``expire_time``."""

    async def moved() -> bool:
        row = await task_row(db, namespace, task_id)
        return row["expire_time"] - expire_time > timedelta(seconds=by_s)

    await poll(moved, "renewed", STEP_TIMEOUT_S, POLL_INTERVAL_S)


async def wait_expired(db: asyncpg.Connection, namespace: str, task_id: str) -> None:
    """Waits, on the database clock, until the task's lease has run out its ttl."""

    async def expired() -> bool:
        return not (await task_row(db, namespace, task_id))["live"]

    await poll(expired, "expired", STEP_TIMEOUT_S, POLL_INTERVAL_S)


# -- a. the holder's network black-holed ---------------------------------------------

HOLDER_TTL_S = 4.0  # beats every 1.33 s; trust deadline 0.4 s before expire_time
HOLDER_BEAT_S = HOLDER_TTL_S / 3
# The client cancels the body at its trust deadline; a few ms of scheduling on a loaded machine.
CANCEL_LAG_S = 0.5
RELEASE_CALL_TIMEOUT_S = 1.0  # the holder's best-effort release after the loss goes nowhere


class WorkerProcess:
    """A ``hold_worker.py`` process whose JSON lines on stdout are collected as they come."""

    def __init__(self, label: str, proc: asyncio.subprocess.Process, stderr: Path) -> None:
        self.label = label
        self.proc = proc
        self.stderr = stderr
        self.events: list[dict[str, Any]] = []
        self._changed = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, label: str, workdir: Path, *args: str) -> WorkerProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
        env["PYTHONUNBUFFERED"] = "1"
        stderr = workdir / f"{label}.stderr"
        with stderr.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(HOLD_WORKER),
                *args,
                env=env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                start_new_session=True,
            )
        return cls(label, proc, stderr)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            try:
                self.events.append(json.loads(line))
            except ValueError:
                self.events.append({"event": "text", "text": line})
            self._changed.set()
        self._changed.set()

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    async def wait_event(self, name: str, within_s: float = STEP_TIMEOUT_S) -> dict[str, Any]:
        """The first event called ``name``, waiting for it."""
        async with asyncio.timeout(within_s):
            while not (found := self.named(name)):
                if self._reader.done():
                    raise AssertionError(f"{self.label} ended without {name!r}: {self.report()}")
                self._changed.clear()
                await self._changed.wait()
        return found[0]

    async def finish(self, within_s: float = STEP_TIMEOUT_S) -> int:
        """Closes stdin (a lost worker then exits) and returns the exit code."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        code = await asyncio.wait_for(self.proc.wait(), within_s)
        await self._reader
        return code

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        with contextlib.suppress(Exception):
            await self._reader

    def report(self) -> str:
        return f"{self.events}\nstderr:\n{self.stderr.read_text(errors='replace')}"


@pytest.mark.process
async def test_holder_network_black_holed_work_stops_before_expire_time_replacement_next_fence(
    database_url: str, db: asyncpg.Connection, namespace: str, tmp_path: Path
) -> None:
    task_id = "t"
    common = ["--namespace", namespace, "--task-id", task_id, "--ttl-s", str(HOLDER_TTL_S)]
    async with running_server(database_url) as server, tcp_proxy("127.0.0.1", server.port) as proxy:
        holder = await WorkerProcess.start(
            "holder",
            tmp_path,
            *common,
            "--target",
            f"127.0.0.1:{proxy.port}",
            "--call-timeout-s",
            str(RELEASE_CALL_TIMEOUT_S),
        )
        workers = [holder]
        try:
            claimed = await holder.wait_event("claimed")
            granted = await task_row(db, namespace, task_id)
            assert (granted["owner_id"], granted["fence"]) == (
                claimed["owner_id"],
                claimed["fence"],
            )
            # A later beat of the heartbeat, not only its first message, went through the proxy.
            await renewed_after(db, namespace, task_id, granted["expire_time"], HOLDER_BEAT_S / 2)

            proxy.black_hole("both")
            holed_at = time.monotonic()

            cancelled = await holder.wait_event("cancelled", within_s=HOLDER_TTL_S + 5)
            asked_at = time.monotonic()
            seen = await task_row(db, namespace, task_id)

            # By causality: stopped, reported, then the database still said HELD by it.
            assert seen["live"], f"expired before the test could look: {dict(seen)}"
            assert (seen["owner_id"], seen["fence"]) == (claimed["owner_id"], claimed["fence"])
            left_s = seen["left_ttl"].total_seconds()
            # On one clock (see the module docstring): the earliest the lease can expire.
            expire_mono = asked_at + left_s
            stopped_before_expiry_s = expire_mono - cancelled["mono"]
            assert stopped_before_expiry_s > 0, stopped_before_expiry_s

            acts = holder.named("act")
            assert acts, holder.report()
            trust_deadline = acts[-1]["trust_deadline"]
            cancel_lag_s = cancelled["mono"] - trust_deadline
            # Not before its trust deadline (nothing told it of a loss), and promptly at it.
            assert -0.01 <= cancel_lag_s < CANCEL_LAG_S, (cancel_lag_s, holder.report())
            assert all(a["mono"] < min(a["trust_deadline"], cancelled["mono"]) for a in acts)

            replacement = await WorkerProcess.start(
                "replacement",
                tmp_path,
                *common,
                "--target",
                server.target,
                "--wait-s",
                str(STEP_TIMEOUT_S),
                "--steps",
                "1",
            )
            workers.append(replacement)
            took_over = await replacement.wait_event("claimed")
            assert took_over["fence"] == claimed["fence"] + 1, replacement.report()
            assert took_over["owner_id"] != claimed["owner_id"]
            assert await replacement.finish() == 0, replacement.report()
            after = await task_row(db, namespace, task_id)
            assert (after["owner_id"], after["fence"]) == (
                took_over["owner_id"],
                took_over["fence"],
            )
            # Granted only once the holder's lease had expired, on the database clock.
            assert after["claim_time"] >= seen["expire_time"], (dict(after), dict(seen))

            lost = await holder.wait_event("lost")  # its release goes on in the background
            assert lost["reason"] == "LEASE_EXPIRED"
            assert await holder.finish() == 3, holder.report()
        finally:
            for worker in workers:
                await worker.kill()

    # The holder never acted after its loss: nothing but the loss and the exit followed.
    names = [e["event"] for e in holder.events]
    assert names == ["claimed", *["act"] * len(acts), "cancelled", "lost", "exit"], names
    assert [e["event"] for e in replacement.events] == ["claimed", "act", "done", "exit"]
    logging.getLogger(__name__).info(
        "a: black-holed at %.3f; cancelled %.3f s later, %.3f s after the trust deadline and"
        " %.3f s before expire_time (%.3f s of ttl left when the test looked)",
        holed_at,
        cancelled["mono"] - holed_at,
        cancel_lag_s,
        stopped_before_expiry_s,
        left_s,
    )


# -- b. renewals failing while reads work ---------------------------------------------

LONG_TTL_S = 30.0
FAST = {
    **QUICK_OUTAGE_SETTINGS,
    # Every beat of the raw stream below writes (none is answered from the last renewal).
    "min_renew_interval_s": 0.0,
}
SLACK_S = 2.0  # a loaded 2-core machine
# Cut: the notification listener's ping (health_interval_s) finds its connection
# gone and wakes the stream, whose read fails within the connect timeout. Far
# below the ttl, and below the trust deadline (ttl - 1 s) by much more.
TOLD_AFTER_CUT_WITHIN_S = FAST["health_interval_s"] + FAST["connect_timeout_s"] + SLACK_S
# Writes refused: the server learns it at the next renewal, i.e. the next beat
# (the client beats every ttl / 3), and ends the stream at once.
TOLD_AFTER_REFUSAL_WITHIN_S = LONG_TTL_S / 3 + SLACK_S
ANSWER_WITHIN_S = 1.0  # one refused statement
RECOVER_WITHIN_S = 10.0  # the heartbeat's reopen backoff after a few failures


class DatabaseBehindProxy:
    """An in-process server that reaches PostgreSQL only through a proxy."""

    def __init__(self, proxy: TcpProxy, server: RunningServer) -> None:
        self.proxy = proxy
        self.server = server


@pytest.fixture
async def behind_proxy(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[DatabaseBehindProxy]:
    async with (
        tcp_proxy(*database_address(database_url)) as proxy,
        running_server(proxied(database_url, proxy.port), **FAST) as server,
    ):
        yield DatabaseBehindProxy(proxy, server)
    # An outage is expected, not a bug: nothing may be logged as an error.
    errors = [r.getMessage() for r in caplog.get_records("call") if r.levelno >= logging.ERROR]
    assert not errors, errors


@contextlib.asynccontextmanager
async def writes_refused(db: asyncpg.Connection, namespace: str) -> AsyncIterator[None]:
    """Every UPDATE of the namespace's task rows fails as on a read-only standby (SQLSTATE 25006).

    A BEFORE UPDATE trigger limited to the namespace; reads and other
    namespaces are untouched. The DDL is quoted by the database (``format``).
    """
    trigger = "refuse_writes_" + re.sub(r"\W", "_", namespace)
    await db.execute(
        "CREATE OR REPLACE FUNCTION leasekeeper_test_refuse_writes() RETURNS trigger"
        " LANGUAGE plpgsql AS $$ BEGIN"
        " IF OLD.namespace = TG_ARGV[0] THEN"
        " RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction'"
        " USING ERRCODE = 'read_only_sql_transaction'; END IF;"
        " RETURN NEW; END $$"
    )
    create = await db.fetchval(
        "SELECT format('CREATE TRIGGER %I BEFORE UPDATE ON leasekeeper_tasks FOR EACH ROW"
        " EXECUTE FUNCTION leasekeeper_test_refuse_writes(%L)', $1::text, $2::text)",
        trigger,
        namespace,
    )
    await db.execute(create)
    try:
        yield
    finally:
        drop = await db.fetchval(
            "SELECT format('DROP TRIGGER IF EXISTS %I ON leasekeeper_tasks', $1::text)", trigger
        )
        await db.execute(drop)


async def expect_stream_unavailable(call: Any) -> float:
    """Reads ``call`` until it ends; it must end UNAVAILABLE DATABASE_UNAVAILABLE. Returns when."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        while (reply := await call.read()) is not grpc.aio.EOF:
            pytest.fail(f"a reply while renewals are refused: {reply}")
        pytest.fail(f"stream ended {await call.code()} instead of UNAVAILABLE")
    ended_at = time.monotonic()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    assert error_info(caught.value).reason == "DATABASE_UNAVAILABLE"
    return ended_at


async def test_heartbeat_writes_refused_stream_ends_unavailable_at_once_reads_answer(
    behind_proxy: DatabaseBehindProxy, db: asyncpg.Connection, namespace: str
) -> None:
    """The protocol level, on raw stubs: what the server promises to any client."""
    lease = {"namespace": namespace, "task_id": "t", "owner_id": "a"}
    async with grpc.aio.insecure_channel(behind_proxy.server.target) as channel:
        stub = rpc.LeaseServiceStub(channel)
        granted = await stub.Claim(pb.ClaimRequest(**lease, ttl=dur(LONG_TTL_S)), timeout=5)
        fence = granted.lease.fence
        beats: asyncio.Queue[pb.HeartbeatRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[pb.HeartbeatRequest]:
            while (message := await beats.get()) is not None:
                yield message

        call = stub.Heartbeat(requests(), timeout=20)
        await beats.put(pb.HeartbeatRequest(**lease, fence=fence, ttl=dur(LONG_TTL_S)))
        assert (await asyncio.wait_for(call.read(), 5)).renewed
        before = await task_row(db, namespace, "t")

        async with writes_refused(db, namespace):
            beat_at = time.monotonic()
            await beats.put(pb.HeartbeatRequest())  # the next beat: a renewal, refused
            told_s = await expect_stream_unavailable(call) - beat_at
            await beats.put(None)
            assert told_s < ANSWER_WITHIN_S, told_s

            # Reads work and show the lease as it was: HELD, same owner, fence, expire_time.
            got = (await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id="t"))).lease
            assert (got.state, got.owner_id, got.fence) == (pb.TASK_STATE_HELD, "a", fence)
            assert (
                got.expire_time.ToDatetime(tzinfo=before["expire_time"].tzinfo)
                == (before["expire_time"])
            )
            check = pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=fence)
            assert (await stub.ValidateFence(check, timeout=5)).valid
            rival = await stub.Claim(
                pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="b", ttl=dur(5)),
                timeout=5,
            )
            assert not rival.acquired and rival.holder_remaining_ttl.seconds > LONG_TTL_S - 10

            # Every renewal path is refused the same way, and a resumed stream too.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Renew(pb.RenewRequest(**lease, fence=fence), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            resumed = stub.Heartbeat(timeout=10)
            await resumed.write(pb.HeartbeatRequest(**lease, fence=fence))
            await expect_stream_unavailable(resumed)

        after = await task_row(db, namespace, "t")
        assert (after["owner_id"], after["fence"], after["expire_time"]) == (
            "a",
            fence,
            before["expire_time"],
        )
        assert after["live"]
        # Writes accepted again: the lease lived on, a new stream resumes it with the same fence.
        resumed = stub.Heartbeat(timeout=10)
        await resumed.write(pb.HeartbeatRequest(**lease, fence=fence, ttl=dur(LONG_TTL_S)))
        reply = await asyncio.wait_for(resumed.read(), 5)
        assert (reply.fence, reply.renewed) == (fence, True)
        await resumed.done_writing()
        assert await asyncio.wait_for(resumed.read(), 5) is grpc.aio.EOF


@pytest.mark.parametrize("fault", ["database_cut", "writes_refused"])
async def test_hold_renewals_failing_holder_told_at_once_lease_kept_same_fence(
    behind_proxy: DatabaseBehindProxy, db: asyncpg.Connection, namespace: str, fault: str
) -> None:
    """The client level: ``hold()`` tells the holder at once, and does not call it a loss.

    guarantees.md: UNAVAILABLE is "safe to retry"; a heartbeat ended UNAVAILABLE
    is resumed "with the same fence"; the lease is lost for the client at its
    trust deadline unless a renewal is confirmed. The client docs
    (``_heartbeat.py``, ``HeldLease.renewal_error``): reopen with backoff for as
    long as the trust deadline allows, with ``renewal_error`` set meanwhile.
    """
    within_s = TOLD_AFTER_CUT_WITHIN_S if fault == "database_cut" else TOLD_AFTER_REFUSAL_WITHIN_S
    async with LeaseClient(behind_proxy.server.target, namespace=namespace) as client:
        async with client.hold("t", ttl=LONG_TTL_S) as lease:
            assert lease.info.expire_time is not None
            await renewed_after(db, namespace, "t", lease.info.expire_time)  # the stream is open
            assert lease.renewal_error is None

            async with contextlib.AsyncExitStack() as fault_lasts:
                if fault == "database_cut":
                    behind_proxy.proxy.cut()
                    fault_lasts.callback(behind_proxy.proxy.restore)
                else:
                    await fault_lasts.enter_async_context(writes_refused(db, namespace))
                faulted_at = time.monotonic()
                trust_left_s = lease.remaining_s()

                told_from = time.monotonic()
                await poll(lambda: lease.renewal_error, "told", within_s, POLL_INTERVAL_S)
                told_s = time.monotonic() - told_from
                error = lease.renewal_error
                assert isinstance(error, LeaseUnavailable), repr(error)
                assert error.reason == "DATABASE_UNAVAILABLE"
                # Not a loss: the lease is HELD in the database, and the holder keeps
                # its trust window (no renewal confirmed since, none refused as lost).
                assert not lease.lost
                assert lease.remaining_s() > trust_left_s - (time.monotonic() - faulted_at) - 0.1
                if fault == "writes_refused":
                    seen = await client.get_lease("t")  # reads work
                    assert (seen.state, seen.owner_id, seen.fence) == (
                        "HELD",
                        client.owner_id,
                        lease.fence,
                    )

            recovered_from = time.monotonic()
            await poll(
                lambda: lease.renewal_error is None, "renewed", RECOVER_WITHIN_S, POLL_INTERVAL_S
            )
            recovered_s = time.monotonic() - recovered_from
            assert not lease.lost
            row = await task_row(db, namespace, "t")
            assert (row["owner_id"], row["fence"], row["live"]) == (
                client.owner_id,
                lease.fence,
                True,
            )
            assert lease.remaining_s() > LONG_TTL_S - 2
    logging.getLogger(__name__).info(
        "b %s: told %.3f s after the fault (trust deadline was %.1f s away, ttl %.0f s);"
        " renewed again %.3f s after the fault ended",
        fault,
        told_s,
        trust_left_s,
        LONG_TTL_S,
        recovered_s,
    )


# -- c. a delayed renewal --------------------------------------------------------------

SHORT_TTL_S = 1.0
# Held in the network past the expiry (one ttl after the claim) and the rival's
# claim (a poll and one call, well under a second).
RENEWAL_DELAY_S = SHORT_TTL_S + 1.5
# guarantees.md: a heartbeat stream ends "as soon as ownership is lost" (the contract
# tests allow 1 s; the server's expiry timer fires 20 ms after expire_time).
LOSS_PUSH_S = 1.0


@pytest.mark.parametrize("via", ["renew", "heartbeat_first_message", "heartbeat_later_beat"])
async def test_delayed_renewal_after_expiry_and_new_claim_refused_new_owner_untouched(
    database_url: str, db: asyncpg.Connection, namespace: str, via: str
) -> None:
    lease = {"namespace": namespace, "task_id": "t", "owner_id": "a"}
    async with (
        running_server(database_url) as server,
        tcp_proxy("127.0.0.1", server.port) as proxy,
        grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}") as late_channel,
        grpc.aio.insecure_channel(server.target) as direct_channel,
    ):
        late, direct = rpc.LeaseServiceStub(late_channel), rpc.LeaseServiceStub(direct_channel)
        granted = await late.Claim(pb.ClaimRequest(**lease, ttl=dur(SHORT_TTL_S)), timeout=5)
        fence = granted.lease.fence
        renewal = pb.HeartbeatRequest(**lease, fence=fence, ttl=dur(LONG_TTL_S))
        stream = None
        if via == "heartbeat_later_beat":
            stream = late.Heartbeat(timeout=15)
            await stream.write(pb.HeartbeatRequest(**lease, fence=fence, ttl=dur(SHORT_TTL_S)))
            assert (await asyncio.wait_for(stream.read(), 5)).renewed

        proxy.delay(RENEWAL_DELAY_S, "upstream")
        outcome: asyncio.Future[Any]
        if via == "renew":
            request = pb.RenewRequest(**lease, fence=fence, ttl=dur(LONG_TTL_S))
            outcome = asyncio.ensure_future(late.Renew(request, timeout=15))
        else:
            if stream is None:
                stream = late.Heartbeat(timeout=15)
            else:
                renewal = pb.HeartbeatRequest(ttl=dur(LONG_TTL_S))  # a later beat names nothing
            await stream.write(renewal)
            outcome = asyncio.ensure_future(stream.read())
        await poll(
            lambda: proxy.queued_chunks,
            "the renewal held in the proxy",
            STEP_TIMEOUT_S,
            POLL_INTERVAL_S,
        )
        sent_at = time.monotonic()

        # Real time is the point: the lease must run out its ttl on the database clock.
        await wait_expired(db, namespace, "t")
        expired_at = time.monotonic()
        if via == "heartbeat_later_beat":
            # The server ends this stream itself at the expiry, pushed (downstream is
            # not delayed), while the beat is still in the network.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(outcome, LOSS_PUSH_S)
            assert caught.value.code() == grpc.StatusCode.ABORTED
            assert error_info(caught.value).reason == "LEASE_EXPIRED"
            assert proxy.queued_chunks, "the beat arrived before the stream ended"
        taken = await direct.Claim(
            pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="b", ttl=dur(LONG_TTL_S)),
            timeout=5,
        )
        assert taken.acquired and taken.lease.fence == fence + 1
        claimed_at = time.monotonic()
        before = await task_row(db, namespace, "t")
        assert proxy.queued_chunks, "the renewal left the proxy before the new claim"

        if via == "heartbeat_later_beat":
            # The beat lands on a finished stream. A call behind it on the same
            # connection: its answer proves the server has read the beat (order kept).
            proxy.restore()
            check = pb.ValidateFenceRequest(namespace=namespace, task_id="t", fence=fence)
            checked = await late.ValidateFence(check, timeout=10)
            assert not checked.valid and checked.current_fence == fence + 1
        else:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await outcome
            assert caught.value.code() == grpc.StatusCode.ABORTED, caught.value
            info = error_info(caught.value)
            assert info.reason == "LEASE_SUPERSEDED"
            assert info.metadata["current_fence"] == str(fence + 1)
        answered_at = time.monotonic()
        assert answered_at - sent_at >= RENEWAL_DELAY_S - 0.5  # sent_at was polled

        after = await task_row(db, namespace, "t")
        untouched = ("owner_id", "fence", "state", "expire_time", "claim_time", "update_time")
        assert {k: after[k] for k in untouched} == {k: before[k] for k in untouched}
        assert after["owner_id"] == "b" and after["live"]
        if stream is not None:
            stream.cancel()
    logging.getLogger(__name__).info(
        "c %s: answered %.3f s after it was sent, %.3f s after the expiry was seen and"
        " %.3f s after the new claim",
        via,
        answered_at - sent_at,
        answered_at - expired_at,
        answered_at - claimed_at,
    )
