/**
 * The heartbeat: one `Heartbeat` stream per held lease, a beat every interval, each answer
 * moving the trust window. Outcomes, as in the Python client:
 *
 * - the stream ends ABORTED with a reason: the lease is lost (pushed by the server);
 * - the trust deadline passes without a confirmed renewal, however healthy the stream looks:
 *   lost with LEASE_EXPIRED (or RUNTIME_EXCEEDED at the runtime budget);
 * - UNAVAILABLE, a stalled or broken stream, an early end: the stream is reopened (on the same
 *   channel, possibly another replica) with the same fence, with backoff (each wait at most
 *   1 s and a quarter of the trust left), for as long as the trust deadline allows; meanwhile
 *   `renewalError` says why;
 * - an error the server would repeat (INVALID_ARGUMENT, ...): lost with that reason, except an
 *   INVALID_ARGUMENT naming a carried checkpoint's field (the stream is reopened, and the save
 *   asks SaveCheckpoint);
 * - stop(): half-close; the server ends the stream OK; the lease stays HELD.
 *
 * A checkpoint may ride on a beat of its own, sent at once ({@link HeartbeatKeeper.carryCheckpoint});
 * a beat not answered on the stream it was sent on reports {@link CheckpointNotCarried}.
 */
import { status as Code, type ClientDuplexStream, type StatusObject } from "@grpc/grpc-js";
import { Backoff } from "./backoff.js";
import { codeName, fromServiceError, InvalidArgument, LeaseError, LeaseLost } from "./errors.js";
import * as pb from "./gen/leasekeeper/v1/lease_service.js";
import type { Clock, TrustWindow } from "./trust.js";
import { fromDuration } from "./types.js";

/** Codes after which the stream is reopened with the same fence. */
const TRANSIENT_CODES = new Set<number>([
  Code.UNAVAILABLE,
  Code.INTERNAL,
  Code.UNKNOWN,
  Code.DEADLINE_EXCEEDED,
  Code.CANCELLED,
  Code.RESOURCE_EXHAUSTED,
]);
/** The longest wait before reopening a failed stream, seconds. */
export const RESUME_MAX_S = 1.0;
/** The largest share of the trust left that one resume wait may take. */
export const RESUME_SHARE_OF_TRUST = 0.25;
/** Beats per ttl by default (an interval of ttl / 3). */
export const DEFAULT_BEATS_PER_TTL = 3;
/** The fewest beats per ttl a chosen interval may leave (at most ttl / 2). */
export const MIN_BEATS_PER_TTL = 2;
/** The shortest interval between beats, seconds. */
export const MIN_BEAT_INTERVAL_S = 0.01;
/** A beat unanswered for this many intervals marks the stream stalled (it is reopened). */
export const STALL_INTERVALS = 2;
/** Seconds stop() waits for the server to end a half-closed stream before cancelling it. */
export const STOP_TIMEOUT_S = 5.0;

/** Refuse an interval that leaves fewer than two beats per ttl (InvalidArgument naming heartbeatInterval). */
export function checkBeatInterval(intervalS: number | null, ttlS: number | null): void {
  if (intervalS === null) return;
  let problem: string;
  if (ttlS === null) problem = "needs an explicit ttl (the server's default ttl is unknown before the grant)";
  else if (intervalS < MIN_BEAT_INTERVAL_S) problem = `must be at least ${MIN_BEAT_INTERVAL_S} s`;
  else if (intervalS * MIN_BEATS_PER_TTL > ttlS)
    problem = `must leave at least ${MIN_BEATS_PER_TTL} beats per ttl (at most ttl / ${MIN_BEATS_PER_TTL} = ${ttlS / MIN_BEATS_PER_TTL} s)`;
  else return;
  throw new InvalidArgument(`heartbeatInterval ${problem}, got ${intervalS} s`, [["heartbeatInterval", problem]]);
}

/** Seconds between beats: the chosen interval, else ttl / 3 (at least 10 ms). */
export function beatIntervalS(intervalS: number | null, ttlS: number): number {
  return intervalS ?? Math.max(ttlS / DEFAULT_BEATS_PER_TTL, MIN_BEAT_INTERVAL_S);
}

/** A checkpoint could not be carried on the stream, or its beat went unanswered: ask SaveCheckpoint. */
export class CheckpointNotCarried extends Error {
  override name = "CheckpointNotCarried";
}

interface Deferred<T> {
  promise: Promise<T>;
  resolve(value: T): void;
  reject(error: unknown): void;
  settled: boolean;
}

function deferred<T>(): Deferred<T> {
  let resolve!: (value: T) => void;
  let reject!: (error: unknown) => void;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  const d: Deferred<T> = {
    promise,
    settled: false,
    resolve: (value) => {
      d.settled = true;
      resolve(value);
    },
    reject: (error) => {
      d.settled = true;
      reject(error);
    },
  };
  return d;
}

type Stored = [version: bigint, saved: boolean];

interface Beat {
  sendTime: number;
  writtenTime: number;
  saved: Deferred<Stored> | null;
}

