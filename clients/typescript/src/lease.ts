/**
 * A held lease: `const lease = await client.hold(taskId, { ttl })`, or
 * `await client.withLease(taskId, { ttl }, async (lease) => ...)`.
 *
 * hold() claims the task, sets the trust deadline from the claim and opens one heartbeat stream
 * renewing every interval (ttl / 3 by default). A grant that arrives after its own trust
 * deadline throws LeaseLost at once: nothing is sent for that fence. Each confirmed renewal moves
 * the deadline (`sendTime + remainingTtl - safetyMargin`, on `performance.now()`).
 *
 * When ownership is lost -- the server ends the heartbeat with a reason, or the trust deadline
 * passes without a confirmed renewal, however healthy the stream looks -- `lease.signal` is
 * aborted with the {@link LeaseLost} as its reason: pass it to the work done under the lease
 * (fetch, timers, child processes, gRPC calls) and it stops there. A pushed loss aborts it as
 * the message arrives; a passed trust deadline, when its timer runs. A process that was paused
 * past the deadline runs its due callbacks in their order, so a tick of the work may see the
 * signal not yet aborted: `check()` reads the clock itself and throws the loss, so call it right
 * before acting (the ledger's `lease.effect()` does).
 *
 * `close()` ends the lease's use: it stops the heartbeat (half-close) and releases the lease
 * (best effort: a lease it cannot release ends by its ttl). After a loss the stream is
 * cancelled, and a lease that may still be ours is released in the background.
 * `complete()` and `fail(reason)` end the run (COMPLETED or FAILED, terminal) instead.
 *
 * The lease is a state machine ({@link LeaseState}); every change of state goes through one
 * method, which checks it, records the loss and aborts the signal.
 */
import { status as Code, type Metadata } from "@grpc/grpc-js";
import { CheckpointWriter } from "./checkpoints.js";
import { EffectRunner, type EffectOptions } from "./effects.js";
import { LeaseError, LeaseLost, TaskCompleted, TaskFailed } from "./errors.js";
import { FenceRef } from "./fencing.js";
import * as pb from "./gen/leasekeeper/v1/lease_service.js";
import { HeartbeatKeeper, STOP_TIMEOUT_S } from "./heartbeat.js";
import type { LeaseClientLike } from "./ports.js";
import type { TrustWindow } from "./trust.js";
import { bytes, type Checkpoint, checkpointMessage, int64, type LeaseInfo, toDuration } from "./types.js";

/** Where a held lease is in its life (`lease.state`). */
export type LeaseState =
  | "HOLDING" // trusted: the work runs
  | "COMPLETING" // complete() awaits the server
  | "COMPLETED" // the task is completed: nothing to release, never lost (final)
  | "FAILING" // fail() awaits the server
  | "FAILED" // the run ended as failed (final)
  | "LOST" // ownership is lost; `loss` says why (final)
  | "RELEASING" // close() on a trusted lease: stopping the heartbeat, releasing
  | "CLOSED"; // closed: released (or left to its ttl)

const TRANSITIONS: Record<LeaseState, ReadonlySet<LeaseState>> = {
  HOLDING: new Set(["COMPLETING", "FAILING", "LOST", "RELEASING"]),
  COMPLETING: new Set(["COMPLETING", "COMPLETED", "LOST", "HOLDING", "CLOSED"]),
  COMPLETED: new Set(["COMPLETED"]),
  FAILING: new Set(["FAILING", "FAILED", "LOST", "HOLDING", "CLOSED"]),
  FAILED: new Set(["FAILED"]),
  LOST: new Set(["LOST"]),
  RELEASING: new Set(["COMPLETING", "FAILING", "LOST", "CLOSED"]),
  CLOSED: new Set(["COMPLETING", "FAILING", "LOST"]),
};
const ENDING = new Set<LeaseState>(["COMPLETING", "FAILING"]);
const ENDED = new Set<LeaseState>(["COMPLETED", "FAILED"]);
const onLoss = (state: LeaseState): LeaseState => (ENDING.has(state) || ENDED.has(state) ? state : "LOST");

