"""The effect ledger's client parts without a server: errors, conversions, digests, arguments.

The runner's protocol is tested against the real server in
tests/integration/test_client_effects.py.
"""

import hashlib
import math
from datetime import UTC, datetime

import grpc
import pytest
from google.protobuf import timestamp_pb2

from leasekeeper import (
    BeginResult,
    EffectAlreadyCompleted,
    EffectError,
    EffectFailed,
    EffectInDoubt,
    EffectKeyReused,
    EffectNotBegun,
    EffectRecord,
    HeldLease,
    InvalidArgument,
    LeaseClient,
    LeaseError,
    LeaseLost,
    TaskCompleted,
    request_digest,
)
from leasekeeper._trust import TrustWindow
from leasekeeper._types import (
    LeaseInfo,
    begin_result,
    effect_outcome,
    effect_policy,
    effect_record,
    effect_state,
)
from leasekeeper.errors import from_rpc_error
from leasekeeper.v1 import lease_service_pb2 as pb
from tests.unit.test_client_errors import rpc_error

BEGIN = datetime(2030, 1, 2, 3, 4, 5, 600_000, tzinfo=UTC)
COMPLETE = datetime(2030, 1, 2, 3, 4, 9, tzinfo=UTC)


def _stamp(dt: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(dt)
    return stamp


def _record(**overrides) -> EffectRecord:
    values = {
        "namespace": "ns",
        "task_id": "t",
        "effect_key": "email:welcome",
        "policy": "ONCE",
        "request_digest": b"",
        "state": "RESERVED",
        "fence": 3,
        "complete_fence": 0,
        "retryable": False,
        "result": b"",
        "attempts": 2,
        "begin_time": BEGIN,
        "complete_time": None,
    }
    values.update(overrides)
    return EffectRecord(**values)


# Errors


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("EFFECT_KEY_REUSED", EffectKeyReused),
        ("EFFECT_NOT_BEGUN", EffectNotBegun),
        ("EFFECT_ALREADY_COMPLETED", EffectAlreadyCompleted),
        ("TASK_COMPLETED", TaskCompleted),
    ],
)
def test_from_rpc_error_failed_precondition_maps_effect_reasons_to_classes(reason, kind):
    error = from_rpc_error(
        rpc_error(grpc.StatusCode.FAILED_PRECONDITION, reason, {"effect_key": "k"}),
        task_id="t",
        fence=2,
    )
    assert type(error) is kind
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, reason)
    assert error.metadata == {"effect_key": "k"}
    assert isinstance(error, EffectError) is (kind is not TaskCompleted)


@pytest.mark.parametrize("reason", ["EFFECT_KEY_REUSED", "EFFECT_NOT_BEGUN"])
def test_from_rpc_error_effect_reason_under_other_code_is_not_effect_error(reason):
    error = from_rpc_error(rpc_error(grpc.StatusCode.INTERNAL, reason))
    assert type(error) is LeaseError


def test_from_rpc_error_aborted_on_effect_call_is_lease_lost():
    error = from_rpc_error(
        rpc_error(grpc.StatusCode.ABORTED, "LEASE_SUPERSEDED", {"current_fence": "4"}),
        task_id="t",
        fence=3,
    )
    assert type(error) is LeaseLost
    assert (error.task_id, error.fence, error.current_fence) == ("t", 3, 4)


def test_effect_in_doubt_carries_earlier_attempt_and_says_reconcile():
    earlier = _record(fence=3, attempts=2)

    error = EffectInDoubt(earlier)

    assert error.effect is earlier
    assert isinstance(error, EffectError)
    assert error.code is None
    assert (error.metadata["fence"], error.metadata["attempts"]) == ("3", "2")
    text = str(error)
    assert "'email:welcome'" in text
    assert "fence 3" in text
    assert BEGIN.isoformat() in text
    assert "reconcile" in text


@pytest.mark.parametrize(
    ("result", "expected"), [(b"\x00raw", b"\x00raw"), ("déclinée", "déclinée".encode())]
)
def test_effect_failed_keeps_retryable_and_result_as_bytes(result, expected):
    error = EffectFailed("card declined", retryable=True, result=result)
    assert error.retryable is True
    assert error.result == expected
    assert error.effect is None
    assert isinstance(error, EffectError)
    assert str(error) == "card declined"


def test_effect_failed_defaults_to_permanent_with_empty_result():
    error = EffectFailed()
    assert (error.retryable, error.result) == (False, b"")


# Conversions


