"""Fuzzing every RPC: whatever arrives, a clean status, and bad input changes nothing.

Two kinds of input reach every RPC of ``leasekeeper.v1.LeaseService``,
the Heartbeat stream and the effect RPCs included:

* malformed bodies, sent as raw bytes through a channel without serializers:
  random bytes, truncated messages, wrong wire types, invalid UTF-8 in string
  fields, over-long varints and lengths, and valid messages of another type;
* well-formed messages with random field values, through the normal stubs:
  empty, over-long, control-character and NUL ids, ids at the byte limit in
  multi-byte UTF-8, fences from int64's minimum to its maximum, durations
  negative, zero, huge, with nanos out of range or signs that disagree,
  unknown enum values, page sizes and page tokens of every kind, attempt
  limits out of bounds, a failed release with or without complete and a
  reason, and checkpoints (in SaveCheckpoint, a beat and CompleteEffect's
  next_checkpoint) with versions below 1 or not moving forward, data at and
  over max_checkpoint_bytes, content types that are long or not printable
  ASCII, and any fence and write_time (which the server ignores).

An oracle written here from guarantees.md's "Bad input" and the proto's field
comments (not from the server's validation code) says which fields of a
request are malformed. Every answer must then be clean:

* a body that does not parse as the method's message is INVALID_ARGUMENT
  naming ``request``; a request with a malformed field is INVALID_ARGUMENT
  naming one of its malformed fields; a well-formed request is never
  INVALID_ARGUMENT (page tokens excepted: whether a string is a token the
  server issued is the server's to say);
* any other status is one the proto documents for that RPC, with a reason it
  lists (ABORTED, FAILED_PRECONDITION, NOT_FOUND), or one the proto's
  comments elsewhere give it (Cancel's fences refused, TaskState's
  quarantine); never INTERNAL, UNKNOWN or
  UNAVAILABLE; every error carries exactly one ErrorInfo, and INVALID_ARGUMENT
  a BadRequest naming the same field as the ErrorInfo;
* a request answered INVALID_ARGUMENT changed nothing: the example's
  namespaces' task and effect rows are the same before and after;
* the server lives on: each example starts with a claim and a BeginEffect in
  a fresh namespace, and ends with a health check answered SERVING.

Every example runs against a namespace holding a live lease (task "t", owner
"a", fence 1) with a reserved effect ("k") and a saved checkpoint (version 2),
so that random values often name real things and well-formed requests do real
work. "Changed nothing" covers the task rows, the effect ledger and the tasks'
history.

A CI run takes about 40 s and always draws the same inputs (derandomized).
For a longer hunt, ``LEASEKEEPER_FUZZ_RANDOM=1`` draws new inputs on every run
and ``LEASEKEEPER_FUZZ_SCALE=N`` runs N times as many examples.
"""

from __future__ import annotations

import base64
import os
import unicodedata
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import asyncpg
import grpc
import pytest
from google.protobuf import descriptor, duration_pb2, timestamp_pb2
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import RunningServer
from tests.helpers import bad_request_fields, error_info, poll, tag, varint
from tests.integration.contract_helpers import grant, snapshot

pytestmark = pytest.mark.timeout(300)

SERVICE = pb.DESCRIPTOR.services_by_name["LeaseService"]
CALL_TIMEOUT_S = 10.0

OK = grpc.StatusCode.OK
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
ABORTED = grpc.StatusCode.ABORTED
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
NOT_FOUND = grpc.StatusCode.NOT_FOUND

# The proto's error lists, RPC by RPC: what a well-formed request may get besides OK.
LOSS = frozenset(
    {
        "LEASE_EXPIRED",
        "LEASE_SUPERSEDED",
        "LEASE_RELEASED",
        "LEASE_REVOKED",
        "RUNTIME_EXCEEDED",
        "TASK_COMPLETED",
        "NOT_OWNER",
        "FENCE_UNKNOWN",
    }
)
# A run's end by an operator or its owner. Cancel's comment: "every fence of the
# task is refused from then on (ValidateFence, Renew, BeginEffect,
# CompleteEffect, SaveCheckpoint)" and "The holder's heartbeat ends at once
# ABORTED TASK_CANCELLED"; a failed task is "terminal like COMPLETED"
# (ReleaseRequest.fail), refused as the LossReason TASK_FAILED.
ENDED = frozenset({"TASK_CANCELLED", "TASK_FAILED"})
FENCE_LOSS = LOSS - {"NOT_OWNER"}
DOCUMENTED: dict[str, dict[grpc.StatusCode, frozenset[str]]] = {
    # Claim's own list says TASK_COMPLETED; Cancel's comment adds TASK_CANCELLED
    # ("claims are refused FAILED_PRECONDITION TASK_CANCELLED"), TaskState's
    # QUARANTINED adds TASK_QUARANTINED, and FAILED is terminal like COMPLETED.
    "Claim": {FAILED_PRECONDITION: frozenset({"TASK_COMPLETED", "TASK_QUARANTINED"}) | ENDED},
    "Renew": {ABORTED: LOSS | ENDED},
    "Release": {
        ABORTED: frozenset(
            {"LEASE_SUPERSEDED", "NOT_OWNER", "LEASE_REVOKED", "TASK_COMPLETED", "FENCE_UNKNOWN"}
        )
    },
    "ValidateFence": {},
    "Heartbeat": {ABORTED: LOSS | ENDED},
    "GetLease": {NOT_FOUND: frozenset({"TASK_NOT_FOUND"})},
    "ListLeases": {},
    "ListNamespaces": {},
    "GetNamespaceStats": {},
    "BeginEffect": {
        ABORTED: FENCE_LOSS | ENDED,
        FAILED_PRECONDITION: frozenset({"EFFECT_KEY_REUSED"}),
    },
    "CompleteEffect": {
        ABORTED: FENCE_LOSS | ENDED,
        # next_checkpoint is "Decided as SaveCheckpoint decides".
        FAILED_PRECONDITION: frozenset(
            {"EFFECT_NOT_BEGUN", "EFFECT_ALREADY_COMPLETED", "CHECKPOINT_NOT_NEWER"}
        ),
    },
    "ListEffects": {},
    "Revoke": {
        NOT_FOUND: frozenset({"TASK_NOT_FOUND"}),
        FAILED_PRECONDITION: frozenset({"TASK_COMPLETED"}),
    },
    "SaveCheckpoint": {
        ABORTED: LOSS | ENDED,
        FAILED_PRECONDITION: frozenset({"CHECKPOINT_NOT_NEWER"}),
    },
    "Cancel": {
        NOT_FOUND: frozenset({"TASK_NOT_FOUND"}),
        FAILED_PRECONDITION: frozenset({"TASK_COMPLETED", "TASK_FAILED"}),
    },
    "Retry": {
        NOT_FOUND: frozenset({"TASK_NOT_FOUND"}),
        FAILED_PRECONDITION: frozenset({"TASK_NOT_QUARANTINED"}),
    },
    "ListTaskHistory": {},
    "Watch": {},
    # A check's bad input is that check's answer (an error status in it): the
    # stream ends INVALID_ARGUMENT only for a message that does not parse.
    "ValidateFences": {},
    # An add's bad input is that add's refusal (an error status in the answer),
    # a lease's loss a Lost entry: the stream goes on. It ends INVALID_ARGUMENT
    # only for a message whose answers could not be matched (sequence 0, an add
    # id that is 0 or already in the session, more than 1000 adds).
    "Session": {},
}
METHODS = {m.name: m for m in SERVICE.methods}
# Watch (a server stream) has its namespace and task checked like GetLease's;
# it is left out of the unary tables, which send a body and read one answer.
UNARY = sorted(
    name for name, m in METHODS.items() if not m.client_streaming and not m.server_streaming
)
REQUEST_TYPES: dict[str, type[Message]] = {
    name: getattr(pb, m.input_type.name) for name, m in METHODS.items()
}

