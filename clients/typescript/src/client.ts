/**
 * LeaseClient: the Node.js client of `leasekeeper.v1.LeaseService`, on @grpc/grpc-js.
 *
 * Every RPC maps to one method; durations go in and come back as numbers of seconds; fences
 * and versions are bigint; every failed call becomes a {@link LeaseError} subclass by its gRPC
 * status code and ErrorInfo reason. The client never retries a call on its own, except inside
 * {@link LeaseClient.hold}, which documents its retries.
 */
import {
  type ChannelCredentials,
  type ClientDuplexStream,
  type ClientOptions,
  credentials as grpcCredentials,
  Metadata,
  type ServiceError,
  status as Code,
} from "@grpc/grpc-js";
import { acquire } from "./acquire.js";
import { fromServiceError, InvalidArgument, LeaseError, LeaseLost } from "./errors.js";
import * as pb from "./gen/leasekeeper/v1/lease_service.js";
import { beatIntervalS, checkBeatInterval } from "./heartbeat.js";
import { newOwnerId, newRequestId } from "./ids.js";
import { HeldLease, RELEASE_AFTER_LOSS_TIMEOUT_S } from "./lease.js";
import { type Clock, defaultSafetyMargin, monotonic, TrustWindow } from "./trust.js";
import { FenceStream } from "./validateStream.js";
import {
  beginResult,
  type BeginResult,
  bytes,
  type Checkpoint,
  type CheckpointLike,
  checkpointMessage,
  checkpointOf,
  claimResult,
  type ClaimResult,
  type EffectPolicy,
  type EffectRecord,
  effectOutcome,
  effectPolicy,
  effectRecord,
  effectState,
  type EffectState,
  fenceCheck,
  type FenceCheck,
  historyEntry,
  type HistoryEntry,
  int64,
  leaseInfo,
  type LeaseInfo,
  optionalSeconds,
  type RenewedLease,
  savedCheckpoint,
  type TaskEvent,
  taskEvent,
  taskState,
  type TaskState,
  toDuration,
} from "./types.js";

export const DEFAULT_TARGET = "127.0.0.1:9457";
export const TARGET_ENV = "LEASEKEEPER_TARGET";
export const TOKEN_ENV = "LEASEKEEPER_TOKEN";
export const DEFAULT_NAMESPACE = "default";
export const DEFAULT_CALL_TIMEOUT_S = 10.0;

/** The server address used when none is given: `$LEASEKEEPER_TARGET`, else 127.0.0.1:9457. */
export function defaultTarget(): string {
  return process.env[TARGET_ENV] || DEFAULT_TARGET;
}

/**
 * The channel options of the client's own channel (the Python client's CHANNEL_OPTIONS): pings
 * find a dead server, or a connection cut without a reset, within 15 s (its calls and streams
 * then fail UNAVAILABLE), and a server that comes back is reconnected to within about 1 s.
 */
export const CHANNEL_OPTIONS: Readonly<Partial<ClientOptions>> = {
  "grpc.keepalive_time_ms": 10_000,
  "grpc.keepalive_timeout_ms": 5_000,
  "grpc.keepalive_permit_without_calls": 1,
  "grpc.initial_reconnect_backoff_ms": 250,
  "grpc.max_reconnect_backoff_ms": 1_000,
};

/** TLS for the client's channel: PEM text or bytes. */
export interface TlsOptions {
  /** The CA that signed the server's certificate; absent: the system's roots. */
  ca?: string | Uint8Array;
  /** The client's private key, for mutual TLS (with `cert`). */
  key?: string | Uint8Array;
  /** The client's certificate chain, for mutual TLS (with `key`). */
  cert?: string | Uint8Array;
}

