/**
 * The effect side in Node.js: a grpc-js service behind fenceInterceptor() runs a call only for
 * the current, live fence carried in the call's metadata (lease.metadata()), and refuses a
 * stale or missing fence before its handler runs, with the status the Python FenceInterceptor
 * sends, which the client turns back into typed errors.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import * as grpc from "@grpc/grpc-js";
import {
  FENCE_CHECK_FAILED,
  FenceChecker,
  fenceFromMetadata,
  fenceInterceptor,
  fromServiceError,
  LeaseClient,
  LeaseLost,
  LeaseUnavailable,
  METADATA_FENCE,
  MissingFence,
  statusDetails,
} from "../src/index.js";
import { freshNamespace, serverForFile } from "./support/server.js";

const server = serverForFile();

// A tiny effect service with JSON messages: Send (protected) and Ping (not).
const json = {
  requestSerialize: (value: unknown) => Buffer.from(JSON.stringify(value)),
  requestDeserialize: (data: Buffer) => JSON.parse(data.toString()),
  responseSerialize: (value: unknown) => Buffer.from(JSON.stringify(value)),
  responseDeserialize: (data: Buffer) => JSON.parse(data.toString()),
};
const GATEWAY = {
  send: { path: "/demo.v1.Gateway/Send", requestStream: false, responseStream: false, ...json },
  ping: { path: "/demo.v1.Gateway/Ping", requestStream: false, responseStream: false, ...json },
} as const;
const GatewayClient = grpc.makeGenericClientConstructor(GATEWAY, "demo.v1.Gateway");

interface Gateway {
  target: string;
  sent: Array<{ fence: string; message: string }>;
  stop(): Promise<void>;
}

async function startGateway(checker: FenceChecker): Promise<Gateway> {
  const sent: Gateway["sent"] = [];
  const service = new grpc.Server({
    interceptors: [fenceInterceptor(checker, { methods: [GATEWAY.send.path] })],
  });
  service.addService(GATEWAY, {
    send: (call: grpc.ServerUnaryCall<{ message: string }, unknown>, done: grpc.sendUnaryData<unknown>) => {
      const ref = fenceFromMetadata(call.metadata); // the handler reads the fence too
      sent.push({ fence: String(ref.fence), message: call.request.message });
      done(null, { accepted: true });
    },
    ping: (_call: unknown, done: grpc.sendUnaryData<unknown>) => done(null, { pong: true }),
  });
  const port = await new Promise<number>((resolve, reject) =>
    service.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))),
  );
  return {
    target: `127.0.0.1:${port}`,
    sent,
    stop: () => new Promise<void>((resolve) => service.tryShutdown(() => resolve())),
  };
}

function call(client: grpc.Client, method: "send" | "ping", request: object, metadata: grpc.Metadata): Promise<unknown> {
  return new Promise((resolve, reject) => {
    (client as unknown as Record<string, Function>)[method]!(request, metadata, (e: grpc.ServiceError | null, r: unknown) =>
      e ? reject(e) : resolve(r),
    );
  });
}

test("a current fence passes; a superseded or missing one is refused before the handler runs", async () => {
  const namespace = freshNamespace();
  const worker = new LeaseClient({ target: server.target, namespace });
  const effects = new LeaseClient({ target: server.target, namespace }); // the effect service's own client
  const gateway = await startGateway(new FenceChecker(effects));
  const stub = new GatewayClient(gateway.target, grpc.credentials.createInsecure());
  try {
    const lease = await worker.hold("report", { ttl: 10 });
    assert.deepEqual(await call(stub, "send", { message: "part 1" }, lease.metadata()), { accepted: true });
    assert.deepEqual(gateway.sent, [{ fence: String(lease.fence), message: "part 1" }]);

    await effects.revoke("report", "test: another owner takes over");
    const successor = new LeaseClient({ target: server.target, namespace });
    const next = await successor.claim("report", { ttl: 10 });
    const refusal = await call(stub, "send", { message: "late" }, lease.metadata()).then(
      () => assert.fail("a stale fence was accepted"),
      (e: grpc.ServiceError) => e,
    );
    assert.equal(refusal.code, grpc.status.ABORTED);
    assert.deepEqual(statusDetails(refusal.metadata).metadata, {
      current_fence: String(next.lease!.fence),
      namespace,
      task_id: "report",
      fence: String(lease.fence),
    });
    const error = fromServiceError(refusal);
    assert.ok(error instanceof LeaseLost);
    assert.equal(error.reason, "LEASE_SUPERSEDED");
    assert.equal(error.currentFence, next.lease!.fence);
    assert.equal(gateway.sent.length, 1, "the handler never ran for the stale fence");

    const missing = await call(stub, "send", { message: "no fence" }, new grpc.Metadata()).then(
      () => assert.fail("a call without a fence was accepted"),
      (e: grpc.ServiceError) => fromServiceError(e),
    );
    assert.ok(missing instanceof MissingFence);
    assert.ok(missing.key.startsWith("leasekeeper-"));
    const malformed = lease.metadata();
    malformed.set(METADATA_FENCE, "one");
    await assert.rejects(call(stub, "send", { message: "bad" }, malformed), (e: grpc.ServiceError) => {
      const typed = fromServiceError(e);
      return typed instanceof MissingFence && typed.key === METADATA_FENCE;
    });
    assert.deepEqual(await call(stub, "ping", {}, new grpc.Metadata()), { pong: true }, "unprotected methods pass");
    assert.equal(gateway.sent.length, 1);
    await lease.close();
    await successor.close();
  } finally {
    stub.close();
    await gateway.stop();
    await worker.close();
    await effects.close();
  }
});

test("when the lease service cannot answer, the interceptor fails closed: UNAVAILABLE FENCE_CHECK_FAILED", async () => {
  const worker = new LeaseClient({ target: server.target, namespace: freshNamespace() });
  const unreachable = new LeaseClient({ target: "127.0.0.1:1", callTimeout: 2 });
  const gateway = await startGateway(new FenceChecker(unreachable));
  const stub = new GatewayClient(gateway.target, grpc.credentials.createInsecure());
  try {
    const lease = await worker.hold("t", { ttl: 10 });
    const refusal = await call(stub, "send", { message: "x" }, lease.metadata()).then(
      () => assert.fail("accepted without a check"),
      (e: grpc.ServiceError) => e,
    );
    assert.equal(refusal.code, grpc.status.UNAVAILABLE);
    assert.equal(statusDetails(refusal.metadata).reason, FENCE_CHECK_FAILED);
    assert.ok(fromServiceError(refusal) instanceof LeaseUnavailable);
    assert.equal(gateway.sent.length, 0);
    await lease.close();
  } finally {
    stub.close();
    await gateway.stop();
    await worker.close();
    await unreachable.close();
  }
});

test("fence metadata: read from a grpc-js Metadata or a plain object, written onto a Metadata given", () => {
  const ref = fenceFromMetadata({ "leasekeeper-namespace": "ns", "Leasekeeper-Task-Id": "t", "leasekeeper-fence": "12" });
  assert.deepEqual([ref.namespace, ref.taskId, ref.fence], ["ns", "t", 12n]);
  const into = new grpc.Metadata();
  assert.equal(ref.metadata(into), into);
  assert.deepEqual(into.getMap(), { "leasekeeper-namespace": "ns", "leasekeeper-task-id": "t", "leasekeeper-fence": "12" });
  const roundTrip = fenceFromMetadata(into);
  assert.equal(roundTrip.fence, 12n);
  for (const fence of ["0", "-1", "1.5", "", "abc"]) {
    assert.throws(() => fenceFromMetadata({ ...into.getMap(), "leasekeeper-fence": fence }), MissingFence);
  }
  assert.throws(
    () => fenceFromMetadata({ ...into.getMap(), "leasekeeper-task-id": ["a", "b"] }),
    (e: unknown) => e instanceof MissingFence && e.key === "leasekeeper-task-id",
  );
});