INT64 = (-(2**63), 2**63 - 1)
INT32 = (-(2**31), 2**31 - 1)
# The test server's max_checkpoint_bytes (the default): the values drawn straddle it.
MAX_CHECKPOINT_BYTES = 262_144


def examples(count: int) -> settings:
    """Hypothesis settings for ``count`` examples (times LEASEKEEPER_FUZZ_SCALE) on the server."""
    return settings(
        max_examples=count * int(os.environ.get("LEASEKEEPER_FUZZ_SCALE", "1")),
        deadline=None,
        database=None,
        derandomize=os.environ.get("LEASEKEEPER_FUZZ_RANDOM") != "1",
        print_blob=True,
        # One server per test: the examples share it (and each makes its own namespace).
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# -- the oracle: which fields of a request are malformed -----------------------


@dataclass(frozen=True)
class Limits:
    """The server's configured bounds (guarantees.md: "limits configurable")."""

    max_id_bytes: int
    min_ttl: Fraction
    max_ttl: Fraction
    max_runtime: Fraction
    max_result_bytes: int
    max_claim_wait: Fraction = Fraction(60)
    max_page_size: int = 1000  # guarantees.md: "at most 1000 a page"
    max_digest_bytes: int = 64  # proto: request_digest "at most 64 bytes"
    max_checkpoint_bytes: int = MAX_CHECKPOINT_BYTES
    max_attempts: int = 1_000_000  # proto: ClaimRequest.max_attempts "[0, 1000000]"
    max_content_type_bytes: int = 128  # proto: Checkpoint.content_type "at most 128 bytes"

    @classmethod
    def of(cls, server: RunningServer) -> Limits:
        s = server.server.settings
        return cls(
            max_id_bytes=s.max_id_bytes,
            min_ttl=Fraction(str(s.min_ttl_s)),
            max_ttl=Fraction(str(s.max_ttl_s)),
            max_runtime=Fraction(str(s.max_runtime_s)),
            max_result_bytes=s.max_effect_result_bytes,
            max_claim_wait=Fraction(str(s.max_claim_wait_s)),
            max_checkpoint_bytes=s.max_checkpoint_bytes,
        )


@dataclass(frozen=True)
class Verdict:
    """Fields that are malformed for sure, and fields the oracle cannot judge (page tokens)."""

    bad: frozenset[str]
    unsure: frozenset[str] = frozenset()

    @property
    def names(self) -> frozenset[str]:
        return self.bad | self.unsure


UNPARSEABLE = Verdict(frozenset({"request"}))


# Unicode's bidirectional format characters: the embeddings, overrides and
# isolates by their bidi class, and the three marks (LRM, RLM, ALM).
BIDI_CLASSES = {"LRE", "RLE", "PDF", "LRO", "RLO", "LRI", "RLI", "FSI", "PDI"}
BIDI_MARKS = "\u200e\u200f\u061c"


# Characters that draw nothing: whitespace, format characters (Cf) and the
# Hangul fillers and blank braille pattern, which are letters and symbols.
BLANKS = "\u115f\u1160\u3164\uffa0\u2800"


def bad_id(value: str, limits: Limits, required: bool = True) -> bool:
    """An id: 1..max_id_bytes bytes of UTF-8; no Cc (NUL too), no bidi control, no
    line or paragraph separator (Zl, Zp), and a visible character."""
    if not value:
        return required
    size = len(value.encode("utf-8"))
    return (
        size > limits.max_id_bytes
        or all(c.isspace() or unicodedata.category(c) == "Cf" or c in BLANKS for c in value)
        or any(
            unicodedata.category(c) in ("Cc", "Zl", "Zp")
            or unicodedata.bidirectional(c) in BIDI_CLASSES
            or c in BIDI_MARKS
            for c in value
        )
    )


def bad_duration(value: duration_pb2.Duration, low: Fraction, high: Fraction) -> bool:
    """Outside [low, high], exactly, or not a well-formed google.protobuf.Duration."""
    seconds, nanos = value.seconds, value.nanos
    well_formed = (
        abs(seconds) <= 315_576_000_000
        and abs(nanos) <= 999_999_999
        and not (seconds > 0 > nanos or seconds < 0 < nanos)
    )
    exact = seconds + Fraction(nanos, 10**9)
    return not (well_formed and low <= exact <= high)


def bad_enum(fd: descriptor.FieldDescriptor, value: int, allowed: Sequence[str] | None) -> bool:
    """Unknown enum values are malformed; ``allowed`` narrows the known ones (names)."""
    known = fd.enum_type.values_by_number.get(value)
    if known is None:
        return True
    return allowed is not None and known.name not in allowed


def field_is_bad(message: Any, fd: descriptor.FieldDescriptor, limits: Limits) -> bool | None:
    """True: malformed; False: well-formed; None: only the server can tell."""
    name, value = fd.name, getattr(message, fd.name)
    kind = message.DESCRIPTOR.name
    reason_limits = replace(limits, max_id_bytes=1024)
    match name:
        case "fence" | "write_time" if kind == "Checkpoint":  # proto: ignored in requests
            return False
        case "checkpoint" | "next_checkpoint":  # judged by its own fields (judged_fields)
            return False
        case "version":  # proto: >= 1
            return value < 1
        case "data":  # proto: at most max_checkpoint_bytes
            return len(value) > limits.max_checkpoint_bytes
        case "content_type":  # proto: at most 128 bytes of printable ASCII; may be empty
            return len(value.encode("utf-8")) > limits.max_content_type_bytes or any(
                not " " <= c <= "~" for c in value
            )
        case "owner_id" if kind == "ListLeasesRequest":  # proto: empty means any owner
            return bad_id(value, limits, required=False)
        case "fence" if kind == "RevokeRequest":  # proto: 0 means whatever is current
            return value < 0
        case "namespace" | "task_id" | "owner_id" | "effect_key":
            return bad_id(value, limits)
        case "reason":  # proto: required, at most 1024 bytes, the rules of ids
            return bad_id(value, reason_limits)
        case "fail_reason":  # proto: with fail only; the rules of Revoke.reason; may be empty
            return bool(value) and (not message.fail or bad_id(value, reason_limits))
        case "fail":  # proto: "Not together with complete"
            return value and message.complete
        case "external_operation_id":  # proto: the rules of ids; may be empty
            return bad_id(value, limits, required=False)
        case "max_attempts":  # proto: [0, 1000000]
            return not 0 <= value <= limits.max_attempts
        case "wait":  # proto: [0, the server's max_claim_wait]
            return message.HasField(name) and bad_duration(
                value, Fraction(0), limits.max_claim_wait
            )
        case "request_id":  # proto: the rules of ids; empty means none
            return bad_id(value, limits, required=False)
        case "fence":
            return value < 1
        case "ttl":
            return message.HasField(name) and bad_duration(value, limits.min_ttl, limits.max_ttl)
        case "max_runtime":  # proto: its upper bound is the server's max_runtime
            return message.HasField(name) and bad_duration(
                value, limits.min_ttl, limits.max_runtime
            )
        case "state":  # UNSPECIFIED lists all
            return bad_enum(fd, value, None)
        case "policy":  # proto: "Required: ONCE or LATEST"
            return bad_enum(fd, value, ("EFFECT_POLICY_ONCE", "EFFECT_POLICY_LATEST"))
        case "outcome":  # proto: "SUCCEEDED or FAILED"
            return bad_enum(fd, value, ("EFFECT_STATE_SUCCEEDED", "EFFECT_STATE_FAILED"))
        case "retryable":  # proto: "Must be false for SUCCEEDED"
            return value and message.outcome == pb.EFFECT_STATE_SUCCEEDED
        case "complete":
            return False
        case "page_size":  # default 100 when unset (0), at most 1000
            return not 0 <= value <= limits.max_page_size
        case "page_token":
            return None if value else False
        case "request_digest":
            return len(value) > limits.max_digest_bytes
        case "result":
            return len(value) > limits.max_result_bytes
        case "checks" | "request" | "id":  # ValidateFences: each check answered on its own
            return False
        case "sequence":  # Session: 0 could not be matched with its answer
            return value == 0
        case "add" | "drop" | "beat":  # Session: each add answered (refused) on its own
            return False
    raise AssertionError(f"the fuzz oracle has no rule for {fd.full_name}: add one")


# A checkpoint SaveCheckpoint must carry: unset, its version is 0 (below 1).
REQUIRED_CHECKPOINTS = {"leasekeeper.v1.SaveCheckpointRequest.checkpoint"}


def judged_fields(
    message: Any, every: bool = False
) -> Iterator[tuple[str, Any, descriptor.FieldDescriptor]]:
    """(path, the message holding it, field) of every field the oracle judges.

    A request's own fields, and the fields of a Checkpoint it carries (or must
    carry), by their dotted path ("checkpoint.version"), as the server names
    them; with ``every``, those of every Checkpoint field, set or not.
    """
    for fd in message.DESCRIPTOR.fields:
        yield fd.name, message, fd
        if fd.message_type is not pb.Checkpoint.DESCRIPTOR:
            continue  # a Duration is judged whole: "ttl"
        if every or message.HasField(fd.name) or fd.full_name in REQUIRED_CHECKPOINTS:
            inner = getattr(message, fd.name)
            for sub in inner.DESCRIPTOR.fields:
                yield f"{fd.name}.{sub.name}", inner, sub


def verdict(message: Any, limits: Limits) -> Verdict:
    """Judges every field of a request message, and of the Checkpoint it carries."""
    bad, unsure = set(), set()
    for path, holder, fd in judged_fields(message):
        judged = field_is_bad(holder, fd, limits)
        if judged is None:
            unsure.add(path)
        elif judged:
            bad.add(path)
    return Verdict(frozenset(bad), frozenset(unsure))


def later_beat_verdict(
    message: pb.HeartbeatRequest, first: pb.HeartbeatRequest, limits: Limits
) -> Verdict:
    """A later heartbeat message: each field empty or the first message's; ttl and
    checkpoint as always."""
    bad = {
        name
        for name in ("namespace", "task_id", "owner_id", "fence")
        if getattr(message, name) and getattr(message, name) != getattr(first, name)
    }
    if message.HasField("ttl") and bad_duration(message.ttl, limits.min_ttl, limits.max_ttl):
        bad.add("ttl")
    bad |= {path for path in verdict(message, limits).bad if path.startswith("checkpoint.")}
    return Verdict(frozenset(bad))


def mistyped(message: Message) -> set[str]:
    """Paths of declared fields that arrived with a wrong wire type, at any depth.

    protobuf keeps such a field as an unknown field with a number the message
    declares; the contract calls the request malformed, naming the field.
    """
    declared = message.DESCRIPTOR.fields_by_number
    unknowns = UnknownFieldSet(message)
    found = {
        declared[unknowns[i].field_number].name
        for i in range(len(unknowns))
        if unknowns[i].field_number in declared
    }
    for fd, value in message.ListFields():
        if fd.message_type is not None:  # singular Durations, Checkpoints and their Timestamp
            found |= {f"{fd.name}.{path}" for path in mistyped(value)}
    return found


def body_verdict(method: str, body: bytes, limits: Limits) -> tuple[Verdict, Any]:
    """The verdict on a raw body and the message it parses to (None if it does not)."""
    try:
        message = REQUEST_TYPES[method].FromString(body)
    except DecodeError:
        return UNPARSEABLE, None
    wrong = mistyped(message)
    return (Verdict(frozenset(wrong)) if wrong else verdict(message, limits)), message


# -- judging an answer -----------------------------------------------------------


def check_answer(method: str, error: grpc.aio.AioRpcError | None, expected: Verdict) -> None:
    """The answer is clean and agrees with the oracle (see the module docstring)."""
    code = OK if error is None else error.code()
    event(f"{method}: {code.name}")
    if code == OK:
        assert not expected.bad, f"{method}: OK for a request with malformed {set(expected.bad)}"
        return
    assert error is not None
    info = error_info(error)  # exactly one, domain leasekeeper
    if code == INVALID_ARGUMENT:
        named = bad_request_fields(error)
        assert len(named) == 1, f"{method}: BadRequest names {named}"
        assert info.reason == "INVALID_ARGUMENT"
        assert info.metadata.get("field") == named[0]
        assert named[0] in expected.names, (
            f"{method}: INVALID_ARGUMENT naming {named[0]!r}; malformed fields: "
            f"{set(expected.bad)} (unsure: {set(expected.unsure)}): {error.details()}"
        )
        return
    assert not expected.bad, (
        f"{method}: {code.name} {info.reason} for a request with malformed "
        f"{set(expected.bad)}: {error.details()}"
    )
    documented = DOCUMENTED[method]
    assert code in documented, (
        f"{method}: undocumented {code.name} {info.reason}: {error.details()}"
    )
    assert info.reason in documented[code], f"{method}: {code.name} with reason {info.reason}"


# -- field values ------------------------------------------------------------------
#
# Each field has good values (naming the example's lease, effect and bounds) and
# any values (good ones among them). A request takes good values for most fields
# and any values for a few, so that requests with one malformed field, which the
# server must name, are common, and so are well-formed requests that do real work.

CONTROL = ["\x00", "\x01", "\t", "\n", "\x1b", "\x1f", "\x7f", "\x80", "\x85", "\x9f"]
# Not control characters: ids may hold them (but for U+2028), next to a visible one.
UNUSUAL = [
    "\u2028",
    "\u200b",
    "\ufeff",
    "\u3164",
    "\u00ad",
    "\ufffd",
    "\ue000",
    "\U0010ffff",
    " ",
    "\\",
    "'",
    "%",
]
# Bidirectional controls: no id may hold them.
BIDI = ["\u202a", "\u202e", "\u2066", "\u2069", "\u200f", "\u061c"]
WIDE = ["x", "\u00e9", "\u20ac", "\U0001f600"]  # 1, 2, 3 and 4 bytes of UTF-8


def near_limit(prefix: str, char: str, extra: int, limit: int = 256) -> str:
    """``prefix`` filled with ``char`` to the byte limit, plus ``extra`` characters."""
    count = (limit - len(prefix.encode())) // len(char.encode())
    return prefix + char * max(0, count + extra)


def ids(good: Sequence[str], prefix: str = "") -> st.SearchStrategy[str]:
    """Empty, random, near the byte limit, huge, or a good value with an odd character.

    Every non-empty value starts with ``prefix`` (a namespace keeps to the example's).
    """
    return st.one_of(
        st.sampled_from(good),
        st.just(""),
        st.sampled_from([" ", "\u3000", " \u00a0 ", "\u200b", " \u200d ", "\u2800"]),  # blank
        st.builds(lambda s: prefix + s, st.text(max_size=12)),
        st.builds(near_limit, st.just(prefix), st.sampled_from(WIDE), st.sampled_from([-1, 0, 1])),
        st.builds(lambda n: prefix + "x" * n, st.sampled_from([300, 5000])),
        st.builds(
            lambda base, char, at: base[:at] + char + base[at:],
            st.sampled_from(good),
            st.sampled_from(CONTROL + UNUSUAL + BIDI),
            st.integers(len(prefix), 64),
        ),
    )


# Durations at the bounds of the test server (min_ttl 0.1 s, max_ttl 3600 s,
# max_runtime 86400 s), to the nanosecond, and some ill-formed ones.
BOUNDARY_DURATIONS = [
    (0, 99_999_999),
    (0, 99_999_000),
    (0, 100_000_000),
    (0, 100_000_001),
    (3599, 999_999_999),
    (3600, 0),
    (3600, 1),
    (3600, 999),
    (3600, 1000),
    (86400, 0),
    (86400, 1),
    (86400, 999),
    (0, 0),
    (0, 999),
    (1, -1),
    (-1, 1),
    (5, 1_000_000_000),
    (0, -100_000_000),
]


def durations() -> st.SearchStrategy[duration_pb2.Duration | None]:
    """Unset, at the bounds (to the nanosecond) or anywhere in int64 and int32."""
    seconds = st.one_of(
        st.sampled_from([0, 1, 5, 3601, 86401, -1, 315_576_000_000, 315_576_000_001]),
        st.sampled_from([INT64[1], INT64[0]]),
        st.integers(*INT64),
    )
    nanos = st.one_of(
        st.sampled_from([0, 1, 999, 1000, 999_999_999, 1_000_000_000, -1, -999_999_999]),
        st.sampled_from([INT32[1], INT32[0]]),
        st.integers(*INT32),
    )
    return st.one_of(
        st.none(),
        st.builds(
            lambda sn: duration_pb2.Duration(seconds=sn[0], nanos=sn[1]),
            st.sampled_from(BOUNDARY_DURATIONS),
        ),
        st.builds(duration_pb2.Duration, seconds=seconds, nanos=nanos),
    )


def wait_durations() -> st.SearchStrategy[duration_pb2.Duration]:
    """Claim waits at the test server's bound (60 s) and ill-formed ones; none that wait long."""
    return st.builds(
        lambda sn: duration_pb2.Duration(seconds=sn[0], nanos=sn[1]),
        st.sampled_from(
            [(0, 0), (0, 1), (60, 1), (61, 0), (-1, 0), (0, -1), (1, -1), (INT64[1], 0), (5, 10**9)]
        ),
    )


def page_tokens() -> st.SearchStrategy[str]:
    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).decode()

    return st.one_of(
        st.text(max_size=20),
        st.builds(b64, st.binary(max_size=20)),
        st.builds(b64, st.sampled_from([b"t", b"k", b"a\x00", b"\xff\xfe", b"x" * 300])),
        st.builds(lambda raw: b64(raw).rstrip("="), st.binary(min_size=1, max_size=8)),
    )


