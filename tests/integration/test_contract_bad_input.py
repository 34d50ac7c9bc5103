"""Bad input: INVALID_ARGUMENT naming the field, and nothing changed (guarantees.md: Bad input).

Every case runs against a namespace holding one live lease (task "t", owner
"a", fence 1) and compares the whole task table before and after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.helpers import bad_request_fields, dur, error_info
from tests.integration.contract_helpers import failure, grant, snapshot

pytestmark = pytest.mark.timeout(30)

LONG_ID = "x" * 257
LONG_UTF8_ID = "\u00e9" * 129  # 258 bytes in 129 characters: limits count bytes


def _claim(**kw: Any) -> Callable[[str], pb.ClaimRequest]:
    def build(ns: str) -> pb.ClaimRequest:
        fields = {"namespace": ns, "task_id": "new", "owner_id": "b", **kw}
        return pb.ClaimRequest(**fields)

    return build


def _renew(**kw: Any) -> Callable[[str], pb.RenewRequest]:
    def build(ns: str) -> pb.RenewRequest:
        fields = {"namespace": ns, "task_id": "t", "owner_id": "a", "fence": 1, **kw}
        return pb.RenewRequest(**fields)

    return build


def _release(**kw: Any) -> Callable[[str], pb.ReleaseRequest]:
    def build(ns: str) -> pb.ReleaseRequest:
        fields = {"namespace": ns, "task_id": "t", "owner_id": "a", "fence": 1, **kw}
        return pb.ReleaseRequest(**fields)

    return build


def _validate(**kw: Any) -> Callable[[str], pb.ValidateFenceRequest]:
    def build(ns: str) -> pb.ValidateFenceRequest:
        return pb.ValidateFenceRequest(**{"namespace": ns, "task_id": "t", "fence": 1, **kw})

    return build


def _get(**kw: Any) -> Callable[[str], pb.GetLeaseRequest]:
    def build(ns: str) -> pb.GetLeaseRequest:
        return pb.GetLeaseRequest(**{"namespace": ns, "task_id": "t", **kw})

    return build


def _list(**kw: Any) -> Callable[[str], pb.ListLeasesRequest]:
    def build(ns: str) -> pb.ListLeasesRequest:
        return pb.ListLeasesRequest(**{"namespace": ns, **kw})

    return build


def _list_namespaces(**kw: Any) -> Callable[[str], pb.ListNamespacesRequest]:
    def build(ns: str) -> pb.ListNamespacesRequest:
        return pb.ListNamespacesRequest(**kw)

    return build


def _stats(**kw: Any) -> Callable[[str], pb.GetNamespaceStatsRequest]:
    def build(ns: str) -> pb.GetNamespaceStatsRequest:
        return pb.GetNamespaceStatsRequest(**{"namespace": ns, **kw})

    return build


def _begin(**kw: Any) -> Callable[[str], pb.BeginEffectRequest]:
    def build(ns: str) -> pb.BeginEffectRequest:
        fields = {
            "namespace": ns,
            "task_id": "t",
            "fence": 1,
            "effect_key": "k",
            "policy": pb.EFFECT_POLICY_ONCE,
            **kw,
        }
        return pb.BeginEffectRequest(**fields)

    return build


def _complete(**kw: Any) -> Callable[[str], pb.CompleteEffectRequest]:
    def build(ns: str) -> pb.CompleteEffectRequest:
        fields = {
            "namespace": ns,
            "task_id": "t",
            "fence": 1,
            "effect_key": "k",
            "outcome": pb.EFFECT_STATE_SUCCEEDED,
            **kw,
        }
        return pb.CompleteEffectRequest(**fields)

    return build


def _list_effects(**kw: Any) -> Callable[[str], pb.ListEffectsRequest]:
    def build(ns: str) -> pb.ListEffectsRequest:
        return pb.ListEffectsRequest(**{"namespace": ns, "task_id": "t", **kw})

    return build


def _revoke(**kw: Any) -> Callable[[str], pb.RevokeRequest]:
    def build(ns: str) -> pb.RevokeRequest:
        return pb.RevokeRequest(**{"namespace": ns, "task_id": "t", "reason": "why", **kw})

    return build


def _raw(data: bytes) -> Callable[[str], bytes]:
    return lambda ns: data


def _b64(raw: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(raw).decode()


def _d(seconds: int, nanos: int = 0) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds, nanos=nanos)


CASES = [
    # ids: empty, over-long, control characters, NUL
    ("Claim", _claim(namespace=""), "namespace", "claim-empty-namespace"),
    ("Claim", _claim(task_id=""), "task_id", "claim-empty-task-id"),
    ("Claim", _claim(owner_id=""), "owner_id", "claim-empty-owner-id"),
    ("Claim", _claim(namespace=LONG_ID), "namespace", "claim-257-byte-namespace"),
    ("Claim", _claim(task_id=LONG_ID), "task_id", "claim-257-byte-task-id"),
    ("Claim", _claim(owner_id=LONG_ID), "owner_id", "claim-257-byte-owner-id"),
    ("Claim", _claim(task_id=LONG_UTF8_ID), "task_id", "claim-258-byte-utf8-task-id"),
    ("Claim", _claim(task_id="a\x00b"), "task_id", "claim-nul-task-id"),
    ("Claim", _claim(owner_id="a\nb"), "owner_id", "claim-newline-owner-id"),
    ("Claim", _claim(namespace="ns\x1b"), "namespace", "claim-escape-namespace"),
    ("Claim", _claim(task_id="\x7f"), "task_id", "claim-del-task-id"),
    ("Claim", _claim(task_id="a\u0085"), "task_id", "claim-c1-control-task-id"),
    ("Claim", _claim(request_id=LONG_ID), "request_id", "claim-257-byte-request-id"),
    ("Claim", _claim(request_id="r\x00"), "request_id", "claim-nul-request-id"),
    # by the live owner of "t": a valid request_id would supersede its lease
    (
        "Claim",
        _claim(task_id="t", owner_id="a", request_id="r\n"),
        "request_id",
        "claim-newline-request-id",
    ),
    ("Renew", _renew(task_id=""), "task_id", "renew-empty-task-id"),
    ("Renew", _renew(owner_id="a\x00"), "owner_id", "renew-nul-owner-id"),
    ("Release", _release(namespace=LONG_ID), "namespace", "release-257-byte-namespace"),
    ("Release", _release(task_id="t\t"), "task_id", "release-tab-task-id"),
    ("ValidateFence", _validate(task_id=""), "task_id", "validate-empty-task-id"),
    ("ValidateFence", _validate(namespace="\x00"), "namespace", "validate-nul-namespace"),
    ("GetLease", _get(task_id=LONG_ID), "task_id", "get-257-byte-task-id"),
    ("GetLease", _get(namespace=""), "namespace", "get-empty-namespace"),
    ("ListLeases", _list(namespace=""), "namespace", "list-empty-namespace"),
    ("ListLeases", _list(namespace="n\x01"), "namespace", "list-control-namespace"),
    # ttl outside [min_ttl 0.1 s, max_ttl 3600 s], negative, zero, malformed
    ("Claim", _claim(ttl=dur(0.05)), "ttl", "claim-ttl-below-min"),
    ("Claim", _claim(ttl=dur(3601)), "ttl", "claim-ttl-above-max"),
    ("Claim", _claim(ttl=_d(-1)), "ttl", "claim-ttl-negative"),
    ("Claim", _claim(ttl=_d(0, -500_000_000)), "ttl", "claim-ttl-negative-nanos"),
    ("Claim", _claim(ttl=_d(0)), "ttl", "claim-ttl-zero"),
    ("Claim", _claim(ttl=_d(1, -5)), "ttl", "claim-ttl-mixed-signs"),
    ("Claim", _claim(ttl=_d(1, 1_000_000_000)), "ttl", "claim-ttl-nanos-overflow"),
    ("Claim", _claim(ttl=_d(10**12)), "ttl", "claim-ttl-beyond-duration-range"),
    ("Renew", _renew(ttl=dur(0.05)), "ttl", "renew-ttl-below-min"),
    ("Renew", _renew(ttl=dur(3601)), "ttl", "renew-ttl-above-max"),
    ("Renew", _renew(ttl=_d(-5)), "ttl", "renew-ttl-negative"),
    # fence < 1
    ("Renew", _renew(fence=0), "fence", "renew-fence-zero"),
    ("Renew", _renew(fence=-1), "fence", "renew-fence-negative"),
    ("Release", _release(fence=0), "fence", "release-fence-zero"),
    ("Release", _release(fence=-(2**63)), "fence", "release-fence-min-int64"),
    ("Release", _release(fence=0, complete=True), "fence", "release-complete-fence-zero"),
    ("ValidateFence", _validate(fence=0), "fence", "validate-fence-zero"),
    ("ValidateFence", _validate(fence=-3), "fence", "validate-fence-negative"),
    # runtime budget above the server's max_runtime (86400 s), or not positive
    ("Claim", _claim(max_runtime=dur(86401)), "max_runtime", "claim-max-runtime-above-max"),
    ("Claim", _claim(max_runtime=_d(-1)), "max_runtime", "claim-max-runtime-negative"),
    ("Claim", _claim(max_runtime=_d(0)), "max_runtime", "claim-max-runtime-zero"),
    ("Claim", _claim(max_runtime=dur(0.05)), "max_runtime", "claim-max-runtime-below-min-ttl"),
    ("Claim", _claim(max_runtime=_d(0, 999)), "max_runtime", "claim-max-runtime-sub-microsecond"),
    ("Claim", _claim(ttl=_d(0, 1)), "ttl", "claim-ttl-one-nanosecond"),
    # a nanosecond beyond a bound is beyond it (a conversion to microseconds would hide it)
    ("Claim", _claim(ttl=_d(3600, 1)), "ttl", "claim-ttl-max-plus-one-nanosecond"),
    ("Renew", _renew(ttl=_d(3600, 999)), "ttl", "renew-ttl-max-plus-999-nanoseconds"),
    (
        "Claim",
        _claim(max_runtime=_d(86400, 1)),
        "max_runtime",
        "claim-max-runtime-max-plus-one-nanosecond",
    ),
    # enums, pages
    ("ListLeases", _list(state=99), "state", "list-unknown-state"),
    ("ListLeases", _list(state=-1), "state", "list-negative-state"),
    ("ListLeases", _list(page_size=1001), "page_size", "list-page-size-1001"),
    ("ListLeases", _list(page_size=-1), "page_size", "list-page-size-negative"),
    ("ListLeases", _list(page_token="not a token!"), "page_token", "list-token-garbage"),
    ("ListLeases", _list(page_token="abc"), "page_token", "list-token-bad-padding"),
    ("ListLeases", _list(page_token=_b64(b"\xff\xfe")), "page_token", "list-token-not-utf8"),
    ("ListLeases", _list(page_token=_b64(b"a\x00")), "page_token", "list-token-nul"),
    ("ListNamespaces", _list_namespaces(page_size=1001), "page_size", "namespaces-page-size-1001"),
    ("ListNamespaces", _list_namespaces(page_size=-1), "page_size", "namespaces-page-size-neg"),
    ("ListNamespaces", _list_namespaces(page_token="%%"), "page_token", "namespaces-token-garbage"),
    ("GetNamespaceStats", _stats(namespace=""), "namespace", "stats-empty-namespace"),
    ("GetNamespaceStats", _stats(namespace=LONG_ID), "namespace", "stats-257-byte-namespace"),
    ("GetNamespaceStats", _stats(namespace="n\x00"), "namespace", "stats-nul-namespace"),
    # the effect ledger
    ("BeginEffect", _begin(effect_key=""), "effect_key", "begin-empty-effect-key"),
    ("BeginEffect", _begin(effect_key=LONG_ID), "effect_key", "begin-257-byte-effect-key"),
    ("BeginEffect", _begin(effect_key="k\x00"), "effect_key", "begin-nul-effect-key"),
    ("BeginEffect", _begin(task_id=""), "task_id", "begin-empty-task-id"),
    ("BeginEffect", _begin(fence=0), "fence", "begin-fence-zero"),
    ("BeginEffect", _begin(policy=0), "policy", "begin-policy-unspecified"),
    ("BeginEffect", _begin(policy=7), "policy", "begin-policy-unknown"),
    ("BeginEffect", _begin(request_digest=b"x" * 65), "request_digest", "begin-digest-65-bytes"),
    ("CompleteEffect", _complete(effect_key=""), "effect_key", "complete-empty-effect-key"),
    ("CompleteEffect", _complete(fence=-1), "fence", "complete-fence-negative"),
    ("CompleteEffect", _complete(outcome=0), "outcome", "complete-outcome-unspecified"),
    ("CompleteEffect", _complete(outcome=1), "outcome", "complete-outcome-reserved"),
    ("CompleteEffect", _complete(outcome=9), "outcome", "complete-outcome-unknown"),
    ("CompleteEffect", _complete(retryable=True), "retryable", "complete-succeeded-retryable"),
    ("CompleteEffect", _complete(result=b"r" * 65537), "result", "complete-result-over-64k"),
    ("ListEffects", _list_effects(task_id=""), "task_id", "list-effects-empty-task-id"),
    ("ListEffects", _list_effects(state=42), "state", "list-effects-unknown-state"),
    ("ListEffects", _list_effects(page_size=1001), "page_size", "list-effects-page-size-1001"),
    ("ListEffects", _list_effects(page_token="%%"), "page_token", "list-effects-token-garbage"),
    # a body that is not a valid message
    ("Claim", _raw(b"\xff\xff"), "request", "claim-garbage-body"),
    ("Claim", _raw(b"\x0a\x02\xff\xfe\x12\x01t\x1a\x01a"), "request", "claim-invalid-utf8"),
    ("Renew", _raw(b"\x0a\x05ab"), "request", "renew-truncated-body"),
    ("Release", _raw(b"\x12\x01\x80"), "request", "release-invalid-utf8-task-id"),
    ("ValidateFence", _raw(b"\x18"), "request", "validate-truncated-varint"),
    ("GetLease", _raw(b"\x0a\x01\xc0"), "request", "get-invalid-utf8"),
    ("ListLeases", _raw(b"\x22\x01\xff"), "request", "list-invalid-utf8-token"),
    ("ListNamespaces", _raw(b"\x12\x01\xff"), "request", "namespaces-invalid-utf8-token"),
    ("GetNamespaceStats", _raw(b"\x0a\x01\xff"), "request", "stats-invalid-utf8-namespace"),
    ("BeginEffect", _raw(b"\x22\x01\xff"), "request", "begin-invalid-utf8-effect-key"),
    ("CompleteEffect", _raw(b"\x3a\x05ab"), "request", "complete-truncated-result"),
    ("ListEffects", _raw(b"\xff"), "request", "list-effects-garbage-body"),
]


@pytest.mark.parametrize(
    ("method", "build", "field"), [c[:3] for c in CASES], ids=[c[3] for c in CASES]
)
async def test_request_bad_input_invalid_argument_names_field_changes_nothing(
    stub, channel, namespace, db, method, build, field
):
    await grant(stub, namespace, "t", "a")
    await stub.BeginEffect(_begin()(namespace))  # a reservation CompleteEffect could complete
    before = await snapshot(db)
    request = build(namespace)

    if isinstance(request, bytes):
        call = channel.unary_unary(
            f"/leasekeeper.v1.LeaseService/{method}",
            request_serializer=None,
            response_deserializer=None,
        )
        exc = await failure(call(request))
    else:
        exc = await failure(getattr(stub, method)(request))

    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
    info = error_info(exc)
    assert info.reason == "INVALID_ARGUMENT"
    assert bad_request_fields(exc) == [field]
    assert await snapshot(db) == before


@pytest.mark.parametrize(
    "task_id",
    [
        "x" * 256,
        "\u00e9" * 128,
        "\U0001f600" * 64,
        "a b",
        " a ",
        "\u05de\u05e9\u05d9\u05de\u05d4-1",  # Hebrew letters: right to left by themselves
        "\U0001f469\u200d\U0001f467",  # a zero-width joiner is not a bidirectional control
        "a\u200db",  # invisible characters inside an id with visible ones
        "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",  # Persian, with a ZWNJ
        "\u0915\u094d\u200d\u0937",  # Devanagari with a ZWJ
        "\u0645\u0631\u062d\u0628\u0627",  # Arabic
    ],
    ids=[
        "256-ascii",
        "256-byte-utf8",
        "256-byte-emoji",
        "inner-space",
        "spaces-around",
        "hebrew",
        "emoji-zwj-sequence",
        "zwj-inside",
        "persian-zwnj",
        "devanagari-zwj",
        "arabic",
    ],
)
async def test_claim_ids_at_limits_accepted(stub, namespace, task_id):
    reply = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id=task_id, owner_id="o", ttl=dur(5))
    )

    assert reply.acquired
    assert reply.lease.task_id == task_id


@pytest.mark.parametrize("ttl_s", [0.1, 3600.0], ids=["min-ttl", "max-ttl"])
async def test_claim_ttl_at_bounds_accepted(stub, namespace, ttl_s):
    reply = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="o", ttl=dur(ttl_s))
    )

    assert reply.acquired


# Ids a reader cannot tell apart in a table or a log: made only of whitespace
# (it reads as empty), or holding one of Unicode's bidirectional controls
# (an override, embedding or isolate U+202A-U+202E, U+2066-U+2069, or a
# mark U+200E, U+200F, U+061C), which can reorder what is shown around it so
# that one id displays as another (Trojan Source, CVE-2021-42574).
UNREADABLE_IDS = [
    " ",
    "\u3000\u00a0\u2003",  # ideographic, no-break and em spaces
    "ab\u202ecd",  # RIGHT-TO-LEFT OVERRIDE: shows as "abdc"
    "ab\u202a",  # LEFT-TO-RIGHT EMBEDDING
    "a\u2067b-1\u2069",  # RIGHT-TO-LEFT ISOLATE ... POP DIRECTIONAL ISOLATE
    "a\u200fb",  # RIGHT-TO-LEFT MARK
    "1\u200e",  # LEFT-TO-RIGHT MARK
    "\u061c7",  # ARABIC LETTER MARK
    # Nothing visible: zero-width and format characters (Cf), blank fillers.
    "\u200b",  # ZERO WIDTH SPACE
    "\u200c",  # ZERO WIDTH NON-JOINER
    "\u200d",  # ZERO WIDTH JOINER
    "\ufeff",  # BYTE ORDER MARK
    "\u2060",  # WORD JOINER
    "\u2063",  # INVISIBLE SEPARATOR
    "\u00ad",  # SOFT HYPHEN
    "\u3164",  # HANGUL FILLER
    "\u115f",  # HANGUL CHOSEONG FILLER
    "\u2800",  # BRAILLE PATTERN BLANK
    " \u200b ",
    # A line separator anywhere: it breaks the line of a log or a table.
    "a\u2028b",
    "a\u2029b",
]

ID_FIELDS = [
    ("Claim", _claim, "namespace"),
    ("Claim", _claim, "task_id"),
    ("Claim", _claim, "owner_id"),
    ("Claim", _claim, "request_id"),
    ("Renew", _renew, "namespace"),
    ("Renew", _renew, "task_id"),
    ("Renew", _renew, "owner_id"),
    ("Release", _release, "namespace"),
    ("Release", _release, "task_id"),
    ("Release", _release, "owner_id"),
    ("ValidateFence", _validate, "namespace"),
    ("ValidateFence", _validate, "task_id"),
    ("GetLease", _get, "namespace"),
    ("GetLease", _get, "task_id"),
    ("ListLeases", _list, "namespace"),
    ("ListLeases", _list, "owner_id"),
    ("GetNamespaceStats", _stats, "namespace"),
    ("BeginEffect", _begin, "namespace"),
    ("BeginEffect", _begin, "task_id"),
    ("BeginEffect", _begin, "effect_key"),
    ("CompleteEffect", _complete, "namespace"),
    ("CompleteEffect", _complete, "task_id"),
    ("CompleteEffect", _complete, "effect_key"),
    ("ListEffects", _list_effects, "namespace"),
    ("ListEffects", _list_effects, "task_id"),
    ("Revoke", _revoke, "namespace"),
    ("Revoke", _revoke, "task_id"),
    ("Revoke", _revoke, "reason"),
]


@pytest.mark.parametrize(
    ("method", "build", "field"), ID_FIELDS, ids=[f"{m}-{f}" for m, _, f in ID_FIELDS]
)
async def test_unreadable_id_invalid_argument_names_field_changes_nothing(
    stub, namespace, db, method, build, field
):
    await grant(stub, namespace, "t", "a")
    await stub.BeginEffect(_begin()(namespace))
    before = await snapshot(db)

    for value in UNREADABLE_IDS:
        request = build(**{field: value})(namespace)
        exc = await failure(getattr(stub, method)(request))
        assert (exc.code(), bad_request_fields(exc)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            [field],
        ), (value, exc.details())

    assert await snapshot(db) == before


@pytest.mark.parametrize("field", ["namespace", "task_id", "owner_id"])
async def test_heartbeat_unreadable_id_invalid_argument_names_field(stub, namespace, db, field):
    await grant(stub, namespace, "t", "a")
    before = await snapshot(db)

    for value in UNREADABLE_IDS:
        ids = {"namespace": namespace, "task_id": "t", "owner_id": "a", field: value}
        call = stub.Heartbeat()
        await call.write(pb.HeartbeatRequest(**ids, fence=1))
        exc = await failure(call.read())
        assert (exc.code(), bad_request_fields(exc)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            [field],
        ), (value, exc.details())

    assert await snapshot(db) == before


@pytest.mark.parametrize("field", ["namespace", "task_id"])
async def test_watch_unreadable_id_invalid_argument_names_field(stub, namespace, field):
    for value in UNREADABLE_IDS:
        ids = {"namespace": namespace, "task_id": "t", field: value}
        exc = await failure(stub.Watch(pb.WatchRequest(**ids)).read())
        assert (exc.code(), bad_request_fields(exc)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            [field],
        ), (value, exc.details())
