/**
 * The values the client returns, and their conversion from and to the generated messages.
 *
 * Durations are numbers of seconds; instants are `Date`s on the database clock; int64 values
 * (fences, checkpoint versions, sizes) are `bigint`, exact however large.
 */
import type { Duration } from "./gen/google/protobuf/duration.js";
import * as pb from "./gen/leasekeeper/v1/lease_service.js";
import { InvalidArgument } from "./errors.js";

/** A task's state: FREE, HELD, EXPIRED, COMPLETED, QUARANTINED, CANCELLED or FAILED. */
export type TaskState = "FREE" | "HELD" | "EXPIRED" | "COMPLETED" | "QUARANTINED" | "CANCELLED" | "FAILED";
/** How an effect may be repeated: ONCE (irreversible) or LATEST (replaceable). */
export type EffectPolicy = "ONCE" | "LATEST";
/** An effect's state in the ledger. */
export type EffectState = "RESERVED" | "SUCCEEDED" | "FAILED";
/** BeginEffect's answer. */
export type EffectDecision = "PROCEED" | "ALREADY_APPLIED" | "IN_DOUBT";

/** A lease on one task, as the database saw it when the answer was made. */
export interface LeaseInfo {
  namespace: string;
  taskId: string;
  /** The owner the lease was granted to (the last one when FREE or COMPLETED). */
  ownerId: string;
  /** The fencing token; 0n only for a task never claimed. */
  fence: bigint;
  state: TaskState;
  /** When the lease ends unless renewed (database clock); null when FREE. */
  expireTime: Date | null;
  /** Seconds left on the lease (database clock); 0 when not live. */
  remainingTtl: number;
  /** The end of the runtime budget, or null. */
  runtimeDeadline: Date | null;
  /** When the current fence was granted, or null. */
  claimTime: Date | null;
  /** Why the last lease ended (a loss reason), or null. */
  endReason: string | null;
  revokeReason: string;
  /** Grants of the task that ended without a release; an operator's Retry resets it to 0. */
  attempts: number;
  /** The attempt limit of the current (or last) grant; 0: none. */
  maxAttempts: number;
  cancelReason: string;
  failReason: string;
  /** The stored checkpoint's version; 0n: none. */
  checkpointVersion: bigint;
  /** The stored checkpoint's size in bytes; 0n: none. */
  checkpointSize: bigint;
}

/** A task's saved progress: what a replacement worker resumes from. */
export interface Checkpoint {
  /** Chosen by the worker; each write carries a higher one (>= 1). */
  version: bigint;
  /** Opaque to the server; at most its max_checkpoint_bytes (256 KiB by default). */
  data: Uint8Array;
  /** What `data` is (e.g. "application/json"); may be empty. */
  contentType: string;
  /** The fence that wrote it (0n in a checkpoint not yet saved). */
  fence: bigint;
  /** When it was written (database clock); null when not known (saved on the heartbeat). */
  writeTime: Date | null;
}

/** The outcome of one Claim. */
export interface ClaimResult {
  /** True when the caller holds the lease. */
  acquired: boolean;
  /** The caller's lease when acquired, else null. */
  lease: LeaseInfo | null;
  /** When not acquired: seconds left on the holder's lease. */
  holderRemainingTtl: number | null;
  /** When not acquired: the holder's expire_time, if sent. */
  holderExpireTime: Date | null;
  /** When not acquired: seconds until the task can be granted, as far as the database could tell. */
  retryAfter: number | null;
  /** The client clock (seconds) when the request was sent: the trust deadline counts from it. */
  sendTime: number;
  /** The request id the claim carried: pass it again to retry this claim. */
  requestId: string;
  /** When acquired: the task's checkpoint, read in the same statement as the grant; null when none. */
  checkpoint: Checkpoint | null;
}

/** A renewed lease and when the renewal was sent (client clock, seconds). */
export interface RenewedLease extends LeaseInfo {
  sendTime: number;
}

/** ValidateFence's answer. */
export interface FenceCheck {
  /** True iff the fence is current, its lease HELD and the task not ended. */
  valid: boolean;
  /** The task's current fence (0n for a task never claimed). */
  currentFence: bigint;
  /** Why the fence is not valid (a loss reason), or null when valid. */
  reason: string | null;
  /** When valid: seconds the lease has left (database clock). */
  remainingTtl: number;
  expireTime: Date | null;
}

