/**
 * Saving a held lease's checkpoints (`lease.saveCheckpoint`), as the Python client does.
 *
 * While the lease's heartbeat stream is open a checkpoint rides on a beat of its own (no extra
 * call: the beat's renewal writes it); otherwise, and whenever the stream cannot say whether it
 * was stored, SaveCheckpoint decides (the same version written again with the same data answers
 * OK). Saves of one lease go one at a time. The server stores a checkpoint only from the owner
 * of the task's live current fence and only with a higher version, on the database clock.
 */
import { CheckpointNotNewer, InvalidArgument } from "./errors.js";
import type * as pb from "./gen/leasekeeper/v1/lease_service.js";
import { CheckpointNotCarried, type HeartbeatKeeper } from "./heartbeat.js";
import type { Checkpoint } from "./types.js";

/** The longest content type the server accepts (printable ASCII). */
export const CONTENT_TYPE_MAX_BYTES = 128;

/** What the writer needs of the client: SaveCheckpoint. */
export interface CheckpointCalls {
  saveCheckpoint(
    taskId: string,
    fence: bigint,
    version: bigint,
    data: Uint8Array,
    contentType: string,
  ): Promise<Checkpoint>;
}

function wellFormed(message: pb.Checkpoint): boolean {
  return message.version >= 1n && message.contentType.length <= CONTENT_TYPE_MAX_BYTES && /^[ -~]*$/.test(message.contentType);
}

export class CheckpointWriter {
  #knownVersion: bigint;
  #queue: Promise<unknown> = Promise.resolve();
  // A carried save that ended without its answer may still be stored: until SaveCheckpoint
  // has decided one, the stream is not trusted to tell this lease's save from that one.
  #unsure = false;
  // Data this long was refused (INVALID_ARGUMENT checkpoint.data): no longer is carried.
  #refusedBytes: number | null = null;

  constructor(
    private readonly client: CheckpointCalls,
    private readonly taskId: string,
    private readonly fence: bigint,
    granted: Checkpoint | null,
  ) {
    this.#knownVersion = granted?.version ?? 0n;
  }

  /** The stored version as this holder last heard it (0n: none). */
  knownVersion(stream: HeartbeatKeeper | null): bigint {
    const heard = stream?.storedCheckpointVersion ?? 0n;
    return heard > this.#knownVersion ? heard : this.#knownVersion;
  }

  /** Save one checkpoint, on `stream` when it can carry it, else by SaveCheckpoint. */
  save(message: pb.Checkpoint, stream: HeartbeatKeeper | null, check: () => void): Promise<Checkpoint> {
    const run = this.#queue.then(() => this.#save(message, stream, check));
    this.#queue = run.catch(() => undefined);
    return run;
  }

  async #save(message: pb.Checkpoint, stream: HeartbeatKeeper | null, check: () => void): Promise<Checkpoint> {
    check();
    const version = message.version;
    if (
      stream !== null &&
      !this.#unsure &&
      version > this.knownVersion(stream) &&
      wellFormed(message) &&
      (this.#refusedBytes === null || message.data.length < this.#refusedBytes)
    ) {
      const carried = await this.#carry(stream, message);
      if (carried !== null) return carried;
      check();
    }
    let saved: Checkpoint;
    try {
      saved = await this.client.saveCheckpoint(this.taskId, this.fence, version, message.data, message.contentType);
    } catch (error) {
      if (error instanceof CheckpointNotNewer) {
        this.#heard(error.currentVersion);
        this.#unsure = false;
      } else if (error instanceof InvalidArgument) {
        this.#unsure = false; // a checkpoint no beat could have stored either
        if (error.field === "checkpoint.data") {
          this.#refusedBytes = Math.min(message.data.length, this.#refusedBytes ?? message.data.length);
        }
      }
      throw error;
    }
    this.#heard(saved.version);
    this.#unsure = false;
    return saved;
  }

  async #carry(stream: HeartbeatKeeper, message: pb.Checkpoint): Promise<Checkpoint | null> {
    this.#unsure = true;
    let stored: bigint;
    let saved: boolean;
    try {
      [stored, saved] = await stream.carryCheckpoint(message);
    } catch (error) {
      if (error instanceof CheckpointNotCarried) return null;
      throw error;
    }
    this.#unsure = false;
    this.#heard(stored);
    if (saved) {
      // this very checkpoint is the stored one (the version alone cannot tell)
      return { version: message.version, data: message.data, contentType: message.contentType, fence: this.fence, writeTime: null };
    }
    if (stored >= message.version) throw CheckpointNotNewer.of(message.version, stored, this.taskId, this.fence);
    return null; // not stored, and nothing as high: a server that ignores beats' checkpoints
  }

  #heard(version: bigint): void {
    if (version > this.#knownVersion) this.#knownVersion = version;
  }
}