export interface LeaseClientOptions {
  /** The server address (host:port, any gRPC target). Absent: `$LEASEKEEPER_TARGET`, else 127.0.0.1:9457. */
  target?: string;
  /** The namespace of every task named by this client ("default"). */
  namespace?: string;
  /** This worker incarnation's owner id; absent (recommended): a fresh {@link newOwnerId}. Never shared by two live processes. */
  ownerId?: string;
  /** Deadline of each unary call, seconds (10); null for none. The heartbeat stream has none. */
  callTimeout?: number | null;
  /**
   * The bearer token sent as `authorization: Bearer <token>` on every call and on the heartbeat
   * stream. Absent: `$LEASEKEEPER_TOKEN` if set. "" or null: no token, whatever the environment says.
   */
  token?: string | null;
  /** TLS: `true` for the system's roots, or the CA (and the client's key and certificate for mutual TLS). */
  tls?: boolean | TlsOptions;
  /** Channel credentials made by the caller (instead of `tls`); absent: `tls`, else plaintext. */
  credentials?: ChannelCredentials;
  /** More grpc-js client options (e.g. `interceptors`), merged over {@link CHANNEL_OPTIONS}. */
  channelOptions?: Partial<ClientOptions>;
  /** The monotonic clock for send times and trust deadlines, seconds (`performance.now() / 1000`). */
  clock?: Clock;
  /** Where the client tells what it cannot throw (a failed release, a heartbeat stream reopened). */
  logger?: { warn?(message: string): void; info?(message: string): void };
  /**
   * true (default): validateFence() sends its checks on one ValidateFences stream the client
   * opens on first use and shares among its calls (much less server CPU per check than a unary
   * call, the same answers); a server without it is asked with ValidateFence. false: one unary
   * ValidateFence per check.
   */
  validateStream?: boolean;
}

export interface ClaimOptions {
  /** Lease length, seconds (30), within the server's [min_ttl, max_ttl]; null: the server's default. */
  ttl?: number | null;
  /** Runtime budget from the grant, seconds; absent: the server's maximum. */
  maxRuntime?: number | null;
  /**
   * Names this logical claim: send the same one to retry a claim whose outcome is unknown (the
   * same lease back, no new fence). Absent: a fresh {@link newRequestId}. "": none.
   */
  requestId?: string;
  /**
   * Seconds the server may wait for a task held by another owner; absent: answer at once. The
   * call's deadline is still `callTimeout`: keep `wait` below it (hold() counts its deadline
   * from the end of the wait instead).
   */
  wait?: number | null;
  /** The attempt limit this grant carries; 0: the namespace's default, else none. */
  maxAttempts?: number;
}

export interface HoldOptions {
  /** Lease length, seconds (30); renewed every heartbeatInterval. null: the server's default. */
  ttl?: number | null;
  maxRuntime?: number | null;
  /**
   * Seconds to wait while another owner holds the task (the server waits; failed attempts are
   * retried with backoff and the same request id). Absent: one attempt (NotAcquired).
   */
  wait?: number | null;
  /** Seconds subtracted from every confirmed remaining ttl; absent: min(1 s, ttl / 10). */
  safetyMargin?: number | null;
  /** Seconds between beats; absent: ttl / 3. At most ttl / 2, and only with an explicit ttl. */
  heartbeatInterval?: number | null;
  maxAttempts?: number;
}

interface InternalClaimOptions {
  ttl: number | null | undefined;
  maxRuntime: number | null | undefined;
  requestId: string;
  wait: number | null | undefined;
  deadlinePastWait?: boolean;
  maxAttempts?: number;
}

type Unary<Req, Res> = (
  request: Req,
  metadata: Metadata,
  options: { deadline?: Date },
  callback: (error: ServiceError | null, response: Res) => void,
) => unknown;

/** Claims, renews, releases and inspects leases in one namespace. `close()` it when done. */
export class LeaseClient {
  readonly target: string;
  readonly namespace: string;
  readonly ownerId: string;
  /** The monotonic clock (seconds) for send times and trust deadlines. */
  readonly clock: Clock;
  /** @internal */
  readonly _callTimeoutS: number | null;
  readonly #stub: pb.LeaseServiceClient;
  readonly #token: string | null;
  readonly #logger: NonNullable<LeaseClientOptions["logger"]>;
  readonly #held = new Set<string>();
  readonly #leases = new Set<HeldLease>();
  readonly #background = new Set<Promise<void>>();
  readonly #fences: FenceStream | null;
  #closing = false;
  #closed = false;

