/**
 * The effect side: carry a fence to every side-effect boundary and check it there.
 *
 * A worker passes `(namespace, taskId, fence)` with every call that has an effect, as gRPC
 * metadata (`lease.metadata()`: the keys `leasekeeper-namespace`, `leasekeeper-task-id` and
 * `leasekeeper-fence`, as the Python client sends them). The effect service reads them back
 * ({@link fenceFromMetadata}) and checks the fence right before the effect ({@link FenceChecker},
 * or {@link fenceInterceptor} for whole methods of a Node.js gRPC server).
 *
 * A check made before the effect leaves a window: the lease can be lost between the check and
 * the effect. For none, reserve the effect in the effect ledger (BeginEffect checks the fence in
 * the same transaction) or refuse lower fences in the effect's own store.
 */
import {
  Metadata,
  type MetadataValue,
  type ServerInterceptingCallInterface,
  type ServerInterceptor,
  ServerInterceptingCall,
  status as Code,
} from "@grpc/grpc-js";
import { codeName, FENCE_MISSING, InvalidArgument, LeaseError, MissingFence, StaleFence } from "./errors.js";
import { richStatus } from "./status.js";
import type { FenceCheck } from "./types.js";

export const METADATA_NAMESPACE = "leasekeeper-namespace";
export const METADATA_TASK_ID = "leasekeeper-task-id";
export const METADATA_FENCE = "leasekeeper-fence";
/** The reason of the UNAVAILABLE status fenceInterceptor sends when it cannot check a fence. */
export const FENCE_CHECK_FAILED = "FENCE_CHECK_FAILED";

/** The lease an effect is made under. */
export class FenceRef {
  constructor(
    readonly namespace: string,
    readonly taskId: string,
    readonly fence: bigint,
  ) {}

  /**
   * The three metadata entries that carry this reference: set on `into`, else on a new Metadata
   * of this package's grpc-js (pass your own `new grpc.Metadata()` when your stubs use another
   * copy of @grpc/grpc-js: grpc-js takes a Metadata of another copy for call options).
   */
  metadata<M extends Pick<Metadata, "set"> = Metadata>(into?: M): M {
    into ??= new Metadata() as unknown as M;
    into.set(METADATA_NAMESPACE, this.namespace);
    into.set(METADATA_TASK_ID, this.taskId);
    into.set(METADATA_FENCE, String(this.fence));
    return into;
  }
}

type MetadataLike = Metadata | Record<string, MetadataValue | MetadataValue[] | undefined>;

function values(metadata: MetadataLike | null | undefined, key: string): string[] {
  if (metadata === null || metadata === undefined) return [];
  let raw: Array<MetadataValue>;
  // A grpc-js Metadata, from this package's copy of grpc-js or another (duck-typed).
  if (typeof (metadata as Metadata).get === "function" && typeof (metadata as Metadata).getMap === "function") {
    raw = (metadata as Metadata).get(key);
  } else {
    const found = Object.entries(metadata).find(([k]) => k.toLowerCase() === key)?.[1];
    raw = found === undefined ? [] : Array.isArray(found) ? found : [found];
  }
  return raw.map((v) => (typeof v === "string" ? v : Buffer.from(v).toString("utf8")));
}

/**
 * Read `(namespace, taskId, fence)` from gRPC metadata (a grpc-js Metadata or a plain object).
 *
 * @throws MissingFence - a key is absent, empty, repeated with different values, or the fence is
 *   not an integer >= 1 (the error names the key).
 */
export function fenceFromMetadata(metadata: MetadataLike | null | undefined): FenceRef {
  const read: Record<string, string> = {};
  for (const key of [METADATA_NAMESPACE, METADATA_TASK_ID, METADATA_FENCE]) {
    const found = values(metadata, key);
    if (new Set(found).size > 1) throw new MissingFence(key, "repeated with different values");
    if (!found[0]) throw new MissingFence(key);
    read[key] = found[0];
  }
  const fenceText = read[METADATA_FENCE]!.trim();
  if (!/^[0-9]+$/.test(fenceText) || BigInt(fenceText) < 1n) {
    throw new MissingFence(METADATA_FENCE, `not an integer >= 1: ${JSON.stringify(fenceText.slice(0, 32))}`);
  }
  return new FenceRef(read[METADATA_NAMESPACE]!, read[METADATA_TASK_ID]!, BigInt(fenceText));
}