def blobs(limit: int) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=80),
        st.builds(lambda n: b"r" * n, st.sampled_from([limit, limit + 1, 100_000])),
    )


def content_types() -> st.SearchStrategy[str]:
    """Checkpoint content types: at and over 128 bytes, not printable ASCII, or anything."""
    printable = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
    return st.one_of(
        st.text(printable, max_size=20),
        st.builds(lambda n: "a" * n, st.sampled_from([127, 128, 129, 300])),
        st.builds(
            lambda at, char: "application/json"[:at] + char + "application/json"[at:],
            st.integers(0, 16),
            st.sampled_from(CONTROL + UNUSUAL + BIDI + WIDE[1:]),
        ),
        st.text(max_size=12),
    )


def timestamps() -> st.SearchStrategy[timestamp_pb2.Timestamp | None]:
    """Unset, or any seconds and nanos (well-formed or not: a request's are ignored)."""
    return st.one_of(
        st.none(),
        st.builds(
            timestamp_pb2.Timestamp,
            seconds=st.one_of(st.sampled_from([0, -1, 253_402_300_800]), st.integers(*INT64)),
            nanos=st.one_of(st.sampled_from([0, -1, 10**9]), st.integers(*INT32)),
        ),
    )


def good_values(fd: descriptor.FieldDescriptor, namespace: str) -> st.SearchStrategy[Any]:
    """Well-formed values for one field of a request (or of its Checkpoint), by its name."""
    match fd.name:
        case "namespace":
            return st.sampled_from([namespace, namespace, f"{namespace}-other"])
        case "task_id":
            return st.sampled_from(["t", "t", "u"])
        case "owner_id":
            return st.sampled_from(["a", "a", "b"])
        case "effect_key":
            return st.sampled_from(["k", "k", "k2"])
        case "request_id":
            return st.sampled_from(["", "r1"])
        case "fence":
            return st.sampled_from([1, 1, 2])
        case "ttl" | "max_runtime":
            return st.sampled_from([None, None, duration_pb2.Duration(seconds=5)])
        case "wait":  # short: a held task makes the claim wait that long
            return st.sampled_from([None, None, duration_pb2.Duration(nanos=50_000_000)])
        case "reason":
            return st.sampled_from(["maintenance", "runaway worker"])
        case "state" | "policy" | "outcome":
            allowed = {
                "state": sorted(fd.enum_type.values_by_number),
                "policy": [pb.EFFECT_POLICY_ONCE, pb.EFFECT_POLICY_LATEST],
                "outcome": [pb.EFFECT_STATE_SUCCEEDED, pb.EFFECT_STATE_FAILED],
            }[fd.name]
            return st.sampled_from(allowed)
        case "retryable":
            return st.just(False)
        case "complete":
            return st.sampled_from([False, False, True])
        case "page_size":
            return st.sampled_from([0, 1, 1000])
        case "page_token":
            return st.just("")
        case "request_digest" | "result":
            return st.sampled_from([b"", b"d1"])
        case "max_attempts":
            return st.sampled_from([0, 0, 3])
        case "fail":  # with complete it is malformed: good alone, like retryable
            return st.just(False)
        case "fail_reason":  # only with fail
            return st.just("")
        case "external_operation_id":
            return st.sampled_from(["", "", "op-1"])
        case "checkpoint" | "next_checkpoint":
            checkpoint = good_messages(pb.Checkpoint, namespace)
            if fd.full_name in REQUIRED_CHECKPOINTS:
                return checkpoint
            return st.one_of(st.none(), st.none(), checkpoint)
        case "version":  # the example's stored version is 2: not newer, the same, newer
            return st.sampled_from([1, 2, 3, 3])
        case "data":
            return st.sampled_from([b"", b"state"])
        case "content_type":
            return st.sampled_from(["", "application/json"])
        case "write_time":
            return st.sampled_from([None, None, timestamp_pb2.Timestamp(seconds=1)])
        case "checks":  # ValidateFences
            return st.lists(good_messages(pb.ValidateFencesRequest.Check, namespace), max_size=3)
        case "id":
            return st.integers(0, 2**64 - 1)
        case "request":
            return good_messages(pb.ValidateFenceRequest, namespace)
        case "sequence":  # Session
            return st.integers(1, 2**64 - 1)
        case "add":
            return st.lists(good_messages(pb.SessionRequest.Add, namespace), max_size=3)
        case "drop":
            return st.lists(st.integers(0, 2**64 - 1), max_size=3)
        case "beat":
            return st.booleans()
    raise AssertionError(f"no fuzz values for {fd.full_name}: add them")


