/**
 * Typed errors: every ErrorInfo reason the proto names becomes its class (the Python client's
 * table, held to lease_service.proto), and the server's real refusals arrive as those classes.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { status as Code } from "@grpc/grpc-js";
import {
  AccessDenied,
  CheckpointNotNewer,
  EffectAlreadyCompleted,
  EffectKeyReused,
  EffectNotBegun,
  fromServiceError,
  InvalidArgument,
  LeaseClient,
  LeaseError,
  LeaseLost,
  LeaseUnavailable,
  LimitExceeded,
  LOSS_REASONS,
  proto,
  richStatus,
  TaskCancelled,
  TaskCompleted,
  TaskEnded,
  TaskFailed,
  TaskNotFound,
  TaskNotQuarantined,
  TaskQuarantined,
} from "../src/index.js";
import { freshNamespace, ROOT, serverForFile } from "./support/server.js";

type ErrorClass = abstract new (...args: never[]) => LeaseError;

/** [code, reason, class]: how each reason the server sends is thrown (a reason may come with two codes). */
const TABLE: Array<[number, string, ErrorClass]> = [
  ...LOSS_REASONS.filter((r) => r !== "TASK_QUARANTINED").map((r): [number, string, ErrorClass] => [Code.ABORTED, r, LeaseLost]),
  [Code.FAILED_PRECONDITION, "TASK_COMPLETED", TaskCompleted],
  [Code.FAILED_PRECONDITION, "TASK_CANCELLED", TaskCancelled],
  [Code.FAILED_PRECONDITION, "TASK_FAILED", TaskFailed],
  [Code.FAILED_PRECONDITION, "TASK_QUARANTINED", TaskQuarantined],
  [Code.FAILED_PRECONDITION, "TASK_NOT_QUARANTINED", TaskNotQuarantined],
  [Code.FAILED_PRECONDITION, "CHECKPOINT_NOT_NEWER", CheckpointNotNewer],
  [Code.FAILED_PRECONDITION, "EFFECT_KEY_REUSED", EffectKeyReused],
  [Code.FAILED_PRECONDITION, "EFFECT_NOT_BEGUN", EffectNotBegun],
  [Code.FAILED_PRECONDITION, "EFFECT_ALREADY_COMPLETED", EffectAlreadyCompleted],
  [Code.INVALID_ARGUMENT, "INVALID_ARGUMENT", InvalidArgument],
  [Code.NOT_FOUND, "TASK_NOT_FOUND", TaskNotFound],
  [Code.RESOURCE_EXHAUSTED, "LEASE_LIMIT", LimitExceeded],
  [Code.RESOURCE_EXHAUSTED, "CLAIM_RATE_LIMIT", LimitExceeded],
  [Code.UNAUTHENTICATED, "UNAUTHENTICATED", AccessDenied],
  [Code.PERMISSION_DENIED, "PERMISSION_DENIED", AccessDenied],
  [Code.UNAVAILABLE, "DATABASE_UNAVAILABLE", LeaseUnavailable],
  [Code.UNAVAILABLE, "SHUTTING_DOWN", LeaseUnavailable],
  [Code.INTERNAL, "INTERNAL", LeaseError],
];

/** The LossReason names of the generated code, without their prefix. */
function lossReasonsInProto(): string[] {
  return Object.keys(proto.LossReason)
    .filter((k) => k.startsWith("LOSS_REASON_") && k !== "LOSS_REASON_UNSPECIFIED")
    .map((k) => k.slice("LOSS_REASON_".length));
}

/** The reasons lease_service.proto says errors carry: every LossReason, and the list at its top. */
function reasonsInProto(): Set<string> {
  const text = readFileSync(join(ROOT, "protos", "leasekeeper", "v1", "lease_service.proto"), "utf8");
  const header = /reason \(the LossReason value name without its prefix, or one of([^)]*)\)/.exec(text);
  assert.ok(header, "the proto's header lists the ErrorInfo reasons");
  const listed = header[1]!.replace(/\/\//g, " ").split(/[\s,]+/).filter((w) => /^[A-Z_]+$/.test(w));
  return new Set([...listed, ...lossReasonsInProto()]);
}

