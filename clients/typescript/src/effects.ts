/**
 * Fenced, idempotent side effects: `lease.effect(effectKey, { policy })`.
 *
 * An effect is something done to an outside system (send an email, charge a card, write a
 * draft) that a retried or replaced worker must not repeat blindly. The effect ledger records
 * each effect of a task under the caller's idempotency key, checked in the same transaction as
 * the lease's fence. {@link EffectRunner.run} walks the protocol of the Python client:
 *
 * 1. Refuse to start when the lease is already lost (LeaseLost).
 * 2. BeginEffect with the lease's fence. The ledger answers:
 *    - PROCEED: reserved for this fence. The function runs once; its value is recorded
 *      SUCCEEDED. If it throws {@link EffectFailed}, FAILED is recorded and the error thrown
 *      on. Any other error records nothing: the outside system may have done the effect, so the
 *      reservation stays in doubt and the error propagates.
 *    - ALREADY_APPLIED: a confirmed outcome exists; the function does not run; the recorded
 *      result is returned (or EffectFailed thrown for a FAILED outcome that may not be retried).
 *    - IN_DOUBT: an earlier attempt was never confirmed. Without `reconcile`, EffectInDoubt is
 *      thrown. With it, the outside system is asked: a result it knows is recorded SUCCEEDED and
 *      returned; null (it never happened) is recorded as a retryable FAILED and the effect is
 *      begun once more -- at most one more attempt, never a loop.
 *
 * Policies (required): "ONCE" for an effect that cannot be taken back (the first confirmed
 * outcome stands for ever); "LATEST" for one that replaces what was there (a newer fence does it
 * again, an older fence's completion is refused).
 */
import { createHash } from "node:crypto";
import { CheckpointNotNewer, EffectFailed, EffectInDoubt, LeaseError } from "./errors.js";
import type { LeaseClientLike } from "./ports.js";
import {
  type BeginResult,
  type CheckpointLike,
  checkpointMessage,
  type EffectPolicy,
  type EffectRecord,
  effectPolicy,
} from "./types.js";

/** An effect function's answer that also names the outside system's operation id. */
export class Performed {
  constructor(
    readonly result: Uint8Array | string | null,
    readonly externalOperationId = "",
  ) {}
}

/** What an effect function (or `reconcile`) returns: bytes, text (UTF-8), null (empty) or {@link Performed}. */
export type EffectValue = Uint8Array | string | null | undefined | Performed;

/** Asks the outside system about an unconfirmed attempt: its record of the effect, or null if it never happened. */
export type Reconcile = (effect: EffectRecord) => Promise<EffectValue | null>;

/** The result recorded with the retryable FAILED outcome when `reconcile` returns null. */
export const RECONCILED_ABSENT = Buffer.from("reconciled: the outside system has no record of the effect");

/** The settled outcome of one run of an effect. */
export interface EffectOutcome {
  /** The recorded result (what the outside system answered). */
  result: Uint8Array;
  /** True when this call performed the effect; false when recorded already, or found by reconcile. */
  fresh: boolean;
  /** The ledger's record of the effect. */
  effect: EffectRecord;
}

export interface EffectOptions {
  /** Required: "ONCE" (irreversible) or "LATEST" (replaceable). */
  policy: EffectPolicy;
  /** Digest of what the effect will do ({@link requestDigest}); at most 64 bytes. */
  requestDigest?: Uint8Array;
  /** Asks the outside system about an unconfirmed earlier attempt; without it IN_DOUBT throws EffectInDoubt. */
  reconcile?: Reconcile;
  /** The task's checkpoint after this effect, saved in the same transaction as its SUCCEEDED outcome. */
  nextCheckpoint?: CheckpointLike;
}

/** What an effect needs of its lease. */
export interface EffectLease {
  readonly client: LeaseClientLike;
  readonly namespace: string;
  readonly taskId: string;
  readonly fence: bigint;
  readonly checkpointVersion: bigint;
  check(): void;
}

function canonical(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(canonical);
  if (value !== null && typeof value === "object") {
    return Object.fromEntries(
      Object.keys(value)
        .sort()
        .map((key) => [key, canonical((value as Record<string, unknown>)[key])]),
    );
  }
  return value;
}

/**
 * SHA-256 of what an effect will do, for `requestDigest`: bytes as they are, text as UTF-8, a
 * JSON-like object or array as canonical JSON (sorted keys, no spaces), so equal values give
 * equal digests whatever their key order (the Python client's `request_digest` gives the same
 * digest for strings, integers, booleans, null, arrays and objects of them).
 */
export function requestDigest(value: Uint8Array | string | object): Uint8Array {
  let data: Uint8Array | string;
  if (value instanceof Uint8Array || typeof value === "string") data = value;
  else data = JSON.stringify(canonical(value));
  return createHash("sha256").update(data).digest();
}