def any_values(fd: descriptor.FieldDescriptor, namespace: str) -> st.SearchStrategy[Any]:
    """Any values for one field of a request, by its name (the oracle's vocabulary)."""
    good = good_values(fd, namespace)
    match fd.name:
        case "namespace":
            return ids([namespace], prefix=namespace)
        case "task_id" | "owner_id" | "effect_key":
            return st.one_of(good, ids(["t", "a", "k"]))
        case "request_id":
            return st.one_of(good, ids(["r1", str(uuid.UUID(int=1))]))
        case "fence":
            return st.one_of(st.sampled_from([0, -1, 3, INT64[1], INT64[0]]), st.integers(*INT64))
        case "ttl" | "max_runtime":
            return durations()
        case "wait":
            return st.one_of(good, wait_durations())
        case "reason":
            return st.one_of(
                good,
                ids(["maintenance"]),
                st.builds(lambda n: "r" * n, st.sampled_from([1024, 1025, 5000])),
            )
        case "state" | "policy" | "outcome":
            return st.one_of(good, st.sampled_from([0, -1, 99]), st.integers(*INT32))
        case "retryable" | "complete" | "fail":
            return st.booleans()
        case "page_size":
            return st.one_of(
                st.sampled_from([2, 1001, -1, INT32[1], INT32[0]]), st.integers(*INT32)
            )
        case "page_token":
            return page_tokens()
        case "request_digest":
            return blobs(64)
        case "result":
            return blobs(65536)
        case "max_attempts":
            return st.one_of(
                good,
                st.sampled_from([1, -1, 1_000_000, 1_000_001, INT32[1], INT32[0]]),
                st.integers(*INT32),
            )
        case "fail_reason":
            return st.one_of(
                good,
                ids(["out of memory"]),
                st.builds(lambda n: "r" * n, st.sampled_from([1024, 1025, 5000])),
            )
        case "external_operation_id":
            return st.one_of(good, ids(["op-1"]))
        case "checkpoint" | "next_checkpoint":
            return st.one_of(st.none(), messages(pb.Checkpoint, namespace))
        case "version":
            return st.one_of(
                good, st.sampled_from([0, -1, INT64[1], INT64[0]]), st.integers(*INT64)
            )
        case "data":
            return blobs(MAX_CHECKPOINT_BYTES)
        case "content_type":
            return st.one_of(good, content_types())
        case "write_time":
            return timestamps()
        case "checks":
            return st.lists(messages(pb.ValidateFencesRequest.Check, namespace), max_size=3)
        case "id":
            return good
        case "request":
            return messages(pb.ValidateFenceRequest, namespace)
        case "sequence":
            return st.one_of(good, st.just(0))
        case "add":
            return st.lists(messages(pb.SessionRequest.Add, namespace), max_size=3)
        case "drop" | "beat":
            return good
    raise AssertionError(f"no fuzz values for {fd.full_name}: add them")


