// The TypeScript client's conformance driver: commands in on stdin, events out on stdout.
//
// A small worker built on @leasekeeper/client (clients/typescript, built to dist/), steered one
// JSON line at a time by the conformance runner; conformance/PROTOCOL.md is the contract every
// client's driver keeps, and drivers/python_driver.py the reference this mirrors command for
// command. Environment: LEASEKEEPER_TARGET, LEASEKEEPER_TOKEN, LEASEKEEPER_NAMESPACE and
// CONFORMANCE_OUTSIDE_DIR.
//
// Run: `node conformance/drivers/ts_driver.mjs` (it waits for commands), after
// `cd clients/typescript && npm ci && npm run build`.
import { appendFileSync, existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { createInterface } from "node:readline";

import {
  ClaimTimeout,
  codeName,
  EffectFailed,
  EffectInDoubt,
  LeaseClient,
  LeaseError,
  LeaseLost,
  NotAcquired,
  TaskNotFound,
} from "../../clients/typescript/dist/index.js";

const CLIENT = "typescript";
const LEASE_COMMANDS = new Set(["work", "act", "save_checkpoint", "release"]);
/** Seconds `exit` waits for the lease still held to be released before giving it up. */
const EXIT_RELEASE_S = 5.0;

/** Write one event line on stdout, at once (stdout on a pipe is synchronous on Linux). */
function emit(event, fields = {}) {
  process.stdout.write(JSON.stringify({ event, ...fields }) + "\n");
}

/** The protocol's reason for a refusal (PROTOCOL.md, "Reasons"). */
function reasonOf(error) {
  if (error instanceof NotAcquired) return "NOT_ACQUIRED"; // a ClaimTimeout: checked first
  if (error instanceof ClaimTimeout) return "CLAIM_TIMEOUT";
  if (error instanceof EffectInDoubt) return "EFFECT_IN_DOUBT";
  if (error instanceof EffectFailed) return "EFFECT_FAILED";
  if (error instanceof LeaseError) {
    if (error.reason) return error.reason;
    return error.code !== null && error.code !== undefined ? codeName(error.code) : error.constructor.name;
  }
  return error?.constructor?.name ?? String(error);
}

function describe(error) {
  return `${error?.constructor?.name ?? "Error"}: ${error?.message ?? String(error)}\n${error?.stack ?? ""}`;
}

/** A checkpoint as the protocol writes it (data as UTF-8 text). */
function checkpointOf(checkpoint) {
  if (checkpoint === null || checkpoint === undefined) return null;
  return {
    version: Number(checkpoint.version),
    data: Buffer.from(checkpoint.data).toString("utf8"),
    fence: Number(checkpoint.fence),
  };
}

/** The outside system: one file per effect key, one line per time the effect was done. */
class Outside {
  constructor(folder) {
    this.folder = folder;
  }

  /** Do the effect: append `result` to the key's file (written before returning). */
  perform(effectKey, result) {
    appendFileSync(join(this.folder, effectKey), result + "\n", "utf8");
  }

  /** The outside system's record of the effect (its first line), or null if never done. */
  lookup(effectKey) {
    const path = join(this.folder, effectKey);
    if (!existsSync(path)) return null;
    const lines = readFileSync(path, "utf8").split("\n");
    return lines[0] ? lines[0] : null;
  }
}

/** Never resolve when the command asks to stall here (a worker that dies at this point). */
function stallIf(command, where) {
  return command.stall === where ? new Promise(() => {}) : Promise.resolve();
}

/** One worker: at most one lease at a time, held by a `hold` command's block. */
class Driver {
  constructor(client, outside) {
    this.client = client;
    this.outside = outside;
    this.lease = null; // the latest lease, kept after its block ends
    this.holding = null; // the hold's promise while it runs
    this.queue = []; // lease commands for the block
    this.waiter = null; // the block waiting for its next command
    this.working = new Map(); // work command id -> progress so far
    this.workTimers = new Set();
    this.tasks = new Set();
  }

  /** Route one command: a lease command to the block holding the lease, others now. */
  dispatch(command) {
    const name = command.cmd;
    if (name === "hold") {
      if (this.holding !== null) {
        emit("error", { id: command.id ?? null, message: "hold while a lease is held" });
        return;
      }
      this.holding = this.hold(command).finally(() => {
        this.holding = null;
      });
    } else if (LEASE_COMMANDS.has(name)) {
      if (this.holding !== null) this.put(command);
      else this.spawn(this.outsideBlock(command));
    } else {
      emit("error", { id: command.id ?? null, message: `unknown command ${JSON.stringify(name)}` });
    }
  }

  put(command) {
    if (this.waiter !== null) {
      const waiter = this.waiter;
      this.waiter = null;
      waiter(command);
    } else {
      this.queue.push(command);
    }
  }

  /** The block's next command, or the loss once `signal` is aborted. */
  next(signal) {
    if (signal.aborted) return Promise.reject(signal.reason);
    if (this.queue.length > 0) return Promise.resolve(this.queue.shift());
    return new Promise((resolve, reject) => {
      const onAbort = () => {
        this.waiter = null;
        reject(signal.reason);
      };
      signal.addEventListener("abort", onAbort, { once: true });
      this.waiter = (command) => {
        signal.removeEventListener("abort", onAbort);
        resolve(command);
      };
    });
  }

  /** Run `work` as a task of the driver (kept until done). */
  spawn(work) {
    const task = work.finally(() => this.tasks.delete(task));
    this.tasks.add(task);
  }

  stopWorks() {
    for (const timer of this.workTimers) clearInterval(timer);
    this.workTimers.clear();
  }

  /** `hold`: claim through the client's withLease(); serve lease commands in its block. */
  async hold(command) {
    const holdId = command.id;
    let released = null;
    try {
      await this.client.withLease(
        command.task_id,
        {
          ttl: command.ttl_s,
          wait: command.wait_s ?? null,
          heartbeatInterval: command.heartbeat_interval_s ?? null,
        },
        async (lease) => {
          this.lease = lease;
          emit("granted", {
            id: holdId,
            task_id: lease.taskId,
            fence: Number(lease.fence),
            checkpoint: checkpointOf(lease.checkpoint),
          });
          // The loss stops the work at once (before its next tick), as Python cancels the block.
          lease.signal.addEventListener("abort", () => this.stopWorks(), { once: true });
          try {
            while (released === null) {
              const next = await this.next(lease.signal);
              if (next.cmd === "release") released = next;
              else await this.inBlock(lease, next);
            }
          } finally {
            this.stopWorks();
          }
        },
      );
    } catch (error) {
      if (error instanceof LeaseLost) {
        emit("lost", { id: holdId, reason: error.reason });
        for (const [workId, progress] of [...this.working.entries()].sort((x, y) => x[0] - y[0])) {
          emit("aborted", { id: workId, progress });
        }
      } else if (error instanceof LeaseError) {
        emit("refused", { id: holdId, reason: reasonOf(error) });
      } else {
        emit("error", { id: holdId, message: describe(error) });
      }
      released = null;
    } finally {
      this.stopWorks();
      this.working.clear();
      this.waiter = null;
    }
    if (released !== null && released.id !== null && released.id !== undefined) {
      emit("released", { id: released.id });
    }
    const left = this.queue.splice(0); // commands the block had no time for
    for (const next of left) this.spawn(this.outsideBlock(next));
  }

  /** A lease command inside the hold block: abandoned (`aborted`) when the lease is lost. */
  async inBlock(lease, command) {
    if (command.cmd === "work") {
      this.working.set(command.id, 0);
      const timer = setInterval(() => {
        const n = this.working.get(command.id) + 1;
        this.working.set(command.id, n);
        emit("progress", { id: command.id, n });
      }, command.interval_s * 1000);
      this.workTimers.add(timer);
      return;
    }
    // JavaScript cannot cancel the call under way: when the loss comes first, the command is
    // reported aborted and whatever it would still say is dropped, as a cancelled task says nothing.
    const outcome = { settled: false, abandoned: false };
    const say = (event, fields) => {
      if (!outcome.abandoned) emit(event, fields);
    };
    const running = this.leaseCommand(lease, command, say).finally(() => {
      outcome.settled = true;
    });
    let onAbort;
    const lost = new Promise((resolve) => {
      onAbort = resolve;
      if (lease.signal.aborted) resolve();
      else lease.signal.addEventListener("abort", resolve, { once: true });
    });
    await Promise.race([running, lost]);
    lease.signal.removeEventListener("abort", onAbort);
    if (!outcome.settled) {
      // A refusal judged in the same turn as the loss (lease.check()) is the command's answer.
      await new Promise((resolve) => setImmediate(resolve));
    }
    if (!outcome.settled) {
      outcome.abandoned = true;
      emit("aborted", { id: command.id });
      throw lease.signal.reason;
    }
  }

  /** A lease command with no block running: asked of the latest lease, which judges it. */
  async outsideBlock(command) {
    if (this.lease === null) emit("refused", { id: command.id, reason: "NO_LEASE" });
    else if (command.cmd === "work" || command.cmd === "release") {
      emit("refused", { id: command.id, reason: "NOT_HELD" });
    } else await this.leaseCommand(this.lease, command, emit);
  }

  /** `act` or `save_checkpoint` with `lease`; a refusal becomes `refused`. */
  async leaseCommand(lease, command, say) {
    try {
      if (command.cmd === "act") {
        await this.act(lease, command, say);
      } else {
        const saved = await lease.saveCheckpoint(command.version, Buffer.from(command.data, "utf8"), "text/plain");
        say("checkpoint_saved", { id: command.id, version: Number(saved.version) });
      }
    } catch (error) {
      if (error instanceof LeaseError) say("refused", { id: command.id, reason: reasonOf(error) });
      else say("error", { id: command.id, message: describe(error) });
    }
  }

  /** `act`: the effect through the ledger (`lease.effect`), done to the outside system. */
  async act(lease, command, say) {
    const actId = command.id;
    const key = command.effect_key;
    const reconciled = []; // what reconcile found in the outside system

    const perform = async () => {
      await stallIf(command, "before_outside");
      this.outside.perform(key, command.result);
      say("outside", { id: actId, effect_key: key, fence: Number(lease.fence) });
      await stallIf(command, "after_outside");
      return String(command.result);
    };

    const reconcile = async (effect) => {
      const found = this.outside.lookup(effect.effectKey);
      if (found !== null) reconciled.push(found);
      return found;
    };

    const runner = lease.effect(key, {
      policy: command.policy,
      ...(command.reconcile ? { reconcile } : {}),
    });
    const outcome = await runner.run(perform);
    let kind;
    if (outcome.fresh) kind = "PERFORMED";
    else if (reconciled.length > 0) kind = "RECONCILED";
    else kind = "ALREADY_APPLIED";
    const result = Buffer.from(outcome.result).toString("utf8");
    say("effect", { id: actId, effect_key: key, outcome: kind, result });
  }
}

/** Feed every stdin line, parsed, to `onCommand` until `exit` or the end of stdin. */
async function readCommands(onCommand) {
  const lines = createInterface({ input: process.stdin, crlfDelay: Infinity });
  for await (const raw of lines) {
    const line = raw.trim();
    if (!line) continue;
    let command;
    try {
      command = JSON.parse(line);
    } catch (error) {
      emit("error", { id: null, message: `not JSON: ${error.message}` });
      continue;
    }
    if (command?.cmd === "exit") {
      lines.close();
      return;
    }
    onCommand(command);
  }
}

function within(promise, seconds) {
  let timer;
  return Promise.race([
    promise,
    new Promise((resolve) => {
      timer = setTimeout(resolve, seconds * 1000);
    }),
  ]).finally(() => clearTimeout(timer));
}

/** Connect, say `ready`, run commands until `exit`, then release and say `bye`. */
async function main() {
  const outside = new Outside(process.env.CONFORMANCE_OUTSIDE_DIR);
  const client = new LeaseClient({
    target: process.env.LEASEKEEPER_TARGET,
    namespace: process.env.LEASEKEEPER_NAMESPACE,
    token: process.env.LEASEKEEPER_TOKEN ?? "",
    logger: { warn: (message) => console.error(`warn: ${message}`), info: (message) => console.error(message) },
  });
  try {
    try {
      await client.getLease("conformance-ready"); // one call: the channel is connected
    } catch (error) {
      if (!(error instanceof TaskNotFound)) throw error;
    }
    emit("ready", { client: CLIENT, owner_id: client.ownerId });
    const driver = new Driver(client, outside);
    await readCommands((command) => driver.dispatch(command));
    if (driver.holding !== null) {
      driver.put({ cmd: "release", id: null });
      // A hold still acquiring, or a block stalled in an effect, is given up after that
      // (client.close() below closes its lease).
      await within(driver.holding, EXIT_RELEASE_S);
    }
    await within(Promise.allSettled([...driver.tasks]), EXIT_RELEASE_S);
  } finally {
    await client.close();
  }
  emit("bye");
  return 0;
}

main().then(
  (code) => process.exit(code),
  (error) => {
    console.error(describe(error));
    process.exit(1);
  },
);
