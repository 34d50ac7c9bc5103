/**
 * hold()'s acquisition: claim a task, letting the server wait for it when asked to.
 *
 * While another owner holds the task, `hold(taskId, { wait })` sends one Claim with `wait` set to
 * the time it has left (at most {@link CLAIM_WAIT_MAX_S}, halved while the server refuses it):
 * the server answers when the task is granted or the wait is over. The client does not poll.
 *
 * UNAVAILABLE, DEADLINE_EXCEEDED and CANCELLED (after which the outcome is unknown) are retried
 * with exponential backoff and full jitter within the caller's wait. Every attempt carries the
 * acquisition's one request id, so a claim that was granted but whose reply was lost comes back
 * as the same lease and fence. A grant that came out of a wait longer than half its remaining
 * ttl is confirmed by a Claim without wait and with the same request id before it is trusted.
 */
import { status as Code } from "@grpc/grpc-js";
import { Backoff } from "./backoff.js";
import { ClaimTimeout, InvalidArgument, LeaseError, LeaseUnavailable, NotAcquired } from "./errors.js";
import { newRequestId } from "./ids.js";
import type { LeaseClientLike } from "./ports.js";
import type { ClaimResult } from "./types.js";

export const CLAIM_BACKOFF_INITIAL_S = 0.05;
export const CLAIM_BACKOFF_MAX_S = 2.0;
/** The longest wait one Claim asks the server for, seconds (the server's default max_claim_wait_s). */
export const CLAIM_WAIT_MAX_S = 60.0;
/** Below this many seconds, a server that refused every wait is polled instead. */
export const CLAIM_WAIT_MIN_S = 1.0;
const CLAIM_RETRY_CODES = new Set<number>([Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED]);

export interface AcquireOptions {
  ttlS: number | null;
  maxRuntimeS: number | null;
  waitS: number | null;
  maxAttempts: number;
}

const sleep = (s: number) => new Promise<void>((resolve) => setTimeout(resolve, s * 1000));

/**
 * Claim `taskId`, waiting up to `waitS` seconds. On return the task is marked held by this
 * client; every error leaves it unmarked.
 *
 * @throws NotAcquired - no wait and the task is held by another owner.
 * @throws ClaimTimeout - still held by another owner after `waitS` seconds.
 * @throws LeaseUnavailable | LeaseError - the last attempt allowed failed, or another refusal.
 */
export async function acquire(client: LeaseClientLike, taskId: string, o: AcquireOptions): Promise<ClaimResult> {
  const clock = client.clock;
  const deadline = o.waitS === null ? null : clock() + o.waitS;
  const backoff = new Backoff(CLAIM_BACKOFF_INITIAL_S, CLAIM_BACKOFF_MAX_S);
  const requestId = newRequestId(); // one logical claim, however many attempts
  let askedMaxS: number | null = CLAIM_WAIT_MAX_S; // null: the server refuses waits, poll
  let confirming = false;
  for (;;) {
    let hintS: number | null = null;
    let backOff = true;
    if (client._markHeld(taskId)) {
      const serverWaitS: number | null = confirming ? null : serverWait(deadline, clock(), askedMaxS);
      let result: ClaimResult | null = null;
      try {
        result = await client._claim(taskId, {
          ttl: o.ttlS,
          maxRuntime: o.maxRuntimeS,
          requestId,
          wait: serverWaitS,
          deadlinePastWait: true,
          maxAttempts: o.maxAttempts,
        });
      } catch (error) {
        client._unmarkHeld(taskId);
        if (error instanceof InvalidArgument && serverWaitS !== null && error.field === "wait") {
          // the server's max_claim_wait_s is below this wait; nothing was claimed
          const halvedS: number = serverWaitS / 2;
          askedMaxS = halvedS >= CLAIM_WAIT_MIN_S ? halvedS : null;
          continue;
        }
        const unknown =
          error instanceof LeaseUnavailable ||
          (error instanceof LeaseError && error.code !== null && CLAIM_RETRY_CODES.has(error.code));
        if (!unknown || deadline === null || clock() >= deadline) throw error;
      }
      if (result !== null) {
        if (result.acquired) {
          if (serverWaitS === null || !waitedLong(result, clock())) return result;
          // confirm at once, without waiting, even past the caller's deadline: the task is ours
          client._unmarkHeld(taskId);
          confirming = true;
          continue;
        }
        confirming = false;
        client._unmarkHeld(taskId);
        hintS = result.holderRemainingTtl;
        // a server that waited its whole wait answers after it: ask again at once
        const waited = serverWaitS !== null && clock() - result.sendTime >= serverWaitS;
        backOff = !waited;
      }
    }
    if (deadline === null) {
      throw new NotAcquired(`task ${JSON.stringify(taskId)} is held by another owner`, taskId, hintS);
    }
    const leftS = deadline - clock();
    if (leftS <= 0) {
      throw new ClaimTimeout(
        `task ${JSON.stringify(taskId)} still held by another owner after ${o.waitS} s`,
        taskId,
        hintS,
      );
    }
    if (backOff) await sleep(Math.min(backoff.nextDelayS(hintS), leftS));
  }
}

function waitedLong(result: ClaimResult, now: number): boolean {
  return now - result.sendTime > (result.lease?.remainingTtl ?? 0) / 2;
}

function serverWait(deadline: number | null, now: number, askedMaxS: number | null): number | null {
  if (deadline === null || askedMaxS === null || deadline <= now) return null;
  return Math.min(deadline - now, askedMaxS);
}