def build(message_type: type[Message], fields: dict[str, Any]) -> Any:
    message = message_type()
    for name, value in fields.items():
        if isinstance(value, Message):
            getattr(message, name).CopyFrom(value)
        elif isinstance(value, list):  # a repeated field (ValidateFences' checks)
            getattr(message, name).extend(value)
        elif value is not None:
            setattr(message, name, value)
    return message


def good_messages(message_type: type[Message], namespace: str) -> st.SearchStrategy[Any]:
    """Messages of ``message_type`` with good values in every field."""
    fields = {fd.name: good_values(fd, namespace) for fd in message_type.DESCRIPTOR.fields}
    return st.fixed_dictionaries(fields).map(lambda values: build(message_type, values))


def messages(message_type: type[Message], namespace: str) -> st.SearchStrategy[Any]:
    """Messages of ``message_type``: good values, except any values in a few fields."""
    fields = message_type.DESCRIPTOR.fields

    def draw_fields(draw: Any) -> dict[str, Any]:
        count = draw(st.sampled_from([0, 1, 1, 1, 2, 2, 3, len(fields)]), label="random fields")
        chosen = set(draw(st.permutations([fd.name for fd in fields]))[:count])
        return {
            fd.name: draw(
                (any_values if fd.name in chosen else good_values)(fd, namespace), label=fd.name
            )
            for fd in fields
        }

    return st.composite(lambda draw: build(message_type, draw_fields(draw)))()


