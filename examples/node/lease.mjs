// A lease on one task from leasekeeper, kept alive by the Heartbeat stream, with its trust
// deadline on this process's monotonic clock.
//
// The proto is the contract: it is loaded at run time from protos/ (no generated or copied
// stubs). Durations are in seconds in this module's API.
//
// The lease counts as lost at the first of:
//   * the server ending the Heartbeat stream with ABORTED (the reason: LEASE_SUPERSEDED,
//     LEASE_EXPIRED, LEASE_REVOKED, ...), pushed as soon as ownership ends;
//   * the trust deadline: send time of the last confirmed request + its remaining_ttl - a
//     safety margin, on performance.now(); past it, no renewal has been confirmed in time and
//     the worker must assume another owner may hold the task, even if the connection looks fine.
// UNAVAILABLE (a server shutting down, a replica gone) is not a loss: the stream is opened again
// with the same fence until the trust deadline.
//
// A task's checkpoint (its saved progress) comes back with the grant: claim() returns it, and a
// worker resumes after it. saveCheckpoint() stores a newer one under the live lease; the server
// refuses a version that does not move forward (CHECKPOINT_NOT_NEWER) and a fence that may no
// longer act (ABORTED with the loss reason), so a stale worker cannot overwrite its successor's.
import { randomUUID } from "node:crypto";
import { EventEmitter } from "node:events";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

import { describeStatus } from "./status.mjs";

const HERE = dirname(fileURLToPath(import.meta.url));
/** The protos folder of the leasekeeper checkout this example lives in. */
export const DEFAULT_PROTO_ROOT = resolve(HERE, "..", "..", "protos");
const SERVICE_PROTO = "leasekeeper/v1/lease_service.proto";
const CALL_TIMEOUT_S = 10;
const RESUME_DELAY_S = 0.2;

/** Seconds as a google.protobuf.Duration. */
export function duration(seconds) {
  const whole = Math.floor(seconds);
  return { seconds: String(whole), nanos: Math.round((seconds - whole) * 1e9) };
}

/** A google.protobuf.Duration (int64 seconds as a string) in seconds. */
export function seconds(value) {
  return value ? Number(value.seconds) + value.nanos / 1e9 : 0;
}

/** The default safety margin for a lease of `ttlS` seconds: min(1 s, ttl / 10), as in Python. */
export function defaultSafetyMargin(ttlS) {
  return Math.min(1, Math.max(ttlS, 0) / 10);
}

/**
 * The LeaseService client, made from the proto at run time.
 *
 * @param {string} target host:port of leasekeeper.
 * @param {string} protoRoot The folder holding leasekeeper/v1/lease_service.proto.
 */
export function leaseServiceClient(target, protoRoot = DEFAULT_PROTO_ROOT) {
  const definition = protoLoader.loadSync(SERVICE_PROTO, {
    includeDirs: [protoRoot],
    keepCase: true, // field names as in the proto: task_id, remaining_ttl
    longs: String, // int64 fences exactly, as decimal strings
    enums: String, // LossReason and TaskState by name
    defaults: true,
  });
  const { LeaseService } = grpc.loadPackageDefinition(definition).leasekeeper.v1;
  return new LeaseService(target, grpc.credentials.createInsecure());
}

/** Call metadata: `authorization: Bearer <token>` when a token is given. */
export function authMetadata(token) {
  const metadata = new grpc.Metadata();
  if (token) metadata.set("authorization", `Bearer ${token}`);
  return metadata;
}

function callOptions(timeoutS = CALL_TIMEOUT_S) {
  return { deadline: new Date(Date.now() + timeoutS * 1000) };
}

function unary(client, method, request, token, timeoutS) {
  return new Promise((resolvePromise, reject) => {
    client[method](request, authMetadata(token), callOptions(timeoutS), (error, response) =>
      error ? reject(error) : resolvePromise(response),
    );
  });
}

/**
 * One claim of a task.
 *
 * @param {object} client A leaseServiceClient.
 * @param {{namespace: string, taskId: string, ownerId: string, ttlS: number, waitS?: number,
 *   token?: string}} args ttlS: lease length in seconds; waitS: how long the server may wait
 *   for the task to become claimable (seconds, 0: answer at once).
 * @returns {Promise<{acquired: boolean, lease: object, checkpoint: object | null,
 *   sendTime: number, response: object}>} checkpoint: the task's Checkpoint ({version, data,
 *   content_type, fence, write_time}; data a Buffer) when acquired and one was ever saved, read
 *   with the grant: resume after it. sendTime is performance.now() (milliseconds) when the
 *   claim was sent.
 * @throws A grpc-js ServiceError: FAILED_PRECONDITION (TASK_COMPLETED, TASK_CANCELLED,
 *   TASK_FAILED, TASK_QUARANTINED), INVALID_ARGUMENT, UNAVAILABLE, UNAUTHENTICATED,
 *   PERMISSION_DENIED.
 */
