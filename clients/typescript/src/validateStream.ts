/**
 * One ValidateFences stream per client, shared by its validateFence() calls.
 *
 * An effect service validates a fence before every effect (FenceChecker, fenceInterceptor). On a
 * stream each check costs the server a fraction of a unary ValidateFence, and every answer is
 * still decided on the database clock after the server received the check (the proto's
 * ValidateFences). The Python client's `_validate_stream` works the same way.
 *
 * {@link FenceStream} opens the stream on the first check and keeps it open. Each check gets an
 * id; the checks made before the event loop's next turn (concurrent calls) go out in one message,
 * at most {@link MAX_CHECKS_PER_MESSAGE} a message. Each answer goes to the call waiting for its
 * id: its response, or its error translated as a unary call's would be (fromServiceError).
 *
 * When the stream ends (the server stopped, the connection broke, the token was revoked), every
 * check still waiting fails: LeaseUnavailable (safe to retry), or AccessDenied for a token
 * refused, never an answer of another check. The next check opens a new stream. A server without
 * ValidateFences (UNIMPLEMENTED: an older version) is asked with the unary ValidateFence from
 * then on.
 */
import { type ClientDuplexStream, Metadata, type ServiceError, status as Code } from "@grpc/grpc-js";
import { fromServiceError, LeaseError, LeaseUnavailable } from "./errors.js";
import { Status } from "./gen/google/rpc/status.js";
import * as pb from "./gen/leasekeeper/v1/lease_service.js";
import { STATUS_DETAILS_KEY } from "./status.js";

/** The most checks in one message (the server's limit, the proto's ValidateFencesRequest). */
export const MAX_CHECKS_PER_MESSAGE = 1000;

type Call = ClientDuplexStream<pb.ValidateFencesRequest, pb.ValidateFencesResponse>;

interface Waiting {
  resolve(response: pb.ValidateFenceResponse): void;
  reject(error: Error): void;
  taskId: string;
  fence: bigint;
}

/** The server has no ValidateFences: ask with the unary call. */
class Unimplemented extends Error {}

/** The client error for a check answered with `status` (a serialized google.rpc.Status). */
export function checkError(status: Uint8Array, taskId: string, fence: bigint): LeaseError {
  let decoded: Status;
  try {
    decoded = Status.decode(status);
  } catch {
    // undecodable: an error all the same, never an answer
    return fromServiceError({ code: Code.UNKNOWN, details: "undecodable status", metadata: new Metadata() });
  }
  const metadata = new Metadata();
  metadata.set(STATUS_DETAILS_KEY, Buffer.from(status));
  return fromServiceError({ code: decoded.code, details: decoded.message, metadata }, { taskId, fence });
}

/** What a check still waiting when its stream ended fails with (one error per caller). */
function streamEnded(error: ServiceError | Error | null): Error {
  if (error !== null && "code" in error && typeof error.code === "number") {
    if (error.code === Code.UNIMPLEMENTED) return new Unimplemented();
    const translated = fromServiceError(error);
    if (error.code === Code.UNAUTHENTICATED || error.code === Code.PERMISSION_DENIED) {
      return translated; // AccessDenied: the token, not the network
    }
    return notValidated(`${Code[error.code]}: ${error.details}`, translated.reason);
  }
  return notValidated(error === null ? "the server ended it" : error.message, null);
}

function notValidated(cause: string, reason: string | null): LeaseUnavailable {
  return new LeaseUnavailable(
    `the ValidateFences stream ended (${cause}) before this check was answered: it was not validated`,
    { code: Code.UNAVAILABLE, reason },
  );
}

/** One open ValidateFences call: its checks waiting for answers. */
class Stream {
  ended = false;
  readonly #call: Call;
  readonly #waiting = new Map<bigint, Waiting>();
  #outbox: pb.ValidateFencesRequest_Check[] = [];
  #flushing = false;