  constructor(options: LeaseClientOptions = {}) {
    this.target = options.target || defaultTarget();
    this.namespace = options.namespace ?? DEFAULT_NAMESPACE;
    this.ownerId = options.ownerId ?? newOwnerId();
    this.clock = options.clock ?? monotonic;
    this._callTimeoutS =
      options.callTimeout === undefined ? DEFAULT_CALL_TIMEOUT_S : optionalSeconds(options.callTimeout, "callTimeout");
    const token = options.token === undefined ? process.env[TOKEN_ENV] : options.token;
    this.#token = token ? token : null;
    this.#logger = options.logger ?? {
      warn: (message) => process.emitWarning(message, "LeaseKeeperWarning"),
    };
    this.#stub = new pb.LeaseServiceClient(this.target, channelCredentials(options), {
      ...CHANNEL_OPTIONS,
      ...options.channelOptions,
    });
    this.#fences =
      options.validateStream === false
        ? null
        : new FenceStream(
            () => this.stub.validateFences(this.callMetadata()),
            (request) => this.#validateUnary(request),
            this._callTimeoutS,
          );
  }

  /** The metadata every call carries (the bearer token), as a new Metadata. */
  callMetadata(): Metadata {
    const metadata = new Metadata();
    if (this.#token !== null) metadata.set("authorization", `Bearer ${this.#token}`);
    return metadata;
  }

  /** The generated grpc-js client (for RPCs this class does not wrap). */
  get stub(): pb.LeaseServiceClient {
    if (this.#closed) throw new Error("LeaseClient is closed");
    return this.#stub;
  }

  /**
   * Close the channel; later calls fail. Closes the leases still held first (each stops its
   * heartbeat and is released), and lets a lost lease's background release end (at most 2 s).
   * Idempotent.
   */
  async close(): Promise<void> {
    if (this.#closed) return;
    await Promise.allSettled([...this.#leases].map((lease) => lease.close()));
    this.#closing = true;
    const background = [...this.#background];
    if (background.length > 0) {
      let timer: NodeJS.Timeout | undefined;
      await Promise.race([
        Promise.allSettled(background),
        new Promise((resolve) => {
          timer = setTimeout(resolve, RELEASE_AFTER_LOSS_TIMEOUT_S * 1000);
        }),
      ]);
      clearTimeout(timer);
    }
    this.#closed = true;
    this.#fences?.close();
    this.#stub.close();
  }

  /** `await using client = new LeaseClient()` closes it at the end of the scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }

  #unary<Req, Res>(
    method: keyof pb.LeaseServiceClient,
    request: Req,
    context: { taskId?: string; fence?: bigint; timeout?: number | null; serverWait?: number } = {},
  ): Promise<Res> {
    let timeoutS = this._callTimeoutS;
    if (context.timeout !== undefined && context.timeout !== null && (timeoutS === null || context.timeout < timeoutS)) {
      timeoutS = context.timeout;
    }
    if (timeoutS !== null) timeoutS += context.serverWait ?? 0;
    const options = timeoutS === null ? {} : { deadline: new Date(Date.now() + Math.max(timeoutS, 0) * 1000) };
    const stub = this.stub;
    const rpc = stub[method] as unknown as Unary<Req, Res>;
    return new Promise<Res>((resolve, reject) => {
      rpc.call(stub, request, this.callMetadata(), options, (error, response) => {
        if (error) reject(fromServiceError(error, { taskId: context.taskId, fence: context.fence }));
        else resolve(response);
      });
    });
  }

  /**
   * Claim a task for this owner: one atomic decision on the database clock. FREE or EXPIRED:
   * granted with the next fence. HELD by another owner: `acquired` false and the holder's
   * remaining ttl. HELD by this owner: with the requestId of the claim that granted it, the same
   * lease back (a retry whose reply was lost); with another, a new incarnation: the next fence,
   * and the earlier one is superseded. Sent once, never retried here: to retry a claim whose
   * outcome is unknown, call again with the same `requestId` (hold() does).
   *
   * @returns the outcome; `sendTime` is this client's clock when the request left, `checkpoint`
   *   the task's checkpoint when acquired (resume from it).
   * @throws TaskCompleted | TaskCancelled | TaskFailed - the task is terminal.
   * @throws TaskQuarantined - attempts used up, until an operator's retry.
   * @throws LimitExceeded | AccessDenied | InvalidArgument | LeaseUnavailable | LeaseError
   */
  claim(taskId: string, options: ClaimOptions = {}): Promise<ClaimResult> {
    return this._claim(taskId, {
      ttl: options.ttl === undefined ? 30 : options.ttl,
      maxRuntime: options.maxRuntime,
      requestId: options.requestId ?? newRequestId(),
      wait: options.wait,
      maxAttempts: options.maxAttempts,
    });
  }

  /** @internal claim(), sent once; with deadlinePastWait the call timeout counts from the end of the wait. */
  async _claim(taskId: string, o: InternalClaimOptions): Promise<ClaimResult> {
    const request = pb.ClaimRequest.create({
      namespace: this.namespace,
      taskId,
      ownerId: this.ownerId,
      ttl: toDuration(o.ttl, "ttl"),
      maxRuntime: toDuration(o.maxRuntime, "maxRuntime"),
      requestId: o.requestId,
      wait: toDuration(o.wait, "wait"),
      maxAttempts: o.maxAttempts ?? 0,
    });
    const serverWait = o.deadlinePastWait && o.wait ? o.wait : 0;
    const sendTime = this.clock();
    const response = await this.#unary<pb.ClaimRequest, pb.ClaimResponse>("claim", request, { taskId, serverWait });
    return claimResult(response, sendTime, o.requestId);
  }

  /**
   * Renew a live lease: expire_time = least(db now + ttl, runtime deadline). Prefer hold().
   *
   * @param options.trustDeadline - the lease's trust deadline on this client's clock: the call's
   *   deadline is no later; past it (or unanswered by it) LeaseLost LEASE_EXPIRED is thrown.
   * @throws LeaseLost - ABORTED with the reason: claim again, never retry the renewal.
   */
  async renew(
    taskId: string,
    fence: bigint | number,
    options: { ttl?: number | null; trustDeadline?: number } = {},
  ): Promise<RenewedLease> {
    const f = int64(fence, "fence");
    const request = pb.RenewRequest.create({
      namespace: this.namespace,
      taskId,
      ownerId: this.ownerId,
      fence: f,
      ttl: toDuration(options.ttl, "ttl"),
    });
    const leftS = options.trustDeadline === undefined ? null : options.trustDeadline - this.clock();
    if (leftS !== null && leftS <= 0) {
      throw new LeaseLost("LEASE_EXPIRED", taskId, f, {
        message: "lease lost: its trust deadline passed before the renewal was sent",
      });
    }
    const boundByTrust = leftS !== null && (this._callTimeoutS === null || leftS < this._callTimeoutS);
    const sendTime = this.clock();
    try {
      const response = await this.#unary<pb.RenewRequest, pb.RenewResponse>("renew", request, {
        taskId,
        fence: f,
        timeout: leftS,
      });
      return { ...leaseInfo(response.lease), sendTime };
    } catch (error) {
      if (boundByTrust && error instanceof LeaseError && error.code === Code.DEADLINE_EXCEEDED) {
        throw new LeaseLost("LEASE_EXPIRED", taskId, f, {
          message: "lease lost: no renewal confirmed by its trust deadline",
          cause: error,
        });
      }
      throw error;
    }
  }

  /**
   * Release a lease (live or expired, unless a newer fence exists). Idempotent. The task becomes
   * FREE; COMPLETED with `complete`; FAILED with `fail` (and `failReason`).
   *
   * @throws LeaseLost - ABORTED: LEASE_SUPERSEDED (the newer lease is untouched), NOT_OWNER, ...
   */
  release(
    taskId: string,
    fence: bigint | number,
    options: { complete?: boolean; fail?: boolean; failReason?: string } = {},
  ): Promise<LeaseInfo> {
    return this._release(taskId, int64(fence, "fence"), options);
  }

  /** @internal release() within `timeout` seconds, if shorter than the call timeout. */
  async _release(
    taskId: string,
    fence: bigint,
    o: { complete?: boolean; fail?: boolean; failReason?: string; timeout?: number | null },
  ): Promise<LeaseInfo> {
    if (o.fail && o.complete) throw InvalidArgument.local("fail", "a run ends completed or failed, not both");
    if (o.failReason && !o.fail) throw InvalidArgument.local("failReason", "only a failed run has a failReason");
    const request = pb.ReleaseRequest.create({
      namespace: this.namespace,
      taskId,
      ownerId: this.ownerId,
      fence,
      complete: o.complete ?? false,
      fail: o.fail ?? false,
      failReason: o.failReason ?? "",
    });
    const response = await this.#unary<pb.ReleaseRequest, pb.ReleaseResponse>("release", request, {
      taskId,
      fence,
      timeout: o.timeout,
    });
    return leaseInfo(response.lease);
  }

  /**
   * Say whether `fence` may act now (database clock). Changes no lease; a refused stale fence is
   * written to the task's history. Needs the effect or admin role when tokens are on. Sent on
   * the client's ValidateFences stream unless `validateStream` is false: the same answer,
   * decided after the check reached the server.
   *
   * @throws InvalidArgument | AccessDenied | LeaseUnavailable | LeaseError - as the unary call;
   *   LeaseUnavailable also when the stream ended before the answer came (not validated).
   */
  async validateFence(
    taskId: string,
    fence: bigint | number,
    options: { namespace?: string } = {},
  ): Promise<FenceCheck> {
    const f = int64(fence, "fence");
    const request = pb.ValidateFenceRequest.create({
      namespace: options.namespace ?? this.namespace,
      taskId,
      fence: f,
    });
    const response =
      this.#fences === null ? await this.#validateUnary(request) : await this.#fences.validate(request, taskId, f);
    return fenceCheck(response);
  }

  #validateUnary(request: pb.ValidateFenceRequest): Promise<pb.ValidateFenceResponse> {
    return this.#unary<pb.ValidateFenceRequest, pb.ValidateFenceResponse>("validateFence", request, {
      taskId: request.taskId,
      fence: request.fence,
    });
  }

  /** The task's current state, never a cached one (TaskNotFound: never claimed). */
  async getLease(taskId: string): Promise<LeaseInfo> {
    const response = await this.#getLease(taskId);
    return leaseInfo(response.lease);
  }

  /** The task's stored checkpoint with its data, or null when none was ever saved. */
  async getCheckpoint(taskId: string): Promise<Checkpoint | null> {
    const response = await this.#getLease(taskId);
    return response.checkpoint ? checkpointOf(response.checkpoint) : null;
  }

  #getLease(taskId: string): Promise<pb.GetLeaseResponse> {
    const request = pb.GetLeaseRequest.create({ namespace: this.namespace, taskId });
    return this.#unary<pb.GetLeaseRequest, pb.GetLeaseResponse>("getLease", request, { taskId });
  }

  /**
   * Save the task's checkpoint under the caller's live lease (SaveCheckpoint). Inside hold()
   * prefer `lease.saveCheckpoint()`, which rides on the heartbeat.
   *
   * @throws CheckpointNotNewer - the version does not move forward (`currentVersion` is stored).
   * @throws LeaseLost - ABORTED with the loss reason.
   */
  async saveCheckpoint(
    taskId: string,
    fence: bigint | number,
    version: bigint | number,
    data: Uint8Array | string,
    contentType = "",
  ): Promise<Checkpoint> {
    const f = int64(fence, "fence");
    const sent = checkpointMessage([int64(version, "version"), bytes(data, "data"), contentType]);
    const request = pb.SaveCheckpointRequest.create({
      namespace: this.namespace,
      taskId,
      ownerId: this.ownerId,
      fence: f,
      checkpoint: sent,
    });
    const response = await this.#unary<pb.SaveCheckpointRequest, pb.SaveCheckpointResponse>(
      "saveCheckpoint",
      request,
      { taskId, fence: f },
    );
    return savedCheckpoint(sent, response.checkpoint, f);
  }

  /** Revoke the task's current lease (admin): its fence stops validating, its heartbeat ends LEASE_REVOKED. */
  async revoke(
    taskId: string,
    reason: string,
    options: { fence?: bigint | number } = {},
  ): Promise<{ revoked: boolean; lease: LeaseInfo }> {
    const request = pb.RevokeRequest.create({
      namespace: this.namespace,
      taskId,
      reason,
      fence: options.fence === undefined ? 0n : int64(options.fence, "fence"),
    });
    const response = await this.#unary<pb.RevokeRequest, pb.RevokeResponse>("revoke", request, { taskId });
    return { revoked: response.revoked, lease: leaseInfo(response.lease) };
  }

  /** Cancel a task (admin): CANCELLED, terminal; its holder's heartbeat ends TASK_CANCELLED. */
  async cancel(taskId: string, reason: string): Promise<LeaseInfo> {
    const request = pb.CancelRequest.create({ namespace: this.namespace, taskId, reason });
    const response = await this.#unary<pb.CancelRequest, pb.CancelResponse>("cancel", request, { taskId });
    return leaseInfo(response.lease);
  }

  /** Put a QUARANTINED task back (admin): FREE with attempts 0 (TaskNotQuarantined otherwise). */
  async retry(taskId: string, reason: string): Promise<LeaseInfo> {
    const request = pb.RetryRequest.create({ namespace: this.namespace, taskId, reason });
    const response = await this.#unary<pb.RetryRequest, pb.RetryResponse>("retry", request, { taskId });
    return leaseInfo(response.lease);
  }

  /** One page of this namespace's tasks (admin), ordered by task id: `[leases, nextPageToken]`. */
  async listLeases(
    options: { state?: TaskState; ownerId?: string; pageSize?: number; pageToken?: string } = {},
  ): Promise<[LeaseInfo[], string]> {
    const request = pb.ListLeasesRequest.create({
      namespace: this.namespace,
      state: taskState(options.state),
      pageSize: options.pageSize ?? 100,
      pageToken: options.pageToken ?? "",
      ownerId: options.ownerId ?? "",
    });
    const response = await this.#unary<pb.ListLeasesRequest, pb.ListLeasesResponse>("listLeases", request);
    return [response.leases.map(leaseInfo), response.nextPageToken];
  }

  /** One page of a task's history, oldest first: `[entries, nextPageToken]`. */
  async listTaskHistory(
    taskId: string,
    options: { pageSize?: number; pageToken?: string; namespace?: string } = {},
  ): Promise<[HistoryEntry[], string]> {
    const request = pb.ListTaskHistoryRequest.create({
      namespace: options.namespace ?? this.namespace,
      taskId,
      pageSize: options.pageSize ?? 100,
      pageToken: options.pageToken ?? "",
    });
    const response = await this.#unary<pb.ListTaskHistoryRequest, pb.ListTaskHistoryResponse>(
      "listTaskHistory",
      request,
      { taskId },
    );
    return [response.entries.map(historyEntry), response.nextPageToken];
  }

  /**
   * The events of one task (or of this namespace when `taskId` is absent) as the database commits
   * them: a SNAPSHOT first, then CLAIMED, RELEASED, EXPIRED, ... Runs until the loop breaks or
   * `signal` aborts; no call timeout applies.
   */
  async *watch(taskId?: string, options: { signal?: AbortSignal } = {}): AsyncGenerator<TaskEvent> {
    const request = pb.WatchRequest.create({ namespace: this.namespace, taskId: taskId ?? "" });
    const call = this.stub.watch(request, this.callMetadata());
    const abort = () => call.cancel();
    options.signal?.addEventListener("abort", abort, { once: true });
    try {
      for await (const event of call) yield taskEvent(event as pb.TaskEvent);
    } catch (error) {
      if (options.signal?.aborted) return;
      throw fromServiceError(error as ServiceError, { taskId: taskId ?? null });
    } finally {
      options.signal?.removeEventListener("abort", abort);
      call.cancel();
    }
  }

  /**
   * Reserve an effect for `fence` in the effect ledger (one transaction on the database clock).
   * Prefer `lease.effect()`, which runs the whole protocol.
   *
   * @returns PROCEED (do it, then completeEffect), ALREADY_APPLIED (the confirmed outcome) or
   *   IN_DOUBT (an earlier attempt never confirmed: reconcile first), with the effect.
   * @throws LeaseLost - the fence may not act; nothing is reserved.
   * @throws EffectKeyReused - the key was reserved with another policy or digest.
   */
  async beginEffect(
    taskId: string,
    fence: bigint | number,
    effectKey: string,
    options: { policy: EffectPolicy; requestDigest?: Uint8Array; namespace?: string },
  ): Promise<BeginResult> {
    const f = int64(fence, "fence");
    const request = pb.BeginEffectRequest.create({
      namespace: options.namespace ?? this.namespace,
      taskId,
      fence: f,
      effectKey,
      policy: effectPolicy(options.policy),
      requestDigest: options.requestDigest ? Buffer.from(options.requestDigest) : Buffer.alloc(0),
    });
    const response = await this.#unary<pb.BeginEffectRequest, pb.BeginEffectResponse>("beginEffect", request, {
      taskId,
      fence: f,
    });
    return beginResult(response);
  }

  /**
   * Record the outcome of a reserved effect (and, with `nextCheckpoint`, the checkpoint after it,
   * in the same transaction). Idempotent for the same outcome, retryable flag and result.
   *
   * @throws LeaseLost - the fence may not act (the effect stays in doubt).
   * @throws EffectNotBegun | EffectAlreadyCompleted | CheckpointNotNewer
   */
  async completeEffect(
    taskId: string,
    fence: bigint | number,
    effectKey: string,
    options: {
      outcome: "SUCCEEDED" | "FAILED";
      retryable?: boolean;
      result?: Uint8Array | string;
      namespace?: string;
      externalOperationId?: string;
      nextCheckpoint?: CheckpointLike;
    },
  ): Promise<EffectRecord> {
    const f = int64(fence, "fence");
    const outcome = effectOutcome(options.outcome);
    if (options.retryable && outcome === pb.EffectState.EFFECT_STATE_SUCCEEDED) {
      throw InvalidArgument.local("retryable", "only a FAILED outcome is retryable");
    }
    const sent = options.nextCheckpoint === undefined ? undefined : checkpointMessage(options.nextCheckpoint, "nextCheckpoint");
    const request = pb.CompleteEffectRequest.create({
      namespace: options.namespace ?? this.namespace,
      taskId,
      fence: f,
      effectKey,
      outcome,
      retryable: options.retryable ?? false,
      result: bytes(options.result ?? new Uint8Array(), "result"),
      externalOperationId: options.externalOperationId ?? "",
      nextCheckpoint: sent,
    });
    const response = await this.#unary<pb.CompleteEffectRequest, pb.CompleteEffectResponse>(
      "completeEffect",
      request,
      { taskId, fence: f },
    );
    const checkpoint = sent === undefined ? null : savedCheckpoint(sent, response.checkpoint, f);
    return effectRecord(response.effect, checkpoint);
  }

  /** One page of a task's effects, ordered by effect key: `[effects, nextPageToken]`. */
  async listEffects(
    taskId: string,
    options: { state?: EffectState; pageSize?: number; pageToken?: string; namespace?: string } = {},
  ): Promise<[EffectRecord[], string]> {
    const request = pb.ListEffectsRequest.create({
      namespace: options.namespace ?? this.namespace,
      taskId,
      state: effectState(options.state),
      pageSize: options.pageSize ?? 100,
      pageToken: options.pageToken ?? "",
    });
    const response = await this.#unary<pb.ListEffectsRequest, pb.ListEffectsResponse>("listEffects", request, {
      taskId,
    });
    return [response.effects.map((e) => effectRecord(e)), response.nextPageToken];
  }

  /**
   * Claim a task, keep it renewed over one heartbeat stream, and trust it only until its trust
   * deadline (see {@link HeldLease}). Close the lease when done (`await lease.close()`, or
   * `await using lease = ...`), or use {@link withLease}.
   *
   * @throws NotAcquired - no `wait` and the task is held by another owner.
   * @throws ClaimTimeout - still held by another owner after `wait` seconds.
   * @throws TaskEnded | TaskQuarantined | InvalidArgument - refused.
   * @throws LeaseUnavailable | LeaseError - after retries within `wait` with the same request id.
   * @throws LeaseLost - the grant arrived after its own trust deadline (nothing was sent for it).
   */
  async hold(taskId: string, options: HoldOptions = {}): Promise<HeldLease> {
    const ttlS = options.ttl === undefined ? 30 : optionalSeconds(options.ttl, "ttl");
    const intervalS = optionalSeconds(options.heartbeatInterval, "heartbeatInterval");
    checkBeatInterval(intervalS, ttlS);
    const marginOption = optionalSeconds(options.safetyMargin, "safetyMargin");
    const result = await acquire(this, taskId, {
      ttlS,
      maxRuntimeS: optionalSeconds(options.maxRuntime, "maxRuntime"),
      waitS: optionalSeconds(options.wait, "wait"),
      maxAttempts: options.maxAttempts ?? 0,
    });
    try {
      const info = result.lease!;
      const leaseTtlS = ttlS ?? info.remainingTtl;
      const window = new TrustWindow(marginOption ?? defaultSafetyMargin(leaseTtlS), this.clock, info.runtimeDeadline);
      window.confirm(result.sendTime, info.remainingTtl, true, info.expireTime);
      if (window.expired()) {
        throw new LeaseLost(window.lossReason, info.taskId, info.fence, {
          message: `lease lost: the grant arrived after its trust deadline (${window.lossReason})`,
        });
      }
      const lease = new HeldLease(this, info, window, result.checkpoint);
      lease._keepRenewed(ttlS, beatIntervalS(intervalS, leaseTtlS));
      this.#leases.add(lease);
      return lease;
    } catch (error) {
      this._unmarkHeld(taskId);
      throw error;
    }
  }

  /**
   * Hold a task while `work(lease)` runs, then close the lease (release it unless `release` is
   * false). Pass `lease.signal` to the work: it is aborted the moment ownership is lost.
   *
   * @returns what `work` returned.
   * @throws LeaseLost - the lease was lost while the work ran (or it ended after the trust
   *   deadline): its work may have run without the lease. Thrown even when `work` resolved, and
   *   in place of the abort error `work` threw because of the loss.
   * @throws whatever `work` threw for another reason (the lease is released all the same), and
   *   what hold() throws.
   */
  async withLease<T>(
    taskId: string,
    options: HoldOptions & { release?: boolean },
    work: (lease: HeldLease) => Promise<T>,
  ): Promise<T> {
    const lease = await this.hold(taskId, options);
    let outcome: { ok: true; value: T } | { ok: false; error: unknown };
    try {
      outcome = { ok: true, value: await work(lease) };
    } catch (error) {
      outcome = { ok: false, error };
    }
    const loss = await lease.close({ release: options.release ?? true });
    if (loss !== null) {
      if (outcome.ok || isAbortFor(outcome.error, lease.signal)) throw loss;
    }
    if (!outcome.ok) throw outcome.error;
    return outcome.value;
  }

  /** @internal */
  _openHeartbeat(): ClientDuplexStream<pb.HeartbeatRequest, pb.HeartbeatResponse> {
    return this.stub.heartbeat(this.callMetadata());
  }

  /** @internal reserve `taskId` for one hold() of this client; false if already held. */
  _markHeld(taskId: string): boolean {
    if (this.#held.has(taskId)) return false;
    this.#held.add(taskId);
    return true;
  }

  /** @internal */
  _unmarkHeld(taskId: string): void {
    this.#held.delete(taskId);
  }

  /** @internal a lease of this client was closed. */
  _leaseClosed(lease: HeldLease): void {
    this.#leases.delete(lease);
  }

  /** @internal run `work` (which handles its own errors) as background work close() waits for. */
  _spawn(work: Promise<void>): void {
    if (this.#closing) return;
    const tracked = work.finally(() => this.#background.delete(tracked));
    this.#background.add(tracked);
  }

  /** @internal */
  _log(level: "warn" | "info", message: string): void {
    this.#logger[level]?.(message);
  }
}

/** True when `error` is what aborting `signal` made the work throw. */
function isAbortFor(error: unknown, signal: AbortSignal): boolean {
  if (!signal.aborted) return false;
  if (error === signal.reason || error instanceof LeaseLost) return true;
  return error instanceof Error && error.name === "AbortError";
}

function pem(value: string | Uint8Array | undefined): Buffer | null {
  return value === undefined ? null : Buffer.from(value);
}

function channelCredentials(options: LeaseClientOptions): ChannelCredentials {
  if (options.credentials !== undefined) return options.credentials;
  const tls = options.tls;
  if (tls === undefined || tls === false) return grpcCredentials.createInsecure();
  const o: TlsOptions = tls === true ? {} : tls;
  if ((o.key === undefined) !== (o.cert === undefined)) {
    throw InvalidArgument.local(o.key === undefined ? "tls.key" : "tls.cert", "mutual TLS needs both key and cert");
  }
  return grpcCredentials.createSsl(pem(o.ca), pem(o.key), pem(o.cert));
}