/** Reasons for which a lost lease belongs to someone else (or nobody): releasing it is pointless. */
const NOT_OURS = new Set([
  "LEASE_SUPERSEDED",
  "LEASE_RELEASED",
  "LEASE_REVOKED",
  "TASK_COMPLETED",
  "TASK_CANCELLED",
  "TASK_FAILED",
  "NOT_OWNER",
  "FENCE_UNKNOWN",
]);
/** Seconds the background release of a lost lease may take. */
export const RELEASE_AFTER_LOSS_TIMEOUT_S = 2.0;

/** A lease held by this client: its fence, its signal, its checkpoints and effects. */
export class HeldLease {
  /** Aborted, with the LeaseLost as its reason, the moment ownership is lost while the lease is open. */
  readonly signal: AbortSignal;
  readonly #controller = new AbortController();
  readonly #client: LeaseClientLike;
  #info: LeaseInfo;
  readonly #checkpoint: Checkpoint | null;
  readonly #checkpoints: CheckpointWriter;
  readonly #window: TrustWindow;
  #keeper: HeartbeatKeeper | null = null;
  #state: LeaseState = "HOLDING";
  #loss: LeaseLost | null = null;
  #open = true; // until close(): a loss aborts the signal only while open
  #closing: Promise<LeaseLost | null> | null = null;

  /** @internal made by `LeaseClient.hold()`. */
  constructor(client: LeaseClientLike, info: LeaseInfo, window: TrustWindow, checkpoint: Checkpoint | null) {
    this.#client = client;
    this.#info = info;
    this.#window = window;
    this.#checkpoint = checkpoint;
    this.#checkpoints = new CheckpointWriter(client, info.taskId, info.fence, checkpoint);
    this.signal = this.#controller.signal;
  }

  get state(): LeaseState {
    return this.#state;
  }
  /** The client the lease was claimed with (its effects go through it). */
  get client(): LeaseClientLike {
    return this.#client;
  }
  get taskId(): string {
    return this.#info.taskId;
  }
  get namespace(): string {
    return this.#info.namespace;
  }
  get ownerId(): string {
    return this.#info.ownerId;
  }
  /** The fencing token of this lease. */
  get fence(): bigint {
    return this.#info.fence;
  }
  /** The lease as granted (as completed, after complete()). */
  get info(): LeaseInfo {
    return this.#info;
  }
  /** The task's checkpoint received with the grant: resume from it. null: none was saved. */
  get checkpoint(): Checkpoint | null {
    return this.#checkpoint;
  }
  /** The stored checkpoint's version as this holder last heard it (0n: none). */
  get checkpointVersion(): bigint {
    return this.#checkpoints.knownVersion(this.#keeper);
  }
  /** `{ namespace, taskId, fence }` of this lease. */
  get ref(): FenceRef {
    return new FenceRef(this.namespace, this.taskId, this.fence);
  }

  /**
   * The gRPC metadata carrying the lease to an effect service (`leasekeeper-namespace`,
   * `leasekeeper-task-id`, `leasekeeper-fence`): pass it to every effect call. Set on `into`
   * when given (e.g. a Metadata of your own copy of @grpc/grpc-js), else on a new one.
   */
  metadata<M extends Pick<Metadata, "set"> = Metadata>(into?: M): M {
    return this.ref.metadata(into);
  }

  /** True once ownership is lost (reported by the server, or the trust deadline passed). */
  get lost(): boolean {
    return this.loss !== null;
  }