export async function claim(client, { namespace, taskId, ownerId, ttlS, waitS = 0, token }) {
  const request = {
    namespace,
    task_id: taskId,
    owner_id: ownerId,
    ttl: duration(ttlS),
    request_id: randomUUID(), // one logical claim (AIP-155); a retry would send it again
  };
  if (waitS > 0) request.wait = duration(waitS);
  const sendTime = performance.now();
  const response = await unary(client, "Claim", request, token, CALL_TIMEOUT_S + waitS);
  const { acquired, lease, checkpoint } = response;
  return { acquired, lease, checkpoint: acquired ? checkpoint : null, sendTime, response };
}

/**
 * Save the task's checkpoint under a live lease (SaveCheckpoint; does not renew the lease).
 * Idempotent: the stored version sent again by the same fence with the same data answers OK.
 *
 * @param {object} client A leaseServiceClient.
 * @param {object} lease The Lease the claim granted (its namespace, task, owner and fence).
 * @param {{version: number, data: Buffer | string, contentType?: string}} checkpoint version:
 *   >= 1 and higher than the stored one; data: at most the server's max_checkpoint_bytes
 *   (256 KiB by default).
 * @returns {Promise<object>} The stored Checkpoint (without its data), with its fence.
 * @throws A grpc-js ServiceError: ABORTED with the loss reason (LEASE_SUPERSEDED, LEASE_EXPIRED,
 *   TASK_CANCELLED, ...): nothing stored; FAILED_PRECONDITION CHECKPOINT_NOT_NEWER (ErrorInfo
 *   metadata current_version): nothing stored; INVALID_ARGUMENT, UNAVAILABLE.
 */
export async function saveCheckpoint(client, lease, checkpoint, token) {
  const { namespace, task_id, owner_id, fence } = lease;
  const { version, data, contentType: content_type = "" } = checkpoint;
  const request = { namespace, task_id, owner_id, fence };
  request.checkpoint = { version: String(version), data: Buffer.from(data), content_type };
  return (await unary(client, "SaveCheckpoint", request, token)).checkpoint;
}

/**
 * Release a lease (idempotent for the same fence).
 *
 * @throws A grpc-js ServiceError: ABORTED (LEASE_SUPERSEDED, NOT_OWNER, ...), UNAVAILABLE.
 */
export function release(client, lease, token) {
  const { namespace, task_id, owner_id, fence } = lease;
  return unary(client, "Release", { namespace, task_id, owner_id, fence }, token);
}

/**
 * A held lease kept alive by one Heartbeat stream, beating every ttl/3.
 *
 * Events:
 *   "renewed" ({fence, remaining_ttl_s, renewed, trust_remaining_s}) for each heartbeat reply;
 *   "lost" ({reason, by}) once: by "stream" (reason from the server's ErrorInfo) or
 *     "trust_deadline" (reason TRUST_DEADLINE_PASSED);
 *   "stream_end" ({code, reason, details}) when a stream ends (also after "lost");
 *   "resuming" ({code}) when a stream ended UNAVAILABLE and is opened again.
 */
export class HeldLease extends EventEmitter {
  /**
   * @param {object} client A leaseServiceClient.
   * @param {object} lease The Lease the claim granted.
   * @param {{ttlS: number, sendTime: number, safetyMarginS?: number, token?: string}} options
   *   sendTime: performance.now() when the claim was sent; safetyMarginS: seconds subtracted
   *   from every confirmed remaining ttl (default min(1, ttl / 10)).
   */
  constructor(client, lease, { ttlS, sendTime, safetyMarginS, token }) {
    super();
    this.client = client;
    this.lease = lease;
    this.ttlS = ttlS;
    this.token = token;
    this.marginMs = 1000 * (safetyMarginS ?? defaultSafetyMargin(ttlS));
    this.lostReason = null;
    this.stopped = false;
    this.stream = null;
    this.streamOpen = false;
    this.endStatus = null;
    this.sendTimes = []; // send times of beats not yet answered, oldest first
    this.deadline = null;
    this.confirmedSendTime = null;
    this.beatTimer = null;
    this.trustTimer = null;
    this.confirm(sendTime, seconds(lease.remaining_ttl), true);
  }

  /** The fence and task as gRPC metadata for an effect service. */
  fenceMetadata() {
    const metadata = new grpc.Metadata();
    metadata.set("leasekeeper-namespace", this.lease.namespace);
    metadata.set("leasekeeper-task-id", this.lease.task_id);
    metadata.set("leasekeeper-fence", String(this.lease.fence));
    return metadata;
  }

