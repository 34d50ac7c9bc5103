"""Resumable runs without a server: checkpoint and history conversions, and their errors."""

from datetime import UTC, datetime

import grpc
import pytest
from google.protobuf import timestamp_pb2

from leasekeeper import (
    Checkpoint,
    CheckpointNotNewer,
    HistoryEntry,
    HistoryKind,
    InvalidArgument,
    LeaseError,
    LeaseLost,
    TaskCancelled,
    TaskCompleted,
    TaskEnded,
    TaskFailed,
    TaskNotQuarantined,
    TaskQuarantined,
)
from leasekeeper._checkpoint import checkpoint_of, saved
from leasekeeper._types import TASK_STATES, claim_result, completed_effect, lease_info, task_state
from leasekeeper.checkpoints import checkpoint_message
from leasekeeper.errors import LOSS_REASONS, from_rpc_error
from leasekeeper.history import history_entry, history_kind, page
from leasekeeper.v1 import lease_service_pb2 as pb
from tests.unit.test_client_errors import rpc_error

WRITTEN = datetime(2030, 1, 2, 3, 4, 5, 600_000, tzinfo=UTC)


def _stamp(dt: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(dt)
    return stamp


def test_every_task_state_of_the_proto_is_a_client_state_name():
    names = {name.removeprefix("TASK_STATE_") for name in pb.TaskState.keys()} - {"UNSPECIFIED"}
    assert set(TASK_STATES) == names
    for name in ("QUARANTINED", "CANCELLED", "FAILED"):
        assert task_state(name) == pb.TaskState.Value(f"TASK_STATE_{name}")


def test_every_loss_reason_of_the_proto_is_known_to_the_client():
    names = {name.removeprefix("LOSS_REASON_") for name in pb.LossReason.keys()}
    assert set(LOSS_REASONS) == names - {"UNSPECIFIED"}


def test_every_history_kind_of_the_proto_is_a_member():
    names = {name.removeprefix("HISTORY_KIND_") for name in pb.HistoryKind.keys()}
    assert {kind.value for kind in HistoryKind} == names


def test_lease_info_carries_attempts_reasons_and_checkpoint_size():
    info = lease_info(
        pb.Lease(
            task_id="t",
            fence=3,
            state=pb.TASK_STATE_QUARANTINED,
            end_reason=pb.LOSS_REASON_LEASE_EXPIRED,
            attempts=2,
            max_attempts=2,
            checkpoint_version=7,
            checkpoint_size=128,
        )
    )
    assert (info.state, info.attempts, info.max_attempts) == ("QUARANTINED", 2, 2)
    assert (info.checkpoint_version, info.checkpoint_size) == (7, 128)
    assert (info.cancel_reason, info.fail_reason) == ("", "")
    cancelled = lease_info(pb.Lease(state=pb.TASK_STATE_CANCELLED, cancel_reason="stop it"))
    failed = lease_info(pb.Lease(state=pb.TASK_STATE_FAILED, fail_reason="bad input"))
    assert (cancelled.state, cancelled.cancel_reason) == ("CANCELLED", "stop it")
    assert (failed.state, failed.fail_reason) == ("FAILED", "bad input")


def test_claim_result_acquired_carries_the_grants_checkpoint():
    stored = pb.Checkpoint(
        version=4, data=b"row=40", content_type="text/plain", fence=2, write_time=_stamp(WRITTEN)
    )
    result = claim_result(
        pb.ClaimResponse(acquired=True, lease=pb.Lease(fence=3), checkpoint=stored), send_time=1.0
    )
    assert result.checkpoint == Checkpoint(4, b"row=40", "text/plain", 2, WRITTEN)
    assert claim_result(pb.ClaimResponse(acquired=True, lease=pb.Lease()), 1.0).checkpoint is None
    refused = claim_result(pb.ClaimResponse(acquired=False, checkpoint=stored), send_time=1.0)
    assert refused.checkpoint is None


def test_checkpoint_of_an_unset_write_time_is_none():
    assert checkpoint_of(pb.Checkpoint(version=1, data=b"x")) == Checkpoint(1, b"x")


@pytest.mark.parametrize(
    "value",
    [
        Checkpoint(5, b"d", "application/json", fence=9, write_time=WRITTEN),
        (5, b"d", "application/json"),
    ],
)
def test_checkpoint_message_sends_version_data_and_content_type_only(value):
    message = checkpoint_message(value)
    assert message == pb.Checkpoint(version=5, data=b"d", content_type="application/json")


def test_checkpoint_message_of_a_pair_has_no_content_type():
    assert checkpoint_message((2, bytearray(b"ab"))) == pb.Checkpoint(version=2, data=b"ab")


@pytest.mark.parametrize(
    "value", [(1, "text"), ("1", b"d"), (True, b"d"), (1, b"d", 3), (1,), b"data", None]
)
def test_checkpoint_message_refuses_what_is_not_a_checkpoint_locally(value):
    with pytest.raises(InvalidArgument) as caught:
        checkpoint_message(value, "next_checkpoint")
    assert caught.value.code is None
    assert caught.value.field == "next_checkpoint"


def test_saved_keeps_the_data_sent_and_takes_the_servers_fence_and_write_time():
    sent = pb.Checkpoint(version=3, data=b"progress", content_type="text/plain")
    stored = pb.Checkpoint(version=3, fence=6, write_time=_stamp(WRITTEN))
    assert saved(sent, stored, fence=6) == Checkpoint(3, b"progress", "text/plain", 6, WRITTEN)
    assert saved(sent, None, fence=6) == Checkpoint(3, b"progress", "text/plain", 6, None)


def test_completed_effect_carries_the_operation_id_and_the_checkpoint_sent_uncompared():
    response = pb.CompleteEffectResponse(
        effect=pb.Effect(
            task_id="t",
            effect_key="charge",
            state=pb.EFFECT_STATE_SUCCEEDED,
            fence=4,
            complete_fence=4,
            external_operation_id="pay_123",
            begin_time=_stamp(WRITTEN),
        ),
        checkpoint=pb.Checkpoint(version=2, fence=4, write_time=_stamp(WRITTEN)),
    )
    sent = pb.Checkpoint(version=2, data=b"charged")
    effect = completed_effect(response, sent, fence=4)
    assert (effect.state, effect.external_operation_id) == ("SUCCEEDED", "pay_123")
    assert effect.checkpoint == Checkpoint(2, b"charged", "", 4, WRITTEN)
    bare = completed_effect(response, None, fence=4)
    assert bare.checkpoint is None
    assert bare == effect  # the checkpoint is not compared: it is the same effect


def test_history_entry_converts_every_field():
    message = pb.HistoryEntry(
        sequence=41,
        event_time=_stamp(WRITTEN),
        kind=pb.HISTORY_KIND_EFFECT_COMPLETED,
        fence=3,
        owner_id="w",
        effect_key="charge",
        effect_outcome=pb.EFFECT_STATE_SUCCEEDED,
        external_operation_id="pay_123",
    )
    assert history_entry(message) == HistoryEntry(
        sequence=41,
        event_time=WRITTEN,
        kind=HistoryKind.EFFECT_COMPLETED,
        fence=3,
        owner_id="w",
        effect_key="charge",
        effect_outcome="SUCCEEDED",
        external_operation_id="pay_123",
    )
    refused = history_entry(
        pb.HistoryEntry(
            sequence=42,
            kind=pb.HISTORY_KIND_FENCE_REFUSED,
            reason="LEASE_SUPERSEDED",
            method="BeginEffect",
        )
    )
    assert refused.kind == "FENCE_REFUSED" and refused.effect_outcome is None
    assert (refused.reason, refused.method, refused.event_time) == (
        "LEASE_SUPERSEDED",
        "BeginEffect",
        None,
    )


def test_history_kind_unknown_to_this_client_is_unspecified():
    assert history_kind(0) is HistoryKind.UNSPECIFIED
    assert history_kind(999) is HistoryKind.UNSPECIFIED
    assert history_kind(pb.HISTORY_KIND_CHECKPOINT_SAVED) is HistoryKind.CHECKPOINT_SAVED


def test_history_page_is_entries_and_the_next_token():
    entries, token = page(
        pb.ListTaskHistoryResponse(
            entries=[pb.HistoryEntry(sequence=1, kind=pb.HISTORY_KIND_GRANTED, attempt=1)],
            next_page_token="next",
        )
    )
    assert [(e.sequence, e.kind, e.attempt) for e in entries] == [(1, "GRANTED", 1)]
    assert token == "next"


@pytest.mark.parametrize(
    ("reason", "kind", "ended"),
    [
        ("TASK_COMPLETED", TaskCompleted, True),
        ("TASK_CANCELLED", TaskCancelled, True),
        ("TASK_FAILED", TaskFailed, True),
        ("TASK_QUARANTINED", TaskQuarantined, False),
        ("TASK_NOT_QUARANTINED", TaskNotQuarantined, False),
        ("CHECKPOINT_NOT_NEWER", CheckpointNotNewer, False),
    ],
)
def test_failed_precondition_reasons_of_runs_map_to_their_errors(reason, kind, ended):
    error = from_rpc_error(rpc_error(grpc.StatusCode.FAILED_PRECONDITION, reason), task_id="t")
    assert type(error) is kind
    assert isinstance(error, TaskEnded) is ended
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, reason)
    assert not error.retryable