# -- malformed bodies --------------------------------------------------------------


def payload(wire_type: int, data: bytes, number: int) -> bytes:
    """A field's bytes after its tag, shaped by the wire type (3..7: groups and invalid types)."""
    match wire_type:
        case 0:
            return varint(number)
        case 1:
            return data[:8].ljust(8, b"\0")
        case 2:
            return varint(len(data)) + data
        case 5:
            return data[:4].ljust(4, b"\0")
    return data


def field_records(message_type: type[Message]) -> st.SearchStrategy[bytes]:
    """Fields of ``message_type`` (and unknown numbers) with any wire type and payload."""
    numbers = [fd.number for fd in message_type.DESCRIPTOR.fields]
    record = st.builds(
        lambda number, wire_type, data, n: tag(number, wire_type) + payload(wire_type, data, n),
        st.one_of(st.sampled_from(numbers), st.integers(1, 2**29 - 1)),
        st.integers(0, 7),
        st.binary(max_size=12),
        st.integers(0, 2**64 - 1),
    )
    return st.lists(record, min_size=1, max_size=5).map(b"".join)


INVALID_UTF8 = [b"\xff", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"ok\xfe", b"\xf4\x90\x80\x80"]


def nested_strings(message_type: type[Message]) -> list[tuple[int, int]]:
    """(field number, number of a string field inside it) for a request's sub-messages."""
    return [
        (fd.number, inner.number)
        for fd in message_type.DESCRIPTOR.fields
        if fd.message_type is not None
        for inner in fd.message_type.fields
        if inner.type == inner.TYPE_STRING
    ]


