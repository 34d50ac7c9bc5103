/**
 * The rich status of a failed call: the `google.rpc.Status` in the `grpc-status-details-bin`
 * trailer, with its `ErrorInfo` (domain "leasekeeper"), `BadRequest` and `RetryInfo`.
 *
 * Decoding never throws: a trailer that is absent or does not parse reads as no details.
 */
import { Metadata, type StatusObject } from "@grpc/grpc-js";
import { Any } from "./gen/google/protobuf/any.js";
import { BadRequest, ErrorInfo, RetryInfo } from "./gen/google/rpc/error_details.js";
import { Status } from "./gen/google/rpc/status.js";

/** The `ErrorInfo.domain` of every leasekeeper error. */
export const DOMAIN = "leasekeeper";
export const STATUS_DETAILS_KEY = "grpc-status-details-bin";

const TYPE_PREFIX = "type.googleapis.com/";
const ERROR_INFO = `${TYPE_PREFIX}google.rpc.ErrorInfo`;
const BAD_REQUEST = `${TYPE_PREFIX}google.rpc.BadRequest`;
const RETRY_INFO = `${TYPE_PREFIX}google.rpc.RetryInfo`;

/** What a failed call's rich status says. */
export interface StatusDetails {
  /** The leasekeeper ErrorInfo reason, or null when the status carried none. */
  reason: string | null;
  /** The ErrorInfo metadata (dynamic values as strings). */
  metadata: Record<string, string>;
  /** `[field, description]` pairs from google.rpc.BadRequest. */
  fieldViolations: Array<[string, string]>;
  /** google.rpc.RetryInfo's delay in seconds, or null. */
  retryDelay: number | null;
}

/** The details of a failed call's trailers (a grpc-js ServiceError's or StatusObject's metadata). */
export function statusDetails(metadata: Metadata | undefined | null): StatusDetails {
  const details: StatusDetails = { reason: null, metadata: {}, fieldViolations: [], retryDelay: null };
  const raw = metadata?.get(STATUS_DETAILS_KEY)?.[0];
  if (raw === undefined || typeof raw === "string") return details;
  let status: Status;
  try {
    status = Status.decode(raw);
  } catch {
    return details; // a malformed trailer is treated as absent
  }
  for (const detail of status.details) {
    try {
      if (detail.typeUrl === ERROR_INFO) {
        const info = ErrorInfo.decode(detail.value);
        if (info.domain === DOMAIN && details.reason === null) {
          details.reason = info.reason;
          details.metadata = { ...info.metadata };
        }
      } else if (detail.typeUrl === BAD_REQUEST) {
        for (const v of BadRequest.decode(detail.value).fieldViolations) {
          details.fieldViolations.push([v.field, v.description]);
        }
      } else if (detail.typeUrl === RETRY_INFO) {
        const delay = RetryInfo.decode(detail.value).retryDelay;
        if (delay) details.retryDelay = Number(delay.seconds) + delay.nanos / 1e9;
      }
    } catch {
      // one undecodable detail does not hide the others
    }
  }
  return details;
}

/**
 * A status to end a call with, carrying one leasekeeper ErrorInfo (as the server's own errors
 * do), for a Node.js gRPC service's refusals.
 *
 * @param code - the gRPC status code.
 * @param message - the status message.
 * @param reason - the ErrorInfo reason, e.g. "LEASE_SUPERSEDED".
 * @param metadata - the ErrorInfo metadata.
 */
export function richStatus(
  code: number,
  message: string,
  reason: string,
  metadata: Record<string, string> = {},
): StatusObject {
  const info = ErrorInfo.encode({ reason, domain: DOMAIN, metadata }).finish();
  const status = Status.encode({
    code,
    message,
    details: [Any.fromPartial({ typeUrl: ERROR_INFO, value: Buffer.from(info) })],
  }).finish();
  const trailers = new Metadata();
  trailers.set(STATUS_DETAILS_KEY, Buffer.from(status));
  return { code, details: message, metadata: trailers };
}
