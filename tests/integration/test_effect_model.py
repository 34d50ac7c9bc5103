"""The effect ledger against a model: random call sequences on a real server, every answer checked.

A hypothesis state machine drives one task ("t") of a fresh namespace per
example: claims by fresh owners, expiry (a backdated expire_time), releases
(some completing the task), operator revocations, and BeginEffect /
CompleteEffect calls with the current, an older or a never-issued fence on two
effect keys. A small model, written here from the documented rules (the
decision table in ``leasekeeper_server/core/effect_rules.py``'s docstring and the RPC
comments in the proto) and deliberately not importing the server's own rules,
predicts every answer exactly: the decision or the error (code, ErrorInfo
reason and metadata), and the record the ledger holds afterwards. After each
step an invariant compares the model with ListEffects (and the task with
GetLease).

Where the documents leave an order open, the model states one: a malformed
CompleteEffect (SUCCEEDED and retryable) is INVALID_ARGUMENT before any lease
check; a fence above every issued one is FENCE_UNKNOWN even on a COMPLETED
task; a key reused with another policy and another digest names the policy;
recording the same outcome again leaves complete_fence as it was.

The server runs on an event loop in a thread of its own (the state machine is
synchronous) and is called through a synchronous channel. Nothing depends on
wall-clock time: ttls are long and a lease expires only by a backdated
expire_time.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf import timestamp_pb2
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.helpers import dur, error_info
from tests.integration import contract_helpers as h
from tests.integration.server_thread import (
    CALL_TIMEOUT_S,
    ServerThread,
    expect_ok,
    serving_thread,
    sync_stub_of,
)

T = TypeVar("T")

TASK = "t"
TTL_S = 30.0

ONCE, LATEST = pb.EFFECT_POLICY_ONCE, pb.EFFECT_POLICY_LATEST
RESERVED, SUCCEEDED, FAILED = (
    pb.EFFECT_STATE_RESERVED,
    pb.EFFECT_STATE_SUCCEEDED,
    pb.EFFECT_STATE_FAILED,
)
PROCEED = pb.EFFECT_DECISION_PROCEED
ALREADY_APPLIED = pb.EFFECT_DECISION_ALREADY_APPLIED
IN_DOUBT = pb.EFFECT_DECISION_IN_DOUBT

ABORTED = grpc.StatusCode.ABORTED
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND

# Each key has a usual policy, so that a key is mostly asked for with the
# policy it was reserved with (a call may still ask for the other one).
USUAL_POLICY = {"k1": ONCE, "k2": LATEST}
# CompleteEffect's outcome and retryable flag, by name; SUCCEEDED and
# retryable is malformed (INVALID_ARGUMENT).
OUTCOMES = {
    "SUCCEEDED": (SUCCEEDED, False),
    "FAILED retryable": (FAILED, True),
    "FAILED": (FAILED, False),
    "SUCCEEDED retryable": (SUCCEEDED, True),
}

# The task's row as the model sees it ("none": never claimed).
NONE, HELD, EXPIRED, RELEASED, REVOKED, COMPLETED = (
    "none",
    "held",
    "expired",
    "released",
    "revoked",
    "completed",
)
WIRE_TASK_STATE = {
    HELD: pb.TASK_STATE_HELD,
    EXPIRED: pb.TASK_STATE_EXPIRED,
    RELEASED: pb.TASK_STATE_FREE,
    REVOKED: pb.TASK_STATE_FREE,
    COMPLETED: pb.TASK_STATE_COMPLETED,
}
# Why the task's current fence may not act, by row (it may while HELD).
ROW_LOSS = {
    EXPIRED: "LEASE_EXPIRED",
    RELEASED: "LEASE_RELEASED",
    REVOKED: "LEASE_REVOKED",
}


# -- the actions of one step ------------------------------------------------
#
# One rule takes one of these. Separate rules would be switched off at random
# per example by hypothesis's swarm testing: many examples would then never
# call BeginEffect, or never claim again after losing the lease. Rare choices
# sit in the middle of each sampled list: hypothesis draws its ends more often.


@dataclass(frozen=True)
class Claim:
    """A fresh owner claims the task."""


@dataclass(frozen=True)
class Expire:
    """The lease's expire_time passes (HELD only); then, maybe, a fresh owner claims."""

    then_claim: bool


