/**
 * Client errors, and the one place a gRPC status becomes one of them ({@link fromServiceError}).
 *
 * Every class is a {@link LeaseError} (the Python client's hierarchy, same names):
 *
 * ```text
 * LeaseError                    any failed call; .code, .reason, .metadata
 * ├── LeaseLost                 ABORTED: ownership is gone (claim again, never retry)
 * ├── AccessDenied              UNAUTHENTICATED or PERMISSION_DENIED: the token (not retryable)
 * ├── LimitExceeded             RESOURCE_EXHAUSTED LEASE_LIMIT, CLAIM_RATE_LIMIT; .retryAfter
 * ├── TaskEnded                 the task is terminal (claims refused; never granted again)
 * │   ├── TaskCompleted         FAILED_PRECONDITION TASK_COMPLETED
 * │   ├── TaskCancelled         FAILED_PRECONDITION TASK_CANCELLED: an operator cancelled it
 * │   └── TaskFailed            FAILED_PRECONDITION TASK_FAILED: its owner ended it as failed
 * ├── TaskQuarantined           FAILED_PRECONDITION TASK_QUARANTINED: attempts used up (Retry)
 * ├── TaskNotQuarantined        FAILED_PRECONDITION TASK_NOT_QUARANTINED: Retry refused; .state
 * ├── CheckpointNotNewer        FAILED_PRECONDITION CHECKPOINT_NOT_NEWER; .currentVersion
 * ├── ClaimTimeout              hold(): the task stayed held by another owner
 * │   └── NotAcquired           hold() without wait: not acquired on the first claim
 * ├── LeaseUnavailable          UNAVAILABLE: database or server out of reach (retry the call)
 * ├── InvalidArgument           INVALID_ARGUMENT; .fieldViolations, .field
 * ├── TaskNotFound              NOT_FOUND TASK_NOT_FOUND
 * ├── StaleFence                an effect boundary refused a fence; .reason, .currentFence
 * ├── MissingFence              fence metadata absent or malformed
 * └── EffectError               the effect ledger refused or could not settle an effect
 *     ├── EffectKeyReused       FAILED_PRECONDITION EFFECT_KEY_REUSED: other policy or digest
 *     ├── EffectNotBegun        FAILED_PRECONDITION EFFECT_NOT_BEGUN: no reservation to complete
 *     ├── EffectAlreadyCompleted  FAILED_PRECONDITION EFFECT_ALREADY_COMPLETED: another outcome
 *     ├── EffectInDoubt         an earlier attempt was never confirmed: reconcile; .effect
 *     └── EffectFailed          the outside system refused the effect; .retryable, .result
 * ```
 *
 * The server puts exactly one `google.rpc.ErrorInfo` (domain "leasekeeper") in the
 * `grpc-status-details-bin` trailer of every error. Errors are chosen by status code and that
 * reason, never by message text.
 */
import { status as Code, type ServiceError, type StatusObject } from "@grpc/grpc-js";
import { statusDetails } from "./status.js";
import type { EffectRecord } from "./types.js";

/** The LossReason names without their `LOSS_REASON_` prefix: the ErrorInfo reasons of a loss. */
export const LOSS_REASONS = [
  "LEASE_EXPIRED",
  "LEASE_SUPERSEDED",
  "LEASE_RELEASED",
  "LEASE_REVOKED",
  "RUNTIME_EXCEEDED",
  "TASK_COMPLETED",
  "NOT_OWNER",
  "FENCE_UNKNOWN",
  "TASK_CANCELLED",
  "TASK_FAILED",
  "TASK_QUARANTINED",
] as const;
/** A loss reason: why an owner no longer holds (or never held) a lease. */
export type LossReason = (typeof LOSS_REASONS)[number];

/** The reason an effect boundary gives for absent or malformed fence metadata. */
export const FENCE_MISSING = "FENCE_MISSING";