  /** Seconds until the trust deadline (<= 0 once passed). */
  trustRemainingS() {
    return (this.deadline - performance.now()) / 1000;
  }

  /** Open the Heartbeat stream and start beating. */
  start() {
    this.openStream();
    this.beatTimer = setInterval(() => this.beat(), (this.ttlS / 3) * 1000);
    return this;
  }

  /** Stop beating and half-close the stream (the lease stays HELD until released or expired). */
  stop() {
    this.stopped = true;
    clearInterval(this.beatTimer);
    clearTimeout(this.trustTimer);
    this.stream?.end();
  }

  /**
   * Resolves with the stream's final status once it ends, or null after `timeoutS` seconds.
   */
  streamEnd(timeoutS) {
    if (this.endStatus) return Promise.resolve(this.endStatus);
    return new Promise((resolvePromise) => {
      const timer = setTimeout(() => resolvePromise(null), timeoutS * 1000);
      this.once("stream_end", (status) => {
        clearTimeout(timer);
        resolvePromise(status);
      });
    });
  }

  confirm(sendTime, remainingTtlS, renewed) {
    // Same rules as the Python client's TrustWindow: an answer to an older request is stale;
    // an answer made without a database write (renewed=false) never extends the deadline.
    if (this.confirmedSendTime !== null && sendTime < this.confirmedSendTime) return;
    const candidate = sendTime + remainingTtlS * 1000 - this.marginMs;
    if (!renewed && this.deadline !== null && candidate > this.deadline) return;
    this.deadline = candidate;
    this.confirmedSendTime = sendTime;
    clearTimeout(this.trustTimer);
    const waitMs = Math.max(0, candidate - performance.now());
    this.trustTimer = setTimeout(() => this.checkTrust(), waitMs);
  }

  checkTrust() {
    if (this.lostReason !== null) return;
    if (performance.now() >= this.deadline) {
      this.lose("TRUST_DEADLINE_PASSED", "trust_deadline");
    } else {
      this.trustTimer = setTimeout(() => this.checkTrust(), this.deadline - performance.now());
    }
  }

  lose(reason, by) {
    if (this.lostReason !== null) return;
    this.lostReason = reason;
    clearInterval(this.beatTimer);
    clearTimeout(this.trustTimer);
    this.emit("lost", { reason, by });
  }

  openStream() {
    const stream = this.client.Heartbeat(authMetadata(this.token));
    this.stream = stream;
    this.streamOpen = true;
    this.endStatus = null;
    this.sendTimes = [];
    stream.on("data", (reply) => {
      if (stream !== this.stream) return; // a stream ended UNAVAILABLE and since replaced
      const sendTime = this.sendTimes.shift();
      if (sendTime === undefined || this.lostReason !== null) return;
      const remainingTtlS = seconds(reply.remaining_ttl);
      this.confirm(sendTime, remainingTtlS, reply.renewed);
      this.emit("renewed", {
        fence: reply.fence,
        remaining_ttl_s: remainingTtlS,
        renewed: reply.renewed,
        trust_remaining_s: Math.round(this.trustRemainingS() * 1000) / 1000,
      });
    });
    stream.on("error", () => {}); // the same outcome arrives as "status"
    stream.on("status", (status) => this.onStreamEnd(stream, status));
    const { namespace, task_id, owner_id, fence } = this.lease;
    this.write({ namespace, task_id, owner_id, fence, ttl: duration(this.ttlS) });
  }

  onStreamEnd(stream, status) {
    const ended = describeStatus(status, grpc.status);
    if (stream === this.stream) {
      this.streamOpen = false;
      this.endStatus = ended;
    }
    this.emit("stream_end", ended);
    if (this.lostReason !== null || stream !== this.stream) return;
    if (status.code === grpc.status.ABORTED) {
      this.lose(ended.reason ?? "ABORTED", "stream");
    } else if (status.code === grpc.status.UNAVAILABLE) {
      // Not a loss: the lease lives on in the database. Resume with the same fence; the trust
      // deadline still decides if no renewal gets through in time.
      this.emit("resuming", { code: ended.code });
      const resume = () => this.lostReason === null && !this.stopped && this.openStream();
      setTimeout(resume, RESUME_DELAY_S * 1000);
    } else if (status.code !== grpc.status.OK || !this.stopped) {
      this.lose(ended.reason ?? `STREAM_ENDED_${ended.code}`, "stream");
    }
  }

  beat() {
    if (this.lostReason === null && this.streamOpen) this.write({ ttl: duration(this.ttlS) });
  }

  write(message) {
    this.sendTimes.push(performance.now());
    this.stream.write(message);
  }
}
