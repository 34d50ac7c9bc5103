/** The client as the lease, its effects and its checkpoints see it (a type only: no import cycle at run time). */
export type { LeaseClient as LeaseClientLike } from "./client.js";