/** A status code's name, e.g. "ABORTED". */
export function codeName(code: number | null | undefined): string {
  return code === null || code === undefined ? "UNKNOWN" : (Code[code] ?? String(code));
}

interface ErrorFields {
  code?: number | null;
  reason?: string | null;
  metadata?: Record<string, string>;
  cause?: unknown;
}

/** A leasekeeper call failed. */
export class LeaseError extends Error {
  /** The gRPC status code (`grpc.status`) behind the error; null when raised locally. */
  readonly code: number | null;
  /** The ErrorInfo reason (e.g. "LEASE_SUPERSEDED"), or null when the status carried none. */
  readonly reason: string | null;
  /** The ErrorInfo metadata: dynamic values as strings. */
  readonly metadata: Record<string, string>;

  constructor(message: string, fields: ErrorFields = {}) {
    super(message, fields.cause === undefined ? undefined : { cause: fields.cause });
    this.name = new.target.name;
    this.code = fields.code ?? null;
    this.reason = fields.reason ?? null;
    this.metadata = { ...(fields.metadata ?? {}) };
  }

  /** True when the same call may simply be sent again (UNAVAILABLE). */
  get retryable(): boolean {
    return this.code === Code.UNAVAILABLE;
  }
}

/**
 * Ownership of the lease is gone: stop, commit nothing, claim again.
 *
 * Raised from calls as ABORTED, and by a held lease when the server ends its heartbeat with a
 * reason or the trust deadline passes (reason LEASE_EXPIRED, or RUNTIME_EXCEEDED when the lease
 * was ending at its runtime budget). A held lease's `signal` is aborted with it.
 */
export class LeaseLost extends LeaseError {
  /** The task, when known. */
  readonly taskId: string | null;
  /** The fence that was lost, when known. */
  readonly fence: bigint | null;
  declare readonly reason: string;

  constructor(
    reason: string,
    taskId: string | null = null,
    fence: bigint | null = null,
    fields: ErrorFields & { message?: string } = {},
  ) {
    let text = fields.message ?? `lease lost: ${reason}`;
    if (taskId !== null) text += ` (task_id=${JSON.stringify(taskId)}, fence=${fence})`;
    super(text, { code: Code.ABORTED, ...fields, reason });
    this.taskId = taskId;
    this.fence = fence;
  }

  /** The task's current fence from the error metadata, when the server sent it. */
  get currentFence(): bigint | null {
    return bigintOrNull(this.metadata.current_fence);
  }
}

/**
 * The server refused the caller's credentials: `code` UNAUTHENTICATED (no token, or one the
 * server does not accept) or PERMISSION_DENIED (the token's role or namespaces do not cover the
 * call). Not retryable.
 */
export class AccessDenied extends LeaseError {}

/** A namespace limit refused the call for now (RESOURCE_EXHAUSTED): LEASE_LIMIT or CLAIM_RATE_LIMIT. */
export class LimitExceeded extends LeaseError {
  /** Seconds to wait before trying again (google.rpc.RetryInfo), or null. */
  readonly retryAfter: number | null;

  constructor(message: string, retryAfter: number | null, fields: ErrorFields = {}) {
    super(message, { code: Code.RESOURCE_EXHAUSTED, ...fields });
    this.retryAfter = retryAfter;
  }
}

/** The task is terminal: no claim is ever granted again (FAILED_PRECONDITION). */
export class TaskEnded extends LeaseError {}
/** The task is COMPLETED (FAILED_PRECONDITION TASK_COMPLETED). */
export class TaskCompleted extends TaskEnded {}
/** An operator cancelled the task (FAILED_PRECONDITION TASK_CANCELLED). */
export class TaskCancelled extends TaskEnded {}
/** The task's owner ended its run as failed (FAILED_PRECONDITION TASK_FAILED). */
export class TaskFailed extends TaskEnded {}

