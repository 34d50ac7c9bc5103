#!/usr/bin/env node
// A leasekeeper worker in Node.js: claim a task, heartbeat it, send one message through the demo
// gateway with the fence, run the task's steps (a checkpoint saved after each), work until done
// (then release) or until the lease is lost.
//
// The checkpoint comes back with the grant, so a worker started after another one died resumes at
// the step after the stored version instead of starting over. --hold-after-step K stops making
// progress after step K (the lease stays held) until the worker is killed or loses its lease.
//
// With --send-after-loss it then does what a stale worker must not do, to show that it cannot:
// it sends once more with its old fence, and the gateway refuses it; with --steps it also saves
// the next checkpoint with that fence, and leasekeeper refuses it.
//
// One JSON object per line on stdout for each event ({"event": "claimed", ...}) and one exit code
// per outcome (EXIT below), so that tests and scripts can follow it. Errors go to stderr.
//
//   node examples/node/worker.mjs --target 127.0.0.1:9457 --gateway 127.0.0.1:50051 \
//       --namespace demo --task-id contract-summary-r42 --ttl-s 10 --steps 5 --step-s 1
//
// Every option can also come from the environment (LEASEKEEPER_TARGET, GATEWAY_TARGET,
// LEASEKEEPER_NAMESPACE, LEASEKEEPER_TASK_ID, LEASEKEEPER_TTL_S, ...; see OPTIONS), and
// LEASEKEEPER_TOKEN, when set, is sent to leasekeeper as `authorization: Bearer <token>`.
import { hostname } from "node:os";
import { randomUUID } from "node:crypto";
import { parseArgs } from "node:util";

import grpc from "@grpc/grpc-js";

import {
  DEFAULT_PROTO_ROOT,
  HeldLease,
  claim,
  leaseServiceClient,
  release,
  saveCheckpoint,
  seconds,
} from "./lease.mjs";
import { describeStatus, errorInfo } from "./status.mjs";

export const EXIT = {
  DONE: 0, // claimed, sent (accepted), ran its steps, worked, released
  ERROR: 1, // anything unexpected (stderr says what)
  REFUSED_AFTER_LOSS: 3, // the lease was lost; the late send with the old fence was refused
  SENT_AFTER_LOSS: 4, // the lease was lost, yet the late send was accepted: fencing failed
  SEND_REFUSED: 5, // the gateway refused the send while the lease was still trusted
  LEASE_LOST: 6, // the lease was lost (no late send was tried)
  NOT_ACQUIRED: 7, // another owner held the task
  CHECKPOINT_NOT_NEWER: 8, // a checkpoint was refused as not newer than the stored one: released
};

const SEND_METHOD = "/demo.v1.Gateway/Send";
const SEND_TIMEOUT_S = 10;
const STREAM_END_WAIT_S = 5;
const CHECKPOINT_TYPE = "application/json";

// option name -> [environment variable, default]
const OPTIONS = {
  target: ["LEASEKEEPER_TARGET", "127.0.0.1:9457"],
  gateway: ["GATEWAY_TARGET", "127.0.0.1:50051"],
  namespace: ["LEASEKEEPER_NAMESPACE", "demo"],
  "task-id": ["LEASEKEEPER_TASK_ID", undefined],
  "owner-id": ["LEASEKEEPER_OWNER_ID", undefined],
  "ttl-s": ["LEASEKEEPER_TTL_S", "10"],
  "wait-s": ["LEASEKEEPER_WAIT_S", "0"],
  "work-s": ["WORK_S", "1"],
  steps: ["WORKER_STEPS", "0"],
  "step-s": ["WORKER_STEP_S", "1"],
  "hold-after-step": ["WORKER_HOLD_AFTER_STEP", undefined],
  "safety-margin-s": ["LEASEKEEPER_SAFETY_MARGIN_S", undefined],
  message: ["WORKER_MESSAGE", undefined],
  "effect-key": ["WORKER_EFFECT_KEY", "send"],
  proto: ["LEASEKEEPER_PROTO_ROOT", DEFAULT_PROTO_ROOT],
};

function emit(event, fields = {}) {
  process.stdout.write(`${JSON.stringify({ event, ...fields })}\n`);
}

