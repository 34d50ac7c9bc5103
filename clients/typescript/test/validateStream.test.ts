/**
 * validateFence() on the client's one ValidateFences stream: the unary call's answers and errors,
 * one stream for many concurrent checks, a check left waiting when the stream ends fails (never
 * answered by another), and a server without ValidateFences is asked with the unary call.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { InterceptingCall, type Interceptor, ListenerBuilder, Metadata, status } from "@grpc/grpc-js";
import { type FenceCheck, InvalidArgument, LeaseClient, LeaseUnavailable } from "../src/index.js";
import { freshNamespace, Server, serverForFile } from "./support/server.js";

const server = serverForFile();

const STREAM = "/leasekeeper.v1.LeaseService/ValidateFences";
const UNARY = "/leasekeeper.v1.LeaseService/ValidateFence";

/** Counts the calls the client starts, by method path. */
function callCounter(): { interceptor: Interceptor; calls: Map<string, number> } {
  const calls = new Map<string, number>();
  const interceptor: Interceptor = (options, nextCall) => {
    const path = options.method_definition.path;
    calls.set(path, (calls.get(path) ?? 0) + 1);
    return new InterceptingCall(nextCall(options));
  };
  return { interceptor, calls };
}

function shape(check: FenceCheck): unknown {
  return [check.valid, check.reason, check.currentFence];
}

test("checks on the stream answer as the unary call does, all on one stream", async () => {
  const counted = callCounter();
  const streamed = new LeaseClient({
    target: server.target,
    namespace: freshNamespace(),
    channelOptions: { interceptors: [counted.interceptor] },
  });
  const unary = new LeaseClient({ target: server.target, namespace: streamed.namespace, validateStream: false });
  try {
    const first = (await streamed.claim("t", { ttl: 30 })).lease!;
    const second = (await streamed.claim("t", { ttl: 30 })).lease!; // a new incarnation: fence 1 is stale
    const asked: Array<[string, bigint]> = [
      ["t", second.fence],
      ["t", first.fence],
      ["t", second.fence + 5n],
      ["never-claimed", 1n],
    ];
    const viaStream = await Promise.all(asked.map(([task, fence]) => streamed.validateFence(task, fence)));
    const viaUnary = await Promise.all(asked.map(([task, fence]) => unary.validateFence(task, fence)));
    assert.deepEqual(viaStream.map(shape), viaUnary.map(shape));
    assert.deepEqual(shape(viaStream[0]!), [true, null, second.fence]);
    assert.deepEqual(shape(viaStream[1]!), [false, "LEASE_SUPERSEDED", second.fence]);

    // A check the server refuses is the unary call's error, and the stream goes on.
    const bad = (c: LeaseClient) => c.validateFence("", second.fence);
    await assert.rejects(bad(streamed), (e: unknown) => e instanceof InvalidArgument && e.field === "task_id");
    await assert.rejects(bad(unary), (e: unknown) => e instanceof InvalidArgument && e.field === "task_id");

    // 2,500 concurrent checks: more than one message's 1,000, every answer its own check's.
    const many = await Promise.all(
      Array.from({ length: 2500 }, (_, i) => streamed.validateFence("t", i % 2 === 0 ? second.fence : first.fence)),
    );
    many.forEach((check, i) => assert.equal(check.valid, i % 2 === 0, `check ${i}`));
    assert.equal(counted.calls.get(STREAM), 1, "one ValidateFences stream for every check");
    assert.equal(counted.calls.get(UNARY) ?? 0, 0, "no unary ValidateFence");
  } finally {
    await streamed.close();
    await unary.close();
  }
});

test("a check waiting when its stream ends fails LeaseUnavailable, not validated", async () => {
  const own = await Server.start(server.database);
  const c = new LeaseClient({ target: own.target, namespace: freshNamespace(), callTimeout: 30 });
  try {
    const lease = (await c.claim("t", { ttl: 30 })).lease!;
    assert.equal((await c.validateFence("t", lease.fence)).valid, true); // the stream is open
    own.pause(); // it answers nothing now
    const waiting = c.validateFence("t", lease.fence);
    own.process.kill("SIGKILL"); // the connection breaks with the check unanswered
    await assert.rejects(waiting, (e: unknown) => {
      assert.ok(e instanceof LeaseUnavailable, String(e));
      assert.match(e.message, /ValidateFences stream ended .* it was not validated/);
      return true;
    });
  } finally {
    await c.close();
    await own.stop();
  }
});

test("a server without ValidateFences is asked with the unary call from then on", async () => {
  const counted = callCounter();
  // Ends every ValidateFences call UNIMPLEMENTED at its start, as an older server would.
  const olderServer: Interceptor = (options, nextCall) => {
    if (options.method_definition.path !== STREAM) return new InterceptingCall(nextCall(options));
    const call: InterceptingCall = new InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        next(
          metadata,
          new ListenerBuilder()
            .withOnReceiveStatus((_status, nextStatus) =>
              nextStatus({ code: status.UNIMPLEMENTED, details: "unknown method (test)", metadata: new Metadata() }),
            )
            .build(),
        );
        setImmediate(() => call.cancelWithStatus(status.CANCELLED, "an older server (test)"));
      },
      sendMessage() {}, // never reaches the server
    });
    return call;
  };
  const c = new LeaseClient({
    target: server.target,
    namespace: freshNamespace(),
    channelOptions: { interceptors: [counted.interceptor, olderServer] },
  });
  try {
    const lease = (await c.claim("t", { ttl: 30 })).lease!;
    for (let i = 0; i < 3; i += 1) assert.equal((await c.validateFence("t", lease.fence)).valid, true);
    assert.equal(counted.calls.get(STREAM), 1, "asked once, then not again");
    assert.equal(counted.calls.get(UNARY), 3, "every check answered by the unary call");
  } finally {
    await c.close();
  }
});