/** One effect of a task as the effect ledger recorded it. */
export interface EffectRecord {
  namespace: string;
  taskId: string;
  /** The caller's idempotency key for the effect, unique within the task. */
  effectKey: string;
  policy: EffectPolicy;
  requestDigest: Uint8Array;
  /** RESERVED (never confirmed: it may or may not have happened), SUCCEEDED or FAILED. */
  state: EffectState;
  /** The fence of the latest reservation. */
  fence: bigint;
  /** The fence that recorded the outcome (0n while RESERVED). */
  completeFence: bigint;
  /** For FAILED: whether a new attempt may be reserved. */
  retryable: boolean;
  /** The opaque result recorded with the outcome. */
  result: Uint8Array;
  /** How many times the effect was reserved. */
  attempts: number;
  beginTime: Date | null;
  completeTime: Date | null;
  externalOperationId: string;
  /** From completeEffect() only: the checkpoint saved with the outcome; null otherwise. */
  checkpoint: Checkpoint | null;
}

/** BeginEffect's answer: the decision and the effect it is about. */
export interface BeginResult {
  decision: EffectDecision;
  effect: EffectRecord;
}

/** One event of a task, as watch() delivers it. */
export interface TaskEvent {
  /** SNAPSHOT, CLAIMED, RELEASED, EXPIRED, COMPLETED, REVOKED, QUARANTINED, RETRIED, CANCELLED or FAILED. */
  type: string;
  /** The task's lease as the event left it; null for a namespace SNAPSHOT. */
  lease: LeaseInfo | null;
  eventTime: Date | null;
}

/** One entry of a task's history. */
export interface HistoryEntry {
  sequence: bigint;
  eventTime: Date | null;
  /** GRANTED, RELEASED, EXPIRED, REVOKED, COMPLETED, FAILED, CANCELLED, QUARANTINED, RETRIED, CHECKPOINT_SAVED, EFFECT_RESERVED, EFFECT_COMPLETED or FENCE_REFUSED. */
  kind: string;
  fence: bigint;
  ownerId: string;
  attempt: number;
  checkpointVersion: bigint;
  checkpointSize: bigint;
  effectKey: string;
  effectOutcome: string | null;
  externalOperationId: string;
  reason: string;
  method: string;
}

/** A checkpoint to save: a {@link Checkpoint} (fence and writeTime ignored), or `[version, data, contentType?]`. */
export type CheckpointLike =
  | Pick<Checkpoint, "version" | "data" | "contentType">
  | readonly [number | bigint, Uint8Array | string]
  | readonly [number | bigint, Uint8Array | string, string];

// ---- conversions -------------------------------------------------------------------------

/** An enum value's name without its prefix, e.g. TASK_STATE_HELD -> HELD; null for UNSPECIFIED. */
function enumName(names: Record<number, string>, value: number, prefix: string): string | null {
  const name = names[value];
  if (name === undefined || name.endsWith("_UNSPECIFIED") || name === "UNRECOGNIZED") return null;
  return name.startsWith(prefix) ? name.slice(prefix.length) : name;
}

/** A duration in seconds as a google.protobuf.Duration; undefined for null/undefined. */
export function toDuration(seconds: number | null | undefined, field: string): Duration | undefined {
  if (seconds === null || seconds === undefined) return undefined;
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) {
    throw InvalidArgument.local(field, `must be a finite number of seconds, got ${String(seconds)}`);
  }
  const whole = Math.floor(seconds);
  let nanos = Math.round((seconds - whole) * 1e9);
  let secs = BigInt(whole);
  if (nanos >= 1e9) {
    secs += 1n;
    nanos -= 1e9;
  }
  return { seconds: secs, nanos };
}

/** A google.protobuf.Duration in seconds (0 when unset). */
export function fromDuration(duration: Duration | undefined): number {
  return duration ? Number(duration.seconds) + duration.nanos / 1e9 : 0;
}

/** An optional, finite, non-negative number of seconds checked locally. */
export function optionalSeconds(value: number | null | undefined, field: string): number | null {
  if (value === null || value === undefined) return null;
  if (typeof value !== "number" || !Number.isFinite(value) || value < 0) {
    throw InvalidArgument.local(field, `must be a finite number of seconds >= 0, got ${String(value)}`);
  }
  return value;
}

