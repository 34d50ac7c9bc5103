/**
 * Owner ids (one per worker incarnation) and request ids (one per logical claim).
 *
 * Two processes must never share an owner id. The request id tells a retry of a claim whose
 * reply was lost (the same lease back) from a new incarnation of the owner (a new fence): one
 * per logical claim, sent again unchanged with every retry of it (AIP-155).
 */
import { randomBytes, randomUUID } from "node:crypto";
import { hostname } from "node:os";

/** A fresh owner id, `"{hostname}-{pid}-{16 hex digits}"`: new on every call. */
export function newOwnerId(): string {
  const host = hostname().split(".", 1)[0] || "host";
  return `${host.slice(0, 64)}-${process.pid}-${randomBytes(8).toString("hex")}`;
}

/** A fresh request id for one logical claim: a UUID4 string (36 ASCII characters). */
export function newRequestId(): string {
  return randomUUID();
}