/** What a fence checker needs: ValidateFence (a LeaseClient). */
export interface FenceValidator {
  validateFence(taskId: string, fence: bigint | number, options?: { namespace?: string }): Promise<FenceCheck>;
}

/** Checks fences with ValidateFence, right before an effect. */
export class FenceChecker {
  /** @param client - a LeaseClient (its namespace is not used: each check names its own). */
  constructor(private readonly client: FenceValidator) {}

  /**
   * Check that `fence` may act now (database clock). Changes no lease.
   *
   * @throws StaleFence - the fence is not current and live; `reason` says why.
   * @throws LeaseUnavailable - the fence could not be checked: treat the effect as refused.
   */
  async check(namespace: string, taskId: string, fence: bigint): Promise<FenceCheck> {
    const answer = await this.client.validateFence(taskId, fence, { namespace });
    if (!answer.valid) {
      throw new StaleFence(answer.reason ?? "FENCE_UNKNOWN", answer.currentFence, namespace, taskId, fence);
    }
    return answer;
  }

  checkRef(ref: FenceRef): Promise<FenceCheck> {
    return this.check(ref.namespace, ref.taskId, ref.fence);
  }

  /** Read the fence from metadata and check it (MissingFence, StaleFence, LeaseUnavailable). */
  async checkMetadata(metadata: MetadataLike | null | undefined): Promise<FenceCheck> {
    return this.checkRef(fenceFromMetadata(metadata));
  }
}

/** The status a refused call ends with, as the Python client's FenceInterceptor sends it. */
export function fenceRefusal(error: unknown) {
  if (error instanceof MissingFence) return richStatus(Code.ABORTED, error.message, FENCE_MISSING, error.metadata);
  if (error instanceof StaleFence) return richStatus(Code.ABORTED, error.message, error.reason, error.metadata);
  if (error instanceof InvalidArgument) {
    return richStatus(Code.INVALID_ARGUMENT, error.message, "INVALID_ARGUMENT", { field: error.field ?? "" });
  }
  const cause = error instanceof LeaseError ? (error.reason ?? codeName(error.code)) : "UNKNOWN";
  return richStatus(Code.UNAVAILABLE, `fence could not be checked: ${cause}`, FENCE_CHECK_FAILED, { cause });
}

/**
 * A grpc-js server interceptor that refuses calls whose fence may not act, before their handler
 * runs: `new grpc.Server({ interceptors: [fenceInterceptor(new FenceChecker(client))] })`.
 *
 * For each protected method it reads the three metadata keys and asks ValidateFence. Refusals
 * (the handler never runs), each with a leasekeeper ErrorInfo:
 * - ABORTED `FENCE_MISSING` (metadata `key`): a key is absent or malformed;
 * - ABORTED with the loss reason (`LEASE_SUPERSEDED`, ...; metadata `current_fence`, `fence`,
 *   `namespace`, `task_id`): a stale fence;
 * - INVALID_ARGUMENT (metadata `field`): the lease service refused the namespace or task id;
 * - UNAVAILABLE `FENCE_CHECK_FAILED` (metadata `cause`): the lease service could not answer
 *   (fail closed).
 *
 * This is the check-just-before pattern; a handler that wants no window re-checks the fence
 * atomically in its own store, or uses the effect ledger. Server interceptors need
 * @grpc/grpc-js 1.10 or later.
 *
 * @param checker - the fence checker.
 * @param options.methods - full method paths to protect ("/demo.v1.Gateway/Send"); all when absent.
 */
export function fenceInterceptor(checker: FenceChecker, options: { methods?: Iterable<string> } = {}): ServerInterceptor {
  const methods = options.methods === undefined ? null : new Set(options.methods);
  return (descriptor, call: ServerInterceptingCallInterface) => {
    if (methods !== null && !methods.has(descriptor.path)) return new ServerInterceptingCall(call);
    return new ServerInterceptingCall(call, {
      start: (next) => {
        next({
          onReceiveMetadata: (metadata, pass) => {
            // Messages that arrive meanwhile wait in grpc-js until `pass` is called.
            checker.checkMetadata(metadata).then(
              () => pass(metadata),
              (error: unknown) => call.sendStatus(fenceRefusal(error)),
            );
          },
        });
      },
    });
  };
}