  constructor(call: Call) {
    this.#call = call;
    call.on("data", (message: pb.ValidateFencesResponse) => {
      for (const answer of message.answers) {
        const waiting = this.#waiting.get(answer.id);
        if (waiting === undefined) continue; // its caller stopped waiting
        this.#waiting.delete(answer.id);
        if (answer.response !== undefined) waiting.resolve(answer.response);
        else waiting.reject(checkError(answer.error ?? new Uint8Array(), waiting.taskId, waiting.fence));
      }
    });
    call.on("error", (error: ServiceError) => this.#end(error));
    call.on("end", () => this.#end(null));
  }

  /** Queues a check; the promise gets its response, or fails with the check's error. */
  send(id: bigint, request: pb.ValidateFenceRequest, taskId: string, fence: bigint): Promise<pb.ValidateFenceResponse> {
    return new Promise((resolve, reject) => {
      this.#waiting.set(id, { resolve, reject, taskId, fence });
      this.#outbox.push({ id, request });
      if (!this.#flushing) {
        this.#flushing = true;
        // The checks made before the loop's next turn join this message.
        setImmediate(() => this.#flush());
      }
    });
  }

  /** Drops a check whose caller stopped waiting (timed out). */
  forget(id: bigint): void {
    this.#waiting.delete(id);
  }

  #flush(): void {
    this.#flushing = false;
    while (this.#outbox.length > 0 && !this.ended) {
      const checks = this.#outbox.splice(0, MAX_CHECKS_PER_MESSAGE);
      this.#call.write(pb.ValidateFencesRequest.create({ checks }));
    }
  }

  /** Marks the stream ended; every check still waiting fails (never answered by another). */
  #end(error: ServiceError | Error | null): void {
    if (this.ended) return;
    this.ended = true;
    const waiting = [...this.#waiting.values()];
    this.#waiting.clear();
    this.#outbox = [];
    for (const check of waiting) check.reject(streamEnded(error));
    this.#call.cancel();
  }

  /** Ends the call; checks still waiting fail. */
  close(): void {
    this.#end(new LeaseError("the client closed its ValidateFences stream"));
  }
}

/** ValidateFence checks over one ValidateFences stream, opened on first use. */
export class FenceStream {
  readonly #open: () => Call;
  readonly #unary: (request: pb.ValidateFenceRequest) => Promise<pb.ValidateFenceResponse>;
  readonly #timeoutS: number | null;
  #ids = 0n;
  #stream: Stream | null = null;
  #unsupported = false;

  /**
   * @param open - opens the call, with the client's metadata (its token).
   * @param unary - the unary ValidateFence, for a server without ValidateFences (UNIMPLEMENTED).
   * @param timeoutS - how long a check waits for its answer, seconds; null: no limit.
   */
  constructor(
    open: () => Call,
    unary: (request: pb.ValidateFenceRequest) => Promise<pb.ValidateFenceResponse>,
    timeoutS: number | null,
  ) {
    this.#open = open;
    this.#unary = unary;
    this.#timeoutS = timeoutS;
  }

  /**
   * The answer to one check.
   *
   * @throws InvalidArgument | AccessDenied | LeaseUnavailable | LeaseError - the check's own error,
   *   as the unary call would throw it.
   * @throws LeaseUnavailable - the stream ended before the answer came (not validated; safe to
   *   retry: the next check opens a new stream).
   * @throws LeaseError - DEADLINE_EXCEEDED: no answer within the timeout.
   */
  async validate(request: pb.ValidateFenceRequest, taskId: string, fence: bigint): Promise<pb.ValidateFenceResponse> {
    if (this.#unsupported) return this.#unary(request);
    let stream = this.#stream;
    if (stream === null || stream.ended) stream = this.#stream = new Stream(this.#open());
    this.#ids += 1n;
    const id = this.#ids;
    const answer = stream.send(id, request, taskId, fence);
    answer.catch(() => {}); // read below, or dropped after a timeout
    let timer: NodeJS.Timeout | undefined;
    try {
      if (this.#timeoutS === null) return await answer;
      const timeoutS = this.#timeoutS;
      const timedOut = new Promise<never>((_, reject) => {
        timer = setTimeout(
          () => reject(new LeaseError(`no answer to the fence check within ${timeoutS} s`, { code: Code.DEADLINE_EXCEEDED })),
          timeoutS * 1000,
        );
      });
      return await Promise.race([answer, timedOut]);
    } catch (error) {
      if (!(error instanceof Unimplemented)) throw error;
      this.#unsupported = true; // an older server: the unary call from now on
      return this.#unary(request);
    } finally {
      clearTimeout(timer);
      stream.forget(id);
    }
  }

  /** Closes the open stream, if any; checks still waiting fail. */
  close(): void {
    const stream = this.#stream;
    this.#stream = null;
    stream?.close();
  }
}