test("every ErrorInfo reason in the proto has its error class", () => {
  const reasons = reasonsInProto();
  assert.ok(reasons.size >= 25, `found ${reasons.size} reasons`);
  assert.deepEqual(new Set(LOSS_REASONS), new Set(lossReasonsInProto()), "LOSS_REASONS is the proto's LossReason");
  const covered = new Set(TABLE.map(([, reason]) => reason));
  assert.deepEqual([...reasons].filter((r) => !covered.has(r)), [], "reasons without a class");
  for (const [code, reason, kind] of TABLE) {
    const error = fromServiceError(richStatus(code, `refused: ${reason}`, reason, { current_version: "7" }));
    assert.ok(error instanceof kind, `${Code[code]} ${reason} -> ${error.constructor.name}, not ${kind.name}`);
    assert.equal(error.reason, reason);
    assert.equal(error.code, code);
    assert.equal(error.name, error.constructor.name);
  }
  const limited = fromServiceError(richStatus(Code.RESOURCE_EXHAUSTED, "x", "LEASE_LIMIT"));
  assert.ok(limited instanceof LimitExceeded && limited.retryAfter === null);
  const bare = fromServiceError({ code: Code.UNAVAILABLE, details: "no trailer", metadata: undefined as never });
  assert.ok(bare instanceof LeaseUnavailable && bare.reason === null && bare.retryable);
  // gRPC's own RESOURCE_EXHAUSTED (a connection ended after a missed keepalive ping) carries no
  // reason: not a namespace limit, and the call's outcome is unknown.
  const calm = fromServiceError({
    code: Code.RESOURCE_EXHAUSTED,
    details: "Bandwidth exhausted or memory limit exceeded",
    metadata: undefined as never,
  });
  assert.ok(calm instanceof LeaseUnavailable && !(calm instanceof LimitExceeded));
  assert.ok(calm.code === Code.RESOURCE_EXHAUSTED && calm.reason === null && calm.retryable);
  assert.ok(new TaskCompleted("x") instanceof TaskEnded);
});

const server = serverForFile();

test("the server's refusals arrive as typed errors", async () => {
  const c = new LeaseClient({ target: server.target, namespace: freshNamespace() });
  try {
    await assert.rejects(c.getLease("never-claimed"), TaskNotFound);
    await assert.rejects(c.claim("", { ttl: 10 }), (e: unknown) => e instanceof InvalidArgument && e.field === "task_id");
    await assert.rejects(c.claim("t", { ttl: Number.NaN }), (e: unknown) => e instanceof InvalidArgument && e.field === "ttl" && e.code === null);

    const granted = (await c.claim("t", { ttl: 10 })).lease!;
    await c.saveCheckpoint("t", granted.fence, 3, "three");
    await assert.rejects(c.saveCheckpoint("t", granted.fence, 2, "two"), (e: unknown) => e instanceof CheckpointNotNewer && e.currentVersion === 3n);
    await c.beginEffect("t", granted.fence, "k", { policy: "ONCE" });
    await assert.rejects(c.beginEffect("t", granted.fence, "k", { policy: "LATEST" }), EffectKeyReused);
    await assert.rejects(c.completeEffect("t", granted.fence, "absent", { outcome: "SUCCEEDED" }), EffectNotBegun);
    await c.completeEffect("t", granted.fence, "k", { outcome: "SUCCEEDED", result: "a" });
    await assert.rejects(c.completeEffect("t", granted.fence, "k", { outcome: "FAILED" }), EffectAlreadyCompleted);
    await assert.rejects(c.retry("t", "not quarantined"), (e: unknown) => e instanceof TaskNotQuarantined && e.state !== null);
    const newer = (await c.claim("t", { ttl: 10 })).lease!; // a new incarnation
    await assert.rejects(
      c.release("t", granted.fence),
      (e: unknown) => e instanceof LeaseLost && e.reason === "LEASE_SUPERSEDED" && e.taskId === "t" && e.fence === granted.fence,
    );
    await c.release("t", newer.fence, { complete: true });
    await assert.rejects(c.claim("t"), TaskCompleted);

    await c.claim("cancelled", { ttl: 10 });
    await c.cancel("cancelled", "test");
    await assert.rejects(c.claim("cancelled"), TaskCancelled);
    const failing = (await c.claim("failed", { ttl: 10 })).lease!;
    await c.release("failed", failing.fence, { fail: true, failReason: "bad input" });
    await assert.rejects(c.claim("failed"), TaskFailed);
    assert.equal((await c.getLease("failed")).failReason, "bad input");
    await assert.rejects(c.release("failed", failing.fence, { complete: true, fail: true }), InvalidArgument);

    await c.claim("attempts", { ttl: 10, maxAttempts: 1 });
    await c.revoke("attempts", "test: the only attempt ends"); // a revoke counts as an attempt
    await assert.rejects(c.claim("attempts"), TaskQuarantined);
    assert.equal((await c.retry("attempts", "test: again")).state, "FREE");
  } finally {
    await c.close();
  }
});