/** The task used up its attempts and waits for an operator's Retry (FAILED_PRECONDITION TASK_QUARANTINED). */
export class TaskQuarantined extends LeaseError {}

/** Retry was refused: the task is not QUARANTINED (FAILED_PRECONDITION TASK_NOT_QUARANTINED). */
export class TaskNotQuarantined extends LeaseError {
  /** The task's state (e.g. "HELD") from the error metadata, when sent. */
  get state(): string | null {
    return this.metadata.state ?? null;
  }
}

/** A checkpoint was not saved: its version does not move forward (FAILED_PRECONDITION CHECKPOINT_NOT_NEWER). */
export class CheckpointNotNewer extends LeaseError {
  /** The refusal of `version` when `currentVersion` is stored (raised locally). */
  static of(version: bigint, currentVersion: bigint, taskId: string, fence: bigint): CheckpointNotNewer {
    return new CheckpointNotNewer(
      `checkpoint version ${version} of task ${JSON.stringify(taskId)} (fence ${fence}) does not ` +
        `move forward: version ${currentVersion} is stored`,
      {
        code: Code.FAILED_PRECONDITION,
        reason: "CHECKPOINT_NOT_NEWER",
        metadata: { current_version: String(currentVersion) },
      },
    );
  }

  /** The stored checkpoint's version (ErrorInfo metadata `current_version`; 0n if absent). */
  get currentVersion(): bigint {
    return bigintOrNull(this.metadata.current_version) ?? 0n;
  }
}

/** hold() could not acquire the task before its wait ran out. */
export class ClaimTimeout extends LeaseError {
  readonly taskId: string;
  /** The holder's remaining ttl in seconds at the last attempt, when the server said. */
  readonly holderRemainingTtl: number | null;

  constructor(message: string, taskId: string, holderRemainingTtl: number | null = null) {
    super(message);
    this.taskId = taskId;
    this.holderRemainingTtl = holderRemainingTtl;
  }
}

/** hold() without `wait`: the task is held by another owner. */
export class NotAcquired extends ClaimTimeout {}

/**
 * The database or server is out of reach, or shutting down (UNAVAILABLE): safe to retry (a claim
 * with the same requestId). Also gRPC's own RESOURCE_EXHAUSTED, which carries no reason (`code`
 * says which): a connection the server ended because this process missed its keepalive ping
 * (paused, or starved of CPU).
 */
export class LeaseUnavailable extends LeaseError {
  /** Always true: the same call may be sent again. */
  override get retryable(): boolean {
    return true;
  }
}

/** The request was malformed and changed nothing (INVALID_ARGUMENT). */
export class InvalidArgument extends LeaseError {
  /** `[field, description]` pairs from google.rpc.BadRequest (or the local check). */
  readonly fieldViolations: ReadonlyArray<readonly [string, string]>;

  constructor(
    message: string,
    fieldViolations: ReadonlyArray<readonly [string, string]> = [],
    fields: ErrorFields = {},
  ) {
    super(message, { reason: "INVALID_ARGUMENT", ...fields });
    this.fieldViolations = fieldViolations;
  }

  /** The first offending field, or the `field` ErrorInfo metadata value. */
  get field(): string | null {
    return this.fieldViolations[0]?.[0] ?? this.metadata.field ?? null;
  }

  /** A refusal made here, before anything was sent, naming `field`. */
  static local(field: string, problem: string): InvalidArgument {
    return new InvalidArgument(`${field}: ${problem}`, [[field, problem]]);
  }
}

/** The task was never claimed (NOT_FOUND TASK_NOT_FOUND). */
export class TaskNotFound extends LeaseError {}

/** A fence may not act now: it is not the task's current, live fence. */
export class StaleFence extends LeaseError {
  readonly currentFence: bigint;
  readonly namespace: string;
  readonly taskId: string;
  readonly fence: bigint;
  declare readonly reason: string;

