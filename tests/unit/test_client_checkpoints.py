"""LeaseClient's run calls and a held lease's checkpoints, on test_client_hold's fake channel.

The fake stores one checkpoint as the server does (a higher version only) and
answers beats carrying one with the stored version, so the choice between the
heartbeat stream and SaveCheckpoint is seen without a server. The real
decisions are tested against a server in tests/integration/test_client_runs.py.
"""

import asyncio

import grpc
import pytest

from leasekeeper import (
    Checkpoint,
    CheckpointNotNewer,
    InvalidArgument,
    LeaseClient,
    LeaseLost,
    TaskQuarantined,
)
from leasekeeper.lease import LeaseState
from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import poll
from tests.unit import test_client_errors
from tests.unit.test_client_hold import TTL_S, FakeChannel, FakeHeartbeatCall, FakeLeaseServer
from tests.unit.test_client_hold import duration as dur


class RunServer(FakeLeaseServer):
    """The fake server, with one stored checkpoint and the run RPCs."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: pb.Checkpoint | None = None
        self.saves: list[pb.SaveCheckpointRequest] = []
        self.carried: list[pb.Checkpoint] = []
        self.cut_checkpoint_beats = False  # end the stream instead of answering such a beat
        self.max_bytes = 1024  # larger checkpoint data is refused INVALID_ARGUMENT
        self.unary_calls: list[tuple[str, object]] = []

    @property
    def version(self) -> int:
        return self.stored.version if self.stored is not None else 0

    def store(self, checkpoint: pb.Checkpoint) -> bool:
        if checkpoint.version <= self.version:
            return False
        self.stored = pb.Checkpoint(
            version=checkpoint.version,
            data=checkpoint.data,
            content_type=checkpoint.content_type,
            fence=self.fence,
        )
        return True

    async def unary(self, name: str, request):
        self.unary_calls.append((name, request))
        if name == "SaveCheckpoint":
            await asyncio.sleep(0)
            self.saves.append(request)
            if refusal := self.refusal(request.checkpoint):
                raise refusal
            same = self.stored is not None and (
                self.stored.version,
                self.stored.data,
            ) == (request.checkpoint.version, request.checkpoint.data)
            if not same and not self.store(request.checkpoint):
                raise test_client_errors.rpc_error(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "CHECKPOINT_NOT_NEWER",
                    {"current_version": str(self.version)},
                )
            return pb.SaveCheckpointResponse(
                checkpoint=pb.Checkpoint(version=self.version, fence=self.fence)
            )
        if name == "ListTaskHistory":
            start = int(request.page_token or 0)
            entries = [
                pb.HistoryEntry(sequence=s, kind=pb.HISTORY_KIND_GRANTED, fence=s)
                for s in range(start + 1, min(start + request.page_size, 5) + 1)
            ]
            token = "" if not entries or entries[-1].sequence >= 5 else str(entries[-1].sequence)
            return pb.ListTaskHistoryResponse(entries=entries, next_page_token=token)
        if name in ("Cancel", "Retry"):
            return getattr(pb, f"{name}Response")(lease=pb.Lease(task_id=request.task_id))
        if name == "CompleteEffect":
            if request.HasField("next_checkpoint"):
                self.store(request.next_checkpoint)
            return pb.CompleteEffectResponse(
                effect=pb.Effect(effect_key=request.effect_key, state=request.outcome),
                checkpoint=pb.Checkpoint(version=self.version, fence=request.fence),
            )
        response = await super().unary(name, request)
        if name == "Claim" and response.acquired and self.stored is not None:
            response.checkpoint.CopyFrom(self.stored)
        if name == "GetLease" and self.stored is not None:
            response.checkpoint.CopyFrom(self.stored)
        return response

    def refusal(self, checkpoint: pb.Checkpoint) -> grpc.aio.AioRpcError | None:
        if checkpoint.version < 1:
            field = "checkpoint.version"
        elif len(checkpoint.data) > self.max_bytes:
            field = "checkpoint.data"
        else:
            return None
        return test_client_errors.rpc_error(
            grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", violations=((field, "bad"),)
        )

    def on_beat(self, call: FakeHeartbeatCall, request) -> None:
        if request.HasField("checkpoint"):
            self.carried.append(request.checkpoint)
            if refusal := self.refusal(request.checkpoint):
                call.end(refusal)  # as the server: the stream ends, the lease lives on
                return
            if self.cut_checkpoint_beats:
                call.end(test_client_errors.rpc_error(grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"))
                return
            saved = self.store(request.checkpoint)
        else:
            saved = False
        call.answers.put_nowait(
            pb.HeartbeatResponse(
                fence=self.fence,
                remaining_ttl=dur(self.granted_ttl_s),
                renewed=True,
                checkpoint_version=self.version,
                checkpoint_saved=saved,
            )
        )


@pytest.fixture
def server() -> RunServer:
    return RunServer()


@pytest.fixture
def client(server) -> LeaseClient:
    return LeaseClient(namespace="ns", owner_id="worker-1", channel=FakeChannel(server))


async def streaming(lease) -> None:
    """Waits until the lease's heartbeat stream has answered a beat (it can carry checkpoints)."""
    await poll(lambda: lease._keeper._streaming, "the heartbeat stream answered")