function parseOptions(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      ...Object.fromEntries(Object.keys(OPTIONS).map((name) => [name, { type: "string" }])),
      "send-after-loss": { type: "boolean", default: false },
      help: { type: "boolean", default: false },
    },
  });
  if (values.help) return null;
  const options = { sendAfterLoss: values["send-after-loss"] };
  for (const [name, [variable, fallback]] of Object.entries(OPTIONS)) {
    options[name] = values[name] ?? process.env[variable] ?? fallback;
  }
  if (!options["task-id"]) throw new Error("--task-id (or LEASEKEEPER_TASK_ID) is required");
  for (const name of ["ttl-s", "wait-s", "work-s", "safety-margin-s", "step-s"]) {
    if (options[name] === undefined) continue;
    const value = Number(options[name]);
    if (!Number.isFinite(value) || value < 0) throw new Error(`--${name} must be a number >= 0`);
    options[name] = value;
  }
  for (const name of ["steps", "hold-after-step"]) {
    if (options[name] === undefined) continue;
    const value = Number(options[name]);
    if (!Number.isSafeInteger(value) || value < 0) {
      throw new Error(`--${name} must be an integer >= 0`);
    }
    options[name] = value;
  }
  options["owner-id"] ??= `node-${hostname()}-${process.pid}-${randomUUID()}`;
  options.message ??= `message for ${options["task-id"]} from ${options["owner-id"]}`;
  return options;
}

/** One send through the gateway with the lease's fence: {accepted, ...} (never throws). */
function send(gateway, held, message, effectKey) {
  const body = Buffer.from(JSON.stringify({ message, effect_key: effectKey }));
  const identity = (buffer) => buffer; // the gateway speaks JSON bytes, not protobuf
  const deadline = new Date(Date.now() + SEND_TIMEOUT_S * 1000);
  return new Promise((resolvePromise) => {
    const done = (error, reply) => {
      if (error) resolvePromise({ accepted: false, ...describeStatus(error, grpc.status) });
      else resolvePromise({ accepted: true, ...JSON.parse(reply.toString("utf8")) });
    };
    const metadata = held.fenceMetadata();
    gateway.makeUnaryRequest(SEND_METHOD, identity, identity, body, metadata, { deadline }, done);
  });
}

/** Resolves true as soon as the lease is lost, false after `ms` (Infinity: only a loss ends it). */
function sleepUnlessLost(held, ms) {
  if (held.lostReason !== null) return Promise.resolve(true);
  return new Promise((resolvePromise) => {
    const onLost = () => {
      clearTimeout(timer);
      resolvePromise(true);
    };
    const timer = Number.isFinite(ms)
      ? setTimeout(() => {
          held.off("lost", onLost);
          resolvePromise(false);
        }, ms)
      : undefined;
    held.once("lost", onLost);
  });
}

/** The last step a checkpoint records: its version (0 without one). */
function stepOf(checkpoint) {
  return checkpoint ? Number(checkpoint.version) : 0;
}

/** Step `step`'s checkpoint: version = the step, so each one moves forward. */
function checkpointAfter(step) {
  return { version: step, data: JSON.stringify({ step }), contentType: CHECKPOINT_TYPE };
}

/**
 * Runs the steps after `progress.step` up to --steps: each one is --step-s seconds of work, then
 * its checkpoint. Stops at a loss (the heartbeat's, or a save refused ABORTED) and at a save
 * refused CHECKPOINT_NOT_NEWER (returned: the worker's progress is behind the stored one).
 *
 * @returns {Promise<object | null>} The refusal of a save ({code, reason, ...}), or null.
 */
async function runSteps(leases, held, options, progress, token) {
  const fence = Number(held.lease.fence);
  while (progress.step < options.steps) {
    const step = progress.step + 1;
    if (await sleepUnlessLost(held, options["step-s"] * 1000)) return null;
    let saved;
    try {
      saved = await saveCheckpoint(leases, held.lease, checkpointAfter(step), token);
    } catch (error) {
      const refused = describeStatus(error, grpc.status);
      if (error.code !== grpc.status.ABORTED && refused.reason !== "CHECKPOINT_NOT_NEWER") {
        throw error;
      }
      const current = errorInfo(error.metadata)?.metadata.current_version;
      emit("checkpoint_refused", {
        fence,
        version: step,
        ...refused,
        ...(current === undefined ? {} : { current_version: Number(current) }),
      });
      // The lease is gone: the same outcome as a heartbeat ended ABORTED, reported once.
      if (error.code === grpc.status.ABORTED) held.lose(refused.reason ?? "ABORTED", "checkpoint");
      return refused;
    }
    progress.step = step;
    emit("step", { step, fence, checkpoint_version: Number(saved.version) });
    if (step === options["hold-after-step"]) {
      emit("holding", { step, fence });
      await sleepUnlessLost(held, Infinity);
      return null;
    }
  }
  return null;
}