  constructor(reason: string, currentFence: bigint, namespace: string, taskId: string, fence: bigint) {
    super(`stale fence ${fence} for ${namespace}/${taskId}: ${reason} (current fence ${currentFence})`, {
      code: Code.ABORTED,
      reason,
      metadata: {
        current_fence: String(currentFence),
        namespace,
        task_id: taskId,
        fence: String(fence),
      },
    });
    this.currentFence = currentFence;
    this.namespace = namespace;
    this.taskId = taskId;
    this.fence = fence;
  }
}

/** Fence metadata is absent or malformed; `key` names the metadata key. */
export class MissingFence extends LeaseError {
  readonly key: string;

  constructor(key: string, problem = "missing") {
    super(`metadata ${JSON.stringify(key)} is ${problem}`, { reason: FENCE_MISSING, metadata: { key } });
    this.key = key;
  }
}

/** The effect ledger refused a call, or an effect could not be settled. */
export class EffectError extends LeaseError {}
/** The effect key was reserved with another policy or request digest (FAILED_PRECONDITION EFFECT_KEY_REUSED). */
export class EffectKeyReused extends EffectError {}
/** No reservation exists for the effect key (FAILED_PRECONDITION EFFECT_NOT_BEGUN). */
export class EffectNotBegun extends EffectError {}
/** Another outcome is already recorded for the effect (FAILED_PRECONDITION EFFECT_ALREADY_COMPLETED). */
export class EffectAlreadyCompleted extends EffectError {}

/**
 * An earlier attempt of the effect was reserved but never confirmed: it may or may not have
 * happened. Ask the outside system, then record its answer (pass `reconcile` to
 * `lease.effect()`, or call `client.completeEffect()`). Raised locally, never by the server.
 */
export class EffectInDoubt extends EffectError {
  /** The earlier, unconfirmed attempt: its fence, attempts and beginTime. */
  readonly effect: EffectRecord;

  constructor(effect: EffectRecord) {
    super(
      `effect ${JSON.stringify(effect.effectKey)} of ${effect.namespace}/${effect.taskId} is in doubt: ` +
        `attempt ${effect.attempts} reserved by fence ${effect.fence} at ` +
        `${effect.beginTime?.toISOString()} was never confirmed; reconcile with the outside system ` +
        "before trying again",
      {
        metadata: {
          namespace: effect.namespace,
          task_id: effect.taskId,
          effect_key: effect.effectKey,
          fence: String(effect.fence),
          attempts: String(effect.attempts),
        },
      },
    );
    this.effect = effect;
  }
}

/**
 * The outside system definitively refused the effect: it did not happen. Throw it from the
 * function `lease.effect()` runs to record the effect FAILED (it is then thrown on). Any other
 * error from the function records nothing: the effect stays in doubt.
 */
export class EffectFailed extends EffectError {
  /** Opaque bytes recorded with the outcome, e.g. the refusal's text. */
  readonly result: Uint8Array;
  /** The ledger's record of the failed effect, once recorded. */
  effect: EffectRecord | null;
  readonly #retryable: boolean;

  constructor(
    message = "the effect was refused",
    options: { retryable?: boolean; result?: Uint8Array | string; effect?: EffectRecord | null } = {},
  ) {
    super(message);
    this.#retryable = options.retryable ?? false;
    const result = options.result ?? new Uint8Array();
    this.result = typeof result === "string" ? Buffer.from(result) : result;
    this.effect = options.effect ?? null;
  }

  /** True when a new attempt of the effect may be made later (not about resending a call). */
  override get retryable(): boolean {
    return this.#retryable;
  }
}

function bigintOrNull(text: string | undefined): bigint | null {
  if (text === undefined || !/^-?\d+$/.test(text)) return null;
  return BigInt(text);
}

type PreconditionError = new (message: string, fields: ErrorFields) => LeaseError;