async def test_claim_sends_max_attempts_and_returns_the_stored_checkpoint(server, client):
    server.stored = pb.Checkpoint(version=3, data=b"row=30", content_type="text/plain", fence=1)
    result = await client.claim("t1", ttl=30.0, max_attempts=4)
    assert server.claims[-1].max_attempts == 4
    assert result.checkpoint == Checkpoint(3, b"row=30", "text/plain", fence=1)
    assert await client.get_checkpoint("t1") == result.checkpoint


async def test_a_held_lease_resumes_from_the_grants_checkpoint_and_saves_on_the_stream(
    server, client
):
    server.stored = pb.Checkpoint(version=3, data=b"row=30", fence=1)
    async with client.hold("t1", ttl=TTL_S, max_attempts=2) as lease:
        assert lease.checkpoint == Checkpoint(3, b"row=30", fence=1)
        assert lease.checkpoint_version == 3
        await streaming(lease)
        saved = await lease.save_checkpoint(4, b"row=40", "text/plain")
        assert saved == Checkpoint(4, b"row=40", "text/plain", fence=lease.fence)
        assert lease.checkpoint_version == 4
        assert lease.checkpoint.version == 3  # the grant's, unchanged
    assert server.claims[0].max_attempts == 2
    assert [c.version for c in server.carried] == [4]
    assert server.saves == []  # no SaveCheckpoint: the beat carried it
    assert (server.stored.version, server.stored.data) == (4, b"row=40")


