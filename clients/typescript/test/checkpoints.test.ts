/**
 * Checkpoints against a real server: saved from the lease (on the heartbeat stream, or by
 * SaveCheckpoint), refused when not newer or from a stale fence, and received with the next
 * owner's grant.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { CheckpointNotNewer, LeaseClient, LeaseLost } from "../src/index.js";
import { freshNamespace, serverForFile } from "./support/server.js";

const server = serverForFile();

const text = (data: Uint8Array) => Buffer.from(data).toString("utf8");

test("checkpoints saved from the lease ride on the heartbeat; the next owner's grant carries the latest", async () => {
  const namespace = freshNamespace();
  const a = new LeaseClient({ target: server.target, namespace });
  const b = new LeaseClient({ target: server.target, namespace });
  try {
    const first = await a.hold("run", { ttl: 10 });
    assert.equal(first.checkpoint, null, "a task never checkpointed: nothing to resume from");
    const one = await first.saveCheckpoint(1, JSON.stringify({ step: 1 }), "application/json");
    assert.deepEqual([one.version, one.fence, one.writeTime], [1n, first.fence, null], "carried by a beat");
    await first.saveCheckpoint(2n, JSON.stringify({ step: 2 }), "application/json");
    assert.equal(first.checkpointVersion, 2n);
    await assert.rejects(first.saveCheckpoint(2, "other data"), (e: unknown) => {
      assert.ok(e instanceof CheckpointNotNewer);
      assert.equal(e.currentVersion, 2n);
      return true;
    });
    await first.close();

    const second = await b.hold("run", { ttl: 10 });
    assert.equal(second.fence, first.fence + 1n);
    const resumed = second.checkpoint!;
    assert.deepEqual(
      [resumed.version, text(resumed.data), resumed.contentType, resumed.fence],
      [2n, '{"step":2}', "application/json", first.fence],
    );
    assert.ok(resumed.writeTime instanceof Date);
    await second.saveCheckpoint(3, JSON.stringify({ step: 3 }));
    await second.close();
    assert.equal(text((await a.getCheckpoint("run"))!.data), '{"step":3}');
  } finally {
    await a.close();
    await b.close();
  }
});

test("SaveCheckpoint: stored with its write time; refused from a superseded fence", async () => {
  const c = new LeaseClient({ target: server.target, namespace: freshNamespace() });
  try {
    const granted = await c.claim("run", { ttl: 10 });
    const fence = granted.lease!.fence;
    const saved = await c.saveCheckpoint("run", fence, 1, new Uint8Array([1, 2, 3]));
    assert.equal(saved.version, 1n);
    assert.ok(saved.writeTime instanceof Date, "SaveCheckpoint answers with the write time");
    const again = await c.saveCheckpoint("run", fence, 1, new Uint8Array([1, 2, 3]));
    assert.equal(again.version, 1n, "the same version, data and fence again: OK (a retry)");
    await c.claim("run", { ttl: 10 }); // a new incarnation: fence + 1
    await assert.rejects(
      c.saveCheckpoint("run", fence, 2, "late"),
      (e: unknown) => e instanceof LeaseLost && e.reason === "LEASE_SUPERSEDED" && e.fence === fence,
    );
    assert.equal((await c.getCheckpoint("run"))!.version, 1n, "the stale fence stored nothing");
  } finally {
    await c.close();
  }
});
