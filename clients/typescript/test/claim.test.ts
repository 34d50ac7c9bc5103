/**
 * Claims against a real server: a retried claim gets the same fence, a new request id is a new
 * incarnation, a reply lost on the way is retried by hold() to the same fence, and a claim waits
 * for the holder.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { InterceptingCall, type Interceptor, ListenerBuilder, Metadata, status } from "@grpc/grpc-js";
import { ClaimTimeout, LeaseClient, LeaseLost, newRequestId, NotAcquired } from "../src/index.js";
import { freshNamespace, pollUntil, serverForFile } from "./support/server.js";

const server = serverForFile();

function client(options: ConstructorParameters<typeof LeaseClient>[0] = {}): LeaseClient {
  return new LeaseClient({ target: server.target, namespace: freshNamespace(), ...options });
}

test("a claim retried with its request id gets the same fence; a new request id supersedes it", async () => {
  const c = client();
  try {
    const requestId = newRequestId();
    const first = await c.claim("t", { ttl: 10, requestId });
    assert.equal(first.acquired, true);
    assert.equal(first.lease?.fence, 1n);
    assert.equal(first.lease?.state, "HELD");
    assert.equal(first.requestId, requestId);
    assert.ok(first.lease!.remainingTtl > 9 && first.lease!.remainingTtl <= 10);
    const retried = await c.claim("t", { ttl: 10, requestId });
    assert.equal(retried.lease?.fence, 1n, "the same request id: the same lease back");
    const incarnation = await c.claim("t", { ttl: 10 });
    assert.equal(incarnation.lease?.fence, 2n, "a new request id: a new incarnation, the next fence");
    const check = await c.validateFence("t", 1n);
    assert.deepEqual([check.valid, check.reason, check.currentFence], [false, "LEASE_SUPERSEDED", 2n]);
    const other = new LeaseClient({ target: server.target, namespace: c.namespace });
    const refused = await other.claim("t", { ttl: 10 });
    assert.equal(refused.acquired, false);
    assert.equal(refused.lease, null);
    assert.ok(refused.holderRemainingTtl! > 0 && refused.retryAfter! > 0);
    await other.close();
  } finally {
    await c.close();
  }
});

// How a reply can be lost: UNAVAILABLE, a connection cut mid-reply; RESOURCE_EXHAUSTED without a
// reason, what grpc-js reports when the server ends the connection with ENHANCE_YOUR_CALM after
// this process missed its keepalive ping (paused, or starved of CPU): not a namespace limit.
const LOST_REPLIES: Array<[number, string]> = [
  [status.UNAVAILABLE, "reply lost (test)"],
  [status.RESOURCE_EXHAUSTED, "Bandwidth exhausted or memory limit exceeded"],
];

for (const [lostCode, lostDetails] of LOST_REPLIES) {
  test(`hold() retries a claim whose reply was lost (${status[lostCode]}) with the same request id: the same fence`, async () => {
    let dropped = 0;
    // Lets the first Claim reach the server and be granted, then ends it with lostCode in place of
    // its OK: the outcome is unknown to the client.
    const loseFirstClaimReply: Interceptor = (options, nextCall) => {
      if (options.method_definition.path !== "/leasekeeper.v1.LeaseService/Claim" || dropped > 0) {
        return new InterceptingCall(nextCall(options));
      }
      dropped += 1;
      return new InterceptingCall(nextCall(options), {
        start(metadata, _listener, next) {
          next(
            metadata,
            new ListenerBuilder()
              .withOnReceiveStatus((_status, nextStatus) =>
                nextStatus({ code: lostCode, details: lostDetails, metadata: new Metadata() }),
              )
              .build(),
          );
        },
      });
    };
    const c = client({ channelOptions: { interceptors: [loseFirstClaimReply] } });
    try {
      const lease = await c.hold("t", { ttl: 10, wait: 10 });
      assert.equal(dropped, 1);
      assert.equal(lease.fence, 1n, "the retry got the granted lease back, not a new fence");
      const [entries] = await c.listTaskHistory("t");
      assert.deepEqual(
        entries.filter((e) => e.kind === "GRANTED").map((e) => e.fence),
        [1n],
        "one grant in the task's history",
      );
      assert.equal(await lease.close(), null);
      assert.equal((await c.getLease("t")).state, "FREE");
    } finally {
      await c.close();
    }
  });
}

test("hold() without wait is NotAcquired; with wait it gets the task once its holder releases", async () => {
  const holder = client();
  const waiter = new LeaseClient({ target: server.target, namespace: holder.namespace });
  try {
    const held = await holder.hold("t", { ttl: 10 });
    await assert.rejects(waiter.hold("t", { ttl: 10 }), (e: unknown) => {
      assert.ok(e instanceof NotAcquired && e.holderRemainingTtl! > 0);
      return true;
    });
    await assert.rejects(waiter.hold("t", { ttl: 10, wait: 0.2 }), ClaimTimeout);
    const waiting = waiter.hold("t", { ttl: 10, wait: 30 });
    await held.close();
    const next = await waiting;
    assert.equal(next.fence, 2n);
    await next.close();
  } finally {
    await holder.close();
    await waiter.close();
  }
});

test("a second hold() of a task on the same client counts as held by another owner", async () => {
  const c = client();
  try {
    const first = await c.hold("t", { ttl: 10 });
    await assert.rejects(c.hold("t", { ttl: 10 }), NotAcquired);
    assert.equal((await c.validateFence("t", first.fence)).valid, true, "the first lease was not superseded");
    await first.close();
    await pollUntil(async () => (await c.getLease("t")).state === "FREE", "the task released");
  } finally {
    await c.close();
  }
});

test("renew, listLeases and watch: the unary calls and the event stream", async () => {
  const c = client();
  const controller = new AbortController();
  try {
    const events: string[] = [];
    const watching = (async () => {
      for await (const event of c.watch("t", { signal: controller.signal })) {
        events.push(`${event.type} ${event.lease?.state} ${event.lease?.fence}`);
        if (event.type === "RELEASED") return;
      }
    })();
    await pollUntil(() => events.length > 0, "the watch's snapshot");
    const granted = (await c.claim("t", { ttl: 5 })).lease!;
    const renewed = await c.renew("t", granted.fence, { ttl: 20, trustDeadline: c.clock() + 5 });
    assert.ok(renewed.remainingTtl > 19 && renewed.sendTime > 0);
    const [leases, next] = await c.listLeases({ state: "HELD" });
    assert.deepEqual([leases.map((l) => l.taskId), next], [["t"], ""]);
    await assert.rejects(
      c.renew("t", granted.fence, { trustDeadline: c.clock() - 1 }),
      (e: unknown) => e instanceof LeaseLost && e.reason === "LEASE_EXPIRED",
      "past its trust deadline a renewal is not even sent",
    );
    await c.release("t", granted.fence);
    await watching;
    assert.deepEqual(events, ["SNAPSHOT FREE 0", "CLAIMED HELD 1", "RELEASED FREE 1"]);
  } finally {
    controller.abort();
    await c.close();
  }
});

test("close() of a client closes the leases it still holds: released, nothing left running", async () => {
  const c = client();
  const lease = await c.hold("t", { ttl: 10 });
  await c.close();
  assert.equal(lease.state, "CLOSED");
  const other = new LeaseClient({ target: server.target, namespace: c.namespace });
  try {
    assert.equal((await other.getLease("t")).state, "FREE");
  } finally {
    await other.close();
  }
});