type StreamEnd =
  | { kind: "clean" | "early" | "stalled" }
  | { kind: "lost"; error: LeaseLost }
  | { kind: "transient" | "checkpointRefused" | "fatal"; error: LeaseError };

interface OpenStream {
  wake(): void;
  halfClose(): void;
  cancel(): void;
}

export interface HeartbeatOptions {
  /** Opens a new Heartbeat stream (with the client's metadata). */
  openStream: () => ClientDuplexStream<pb.HeartbeatRequest, pb.HeartbeatResponse>;
  /** The message naming the lease, sent first on every stream. */
  firstRequest: pb.HeartbeatRequest;
  /** Seconds between beats. */
  intervalS: number;
  window: TrustWindow;
  /** Called once when the lease is lost. */
  onLost: (error: LeaseLost) => void;
  clock: Clock;
  /** Where the stream's transient failures are told (never the token). */
  log?: (message: string) => void;
}

/** Keeps one lease renewed until stopped or lost. */
export class HeartbeatKeeper {
  /** The loss, once reported. */
  lost: LeaseLost | null = null;
  /** Why the last stream failed, while no renewal has been confirmed since. */
  renewalError: LeaseError | null = null;
  streamsOpened = 0;
  /** The highest stored checkpoint version the answers told (0n: none). */
  storedCheckpointVersion = 0n;

  readonly #o: HeartbeatOptions;
  readonly #backoff: Backoff;
  #stopping = false;
  #current: OpenStream | null = null;
  #outbox: Array<{ checkpoint: pb.Checkpoint; saved: Deferred<Stored> }> = [];
  #done: Promise<void> | null = null;
  #wakeSleeper: (() => void) | null = null;

  constructor(options: HeartbeatOptions) {
    this.#o = options;
    this.#backoff = new Backoff(0.05, Math.max(Math.min(options.intervalS, RESUME_MAX_S), 0.05));
  }

  /** True while the keeper has not finished. */
  get running(): boolean {
    return this.#done !== null && !this.#stopping && this.lost === null;
  }

  start(): void {
    this.#done ??= this.#supervise();
  }

  /**
   * Stop beating: half-close the stream and wait for the server's OK (the lease stays HELD).
   * After `timeoutS` seconds the stream is cancelled instead. Idempotent.
   */
  async stop(timeoutS = STOP_TIMEOUT_S): Promise<void> {
    this.#stopping = true;
    this.#wakeSleeper?.();
    this.#dropOutbox();
    const done = this.#done;
    if (done === null) return;
    if (timeoutS <= 0) this.#current?.cancel();
    else this.#current?.halfClose();
    let timer: NodeJS.Timeout | undefined;
    const timedOut = new Promise<boolean>((resolve) => {
      timer = setTimeout(() => resolve(true), timeoutS * 1000);
    });
    try {
      if (await Promise.race([done.then(() => false), timedOut])) {
        this.#current?.cancel();
        await done;
      }
    } finally {
      clearTimeout(timer);
    }
  }

  /**
   * Save `checkpoint` with a beat of the open stream, sent at once.
   *
   * @returns the stored version after the beat, and whether the stored one is this checkpoint.
   * @throws CheckpointNotCarried - no stream is open and answering, or it ended before the answer.
   */
  carryCheckpoint(checkpoint: pb.Checkpoint): Promise<Stored> {
    // An open stream carries it even before its first answer: if the stream ends before the
    // beat's answer, the caller's SaveCheckpoint decides whether it was stored.
    if (this.#stopping || this.lost !== null || this.#current === null) {
      return Promise.reject(new CheckpointNotCarried("no heartbeat stream is open"));
    }
    const saved = deferred<Stored>();
    this.#outbox.push({ checkpoint, saved });
    this.#current.wake();
    return saved.promise;
  }