def with_nested_string(body: bytes, numbers: tuple[int, int], value: bytes) -> bytes:
    """``body`` followed by a sub-message (merged into the one it may hold) with a string."""
    outer, inner = numbers
    field = tag(inner, 2) + varint(len(value)) + value
    return body + tag(outer, 2) + varint(len(field)) + field


def malformed(message_type: type[Message], namespace: str) -> st.SearchStrategy[bytes]:
    """Bodies that are (mostly) not valid ``message_type`` messages."""
    string_numbers = [
        fd.number for fd in message_type.DESCRIPTOR.fields if fd.type == fd.TYPE_STRING
    ]
    valid = messages(message_type, namespace).map(lambda m: m.SerializeToString())
    others = st.sampled_from(sorted(REQUEST_TYPES)).flatmap(
        lambda name: messages(REQUEST_TYPES[name], namespace)
    )
    nested = nested_strings(message_type)
    # invalid UTF-8 in a string field of a sub-message (Checkpoint.content_type)
    in_sub_message = (
        [
            st.builds(
                with_nested_string, valid, st.sampled_from(nested), st.sampled_from(INVALID_UTF8)
            )
        ]
        if nested
        else []
    )
    return st.one_of(
        *in_sub_message,
        st.binary(max_size=48),
        # a valid message cut short
        st.builds(lambda body, at: body[: at % max(1, len(body))], valid, st.integers(0, 1000)),
        field_records(message_type),
        # invalid UTF-8 in a string field, after a valid message
        st.builds(
            lambda body, number, bad: body + tag(number, 2) + varint(len(bad)) + bad,
            valid,
            st.sampled_from(string_numbers),
            st.sampled_from(INVALID_UTF8),
        ),
        # an over-long varint, or a length far beyond the body
        st.builds(
            lambda number, k: tag(number, 0) + b"\xff" * k + b"\x01",
            st.integers(1, 7),
            st.sampled_from([9, 10, 11, 20]),
        ),
        st.builds(
            lambda number, size: tag(number, 2) + varint(size) + b"abc",
            st.integers(1, 7),
            st.sampled_from([4, 2**31, 2**63]),
        ),
        # a valid message of another type, maybe with garbage after it
        st.builds(lambda m, tail: m.SerializeToString() + tail, others, st.binary(max_size=4)),
    )


# -- the server and the database around one example --------------------------------


async def prepare(stub: rpc.LeaseServiceStub) -> str:
    """A fresh namespace with a live lease (t, a, fence 1), a reserved effect (k) and a
    checkpoint (version 2, b"state", application/json, by fence 1).

    Also proves the server still grants claims after the previous example.
    """
    namespace = f"fuzz-{uuid.uuid4().hex[:12]}"
    await grant(stub, namespace, "t", "a", ttl_s=30.0)
    reply = await stub.BeginEffect(
        pb.BeginEffectRequest(
            namespace=namespace, task_id="t", fence=1, effect_key="k", policy=pb.EFFECT_POLICY_ONCE
        ),
        timeout=CALL_TIMEOUT_S,
    )
    assert reply.decision == pb.EFFECT_DECISION_PROCEED
    saved = await stub.SaveCheckpoint(
        pb.SaveCheckpointRequest(
            namespace=namespace,
            task_id="t",
            owner_id="a",
            fence=1,
            checkpoint=pb.Checkpoint(version=2, data=b"state", content_type="application/json"),
        ),
        timeout=CALL_TIMEOUT_S,
    )
    assert saved.checkpoint.version == 2
    return namespace


HISTORY = (
    "SELECT * FROM leasekeeper_task_history"
    " WHERE starts_with(namespace, $1) OR namespace = ANY($2::text[]) ORDER BY sequence"
)


async def rows(db: asyncpg.Connection, namespace: str, message: Any = None) -> list[Any]:
    """The rows of the example's namespaces, and of the namespace ``message`` names:
    tasks, effects and the tasks' history."""
    named = getattr(message, "namespace", "") if message is not None else ""
    others = [named] if "\x00" not in named else []
    history = await db.fetch(HISTORY, namespace, others)
    return await snapshot(db, namespace, others) + [tuple(r) for r in history]