function asBytes(value: EffectValue): Uint8Array {
  const inner = value instanceof Performed ? value.result : value;
  if (inner === null || inner === undefined) return new Uint8Array();
  if (typeof inner === "string") return Buffer.from(inner, "utf8");
  if (inner instanceof Uint8Array) return inner;
  throw new TypeError(`an effect must return a Uint8Array, a string or null, got ${typeof inner}`);
}

/** Runs one effect of a held lease through the effect ledger (made by `lease.effect()`). */
export class EffectRunner {
  readonly effectKey: string;
  readonly #lease: EffectLease;
  readonly #options: EffectOptions;

  constructor(lease: EffectLease, effectKey: string, options: EffectOptions) {
    effectPolicy(options?.policy); // InvalidArgument naming "policy" before anything is sent
    this.#lease = lease;
    this.effectKey = effectKey;
    this.#options = options;
  }

  /**
   * Begin the effect and run `fn` only when the ledger says PROCEED.
   *
   * @throws LeaseLost - lost before the start (nothing sent), or ABORTED from either call.
   * @throws EffectInDoubt - an earlier attempt was never confirmed and there is no reconcile.
   * @throws EffectFailed - `fn` threw it (recorded FAILED first), or a FAILED outcome that may not be retried is recorded.
   * @throws EffectKeyReused - the key was begun with another policy or digest.
   */
  async run(fn: () => Promise<EffectValue> | EffectValue): Promise<EffectOutcome> {
    this.#lease.check();
    this.#checkCheckpointNewer();
    let begun = await this.#begin();
    if (begun.decision === "IN_DOUBT") {
      const reconcile = this.#options.reconcile;
      if (reconcile === undefined) throw new EffectInDoubt(begun.effect);
      const found = await reconcile(begun.effect);
      if (found !== null && found !== undefined) {
        const effect = await this.#succeeded(found);
        return { result: effect.result, fresh: false, effect };
      }
      await this.#complete("FAILED", { retryable: true, result: RECONCILED_ABSENT });
      begun = await this.#begin();
      if (begun.decision === "IN_DOUBT") throw new EffectInDoubt(begun.effect); // never loop
    }
    if (begun.decision === "ALREADY_APPLIED") return recorded(begun.effect);
    if (begun.decision !== "PROCEED") throw new LeaseError(`BeginEffect answered an unknown decision ${begun.decision}`);
    let value: EffectValue;
    try {
      value = await fn();
    } catch (error) {
      if (error instanceof EffectFailed) {
        error.effect = await this.#complete("FAILED", { retryable: error.retryable, result: error.result });
      }
      throw error;
    }
    const effect = await this.#succeeded(value);
    return { result: effect.result, fresh: true, effect };
  }

  #checkCheckpointNewer(): void {
    const next = this.#options.nextCheckpoint;
    if (next === undefined) return;
    const version = checkpointMessage(next, "nextCheckpoint").version;
    const known = this.#lease.checkpointVersion;
    if (version <= known) throw CheckpointNotNewer.of(version, known, this.#lease.taskId, this.#lease.fence);
  }

  async #succeeded(value: EffectValue): Promise<EffectRecord> {
    const externalOperationId = value instanceof Performed ? value.externalOperationId : "";
    const result = asBytes(value);
    try {
      return await this.#complete("SUCCEEDED", {
        result,
        externalOperationId,
        nextCheckpoint: this.#options.nextCheckpoint,
      });
    } catch (error) {
      // The effect happened: record it on its own, never leave it in doubt, then throw.
      if (error instanceof CheckpointNotNewer) await this.#complete("SUCCEEDED", { result, externalOperationId });
      throw error;
    }
  }

  #begin(): Promise<BeginResult> {
    const lease = this.#lease;
    return lease.client.beginEffect(lease.taskId, lease.fence, this.effectKey, {
      policy: this.#options.policy,
      requestDigest: this.#options.requestDigest,
      namespace: lease.namespace,
    });
  }

  #complete(
    outcome: "SUCCEEDED" | "FAILED",
    options: { retryable?: boolean; result?: Uint8Array; externalOperationId?: string; nextCheckpoint?: CheckpointLike },
  ): Promise<EffectRecord> {
    const lease = this.#lease;
    return lease.client.completeEffect(lease.taskId, lease.fence, this.effectKey, {
      outcome,
      namespace: lease.namespace,
      ...options,
    });
  }
}

function recorded(effect: EffectRecord): EffectOutcome {
  if (effect.state === "FAILED") {
    throw new EffectFailed(
      `effect ${JSON.stringify(effect.effectKey)} of ${effect.namespace}/${effect.taskId} is recorded as FAILED ` +
        `by fence ${effect.completeFence}`,
      { retryable: effect.retryable, result: effect.result, effect },
    );
  }
  return { result: effect.result, fresh: false, effect };
}