@dataclass(frozen=True)
class Release:
    """The owner releases its HELD or EXPIRED lease, maybe completing the task."""

    complete: bool
    then_claim: bool


@dataclass(frozen=True)
class Revoke:
    """An operator revokes the HELD or EXPIRED lease."""

    then_claim: bool


@dataclass(frozen=True)
class Begin:
    """BeginEffect.

    Attributes:
        fence: "current", "older" (``pick`` chooses which; the current one when
            none is older) or "unknown" (never issued; also "current" before
            the first claim).
        policy: "usual" (the key's) or "other".
    """

    fence: str
    pick: int
    key: str
    policy: str
    digest: bytes


@dataclass(frozen=True)
class Complete:
    """CompleteEffect; ``fence`` and ``pick`` as for Begin, ``outcome`` a key of OUTCOMES."""

    fence: str
    pick: int
    key: str
    outcome: str
    result: bytes


Action = Claim | Expire | Release | Revoke | Begin | Complete

FENCES = st.sampled_from(["current"] * 3 + ["older", "unknown"] + ["current"] * 3)
PICKS = st.integers(0, 7)
KEYS = st.sampled_from(sorted(USUAL_POLICY))
# A lost task is mostly taken over soon.
THEN_CLAIM = st.sampled_from([True, True, False, True, True])
BEGINS = st.builds(
    Begin,
    fence=FENCES,
    pick=PICKS,
    key=KEYS,
    policy=st.sampled_from(["usual"] * 3 + ["other"] + ["usual"] * 3),
    digest=st.sampled_from([b"d1", b"d1", b"d2", b"d1", b"d1"]),
)
COMPLETES = st.builds(
    Complete,
    fence=FENCES,
    pick=PICKS,
    key=KEYS,
    outcome=st.sampled_from(
        [
            *["SUCCEEDED", "FAILED retryable", "FAILED", "FAILED retryable"],
            "SUCCEEDED retryable",
            *["FAILED retryable", "FAILED", "FAILED retryable", "SUCCEEDED"],
        ]
    ),
    result=st.sampled_from([b"r1", b"r1", b"r2", b"r1", b"r1"]),
)


def lease_event(kind: str, complete: bool, then_claim: bool) -> Action:
    return {
        "claim": Claim(),
        "expire": Expire(then_claim),
        "release": Release(complete, then_claim),
        "revoke": Revoke(then_claim),
    }[kind]


LEASE_EVENTS = st.builds(
    lease_event,
    st.sampled_from(["expire", "claim", "revoke", "release"]),
    complete=st.sampled_from([False] * 3 + [True] + [False] * 3),
    then_claim=THEN_CLAIM,
)
# Two steps in three call the ledger; about one example in eight completes the task.
ACTIONS: st.SearchStrategy[Action] = st.one_of(BEGINS, LEASE_EVENTS, COMPLETES)


# -- the model --------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """The model of one ledger row, with the timestamps the server reported for it."""

    policy: int
    digest: bytes
    state: int
    fence: int
    complete_fence: int = 0
    retryable: bool = False
    result: bytes = b""
    attempts: int = 1
    begin_time: timestamp_pb2.Timestamp | None = None
    complete_time: timestamp_pb2.Timestamp | None = None

    def fields(self, key: str) -> tuple[object, ...]:
        return (
            key,
            pb.EffectPolicy.Name(self.policy),
            self.digest,
            pb.EffectState.Name(self.state),
            self.fence,
            self.complete_fence,
            self.retryable,
            self.result,
            self.attempts,
        )


def wire_fields(effect: pb.Effect) -> tuple[object, ...]:
    return (
        effect.effect_key,
        pb.EffectPolicy.Name(effect.policy),
        effect.request_digest,
        pb.EffectState.Name(effect.state),
        effect.fence,
        effect.complete_fence,
        effect.retryable,
        effect.result,
        effect.attempts,
    )


@dataclass(frozen=True)
class Refusal:
    """A predicted error: its code, ErrorInfo reason and (some of) its metadata."""

    code: grpc.StatusCode
    reason: str
    metadata: tuple[tuple[str, str], ...] = ()


def key_reused(field: str, old: Record) -> Refusal:
    return Refusal(
        FAILED_PRECONDITION,
        "EFFECT_KEY_REUSED",
        (("field", field), ("recorded_fence", str(old.fence))),
    )