const PRECONDITION_ERRORS: Record<string, PreconditionError> = {
  TASK_COMPLETED: TaskCompleted,
  TASK_CANCELLED: TaskCancelled,
  TASK_FAILED: TaskFailed,
  TASK_QUARANTINED: TaskQuarantined,
  TASK_NOT_QUARANTINED: TaskNotQuarantined,
  CHECKPOINT_NOT_NEWER: CheckpointNotNewer,
  EFFECT_KEY_REUSED: EffectKeyReused,
  EFFECT_NOT_BEGUN: EffectNotBegun,
  EFFECT_ALREADY_COMPLETED: EffectAlreadyCompleted,
};

/**
 * Translate a failed call into the matching {@link LeaseError}.
 *
 * | status code         | reason                 | error                        |
 * |---------------------|------------------------|------------------------------|
 * | ABORTED             | FENCE_MISSING          | MissingFence                 |
 * | ABORTED             | any other / none       | LeaseLost                    |
 * | FAILED_PRECONDITION | TASK_COMPLETED, ...    | TaskCompleted, TaskCancelled, TaskFailed, TaskQuarantined, TaskNotQuarantined, CheckpointNotNewer, EffectKeyReused, EffectNotBegun, EffectAlreadyCompleted |
 * | INVALID_ARGUMENT    | any                    | InvalidArgument              |
 * | NOT_FOUND           | any                    | TaskNotFound                 |
 * | UNAVAILABLE         | any                    | LeaseUnavailable             |
 * | UNAUTHENTICATED, PERMISSION_DENIED | any     | AccessDenied                 |
 * | RESOURCE_EXHAUSTED  | LEASE_LIMIT, ...       | LimitExceeded (retryAfter)   |
 * | RESOURCE_EXHAUSTED  | none (gRPC's own)      | LeaseUnavailable             |
 * | anything else       | any                    | LeaseError                   |
 *
 * @param error - a grpc-js ServiceError (or the StatusObject of a stream).
 * @param context - the task and fence the call was about, recorded on LeaseLost.
 */
export function fromServiceError(
  error: Partial<ServiceError> | StatusObject,
  context: { taskId?: string | null; fence?: bigint | null } = {},
): LeaseError {
  const code = typeof error.code === "number" ? error.code : Code.UNKNOWN;
  const message = error.details || ("message" in error && error.message) || codeName(code);
  const { reason, metadata, fieldViolations, retryDelay } = statusDetails(error.metadata);
  const fields = { code, reason, metadata, cause: error };
  if (code === Code.ABORTED) {
    if (reason === FENCE_MISSING) return new MissingFence(metadata.key ?? "leasekeeper-fence");
    return new LeaseLost(reason ?? "UNKNOWN", context.taskId ?? null, context.fence ?? null, {
      message,
      metadata,
      cause: error,
    });
  }
  if (code === Code.FAILED_PRECONDITION && reason !== null && reason in PRECONDITION_ERRORS) {
    return new PRECONDITION_ERRORS[reason]!(message, fields);
  }
  switch (code) {
    case Code.INVALID_ARGUMENT:
      return new InvalidArgument(message, fieldViolations, fields);
    case Code.NOT_FOUND:
      return new TaskNotFound(message, fields);
    case Code.UNAVAILABLE:
      return new LeaseUnavailable(message, fields);
    case Code.UNAUTHENTICATED:
    case Code.PERMISSION_DENIED:
      return new AccessDenied(message, fields);
    case Code.RESOURCE_EXHAUSTED:
      // Without a reason it is not a namespace limit but gRPC's own: a connection the server
      // ended with ENHANCE_YOUR_CALM (a client paused past its keepalive ping; grpc-js says
      // "Bandwidth exhausted or memory limit exceeded"), or a message over a size limit. The
      // call's outcome is unknown, as for UNAVAILABLE.
      if (reason === null) return new LeaseUnavailable(message, fields);
      return new LimitExceeded(message, retryDelay, fields);
    default:
      return new LeaseError(message, fields);
  }
}