export function leaseInfo(lease: pb.Lease | undefined): LeaseInfo {
  const l = lease ?? pb.Lease.create();
  return {
    namespace: l.namespace,
    taskId: l.taskId,
    ownerId: l.ownerId,
    fence: l.fence,
    state: (enumName(pb.TaskState, l.state, "TASK_STATE_") ?? "FREE") as TaskState,
    expireTime: l.expireTime ?? null,
    remainingTtl: fromDuration(l.remainingTtl),
    runtimeDeadline: l.runtimeDeadline ?? null,
    claimTime: l.claimTime ?? null,
    endReason: enumName(pb.LossReason, l.endReason, "LOSS_REASON_"),
    revokeReason: l.revokeReason,
    attempts: l.attempts,
    maxAttempts: l.maxAttempts,
    cancelReason: l.cancelReason,
    failReason: l.failReason,
    checkpointVersion: l.checkpointVersion,
    checkpointSize: l.checkpointSize,
  };
}

export function checkpointOf(message: pb.Checkpoint): Checkpoint {
  return {
    version: message.version,
    data: message.data,
    contentType: message.contentType,
    fence: message.fence,
    writeTime: message.writeTime ?? null,
  };
}

export function claimResult(response: pb.ClaimResponse, sendTime: number, requestId: string): ClaimResult {
  const acquired = response.acquired;
  return {
    acquired,
    lease: acquired && response.lease ? leaseInfo(response.lease) : null,
    holderRemainingTtl: acquired ? null : fromDuration(response.holderRemainingTtl),
    holderExpireTime: acquired ? null : (response.holderExpireTime ?? null),
    retryAfter: acquired || !response.retryAfter ? null : fromDuration(response.retryAfter),
    sendTime,
    requestId,
    checkpoint: acquired && response.checkpoint ? checkpointOf(response.checkpoint) : null,
  };
}

export function fenceCheck(response: pb.ValidateFenceResponse): FenceCheck {
  return {
    valid: response.valid,
    currentFence: response.currentFence,
    reason: response.valid ? null : enumName(pb.LossReason, response.reason, "LOSS_REASON_"),
    remainingTtl: fromDuration(response.remainingTtl),
    expireTime: response.expireTime ?? null,
  };
}

export function effectRecord(effect: pb.Effect | undefined, checkpoint: Checkpoint | null = null): EffectRecord {
  const e = effect ?? pb.Effect.create();
  return {
    namespace: e.namespace,
    taskId: e.taskId,
    effectKey: e.effectKey,
    policy: (enumName(pb.EffectPolicy, e.policy, "EFFECT_POLICY_") ?? "ONCE") as EffectPolicy,
    requestDigest: e.requestDigest,
    state: (enumName(pb.EffectState, e.state, "EFFECT_STATE_") ?? "RESERVED") as EffectState,
    fence: e.fence,
    completeFence: e.completeFence,
    retryable: e.retryable,
    result: e.result,
    attempts: e.attempts,
    beginTime: e.beginTime ?? null,
    completeTime: e.completeTime ?? null,
    externalOperationId: e.externalOperationId,
    checkpoint,
  };
}

export function beginResult(response: pb.BeginEffectResponse): BeginResult {
  const decision = enumName(pb.EffectDecision, response.decision, "EFFECT_DECISION_");
  return { decision: (decision ?? "UNSPECIFIED") as EffectDecision, effect: effectRecord(response.effect) };
}

export function taskEvent(event: pb.TaskEvent): TaskEvent {
  return {
    type: enumName(pb.TaskEventType, event.type, "TASK_EVENT_TYPE_") ?? "UNSPECIFIED",
    lease: event.lease ? leaseInfo(event.lease) : null,
    eventTime: event.eventTime ?? null,
  };
}

export function historyEntry(entry: pb.HistoryEntry): HistoryEntry {
  return {
    sequence: entry.sequence,
    eventTime: entry.eventTime ?? null,
    kind: enumName(pb.HistoryKind, entry.kind, "HISTORY_KIND_") ?? "UNSPECIFIED",
    fence: entry.fence,
    ownerId: entry.ownerId,
    attempt: entry.attempt,
    checkpointVersion: entry.checkpointVersion,
    checkpointSize: entry.checkpointSize,
    effectKey: entry.effectKey,
    effectOutcome: enumName(pb.EffectState, entry.effectOutcome, "EFFECT_STATE_"),
    externalOperationId: entry.externalOperationId,
    reason: entry.reason,
    method: entry.method,
  };
}