def test_effect_record_converts_enums_bytes_and_instants():
    message = pb.Effect(
        namespace="ns",
        task_id="t",
        effect_key="email:welcome",
        policy=pb.EFFECT_POLICY_LATEST,
        request_digest=b"\x01\x02",
        state=pb.EFFECT_STATE_SUCCEEDED,
        fence=3,
        complete_fence=4,
        result=b"msg-17",
        attempts=2,
        begin_time=_stamp(BEGIN),
        complete_time=_stamp(COMPLETE),
    )

    record = effect_record(message)

    assert record == _record(
        policy="LATEST",
        request_digest=b"\x01\x02",
        state="SUCCEEDED",
        complete_fence=4,
        result=b"msg-17",
        complete_time=COMPLETE,
    )
    assert record.begin_time.tzinfo is not None


def test_effect_record_reserved_has_no_complete_time():
    record = effect_record(
        pb.Effect(effect_key="k", state=pb.EFFECT_STATE_RESERVED, begin_time=_stamp(BEGIN))
    )
    assert (record.state, record.complete_time, record.complete_fence) == ("RESERVED", None, 0)


@pytest.mark.parametrize(
    ("decision", "name"),
    [
        (pb.EFFECT_DECISION_PROCEED, "PROCEED"),
        (pb.EFFECT_DECISION_ALREADY_APPLIED, "ALREADY_APPLIED"),
        (pb.EFFECT_DECISION_IN_DOUBT, "IN_DOUBT"),
        (pb.EFFECT_DECISION_UNSPECIFIED, "UNSPECIFIED"),
    ],
)
def test_begin_result_names_decision_and_converts_effect(decision, name):
    result = begin_result(
        pb.BeginEffectResponse(
            decision=decision, effect=pb.Effect(effect_key="k", fence=5, attempts=1)
        )
    )
    assert result.decision == name
    assert (result.effect.effect_key, result.effect.fence, result.effect.attempts) == ("k", 5, 1)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ONCE", pb.EFFECT_POLICY_ONCE),
        ("latest", pb.EFFECT_POLICY_LATEST),
        ("EFFECT_POLICY_LATEST", pb.EFFECT_POLICY_LATEST),
    ],
)
def test_effect_policy_accepts_short_and_full_names(name, value):
    assert effect_policy(name) == value


@pytest.mark.parametrize(
    ("convert", "value", "field"),
    [
        (effect_policy, "ALWAYS", "policy"),
        (effect_policy, "UNSPECIFIED", "policy"),
        (effect_policy, None, "policy"),
        (effect_state, "DONE", "state"),
        (effect_outcome, "RESERVED", "outcome"),
        (effect_outcome, "OK", "outcome"),
    ],
)
def test_effect_enum_unknown_name_raises_invalid_argument_naming_field(convert, value, field):
    with pytest.raises(InvalidArgument) as caught:
        convert(value)
    assert caught.value.field == field
    assert caught.value.code is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (None, pb.EFFECT_STATE_UNSPECIFIED),
        ("reserved", pb.EFFECT_STATE_RESERVED),
        ("EFFECT_STATE_FAILED", pb.EFFECT_STATE_FAILED),
    ],
)
def test_effect_state_filter_accepts_none_and_names(name, value):
    assert effect_state(name) == value


# request_digest


def test_request_digest_of_bytes_and_text_is_sha256_of_utf8():
    assert request_digest(b"\xffraw") == hashlib.sha256(b"\xffraw").digest()
    assert request_digest("héllo") == hashlib.sha256("héllo".encode()).digest()
    assert len(request_digest("")) == 32


def test_request_digest_of_mapping_is_canonical_json():
    value = {"to": "ana@example.com", "body": "Bienvenue", "tags": [2, 1]}
    canonical = '{"body":"Bienvenue","tags":[2,1],"to":"ana@example.com"}'

    assert request_digest(value) == hashlib.sha256(canonical.encode()).digest()
    reordered = {"tags": [2, 1], "to": "ana@example.com", "body": "Bienvenue"}
    assert request_digest(reordered) == request_digest(value)


def test_request_digest_keeps_non_ascii_text_as_utf8_in_json():
    assert request_digest({"name": "Zoë"}) == hashlib.sha256('{"name":"Zoë"}'.encode()).digest()


def test_request_digest_differs_for_different_requests():
    assert request_digest({"to": "a"}) != request_digest({"to": "b"})
    assert request_digest([1, 2]) != request_digest([2, 1])


@pytest.mark.parametrize(
    ("value", "error"),
    [({"amount": math.nan}, ValueError), ({"when": datetime(2030, 1, 1)}, TypeError)],
)
def test_request_digest_refuses_values_json_cannot_encode(value, error):
    with pytest.raises(error):
        request_digest(value)


