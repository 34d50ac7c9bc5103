// The reason of a failed gRPC call: the google.rpc.ErrorInfo in its status details.
//
// leasekeeper (and the demo gateway) end every failed call with exactly one ErrorInfo in the
// `grpc-status-details-bin` trailer (a serialized google.rpc.Status). Clients match on its
// `reason` (LEASE_SUPERSEDED, LEASE_EXPIRED, ...), never on the message text.
import protobuf from "protobufjs";

// The messages of googleapis' google/rpc/status.proto and error_details.proto (and
// google/protobuf/any.proto) needed here, field numbers as published there.
const RPC_TYPES = new protobuf.Root();
protobuf.parse(
  `syntax = "proto3";
  package google.protobuf;
  message Any {
    string type_url = 1;
    bytes value = 2;
  }`,
  RPC_TYPES,
  { keepCase: true },
);
protobuf.parse(
  `syntax = "proto3";
  package google.rpc;
  message Status {
    int32 code = 1;
    string message = 2;
    repeated google.protobuf.Any details = 3;
  }
  message ErrorInfo {
    string reason = 1;
    string domain = 2;
    map<string, string> metadata = 3;
  }`,
  RPC_TYPES,
  { keepCase: true },
);
const Status = RPC_TYPES.lookupType("google.rpc.Status");
const ErrorInfo = RPC_TYPES.lookupType("google.rpc.ErrorInfo");
const ERROR_INFO_URL = "type.googleapis.com/google.rpc.ErrorInfo";

/**
 * The ErrorInfo of a call's final status, if it carries one.
 *
 * @param {import("@grpc/grpc-js").Metadata | undefined} metadata The status's trailing metadata.
 * @returns {{reason: string, domain: string, metadata: Record<string, string>} | null}
 */
export function errorInfo(metadata) {
  const [raw] = metadata?.get("grpc-status-details-bin") ?? [];
  if (!Buffer.isBuffer(raw)) return null;
  const status = Status.decode(raw);
  const detail = status.details.find((any) => any.type_url === ERROR_INFO_URL);
  if (!detail) return null;
  const info = ErrorInfo.toObject(ErrorInfo.decode(detail.value), { defaults: true });
  return { reason: info.reason, domain: info.domain, metadata: info.metadata ?? {} };
}

/**
 * A failed call's status as one JSON-friendly object.
 *
 * @param {{code: number, details: string, metadata?: import("@grpc/grpc-js").Metadata}} status
 * @param {typeof import("@grpc/grpc-js").status} codes grpc-js's status code enum.
 * @returns {{code: string, reason: string | null, details: string}}
 */
export function describeStatus(status, codes) {
  const info = errorInfo(status.metadata);
  const code = codes[status.code] ?? String(status.code);
  return { code, reason: info?.reason ?? null, details: status.details };
}