  #nextBeat(): [pb.HeartbeatRequest, Deferred<Stored> | null] {
    for (let next = this.#outbox.shift(); next !== undefined; next = this.#outbox.shift()) {
      if (!next.saved.settled) return [pb.HeartbeatRequest.create({ checkpoint: next.checkpoint }), next.saved];
    }
    return [pb.HeartbeatRequest.create(), null];
  }

  #dropOutbox(): void {
    const waiting = this.#outbox;
    this.#outbox = [];
    for (const { saved } of waiting) saved.reject(new CheckpointNotCarried("the heartbeat stream ended"));
  }

  #lose(error: LeaseLost): void {
    if (this.lost === null && !this.#stopping) {
      this.lost = error;
      this.#o.onLost(error);
    }
  }

  #lostError(reason: string, cause?: unknown): LeaseLost {
    const request = this.#o.firstRequest;
    return new LeaseLost(reason, request.taskId, request.fence, cause === undefined ? {} : { cause });
  }

  #name(): string {
    return `${this.#o.firstRequest.namespace}/${this.#o.firstRequest.taskId}`;
  }

  async #supervise(): Promise<void> {
    const window = this.#o.window;
    while (!this.#stopping) {
      if (window.expired()) {
        this.#lose(this.#lostError(window.lossReason));
        return;
      }
      let end: StreamEnd;
      try {
        end = await this.#runStream();
      } catch (error) {
        // e.g. the client was closed under the lease: no stream can be opened any more
        this.#lose(this.#lostError("INTERNAL", error));
        return;
      }
      switch (end.kind) {
        case "clean":
          return;
        case "lost":
          this.#lose(end.error);
          return;
        case "fatal":
          this.#lose(this.#lostError(end.error.reason ?? codeName(end.error.code), end.error));
          return;
        case "checkpointRefused":
          this.#o.log?.(`heartbeat stream for ${this.#name()}: ${end.error.message}`);
          break;
        case "transient":
          this.#o.log?.(`heartbeat stream for ${this.#name()} failed: ${end.error.message}`);
          this.renewalError = end.error;
          break;
        case "stalled":
          this.renewalError = new LeaseError(
            `heartbeat stream stalled: a beat unanswered for ${STALL_INTERVALS} intervals`,
          );
          break;
        case "early":
          this.renewalError = new LeaseError("heartbeat stream ended before it was stopped");
          break;
      }
      if (this.#stopping) return;
      const delayS = Math.min(this.#backoff.nextDelayS(), RESUME_SHARE_OF_TRUST * Math.max(window.remainingS(), 0));
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, delayS * 1000);
        this.#wakeSleeper = () => {
          clearTimeout(timer);
          resolve();
        };
      });
      this.#wakeSleeper = null;
    }
  }

  #runStream(): Promise<StreamEnd> {
    const { clock, intervalS, window } = this.#o;
    const call = this.#o.openStream();
    this.streamsOpened += 1;
    const sent: Beat[] = [];
    let finished = false;
    let beatTimer: NodeJS.Timeout | undefined;
    let trustTimer: NodeJS.Timeout | undefined;
    return new Promise<StreamEnd>((resolve) => {
      const finish = (end: StreamEnd, cancel: boolean): void => {
        if (finished) return;
        finished = true;
        clearTimeout(beatTimer);
        clearTimeout(trustTimer);
        this.#current = null;
        for (const beat of sent) beat.saved?.reject(new CheckpointNotCarried("the heartbeat stream ended"));
        this.#dropOutbox();
        if (cancel) call.cancel();
        resolve(end);
      };
      const armTrust = (): void => {
        clearTimeout(trustTimer);
        const leftS = window.remainingS();
        if (leftS <= 0) {
          finish({ kind: "lost", error: this.#lostError(window.lossReason) }, true);
          return;
        }
        trustTimer = setTimeout(armTrust, Math.ceil(leftS * 1000));
      };
      const write = (request: pb.HeartbeatRequest, saved: Deferred<Stored> | null): void => {
        if (finished) return;
        const oldest = sent[0];
        if (oldest !== undefined && clock() - oldest.writtenTime > STALL_INTERVALS * intervalS) {
          saved?.reject(new CheckpointNotCarried("the heartbeat stream stalled"));
          finish({ kind: "stalled" }, true);
          return;
        }
        // The trust window counts from before the send: the conservative end.
        const beat: Beat = { sendTime: clock(), writtenTime: Infinity, saved };
        sent.push(beat);
        call.write(request, () => {
          beat.writtenTime = clock();
        });
        clearTimeout(beatTimer);
        if (!this.#stopping) beatTimer = setTimeout(beatNow, intervalS * 1000);
      };
      const beatNow = (): void => {
        if (finished || this.#stopping) return;
        const [request, saved] = this.#nextBeat();
        write(request, saved);
      };
      call.on("data", (response: pb.HeartbeatResponse) => {
        if (finished) return;
        if (response.checkpointVersion > this.storedCheckpointVersion) {
          this.storedCheckpointVersion = response.checkpointVersion;
        }
        const beat = sent.shift();
        if (beat === undefined) return; // more answers than beats: nothing to measure from
        window.confirm(beat.sendTime, fromDuration(response.remainingTtl), response.renewed, response.expireTime ?? null);
        if (response.renewed) this.renewalError = null;
        beat.saved?.resolve([response.checkpointVersion, response.checkpointSaved]);
        this.#backoff.reset();
        armTrust();
      });
      call.on("error", () => {
        // the same outcome arrives as "status"
      });
      call.on("status", (status: StatusObject) => finish(this.#classify(status), false));
      this.#current = {
        wake: beatNow,
        halfClose: () => {
          clearTimeout(beatTimer);
          if (!finished) call.end();
        },
        cancel: () => finish({ kind: "clean" }, true),
      };
      armTrust();
      write(this.#o.firstRequest, null);
    });
  }

  #classify(status: StatusObject): StreamEnd {
    if (status.code === Code.OK) return { kind: this.#stopping ? "clean" : "early" };
    if (this.#stopping && status.code === Code.CANCELLED) return { kind: "clean" };
    const request = this.#o.firstRequest;
    const error = fromServiceError(status, { taskId: request.taskId, fence: request.fence });
    if (error instanceof LeaseLost) return { kind: "lost", error };
    if (error instanceof InvalidArgument && error.field?.startsWith("checkpoint.")) {
      return { kind: "checkpointRefused", error };
    }
    if (error.code !== null && TRANSIENT_CODES.has(error.code)) return { kind: "transient", error };
    return { kind: "fatal", error };
  }
}
