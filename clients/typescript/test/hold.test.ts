/**
 * hold() against a real server: the heartbeat keeps the lease past its ttl, a revoke is pushed
 * and aborts the lease's signal at once, a server that stops answering (SIGSTOP past the ttl)
 * makes the trust deadline pass on the client's own clock, withLease() turns the abort into
 * LeaseLost, and complete()/close() end the lease.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { LeaseClient, LeaseLost, TaskCompleted } from "../src/index.js";
import { freshNamespace, pollUntil, Server, serverForFile } from "./support/server.js";

const server = serverForFile();

/** Resolves with the signal's reason once it is aborted. */
function aborted(signal: AbortSignal): Promise<unknown> {
  if (signal.aborted) return Promise.resolve(signal.reason);
  return new Promise((resolve) => signal.addEventListener("abort", () => resolve(signal.reason), { once: true }));
}

test("the heartbeat keeps the lease past its ttl; close() releases it", async () => {
  const c = new LeaseClient({ target: server.target, namespace: freshNamespace() });
  try {
    const lease = await c.hold("t", { ttl: 1.5 });
    const granted = lease.info.expireTime!.getTime();
    await pollUntil(
      async () => (await c.getLease("t")).expireTime!.getTime() > granted + 1500,
      "renewals moved the expiry a whole ttl past the grant's",
    );
    assert.equal(lease.lost, false);
    assert.equal(lease.signal.aborted, false);
    assert.equal((await c.validateFence("t", lease.fence)).valid, true);
    assert.equal(await lease.close(), null);
    assert.equal(lease.state, "CLOSED");
    assert.equal((await c.getLease("t")).state, "FREE");
  } finally {
    await c.close();
  }
});

test("a revoke is pushed: the signal aborts with LeaseLost LEASE_REVOKED before the next beat", async () => {
  const namespace = freshNamespace();
  const worker = new LeaseClient({ target: server.target, namespace });
  const admin = new LeaseClient({ target: server.target, namespace });
  try {
    const lease = await worker.hold("t", { ttl: 10, heartbeatInterval: 4 });
    await pollUntil(() => lease.checkpointVersion === 0n && lease.remaining() > 0, "the lease trusted");
    const started = performance.now();
    const { revoked } = await admin.revoke("t", "test: revoke is pushed");
    assert.equal(revoked, true);
    const reason = await aborted(lease.signal);
    assert.ok(performance.now() - started < 4000, "pushed by the server, not found by a later beat");
    assert.ok(reason instanceof LeaseLost);
    assert.equal(reason.reason, "LEASE_REVOKED");
    assert.equal(reason.fence, lease.fence);
    assert.equal(lease.state, "LOST");
    assert.throws(() => lease.check(), (e: unknown) => e === reason);
    assert.equal((await lease.close())?.reason, "LEASE_REVOKED");
    const next = await admin.claim("t", { ttl: 10 });
    assert.equal(next.lease?.fence, lease.fence + 1n);
  } finally {
    await worker.close();
    await admin.close();
  }
});

test("withLease(): work that honours the signal stops, and the loss is what it throws", async () => {
  const namespace = freshNamespace();
  const worker = new LeaseClient({ target: server.target, namespace });
  const admin = new LeaseClient({ target: server.target, namespace });
  try {
    let started!: () => void;
    const working = new Promise<void>((r) => (started = r));
    const run = worker.withLease("t", { ttl: 10 }, async (lease) => {
      started();
      await sleep(60_000, undefined, { signal: lease.signal }); // the work, abortable
      return "finished";
    });
    await working;
    // Handled before the revoke: the pushed loss may reject `run` before revoke() answers.
    const refused = assert.rejects(run, (e: unknown) => e instanceof LeaseLost && e.reason === "LEASE_REVOKED");
    await admin.revoke("t", "test: withLease");
    await refused;
    assert.equal(
      await worker.withLease("u", { ttl: 10 }, async () => "done"),
      "done",
      "work that ends on a trusted lease returns its value",
    );
    assert.equal((await admin.getLease("u")).state, "FREE", "and the lease is released");
    await assert.rejects(
      worker.withLease("v", { ttl: 10 }, async () => {
        throw new RangeError("the work's own error");
      }),
      RangeError,
    );
    assert.equal((await admin.getLease("v")).state, "FREE");
  } finally {
    await worker.close();
    await admin.close();
  }
});

test("complete() ends the run: COMPLETED, the signal is not aborted, and the task is never granted again", async () => {
  const c = new LeaseClient({ target: server.target, namespace: freshNamespace() });
  try {
    const lease = await c.hold("t", { ttl: 5 });
    const done = await lease.complete();
    assert.equal(done.state, "COMPLETED");
    assert.equal(lease.state, "COMPLETED");
    assert.equal(await lease.close(), null);
    assert.equal(lease.signal.aborted, false);
    await assert.rejects(c.claim("t"), TaskCompleted);
    await assert.rejects(c.hold("t"), TaskCompleted);
  } finally {
    await c.close();
  }
});

test("a server paused past the ttl: the trust deadline passes on the client's clock and aborts the signal", async () => {
  const paused = await Server.start(server.database);
  const c = new LeaseClient({ target: paused.target, namespace: freshNamespace() });
  try {
    const lease = await c.hold("t", { ttl: 2 });
    await pollUntil(() => lease.remaining() > 1, "a renewal confirmed");
    paused.pause();
    let reason: unknown;
    try {
      reason = await aborted(lease.signal);
      assert.equal(paused.process.signalCode, null, "the server is still stopped, not gone");
    } finally {
      paused.resume();
    }
    assert.ok(reason instanceof LeaseLost);
    assert.equal(reason.reason, "LEASE_EXPIRED");
    assert.equal(lease.remaining(), 0);
    assert.throws(() => lease.check(), LeaseLost);
    await assert.rejects(
      lease.saveCheckpoint(1, "late"),
      (e: unknown) => e instanceof LeaseLost,
      "nothing is sent once the lease is lost",
    );
    await lease.close({ release: false }); // leave it to the server's clock
    const check = await pollUntil(async () => {
      const answer = await c.validateFence("t", lease.fence);
      return answer.valid ? undefined : answer;
    }, "the server judged the fence expired once it ran again");
    assert.equal(check.reason, "LEASE_EXPIRED");
  } finally {
    await c.close();
    await paused.stop();
  }
});