async function afterLoss(held, leases, gateway, options, lost, progress, token) {
  emit("lost", { ...lost, fence: Number(held.lease.fence) });
  // What the stream said, when it was not what told us: the server pushes its ABORTED, but a
  // worker that was paused may see its trust deadline pass before it reads that status.
  held.stop();
  if ((await held.streamEnd(STREAM_END_WAIT_S)) === null) {
    emit("stream_end", { code: null, details: `no end status within ${STREAM_END_WAIT_S} s` });
  }
  if (!options.sendAfterLoss) return EXIT.LEASE_LOST;
  const fence = Number(held.lease.fence);
  const late = await send(gateway, held, `${options.message} (after loss)`, options["effect-key"]);
  emit("late_send", { fence, ...late });
  let lateStored = false;
  if (options.steps > 0) {
    const version = progress.step + 1;
    try {
      await saveCheckpoint(leases, held.lease, checkpointAfter(version), token);
      lateStored = true;
      emit("late_checkpoint", { fence, version, stored: true });
    } catch (error) {
      const refused = describeStatus(error, grpc.status);
      emit("late_checkpoint", { fence, version, stored: false, ...refused });
    }
  }
  return late.accepted || lateStored ? EXIT.SENT_AFTER_LOSS : EXIT.REFUSED_AFTER_LOSS;
}

async function run(options) {
  const token = process.env.LEASEKEEPER_TOKEN || undefined;
  const leases = leaseServiceClient(options.target, options.proto);
  const gateway = new grpc.Client(options.gateway, grpc.credentials.createInsecure());
  try {
    const ttlS = options["ttl-s"];
    const claimed = await claim(leases, {
      namespace: options.namespace,
      taskId: options["task-id"],
      ownerId: options["owner-id"],
      ttlS,
      waitS: options["wait-s"],
      token,
    });
    if (!claimed.acquired) {
      const { retry_after: retryAfter, holder_remaining_ttl: holderRemaining } = claimed.response;
      emit("not_acquired", { retry_after_s: seconds(retryAfter ?? holderRemaining) });
      return EXIT.NOT_ACQUIRED;
    }
    // Fences are int64: exact as strings; printed as numbers (exact below 2^53).
    const { namespace, task_id, owner_id, fence } = claimed.lease;
    emit("claimed", { namespace, task_id, owner_id, fence: Number(fence), ttl_s: ttlS });
    const { checkpoint } = claimed;
    const progress = { step: stepOf(checkpoint) };
    if (checkpoint) {
      emit("resumed", {
        checkpoint_version: Number(checkpoint.version),
        checkpoint_fence: Number(checkpoint.fence),
        checkpoint_data: JSON.parse(checkpoint.data.toString("utf8")),
        next_step: progress.step + 1,
      });
    }

    const held = new HeldLease(leases, claimed.lease, {
      ttlS,
      sendTime: claimed.sendTime,
      safetyMarginS: options["safety-margin-s"],
      token,
    });
    let lost = null;
    held.on("lost", (event) => (lost = event));
    held.on("renewed", (beat) => emit("heartbeat", { ...beat, fence: Number(beat.fence) }));
    held.on("resuming", (event) => emit("heartbeat_resuming", event));
    held.on("stream_end", (status) => emit("stream_end", status));
    held.start();

    if (lost === null) {
      const sent = await send(gateway, held, options.message, options["effect-key"]);
      emit("send", { fence: Number(fence), ...sent });
      if (!sent.accepted && lost === null) {
        held.stop();
        return EXIT.SEND_REFUSED;
      }
    }
    const refused = lost === null ? await runSteps(leases, held, options, progress, token) : null;
    if (lost === null && refused?.reason === "CHECKPOINT_NOT_NEWER") {
      held.stop();
      await release(leases, claimed.lease, token); // whoever is ahead resumes from its checkpoint
      emit("released", { fence: Number(fence) });
      return EXIT.CHECKPOINT_NOT_NEWER;
    }
    if (lost === null && !(await sleepUnlessLost(held, options["work-s"] * 1000))) {
      held.stop();
      await release(leases, claimed.lease, token);
      emit("released", { fence: Number(fence) });
      return EXIT.DONE;
    }
    return await afterLoss(held, leases, gateway, options, lost, progress, token);
  } finally {
    gateway.close();
    leases.close();
  }
}

function usage() {
  const lines = Object.entries(OPTIONS).map(
    ([name, [variable, fallback]]) =>
      `  --${name} (${variable})${fallback ? ` default ${fallback}` : ""}`,
  );
  lines.push(
    "  --send-after-loss  after losing the lease, send (and with --steps save a checkpoint)",
    "                     once more with the old fence",
  );
  process.stdout.write(`usage: node worker.mjs --task-id ID [options]\n${lines.join("\n")}\n`);
}

async function main() {
  let code;
  try {
    const options = parseOptions(process.argv.slice(2));
    if (options === null) return usage();
    code = await run(options);
  } catch (error) {
    process.stderr.write(`worker: ${error.stack ?? error}\n`);
    code = EXIT.ERROR;
  }
  const outcome = Object.keys(EXIT).find((name) => EXIT[name] === code);
  emit("exit", { code, outcome });
  process.exitCode = code;
}

await main();