# -- the server, on a loop of its own ----------------------------------------


@pytest.fixture(scope="module")
def backend(database_url: str) -> Iterator[ServerThread]:
    with serving_thread(database_url) as server:
        yield server


@pytest.fixture(scope="module")
def sync_stub(backend: ServerThread) -> Iterator[rpc.LeaseServiceStub]:
    with sync_stub_of(backend) as stub:
        yield stub


# -- the state machine -------------------------------------------------------


class EffectLedgerModel(RuleBasedStateMachine):
    """One task, two effect keys: the server's answers against the model's."""

    def __init__(
        self, backend: ServerThread, stub: rpc.LeaseServiceStub, stats: Counter[str]
    ) -> None:
        super().__init__()
        self.backend = backend
        self.stub = stub
        self.stats = stats
        stats["examples"] += 1
        self.namespace = f"model-{uuid.uuid4().hex[:12]}"
        self.fence = 0  # the task's current fence
        self.row = NONE
        self.owner = ""  # the current fence's owner
        self.owners = 0
        self.records: dict[str, Record] = {}

    # -- calling the server ---------------------------------------------------

    def call(self, method: Callable[..., T], request: Any) -> T | grpc.RpcError:
        """The reply, or the error for the codes a model predicts (others propagate)."""
        try:
            return method(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            if error.code() not in (ABORTED, FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND):
                raise
            return error

    def expect_refusal(self, answer: object, expected: Refusal) -> None:
        assert isinstance(answer, grpc.RpcError), f"expected {expected}, got OK: {answer}"
        info = error_info(answer)  # type: ignore[arg-type]
        got = Refusal(
            answer.code(),
            info.reason,
            tuple((k, info.metadata.get(k, "<missing>")) for k, _ in expected.metadata),
        )
        assert got == expected, answer.details()

    # -- the model's rules ----------------------------------------------------

    def pick_fence(self, which: str, pick: int) -> int:
        """A fence for a call: an older one (if any), the current one, or one never issued."""
        if which == "older" and self.fence >= 2:
            return 1 + pick % (self.fence - 1)
        if which == "unknown" or self.fence == 0:
            return self.fence + 1
        return self.fence

    def fence_refusal(self, fence: int) -> Refusal | None:
        """Why ``fence`` may not act now (ABORTED), or None when it is current and HELD."""
        if fence > self.fence:
            reason = "FENCE_UNKNOWN"
        elif self.row == COMPLETED:
            reason = "TASK_COMPLETED"
        elif fence < self.fence:
            reason = "LEASE_SUPERSEDED"
        elif self.row == HELD:
            return None
        else:
            reason = ROW_LOSS[self.row]
        return Refusal(ABORTED, reason, (("current_fence", str(self.fence)),))

    def predict_begin(
        self, fence: int, key: str, policy: int, digest: bytes
    ) -> Refusal | tuple[int, Record]:
        """BeginEffect by the table: the error, or the decision and the record afterwards."""
        refusal = self.fence_refusal(fence)
        if refusal is not None:
            return refusal
        old = self.records.get(key)
        new = Record(policy=policy, digest=digest, state=RESERVED, fence=fence)
        if old is None:
            return PROCEED, new
        # The newest fence that touched the record: the one that reserved it, or
        # the one that recorded its outcome. The caller's fence is current and
        # live: that one, or a newer one.
        newest = max(old.fence, old.complete_fence)
        assert fence >= newest, "the model lost track of the fences"
        supersedes = old.policy == LATEST and fence > newest
        if policy != old.policy:
            return key_reused("policy", old)
        if digest != old.digest and not supersedes:
            return key_reused("request_digest", old)
        again = replace(new, attempts=old.attempts + 1)
        if old.state == FAILED and old.retryable:
            return PROCEED, again
        if old.state == RESERVED:  # never confirmed
            if policy == ONCE or fence == old.fence:
                return IN_DOUBT, old
            return PROCEED, again
        # Confirmed: SUCCEEDED, or FAILED and not retryable.
        if policy == ONCE or fence == newest:
            return ALREADY_APPLIED, old
        return PROCEED, again

    def predict_complete(
        self, fence: int, key: str, state: int, retryable: bool, result: bytes
    ) -> Refusal | tuple[bool, Record]:
        """CompleteEffect: the error, or whether it writes and the record afterwards."""
        if state == SUCCEEDED and retryable:
            return Refusal(INVALID_ARGUMENT, "INVALID_ARGUMENT", (("field", "retryable"),))
        refusal = self.fence_refusal(fence)
        if refusal is not None:
            return refusal
        old = self.records.get(key)
        if old is None:
            return Refusal(FAILED_PRECONDITION, "EFFECT_NOT_BEGUN")
        if old.state == RESERVED:
            return True, replace(
                old, state=state, retryable=retryable, result=result, complete_fence=fence
            )
        if (old.state, old.retryable, old.result) == (state, retryable, result):
            return False, old
        return Refusal(
            FAILED_PRECONDITION,
            "EFFECT_ALREADY_COMPLETED",
            (
                ("state", pb.EffectState.Name(old.state).removeprefix("EFFECT_STATE_")),
                ("complete_fence", str(old.complete_fence)),
            ),
        )

    def check_effect(self, effect: pb.Effect, record: Record, key: str) -> None:
        """The wire effect is the model's record (timestamps: as the server reported them)."""
        assert (effect.namespace, effect.task_id) == (self.namespace, TASK)
        assert wire_fields(effect) == record.fields(key)
        assert effect.HasField("begin_time")
        assert effect.HasField("complete_time") == (record.state != RESERVED)
        if record.begin_time is not None:
            assert effect.begin_time == record.begin_time
        if record.complete_time is not None:
            assert effect.complete_time == record.complete_time

    # -- steps ------------------------------------------------------------------

    @initialize(claimed=st.sampled_from([True] * 4 + [False] + [True] * 4))
    def start(self, claimed: bool) -> None:
        """Most examples start with a lease (the ledger has little to say without one)."""
        if claimed:
            self.claim()

    @rule(action=ACTIONS)
    def step(self, action: Action) -> None:
        self.stats["steps"] += 1
        self.stats[f"step {type(action).__name__}"] += 1
        match action:
            case Claim():
                self.claim()
            case Expire() if self.row == HELD:
                self.backend.run(lambda db: h.backdate(db, self.namespace, TASK))
                self.row = EXPIRED
            case Release() if self.row in (HELD, EXPIRED):
                self.release(action.complete)
            case Revoke() if self.row in (HELD, EXPIRED):
                self.backend.run(lambda db: h.revoke_in_database(db, self.namespace, TASK))
                self.row = REVOKED
            case Begin():
                usual = USUAL_POLICY[action.key]
                other = LATEST if usual == ONCE else ONCE
                fence = self.pick_fence(action.fence, action.pick)
                policy = usual if action.policy == "usual" else other
                self.begin(fence, action.key, policy, action.digest)
            case Complete():
                fence = self.pick_fence(action.fence, action.pick)
                state, retryable = OUTCOMES[action.outcome]
                self.complete(fence, action.key, state, retryable, action.result)
            case _:
                self.stats["lease steps that do not apply"] += 1
                return
        if getattr(action, "then_claim", False):
            self.claim()

    def claim(self) -> None:
        """A fresh owner claims: granted with fence + 1 unless HELD; refused when COMPLETED."""
        self.owners += 1
        owner = f"o{self.owners}"
        request = pb.ClaimRequest(
            namespace=self.namespace, task_id=TASK, owner_id=owner, ttl=dur(TTL_S)
        )
        answer = self.call(self.stub.Claim, request)
        if self.row == COMPLETED:
            self.stats["claim TASK_COMPLETED"] += 1
            current = (("current_fence", str(self.fence)),)
            self.expect_refusal(answer, Refusal(FAILED_PRECONDITION, "TASK_COMPLETED", current))
            return
        reply = expect_ok(answer)
        if self.row == HELD:
            self.stats["claim not acquired"] += 1
            assert not reply.acquired, reply
            assert h.secs(reply.holder_remaining_ttl) > 0
            return
        self.stats["claim granted"] += 1
        assert reply.acquired, reply
        self.fence, self.row, self.owner = self.fence + 1, HELD, owner
        lease = reply.lease
        assert (lease.fence, lease.owner_id, lease.state) == (self.fence, owner, pb.TASK_STATE_HELD)

    def release(self, complete: bool) -> None:
        """The owner releases its live or expired lease; complete=True ends the task."""
        request = pb.ReleaseRequest(
            namespace=self.namespace,
            task_id=TASK,
            owner_id=self.owner,
            fence=self.fence,
            complete=complete,
        )
        lease = expect_ok(self.call(self.stub.Release, request)).lease
        self.row = COMPLETED if complete else RELEASED
        assert (lease.fence, lease.state) == (self.fence, WIRE_TASK_STATE[self.row])

    def begin(self, fence: int, key: str, policy: int, digest: bytes) -> None:
        request = pb.BeginEffectRequest(
            namespace=self.namespace,
            task_id=TASK,
            fence=fence,
            effect_key=key,
            policy=policy,  # type: ignore[arg-type]
            request_digest=digest,
        )
        expected = self.predict_begin(fence, key, policy, digest)
        answer = self.call(self.stub.BeginEffect, request)
        if isinstance(expected, Refusal):
            self.stats[f"begin {expected.reason}"] += 1
            self.expect_refusal(answer, expected)
            return
        decision, record = expected
        self.stats[f"begin {pb.EffectDecision.Name(decision)}"] += 1
        reply = expect_ok(answer)
        assert pb.EffectDecision.Name(reply.decision) == pb.EffectDecision.Name(decision), reply
        if decision == PROCEED:  # a new reservation: its begin_time is the server's
            record = replace(record, begin_time=reply.effect.begin_time)
        self.check_effect(reply.effect, record, key)
        self.records[key] = record

    def complete(self, fence: int, key: str, state: int, retryable: bool, result: bytes) -> None:
        request = pb.CompleteEffectRequest(
            namespace=self.namespace,
            task_id=TASK,
            fence=fence,
            effect_key=key,
            outcome=state,  # type: ignore[arg-type]
            retryable=retryable,
            result=result,
        )
        expected = self.predict_complete(fence, key, state, retryable, result)
        answer = self.call(self.stub.CompleteEffect, request)
        if isinstance(expected, Refusal):
            self.stats[f"complete {expected.reason}"] += 1
            self.expect_refusal(answer, expected)
            return
        writes, record = expected
        self.stats["complete writes" if writes else "complete again (same outcome)"] += 1
        effect = expect_ok(answer).effect
        if writes:  # the outcome is recorded now: its complete_time is the server's
            record = replace(record, complete_time=effect.complete_time)
        self.check_effect(effect, record, key)
        self.records[key] = record

    # -- invariants -------------------------------------------------------------

    @invariant()
    def ledger_is_the_model(self) -> None:
        effects: list[pb.Effect] = []
        token = ""
        while True:
            reply = self.stub.ListEffects(
                pb.ListEffectsRequest(namespace=self.namespace, task_id=TASK, page_token=token),
                timeout=CALL_TIMEOUT_S,
            )
            effects.extend(reply.effects)
            token = reply.next_page_token
            if not token:
                break
        assert [e.effect_key for e in effects] == sorted(self.records)
        for effect in effects:
            self.check_effect(effect, self.records[effect.effect_key], effect.effect_key)

    @invariant()
    def task_is_the_model(self) -> None:
        answer = self.call(
            self.stub.GetLease, pb.GetLeaseRequest(namespace=self.namespace, task_id=TASK)
        )
        if self.row == NONE:
            self.expect_refusal(answer, Refusal(NOT_FOUND, "TASK_NOT_FOUND"))
            return
        lease = expect_ok(answer).lease
        assert (lease.fence, lease.owner_id, lease.state) == (
            self.fence,
            self.owner,
            WIRE_TASK_STATE[self.row],
        )


MODEL_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    database=None,  # nothing written into the working tree; a failure prints its steps
    print_blob=True,
    report_multiple_bugs=False,  # shrink one failure only: each run calls the server
    suppress_health_check=[HealthCheck.too_slow],
)


# A pass takes about 12 s; a failure is shrunk by replaying sequences against the
# server, which can take minutes (hypothesis stops shrinking after 300 s).
@pytest.mark.timeout(420)
def test_effect_ledger_follows_the_model(
    backend: ServerThread, sync_stub: rpc.LeaseServiceStub
) -> None:
    stats: Counter[str] = Counter()
    run_state_machine_as_test(
        lambda: EffectLedgerModel(backend, sync_stub, stats), settings=MODEL_SETTINGS
    )
    print(f"effect model: {dict(sorted(stats.items()))}")  # shown with -rP or -s