async def unary_raw(channel: grpc.aio.Channel, method: str, body: bytes) -> Any:
    """Sends ``body`` as is; returns the error, or None for OK (after parsing the reply)."""
    call = channel.unary_unary(
        f"/{SERVICE.full_name}/{method}", request_serializer=None, response_deserializer=None
    )
    try:
        reply = await call(body, timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        return error
    getattr(pb, METHODS[method].output_type.name).FromString(reply)  # a valid reply
    return None


async def read_one(call: Any) -> tuple[bool, grpc.aio.AioRpcError | None]:
    """Reads one heartbeat reply: (True, None), or the stream's end (False, error or None)."""
    try:
        reply = await call.read()
    except grpc.aio.AioRpcError as error:
        return False, error
    if reply is grpc.aio.EOF:
        return False, None
    if isinstance(reply, bytes):
        pb.HeartbeatResponse.FromString(reply)
    return True, None


async def stream_end(call: Any) -> grpc.aio.AioRpcError | None:
    """Reads a heartbeat stream to its end: the error, or None for OK."""
    while True:
        more, error = await read_one(call)
        if not more:
            return error


async def health_serving(channel: grpc.aio.Channel) -> None:
    """The server still serves: its health answers SERVING (within a few checks).

    Health is judged every health_interval_s from the database's answers; on
    a loaded machine one check may find a ping unanswered, so the test waits
    for SERVING rather than sampling one answer.
    """
    stub = health_pb2_grpc.HealthStub(channel)

    async def serving() -> bool:
        reply = await stub.Check(
            health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=CALL_TIMEOUT_S
        )
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    await poll(serving, "health SERVING", within_s=10.0, interval_s=0.05)


# -- the tests -------------------------------------------------------------------------


def test_fuzz_tables_cover_every_rpc_and_field() -> None:
    assert set(DOCUMENTED) == set(METHODS)
    for message_type in REQUEST_TYPES.values():
        limits = Limits(256, Fraction(1, 10), Fraction(3600), Fraction(86400), 65536)
        for _, holder, fd in judged_fields(message_type(), every=True):
            field_is_bad(holder, fd, limits)  # a rule for every field, nested ones too
            good_values(fd, "ns")  # and values for it
            any_values(fd, "ns")


@examples(300)
@given(method=st.sampled_from(UNARY), data=st.data())
async def test_unary_malformed_body_clean_status_changes_nothing(
    server, channel, stub, db, method, data
):
    limits = Limits.of(server)
    namespace = await prepare(stub)
    body = data.draw(malformed(REQUEST_TYPES[method], namespace), label="body")
    expected, message = body_verdict(method, body, limits)
    before = await rows(db, namespace, message)

    error = await unary_raw(channel, method, body)

    check_answer(method, error, expected)
    if error is not None and error.code() == INVALID_ARGUMENT:
        assert await rows(db, namespace, message) == before
    if message is None:  # not a message: refused naming the request
        assert error is not None and bad_request_fields(error) == ["request"]
    await health_serving(channel)


@examples(120)
@given(data=st.data(), second=st.booleans())
async def test_heartbeat_malformed_message_clean_status_changes_nothing(
    server, channel, stub, db, data, second
):
    limits = Limits.of(server)
    namespace = await prepare(stub)
    call = channel.stream_stream(
        f"/{SERVICE.full_name}/Heartbeat", request_serializer=None, response_deserializer=None
    )(timeout=CALL_TIMEOUT_S)
    good = pb.HeartbeatRequest(namespace=namespace, task_id="t", owner_id="a", fence=1)
    body = data.draw(malformed(pb.HeartbeatRequest, namespace), label="body")
    if second:  # the malformed body follows a good first message
        await call.write(good.SerializeToString())
        assert (await read_one(call)) == (True, None)
        expected = UNPARSEABLE
        try:
            later = pb.HeartbeatRequest.FromString(body)
            wrong = mistyped(later)
            expected = (
                Verdict(frozenset(wrong)) if wrong else later_beat_verdict(later, good, limits)
            )
        except DecodeError:
            pass
    else:
        expected, _ = body_verdict("Heartbeat", body, limits)
    before = await rows(db, namespace)

    await call.write(body)
    await call.done_writing()
    error = await stream_end(call)

    check_answer("Heartbeat", error, expected)
    if error is not None and error.code() == INVALID_ARGUMENT:
        assert await rows(db, namespace) == before
    await health_serving(channel)


@examples(500)
@given(method=st.sampled_from(UNARY), data=st.data())
async def test_unary_random_field_values_clean_status_changes_nothing(
    server, channel, stub, db, method, data
):
    limits = Limits.of(server)
    namespace = await prepare(stub)
    request = data.draw(messages(REQUEST_TYPES[method], namespace), label="request")
    expected = verdict(request, limits)
    before = await rows(db, namespace, request)

    error = None
    try:
        await getattr(stub, method)(request, timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        error = exc

    check_answer(method, error, expected)
    if error is not None and error.code() == INVALID_ARGUMENT:
        assert await rows(db, namespace, request) == before
    await health_serving(channel)


@examples(150)
@given(data=st.data(), second=st.booleans())
async def test_heartbeat_random_field_values_clean_status_changes_nothing(
    server, channel, stub, db, data, second
):
    limits = Limits.of(server)
    namespace = await prepare(stub)
    first = data.draw(messages(pb.HeartbeatRequest, namespace), label="first")
    expected = verdict(first, limits)
    call = stub.Heartbeat(timeout=CALL_TIMEOUT_S)
    before = await rows(db, namespace, first)

    await call.write(first)
    more = True
    if second and not expected.bad:
        more, error = await read_one(call)
        if more:  # renewed: judge the second message on its own
            later = data.draw(messages(pb.HeartbeatRequest, namespace), label="later")
            expected = later_beat_verdict(later, first, limits)
            before = await rows(db, namespace, first)
            await call.write(later)
    if more:
        await call.done_writing()
        error = await stream_end(call)

    check_answer("Heartbeat", error, expected)
    if error is not None and error.code() == INVALID_ARGUMENT:
        assert await rows(db, namespace, first) == before
    await health_serving(channel)
