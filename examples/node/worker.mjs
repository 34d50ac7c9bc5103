#!/usr/bin/env node
// A leasekeeper worker in Node.js: claim a task, heartbeat it, send one message through the demo
// gateway with the fence, work until done (then release) or until the lease is lost.
//
// With --send-after-loss it then does what a stale worker must not do, to show that it cannot:
// it sends once more with its old fence, and the gateway refuses it.
//
// One JSON object per line on stdout for each event ({"event": "claimed", ...}) and one exit code
// per outcome (EXIT below), so that tests and scripts can follow it. Errors go to stderr.
//
//   node examples/node/worker.mjs --target 127.0.0.1:9457 --gateway 127.0.0.1:50051 \
//       --namespace demo --task-id contract-summary-r42 --ttl-s 10 --work-s 5
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
  seconds,
} from "./lease.mjs";
import { describeStatus } from "./status.mjs";

export const EXIT = {
  DONE: 0, // claimed, sent (accepted), worked, released
  ERROR: 1, // anything unexpected (stderr says what)
  REFUSED_AFTER_LOSS: 3, // the lease was lost; the late send with the old fence was refused
  SENT_AFTER_LOSS: 4, // the lease was lost, yet the late send was accepted: fencing failed
  SEND_REFUSED: 5, // the gateway refused the send while the lease was still trusted
  LEASE_LOST: 6, // the lease was lost (no late send was tried)
  NOT_ACQUIRED: 7, // another owner held the task
};

const SEND_METHOD = "/demo.v1.Gateway/Send";
const SEND_TIMEOUT_S = 10;
const STREAM_END_WAIT_S = 5;

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
  for (const name of ["ttl-s", "wait-s", "work-s", "safety-margin-s"]) {
    if (options[name] === undefined) continue;
    const value = Number(options[name]);
    if (!Number.isFinite(value) || value < 0) throw new Error(`--${name} must be a number >= 0`);
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

function sleepUnlessLost(held, ms) {
  return new Promise((resolvePromise) => {
    const timer = setTimeout(() => resolvePromise(false), ms);
    held.once("lost", () => {
      clearTimeout(timer);
      resolvePromise(true);
    });
  });
}

async function afterLoss(held, gateway, options, lost) {
  emit("lost", { ...lost, fence: Number(held.lease.fence) });
  // What the stream said, when it was not what told us: the server pushes its ABORTED, but a
  // worker that was paused may see its trust deadline pass before it reads that status.
  held.stop();
  if ((await held.streamEnd(STREAM_END_WAIT_S)) === null) {
    emit("stream_end", { code: null, details: `no end status within ${STREAM_END_WAIT_S} s` });
  }
  if (!options.sendAfterLoss) return EXIT.LEASE_LOST;
  const late = await send(gateway, held, `${options.message} (after loss)`, options["effect-key"]);
  emit("late_send", { fence: Number(held.lease.fence), ...late });
  return late.accepted ? EXIT.SENT_AFTER_LOSS : EXIT.REFUSED_AFTER_LOSS;
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
    if (lost === null && !(await sleepUnlessLost(held, options["work-s"] * 1000))) {
      held.stop();
      await release(leases, claimed.lease, token);
      emit("released", { fence: Number(fence) });
      return EXIT.DONE;
    }
    return await afterLoss(held, gateway, options, lost);
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
  lines.push("  --send-after-loss  after losing the lease, send once more with the old fence");
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