def test_checkpoint_not_newer_carries_the_stored_version():
    error = from_rpc_error(
        rpc_error(
            grpc.StatusCode.FAILED_PRECONDITION, "CHECKPOINT_NOT_NEWER", {"current_version": "12"}
        )
    )
    assert isinstance(error, CheckpointNotNewer)
    assert error.current_version == 12
    local = CheckpointNotNewer.of(5, 12, "t", fence=3)
    assert (local.current_version, local.reason) == (12, "CHECKPOINT_NOT_NEWER")
    assert local.code is grpc.StatusCode.FAILED_PRECONDITION
    bare = from_rpc_error(rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "CHECKPOINT_NOT_NEWER"))
    assert isinstance(bare, CheckpointNotNewer) and bare.current_version == 0


def test_task_not_quarantined_carries_the_tasks_state():
    error = from_rpc_error(
        rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "TASK_NOT_QUARANTINED", {"state": "HELD"})
    )
    assert isinstance(error, TaskNotQuarantined) and error.state == "HELD"


@pytest.mark.parametrize("reason", ["TASK_CANCELLED", "TASK_FAILED"])
def test_aborted_by_a_runs_end_is_a_loss_with_that_reason(reason):
    error = from_rpc_error(rpc_error(grpc.StatusCode.ABORTED, reason), task_id="t", fence=4)
    assert type(error) is LeaseLost
    assert (error.reason, error.task_id, error.fence) == (reason, "t", 4)
    assert isinstance(error, LeaseError)
