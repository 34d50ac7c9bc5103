/**
 * The trust window: how long the client may act on a lease without hearing back.
 *
 * The database clock decides whether a lease is live, and the client never sees it. What it
 * sees is `remaining_ttl`: the time the lease had left when the database answered. The answer
 * was made after the request was sent, so on the client's monotonic clock the lease lasts at
 * least until `sendTime + remainingTtl`. The trust deadline keeps a safety margin:
 *
 *     trustDeadline = sendTime + remainingTtl - safetyMargin
 *
 * Past it, unless a renewal was confirmed since, the lease counts as lost: LEASE_EXPIRED, or
 * RUNTIME_EXCEEDED when the answer that set it had already ended the lease at its runtime budget.
 * The clock is `performance.now()` in seconds unless another is injected; `Date.now()` is never
 * used: it jumps when the machine's time is set.
 */

/** A monotonic clock in seconds. */
export type Clock = () => number;

/** `performance.now()` in seconds: monotonic, never set back. */
export const monotonic: Clock = () => performance.now() / 1000;

export const MAX_DEFAULT_SAFETY_MARGIN_S = 1.0;

/** The default safety margin for a lease of `ttlS` seconds: min(1 s, ttl / 10). */
export function defaultSafetyMargin(ttlS: number): number {
  return Math.min(MAX_DEFAULT_SAFETY_MARGIN_S, Math.max(ttlS, 0) / 10);
}

/** `sendTime + remainingTtlS - safetyMarginS`: past this clock reading a lease is lost. */
export function trustDeadline(sendTime: number, remainingTtlS: number, safetyMarginS: number): number {
  return sendTime + remainingTtlS - safetyMarginS;
}

/** The client-side deadline of a lease, moved only by confirmed renewals. */
export class TrustWindow {
  #deadline: number | null = null;
  #confirmedSendTime: number | null = null;
  #atBudget = false;

  /**
   * @param safetyMarginS - seconds subtracted from every confirmed remaining ttl (>= 0).
   * @param clock - the monotonic clock, seconds.
   * @param runtimeDeadline - the end of the lease's runtime budget (database clock), if known.
   */
  constructor(
    readonly safetyMarginS: number,
    readonly clock: Clock = monotonic,
    private readonly runtimeDeadline: Date | null = null,
  ) {
    if (!(safetyMarginS >= 0)) throw new RangeError(`safetyMarginS must be >= 0, got ${safetyMarginS}`);
  }

  /** The trust deadline on the clock, or null before the first confirmation. */
  get deadline(): number | null {
    return this.#deadline;
  }

  /**
   * Record an answer saying the lease had `remainingTtlS` left. An answer to a request sent
   * before the one that set the deadline is ignored; one made without a database write
   * (`renewed` false) may shorten the deadline but never extends it.
   */
  confirm(sendTime: number, remainingTtlS: number, renewed = true, expireTime: Date | null = null): void {
    if (this.#confirmedSendTime !== null && sendTime < this.#confirmedSendTime) return;
    const candidate = trustDeadline(sendTime, remainingTtlS, this.safetyMarginS);
    if (!renewed && this.#deadline !== null && candidate > this.#deadline) return;
    this.#deadline = candidate;
    this.#confirmedSendTime = sendTime;
    this.#atBudget =
      expireTime !== null && this.runtimeDeadline !== null && expireTime.getTime() >= this.runtimeDeadline.getTime();
  }

  /** Why the lease is lost once the deadline passes: RUNTIME_EXCEEDED or LEASE_EXPIRED. */
  get lossReason(): "RUNTIME_EXCEEDED" | "LEASE_EXPIRED" {
    return this.#atBudget ? "RUNTIME_EXCEEDED" : "LEASE_EXPIRED";
  }

  /** Seconds until the trust deadline (<= 0 once passed or never confirmed). */
  remainingS(): number {
    return this.#deadline === null ? 0 : this.#deadline - this.clock();
  }

  /** True once the trust deadline has passed (or was never set). */
  expired(): boolean {
    return this.remainingS() <= 0;
  }
}
