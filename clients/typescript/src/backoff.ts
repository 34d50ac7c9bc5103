/** Exponential backoff with full jitter: attempt n waits uniform(0, min(max, initial * 2^n)). */
export class Backoff {
  #attempt = 0;

  /**
   * @param initialS - upper bound of the first delay, seconds (> 0).
   * @param maxS - upper bound of every delay, seconds.
   * @param random - a source of numbers in [0, 1) (Math.random by default).
   */
  constructor(
    readonly initialS = 0.05,
    readonly maxS = 2.0,
    private readonly random: () => number = Math.random,
  ) {}

  /**
   * The next delay in seconds.
   *
   * @param hintS - when the wait can end early (a holder's remaining ttl, seconds), the delay
   *   never exceeds it by more than 5 ms.
   */
  nextDelayS(hintS: number | null = null): number {
    const cap = Math.min(this.maxS, this.initialS * 2 ** Math.min(this.#attempt, 62));
    this.#attempt += 1;
    let delay = this.random() * cap;
    if (hintS !== null) delay = Math.min(delay, Math.max(hintS, 0) + 0.005);
    return delay;
  }

  /** Start again from the first delay (after a success). */
  reset(): void {
    this.#attempt = 0;
  }
}