const POLICIES: Record<string, pb.EffectPolicy> = {
  ONCE: pb.EffectPolicy.EFFECT_POLICY_ONCE,
  LATEST: pb.EffectPolicy.EFFECT_POLICY_LATEST,
};
const OUTCOMES: Record<string, pb.EffectState> = {
  SUCCEEDED: pb.EffectState.EFFECT_STATE_SUCCEEDED,
  FAILED: pb.EffectState.EFFECT_STATE_FAILED,
};
const EFFECT_STATES: Record<string, pb.EffectState> = {
  ...OUTCOMES,
  RESERVED: pb.EffectState.EFFECT_STATE_RESERVED,
};
const TASK_STATES: Record<string, pb.TaskState> = {
  FREE: pb.TaskState.TASK_STATE_FREE,
  HELD: pb.TaskState.TASK_STATE_HELD,
  EXPIRED: pb.TaskState.TASK_STATE_EXPIRED,
  COMPLETED: pb.TaskState.TASK_STATE_COMPLETED,
  QUARANTINED: pb.TaskState.TASK_STATE_QUARANTINED,
  CANCELLED: pb.TaskState.TASK_STATE_CANCELLED,
  FAILED: pb.TaskState.TASK_STATE_FAILED,
};

function lookup<T>(table: Record<string, T>, value: string, field: string): T {
  const found = Object.prototype.hasOwnProperty.call(table, value) ? table[value] : undefined;
  if (found === undefined) {
    throw InvalidArgument.local(field, `must be one of ${Object.keys(table).join(", ")}, got ${JSON.stringify(value)}`);
  }
  return found;
}

export const effectPolicy = (policy: string): pb.EffectPolicy => lookup(POLICIES, policy, "policy");
export const effectOutcome = (outcome: string): pb.EffectState => lookup(OUTCOMES, outcome, "outcome");
export function effectState(state: string | null | undefined): pb.EffectState {
  return state ? lookup(EFFECT_STATES, state, "state") : pb.EffectState.EFFECT_STATE_UNSPECIFIED;
}
export function taskState(state: string | null | undefined): pb.TaskState {
  return state ? lookup(TASK_STATES, state, "state") : pb.TaskState.TASK_STATE_UNSPECIFIED;
}

/** An int64 given as a number or bigint, checked to be an integer. */
export function int64(value: number | bigint, field: string): bigint {
  if (typeof value === "bigint") return value;
  if (typeof value !== "number" || !Number.isSafeInteger(value)) {
    throw InvalidArgument.local(field, `must be an integer (number or bigint), got ${String(value)}`);
  }
  return BigInt(value);
}

/** Bytes given as a Uint8Array or text (UTF-8). */
export function bytes(value: Uint8Array | string, field: string): Buffer {
  if (typeof value === "string") return Buffer.from(value, "utf8");
  if (value instanceof Uint8Array) return Buffer.from(value.buffer, value.byteOffset, value.byteLength);
  throw InvalidArgument.local(field, `must be a Uint8Array or a string, got ${typeof value}`);
}

/** A checkpoint to save as a message (version, data, content type only). */
export function checkpointMessage(checkpoint: CheckpointLike, field = "checkpoint"): pb.Checkpoint {
  let version: number | bigint;
  let data: Uint8Array | string;
  let contentType: string;
  if (Array.isArray(checkpoint)) {
    [version, data, contentType = ""] = checkpoint as [number | bigint, Uint8Array | string, string?];
  } else if (checkpoint !== null && typeof checkpoint === "object" && "version" in checkpoint) {
    ({ version, data, contentType = "" } = checkpoint as Pick<Checkpoint, "version" | "data" | "contentType">);
  } else {
    throw InvalidArgument.local(field, "must be a Checkpoint or [version, data, contentType?]");
  }
  if (typeof contentType !== "string") throw InvalidArgument.local(`${field}.content_type`, "must be a string");
  return pb.Checkpoint.create({
    version: int64(version, `${field}.version`),
    data: bytes(data, `${field}.data`),
    contentType,
  });
}

/** The checkpoint as saved: what was sent, with the server's fence and write time. */
export function savedCheckpoint(sent: pb.Checkpoint, stored: pb.Checkpoint | undefined, fence: bigint): Checkpoint {
  return {
    version: stored?.version ? stored.version : sent.version,
    data: sent.data,
    contentType: sent.contentType,
    fence: stored?.fence ? stored.fence : fence,
    writeTime: stored?.writeTime ?? null,
  };
}
