/**
 * @leasekeeper/client: the Node.js client of leasekeeper.
 *
 * Workers hold leases on tasks and pass fences to their side effects:
 *
 * ```js
 * import { LeaseClient } from "@leasekeeper/client";
 *
 * const client = new LeaseClient({ namespace: "billing" });
 * await client.withLease("invoice-42", { ttl: 30, wait: 60 }, async (lease) => {
 *   await gateway.send(request, lease.metadata(), { signal: lease.signal });
 * });
 * client.close();
 * ```
 *
 * Durations are numbers of seconds; fences and checkpoint versions are bigint; instants are
 * Dates on the database clock.
 */
export { acquire, CLAIM_WAIT_MAX_S } from "./acquire.js";
export {
  CHANNEL_OPTIONS,
  DEFAULT_CALL_TIMEOUT_S,
  DEFAULT_NAMESPACE,
  DEFAULT_TARGET,
  defaultTarget,
  LeaseClient,
  TARGET_ENV,
  TOKEN_ENV,
  type ClaimOptions,
  type HoldOptions,
  type LeaseClientOptions,
  type TlsOptions,
} from "./client.js";
export {
  EffectRunner,
  Performed,
  RECONCILED_ABSENT,
  requestDigest,
  type EffectLease,
  type EffectOptions,
  type EffectOutcome,
  type EffectValue,
  type Reconcile,
} from "./effects.js";
export {
  AccessDenied,
  CheckpointNotNewer,
  ClaimTimeout,
  codeName,
  EffectAlreadyCompleted,
  EffectError,
  EffectFailed,
  EffectInDoubt,
  EffectKeyReused,
  EffectNotBegun,
  FENCE_MISSING,
  fromServiceError,
  InvalidArgument,
  LeaseError,
  LeaseLost,
  LeaseUnavailable,
  LimitExceeded,
  LOSS_REASONS,
  MissingFence,
  NotAcquired,
  StaleFence,
  TaskCancelled,
  TaskCompleted,
  TaskEnded,
  TaskFailed,
  TaskNotFound,
  TaskNotQuarantined,
  TaskQuarantined,
  type LossReason,
} from "./errors.js";
export {
  FENCE_CHECK_FAILED,
  FenceChecker,
  fenceFromMetadata,
  fenceInterceptor,
  fenceRefusal,
  FenceRef,
  METADATA_FENCE,
  METADATA_NAMESPACE,
  METADATA_TASK_ID,
  type FenceValidator,
} from "./fencing.js";
export { newOwnerId, newRequestId } from "./ids.js";
export { HeldLease, type LeaseState } from "./lease.js";
export { DOMAIN, richStatus, statusDetails, type StatusDetails } from "./status.js";
export { type Clock, defaultSafetyMargin, monotonic, TrustWindow, trustDeadline } from "./trust.js";
export type {
  BeginResult,
  Checkpoint,
  CheckpointLike,
  ClaimResult,
  EffectDecision,
  EffectPolicy,
  EffectRecord,
  EffectState,
  FenceCheck,
  HistoryEntry,
  LeaseInfo,
  RenewedLease,
  TaskEvent,
  TaskState,
} from "./types.js";
/**
 * The @grpc/grpc-js this package runs on. Make metadata, credentials, clients and servers that
 * meet the package's objects with it: grpc-js checks `instanceof`, and a second copy of it in a
 * project (another version) does not pass.
 */
export * as grpc from "@grpc/grpc-js";
/** The generated messages and grpc-js service definition of leasekeeper.v1 (ts-proto). */
export * as proto from "./gen/leasekeeper/v1/lease_service.js";