# Arguments checked before anything is sent


@pytest.fixture
async def closed_client():
    """A client whose every RPC would fail with RuntimeError: a local check must come first."""
    client = LeaseClient("127.0.0.1:1", namespace="ns")
    await client.close()
    return client


async def test_begin_effect_unknown_policy_is_refused_locally(closed_client):
    with pytest.raises(InvalidArgument) as caught:
        await closed_client.begin_effect("t", 1, "k", policy="SOMETIMES")
    assert (caught.value.field, caught.value.code) == ("policy", None)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"outcome": "RESERVED"}, "outcome"),
        ({"outcome": "DONE"}, "outcome"),
        ({"outcome": "SUCCEEDED", "retryable": True}, "retryable"),
    ],
)
async def test_complete_effect_bad_outcome_is_refused_locally(closed_client, kwargs, field):
    with pytest.raises(InvalidArgument) as caught:
        await closed_client.complete_effect("t", 1, "k", **kwargs)
    assert (caught.value.field, caught.value.code) == (field, None)


async def test_list_effects_unknown_state_is_refused_locally(closed_client):
    with pytest.raises(InvalidArgument) as caught:
        await closed_client.list_effects("t", state="DONE")
    assert caught.value.field == "state"


async def test_effect_calls_with_valid_arguments_reach_the_channel(closed_client):
    # The counterpart of the tests above: valid arguments pass the local checks.
    with pytest.raises(RuntimeError, match="closed"):
        await closed_client.begin_effect("t", 1, "k", policy="once")
    with pytest.raises(RuntimeError, match="closed"):
        await closed_client.complete_effect("t", 1, "k", outcome="FAILED", retryable=True)
    with pytest.raises(RuntimeError, match="closed"):
        await closed_client.list_effects("t", state="RESERVED")


def _held_lease(client: LeaseClient, window: TrustWindow) -> HeldLease:
    info = LeaseInfo("ns", "t", client.owner_id, 1, "HELD", None, 5.0, None, None, None)
    return HeldLease(client, info, window)


async def test_lease_effect_unknown_policy_is_refused_when_made(closed_client):
    lease = _held_lease(closed_client, TrustWindow(0.0))
    with pytest.raises(InvalidArgument) as caught:
        lease.effect("k", policy="ALWAYS")
    assert caught.value.field == "policy"


async def test_lease_effect_on_lost_lease_refuses_to_start_and_sends_nothing(closed_client):
    lease = _held_lease(closed_client, TrustWindow(0.0))  # never confirmed: trust expired
    calls = []

    async def send() -> str:
        calls.append("send")
        return "sent"

    with pytest.raises(LeaseLost) as caught:
        await lease.effect("k", policy="ONCE").run(send)

    assert caught.value.reason == "LEASE_EXPIRED"
    assert calls == []


class ScriptedLedger:
    """Stands in for the client's two effect calls, for the one branch a real server
    cannot reach on demand: another attempt reserved between our FAILED and our BeginEffect."""

    def __init__(self, decisions: list[str]) -> None:
        self.decisions = decisions
        self.calls: list[tuple[str, ...]] = []

    async def begin_effect(self, task_id, fence, effect_key, **kwargs) -> BeginResult:
        self.calls.append(("begin", effect_key))
        return BeginResult(self.decisions.pop(0), _record(fence=fence))

    async def complete_effect(self, task_id, fence, effect_key, *, outcome, **kwargs):
        self.calls.append(("complete", outcome))
        return _record(state=outcome, complete_fence=fence)


async def test_lease_effect_in_doubt_again_after_reconcile_raises_instead_of_looping():
    ledger = ScriptedLedger(["IN_DOUBT", "IN_DOUBT"])
    window = TrustWindow(0.0, clock=lambda: 0.0)
    window.confirm(0.0, 60.0)
    info = LeaseInfo("ns", "t", "o", 3, "HELD", None, 60.0, None, None, None)
    lease = HeldLease(ledger, info, window)
    reconciles, sends = [], []

    async def never_sent(earlier: EffectRecord) -> None:
        reconciles.append(earlier)

    async def send() -> str:
        sends.append("send")
        return "sent"

    with pytest.raises(EffectInDoubt):
        await lease.effect("k", policy="ONCE", reconcile=never_sent).run(send)

    assert ledger.calls == [("begin", "k"), ("complete", "FAILED"), ("begin", "k")]
    assert (len(reconciles), sends) == (1, [])
