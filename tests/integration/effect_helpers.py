"""Raw-stub helpers for the effect ledger's contract tests."""

from __future__ import annotations

import asyncpg

from leasekeeper.v1 import lease_service_pb2 as pb
from tests.integration.contract_helpers import Stub

ONCE = pb.EFFECT_POLICY_ONCE
LATEST = pb.EFFECT_POLICY_LATEST
PROCEED = pb.EFFECT_DECISION_PROCEED
ALREADY_APPLIED = pb.EFFECT_DECISION_ALREADY_APPLIED
IN_DOUBT = pb.EFFECT_DECISION_IN_DOUBT
RESERVED = pb.EFFECT_STATE_RESERVED
SUCCEEDED = pb.EFFECT_STATE_SUCCEEDED
FAILED = pb.EFFECT_STATE_FAILED


async def begin(
    stub: Stub,
    namespace: str,
    fence: int,
    effect_key: str = "send",
    policy: int = ONCE,
    digest: bytes = b"d1",
    task_id: str = "t",
) -> pb.BeginEffectResponse:
    return await stub.BeginEffect(
        pb.BeginEffectRequest(
            namespace=namespace,
            task_id=task_id,
            fence=fence,
            effect_key=effect_key,
            policy=policy,  # type: ignore[arg-type]
            request_digest=digest,
        )
    )


async def complete(
    stub: Stub,
    namespace: str,
    fence: int,
    effect_key: str = "send",
    outcome: int = SUCCEEDED,
    result: bytes = b"msg-1",
    retryable: bool = False,
    task_id: str = "t",
) -> pb.Effect:
    reply = await stub.CompleteEffect(
        pb.CompleteEffectRequest(
            namespace=namespace,
            task_id=task_id,
            fence=fence,
            effect_key=effect_key,
            outcome=outcome,  # type: ignore[arg-type]
            retryable=retryable,
            result=result,
        )
    )
    return reply.effect


async def list_effects(
    stub: Stub, namespace: str, task_id: str = "t", state: int = 0, page_size: int = 0
) -> list[pb.Effect]:
    """Every effect of the task, following pages."""
    effects: list[pb.Effect] = []
    token = ""
    while True:
        reply = await stub.ListEffects(
            pb.ListEffectsRequest(
                namespace=namespace,
                task_id=task_id,
                state=state,  # type: ignore[arg-type]
                page_size=page_size,
                page_token=token,
            )
        )
        effects.extend(reply.effects)
        token = reply.next_page_token
        if not token:
            return effects


async def effect_rows(db: asyncpg.Connection, namespace: str) -> list[tuple[object, ...]]:
    """The namespace's ledger rows, as stored, in a stable order."""
    rows = await db.fetch(
        "SELECT * FROM leasekeeper_effects WHERE namespace = $1 ORDER BY task_id, effect_key",
        namespace,
    )
    return [tuple(r) for r in rows]
