"""Conversions between protos and the client's value types."""

import math
from datetime import UTC, datetime, timedelta

import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from leasekeeper import InvalidArgument
from leasekeeper._types import (
    claim_result,
    fence_check,
    from_duration,
    lease_info,
    seconds,
    task_state,
    to_duration,
)
from leasekeeper.v1 import lease_service_pb2 as pb


@pytest.mark.parametrize(
    ("value", "expected"),
    [(30, 30.0), (0.25, 0.25), (timedelta(minutes=1, milliseconds=500), 60.5)],
)
def test_seconds_accepts_numbers_and_timedelta(value, expected):
    assert seconds(value, "ttl") == expected


@pytest.mark.parametrize("value", [math.inf, math.nan, "30", True, None])
def test_seconds_rejects_non_durations_locally(value):
    with pytest.raises(InvalidArgument) as caught:
        seconds(value, "ttl")
    assert caught.value.field == "ttl"
    assert caught.value.code is None


def test_to_duration_round_trips_with_nanosecond_precision():
    message = to_duration(1.5, "ttl")
    assert (message.seconds, message.nanos) == (1, 500_000_000)
    assert from_duration(message) == 1.5
    assert to_duration(None, "ttl") is None
    assert to_duration(timedelta(seconds=2), "ttl").seconds == 2


def _stamp(dt: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(dt)
    return stamp


def test_lease_info_converts_enums_instants_and_durations():
    expire = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    message = pb.Lease(
        namespace="ns",
        task_id="t",
        owner_id="o",
        fence=4,
        state=pb.TASK_STATE_HELD,
        expire_time=_stamp(expire),
        remaining_ttl=duration_pb2.Duration(seconds=29, nanos=500_000_000),
        claim_time=_stamp(expire - timedelta(seconds=30)),
    )
    info = lease_info(message)
    assert (info.namespace, info.task_id, info.owner_id, info.fence) == ("ns", "t", "o", 4)
    assert info.state == "HELD"
    assert info.expire_time == expire
    assert info.expire_time.tzinfo is not None
    assert info.remaining_ttl == 29.5
    assert info.runtime_deadline is None
    assert info.claim_time == expire - timedelta(seconds=30)
    assert info.end_reason is None


def test_lease_info_free_task_has_end_reason_and_no_expire_time():
    info = lease_info(
        pb.Lease(
            task_id="t", fence=2, state=pb.TASK_STATE_FREE, end_reason=pb.LOSS_REASON_LEASE_RELEASED
        )
    )
    assert (info.state, info.end_reason, info.expire_time) == ("FREE", "LEASE_RELEASED", None)


def test_claim_result_not_acquired_carries_holder_remaining_ttl():
    result = claim_result(
        pb.ClaimResponse(acquired=False, holder_remaining_ttl=duration_pb2.Duration(seconds=12)),
        send_time=7.0,
    )
    assert result.acquired is False
    assert result.lease is None
    assert result.holder_remaining_ttl == 12.0
    assert result.send_time == 7.0


def test_fence_check_invalid_carries_reason_and_current_fence():
    check = fence_check(
        pb.ValidateFenceResponse(
            valid=False, current_fence=9, reason=pb.LOSS_REASON_LEASE_SUPERSEDED
        )
    )
    assert (check.valid, check.current_fence, check.reason, check.remaining_ttl) == (
        False,
        9,
        "LEASE_SUPERSEDED",
        None,
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (None, pb.TASK_STATE_UNSPECIFIED),
        ("HELD", pb.TASK_STATE_HELD),
        ("held", pb.TASK_STATE_HELD),
        ("TASK_STATE_COMPLETED", pb.TASK_STATE_COMPLETED),
    ],
)
def test_task_state_accepts_short_and_full_names(name, value):
    assert task_state(name) == value


def test_task_state_unknown_name_raises_invalid_argument():
    with pytest.raises(InvalidArgument):
        task_state("LOCKED")