  /** The loss, or null while the lease is trusted (or after complete()/fail()). */
  get loss(): LeaseLost | null {
    if (ENDED.has(this.#state)) return null;
    if (this.#loss === null && this.#window.expired()) this.#move(onLoss(this.#state), this.#windowLoss());
    return this.#loss;
  }

  /** Throw the loss if the lease may not be acted on any more. Call it right before each effect. */
  check(): void {
    const loss = this.loss;
    if (loss !== null) throw loss;
  }

  /** Seconds left until the trust deadline on the monotonic clock (>= 0). */
  remaining(): number {
    return Math.max(this.#window.remainingS(), 0);
  }

  /**
   * Why renewals are not being confirmed now (LeaseUnavailable, a stalled stream, ...), or null.
   * Not a loss: the heartbeat keeps resuming with the same fence until the trust deadline.
   */
  get renewalError(): LeaseError | null {
    return this.#keeper?.renewalError ?? null;
  }

  /**
   * Save the task's progress under this lease: a replacement resumes from it. Rides on a beat of
   * the heartbeat stream when it is open, else SaveCheckpoint. Saves of one lease go one at a time.
   *
   * @param version - higher than the stored version (e.g. the step number); >= 1.
   * @param data - the progress (bytes, or text as UTF-8), at most the server's max_checkpoint_bytes.
   * @param contentType - what `data` is, e.g. "application/json"; may be empty.
   * @returns the checkpoint as stored (`writeTime` null when the stream carried it).
   * @throws CheckpointNotNewer - a version at least as high is stored (`currentVersion`).
   * @throws LeaseLost - the lease is lost (nothing sent), or the server refused ABORTED.
   * @throws InvalidArgument - data too large, version < 1, a bad content type.
   */
  saveCheckpoint(version: number | bigint, data: Uint8Array | string, contentType = ""): Promise<Checkpoint> {
    const message = checkpointMessage([int64(version, "version"), bytes(data, "data"), contentType]);
    return this.#checkpoints.save(message, this.#keeper, () => this.check());
  }

  /**
   * An effect of this lease's task, run through the effect ledger with this fence:
   * `await lease.effect("email:welcome", { policy: "ONCE" }).run(() => mailer.send(...))`.
   */
  effect(effectKey: string, options: EffectOptions): EffectRunner {
    return new EffectRunner(this, effectKey, options);
  }

  /**
   * Mark the task COMPLETED now (release with complete), then stop the heartbeat. The call's
   * deadline is the trust deadline when that comes first. Idempotent once it succeeded.
   *
   * @throws LeaseLost - already lost (nothing sent), refused ABORTED, or the trust deadline passed first.
   * @throws TaskFailed - the run already ended as failed (nothing sent).
   * @throws LeaseUnavailable - UNAVAILABLE: not completed; the heartbeat goes on; call again.
   */
  complete(): Promise<LeaseInfo> {
    return this.#endRun("COMPLETING", "COMPLETED", null);
  }

  /** End the run as failed (FAILED, terminal; `reason` kept as failReason). Errors as complete(). */
  fail(reason = ""): Promise<LeaseInfo> {
    return this.#endRun("FAILING", "FAILED", reason);
  }

  async #endRun(ending: LeaseState, ended: LeaseState, failReason: string | null): Promise<LeaseInfo> {
    if (this.#state === ended) return this.#info;
    if (ENDED.has(this.#state)) {
      throw this.#state === "FAILED"
        ? new TaskFailed(`task ${JSON.stringify(this.taskId)}: the run already ended as failed`)
        : new TaskCompleted(`task ${JSON.stringify(this.taskId)}: the run is already completed`);
    }
    this.check();
    const before = this.#state;
    const wasOpen = this.#open;
    const deadline = this.#window.deadline;
    const leftS = this.#window.remainingS();
    this.#move(ending);
    let info: LeaseInfo;
    try {
      info = await this.#client._release(this.taskId, this.fence, {
        complete: failReason === null,
        fail: failReason !== null,
        failReason: failReason ?? "",
        timeout: leftS,
      });
    } catch (error) {
      if (error instanceof LeaseLost) {
        this.#move("LOST", error);
        throw error;
      }
      if (error instanceof LeaseError && this.#loss === null && this.#cutOff(error, deadline, leftS)) {
        this.#move("LOST", this.#windowLoss(true));
      }
      this.#move(this.#afterFailedEnd(before, wasOpen));
      if (this.#loss !== null) throw this.#loss;
      throw error;
    }
    this.#info = info;
    this.#move(ended);
    await this.#keeper?.stop();
    return info;
  }

  #afterFailedEnd(before: LeaseState, wasOpen: boolean): LeaseState {
    if (this.#state === "LOST" || this.#loss !== null) return "LOST";
    if (before === "HOLDING" && (!wasOpen || this.#open)) return "HOLDING";
    return "CLOSED";
  }

  #cutOff(error: LeaseError, deadline: number | null, leftS: number): boolean {
    const callTimeout = this.#client._callTimeoutS;
    const bounded = callTimeout === null || leftS < callTimeout;
    return bounded && error.code === Code.DEADLINE_EXCEEDED && this.#window.deadline === deadline;
  }

  /** @internal start the heartbeat (called once by hold()). */
  _keepRenewed(ttlS: number | null, intervalS: number): void {
    if (this.#keeper !== null) throw new Error("the heartbeat of a HeldLease is started only once");
    const first = pb.HeartbeatRequest.create({
      namespace: this.namespace,
      taskId: this.taskId,
      ownerId: this.ownerId,
      fence: this.fence,
      ttl: toDuration(ttlS, "ttl"),
    });
    this.#keeper = new HeartbeatKeeper({
      openStream: () => this.#client._openHeartbeat(),
      firstRequest: first,
      intervalS,
      window: this.#window,
      onLost: (error) => this.#move(onLoss(this.#state), error),
      clock: this.#client.clock,
      log: (message) => this.#client._log("info", message),
    });
    this.#keeper.start();
  }

  /**
   * Stop using the lease: stop the heartbeat and release the lease (unless `release` is false:
   * then it ends by its ttl). Idempotent; never throws for a loss.
   *
   * @returns the loss as judged when close() was called (null: the lease was trusted then).
   */
  close(options: { release?: boolean } = {}): Promise<LeaseLost | null> {
    this.#closing ??= this.#close(options.release ?? true);
    return this.#closing;
  }

  /** `await using lease = await client.hold(...)` closes the lease at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }

  async #close(release: boolean): Promise<LeaseLost | null> {
    this.#open = false; // before any await: no abort lands during the cleanup
    const loss = this.loss; // judged now: the cleanup's own time must not count against the work
    try {
      if (this.#state === "HOLDING") this.#move("RELEASING");
      // After a loss there is no OK to wait for: cancel the stream at once.
      await this.#keeper?.stop(this.lost ? 0 : STOP_TIMEOUT_S);
      if (release && !ENDED.has(this.#state)) {
        const late = this.loss; // the trust deadline may have passed while stopping
        if (late === null) await this.#release(null, "warn");
        else if (!NOT_OURS.has(late.reason)) {
          this.#client._spawn(this.#release(RELEASE_AFTER_LOSS_TIMEOUT_S, "info"));
        }
      }
      if (this.#state === "RELEASING") this.#move("CLOSED");
    } finally {
      this.#client._unmarkHeld(this.taskId);
      this.#client._leaseClosed(this);
    }
    return loss;
  }

  async #release(timeoutS: number | null, level: "warn" | "info"): Promise<void> {
    try {
      await this.#client._release(this.taskId, this.fence, { timeout: timeoutS });
    } catch (error) {
      if (error instanceof LeaseLost) return; // already gone; nothing to give back
      this.#client._log(
        level,
        `release of ${this.namespace}/${this.taskId} fence ${this.fence} failed (the lease ends by its ttl): ${String(error)}`,
      );
    }
  }

  /** The one transition of the state machine: check it, record the loss, abort the signal. */
  #move(to: LeaseState, loss: LeaseLost | null = null): void {
    if (!TRANSITIONS[this.#state].has(to)) {
      throw new Error(`HeldLease cannot go from ${this.#state} to ${to}`);
    }
    this.#state = to;
    if (ENDED.has(to)) {
      this.#loss = null;
      return;
    }
    // The server's reason is the truth over a passed trust deadline noticed first.
    if (loss !== null && (this.#loss === null || (this.#loss.reason === "LEASE_EXPIRED" && loss.reason !== "LEASE_EXPIRED"))) {
      this.#loss = loss;
    }
    if (to === "LOST" && this.#open && !this.#controller.signal.aborted) this.#controller.abort(this.#loss);
  }

  #windowLoss(cutOff = false): LeaseLost {
    const reason = this.#window.lossReason;
    const message = cutOff
      ? `lease lost: its trust deadline passed before the completion was confirmed (${reason})`
      : undefined;
    return new LeaseLost(reason, this.taskId, this.fence, message === undefined ? {} : { message });
  }
}