async def test_a_stale_version_is_sent_to_save_checkpoint_which_refuses_it(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        await streaming(lease)
        await lease.save_checkpoint(5, b"five")
        with pytest.raises(CheckpointNotNewer) as caught:
            await lease.save_checkpoint(5, b"other five")
        assert caught.value.current_version == 5
        again = await lease.save_checkpoint(5, b"five")  # the same write again: OK
        assert again.version == 5
    assert [c.version for c in server.carried] == [5]
    assert [s.checkpoint.data for s in server.saves] == [b"other five", b"five"]


async def test_a_higher_version_stored_meanwhile_is_refused_from_the_beats_answer(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        await streaming(lease)
        server.stored = pb.Checkpoint(version=9, fence=lease.fence)  # not yet heard by the lease
        with pytest.raises(CheckpointNotNewer) as caught:
            await lease.save_checkpoint(6, b"six")
        assert caught.value.current_version == 9
        assert lease.checkpoint_version == 9
    assert [c.version for c in server.carried] == [6] and server.saves == []


async def test_a_beat_that_ends_its_stream_unanswered_is_decided_by_save_checkpoint(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        await streaming(lease)
        server.cut_checkpoint_beats = True
        saved = await lease.save_checkpoint(2, b"two")
        assert saved.version == 2 and not lease.lost
    assert [c.version for c in server.carried] == [2]
    assert [s.checkpoint.version for s in server.saves] == [2]


async def test_a_checkpoint_the_stream_refuses_is_refused_by_save_checkpoint_not_lost(
    server, client
):
    async with client.hold("t1", ttl=TTL_S) as lease:
        await streaming(lease)
        with pytest.raises(InvalidArgument) as caught:
            await lease.save_checkpoint(1, b"x" * 2048)
        assert caught.value.field == "checkpoint.data"
        await poll(lambda: len(server.streams) == 2, "the heartbeat stream reopened")
        await streaming(lease)
        with pytest.raises(InvalidArgument):  # as large again: not carried, not reopened
            await lease.save_checkpoint(1, b"y" * 4096)
        assert (await lease.save_checkpoint(1, b"small")).version == 1
        assert not lease.lost and len(server.streams) == 2
    assert [len(c.data) for c in server.carried] == [2048, 5]
    assert [len(s.checkpoint.data) for s in server.saves] == [2048, 4096]


async def test_a_checkpoint_the_server_cannot_accept_is_not_carried(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        await streaming(lease)
        with pytest.raises(InvalidArgument) as caught:
            await lease.save_checkpoint(0, b"d")
        assert caught.value.field == "checkpoint.version"
        await lease.save_checkpoint(1, b"d", "bad\ttype")  # the fake checks the version only
        assert not lease.lost
    assert server.carried == [] and [s.checkpoint.version for s in server.saves] == [0, 1]


async def test_a_save_before_the_stream_answers_goes_by_save_checkpoint(server, client):
    server.silent = True  # beats are never answered: no stream can carry a checkpoint
    async with client.hold("t1", ttl=TTL_S) as lease:
        saved = await lease.save_checkpoint(1, b"one")
    assert saved == Checkpoint(1, b"one", fence=lease.fence)
    assert server.carried == [] and [s.fence for s in server.saves] == [lease.fence]


async def test_a_lost_lease_saves_nothing(server, client):
    with pytest.raises(LeaseLost) as caught:
        async with client.hold("t1", ttl=TTL_S) as lease:
            await streaming(lease)
            server.abort_streams("TASK_CANCELLED")
            await asyncio.sleep(10)
    assert caught.value.reason == "TASK_CANCELLED"
    assert server.releases == []  # a cancelled task is nobody's: nothing to release
    with pytest.raises(LeaseLost):
        await lease.save_checkpoint(1, b"late")
    assert server.carried == [] and server.saves == []


async def test_fail_ends_the_run_as_failed_and_releases_nothing_more(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        await lease.fail("bad input")
        assert lease.state is LeaseState.FAILED
        assert await lease.fail("bad input") is lease.info  # idempotent, nothing sent
    [release] = server.releases
    assert (release.fail, release.fail_reason, release.complete) == (True, "bad input", False)
    assert lease.state is LeaseState.FAILED and lease.loss is None


async def test_complete_after_fail_is_refused_locally(server, client):
    async with client.hold("t1", ttl=TTL_S) as lease:
        await lease.fail()
        with pytest.raises(Exception, match="already ended as failed"):
            await lease.complete()
    assert len(server.releases) == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"complete": True, "fail": True}, "fail"), ({"fail_reason": "why"}, "fail_reason")],
)
async def test_release_refuses_a_run_ending_both_ways_locally(server, client, kwargs, field):
    with pytest.raises(InvalidArgument) as caught:
        await client.release("t1", 1, **kwargs)
    assert caught.value.field == field and server.releases == []


async def test_cancel_retry_and_history_pages(server, client):
    assert (await client.cancel("t1", "stop")).task_id == "t1"
    assert (await client.retry("t1", "again")).task_id == "t1"
    sent = {name: request for name, request in server.unary_calls}
    assert (sent["Cancel"].namespace, sent["Cancel"].reason) == ("ns", "stop")
    assert (sent["Retry"].task_id, sent["Retry"].reason) == ("t1", "again")
    entries = [e async for e in client.iter_task_history("t1", page_size=2)]
    assert [e.sequence for e in entries] == [1, 2, 3, 4, 5]
    pages = [r.page_token for n, r in server.unary_calls if n == "ListTaskHistory"]
    assert pages == ["", "2", "4"]


async def test_complete_effect_sends_the_operation_id_and_next_checkpoint(server, client):
    effect = await client.complete_effect(
        "t1",
        3,
        "charge",
        outcome="SUCCEEDED",
        external_operation_id="pay_1",
        next_checkpoint=(2, b"charged", "text/plain"),
    )
    [(_, request)] = [c for c in server.unary_calls if c[0] == "CompleteEffect"]
    assert request.external_operation_id == "pay_1"
    assert request.next_checkpoint == pb.Checkpoint(
        version=2, data=b"charged", content_type="text/plain"
    )
    assert effect.checkpoint == Checkpoint(2, b"charged", "text/plain", fence=3)


async def test_hold_of_a_quarantined_task_raises_task_quarantined(server, client):
    server.claim_script.append(
        test_client_errors.rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "TASK_QUARANTINED")
    )
    with pytest.raises(TaskQuarantined):
        async with client.hold("t1", ttl=TTL_S, wait=5.0):
            pass
    assert len(server.claims) == 1  # not retried
