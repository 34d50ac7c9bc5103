/** The trust window on an injected clock: the rules the heartbeat relies on. */
import assert from "node:assert/strict";
import { test } from "node:test";
import { defaultSafetyMargin, InvalidArgument, LeaseClient, TrustWindow } from "../src/index.js";

test("the trust deadline is send time + remaining ttl - margin, moved only by newer, written answers", () => {
  let now = 100;
  const window = new TrustWindow(0.5, () => now, new Date("2030-01-01T00:00:10Z"));
  assert.equal(window.expired(), true, "nothing confirmed yet: not trusted");
  window.confirm(100, 10);
  assert.equal(window.deadline, 109.5);
  window.confirm(99, 30); // an answer to an older request
  assert.equal(window.deadline, 109.5);
  window.confirm(101, 30, false); // answered without a write: never extends
  assert.equal(window.deadline, 109.5);
  window.confirm(102, 2, false); // ... but may shorten
  assert.equal(window.deadline, 103.5);
  now = 103.5;
  assert.equal(window.expired(), true);
  assert.equal(window.lossReason, "LEASE_EXPIRED");
  window.confirm(104, 6, true, new Date("2030-01-01T00:00:10Z"));
  assert.equal(window.lossReason, "RUNTIME_EXCEEDED", "the answer ended the lease at its runtime budget");
  assert.equal(defaultSafetyMargin(30), 1);
  assert.equal(defaultSafetyMargin(2), 0.2);
});

test("hold() refuses a heartbeat interval that leaves fewer than two beats per ttl, naming it", async () => {
  const client = new LeaseClient({ target: "127.0.0.1:1" });
  try {
    for (const options of [{ ttl: 10, heartbeatInterval: 6 }, { ttl: null, heartbeatInterval: 1 }, { ttl: 10, heartbeatInterval: 0.001 }]) {
      await assert.rejects(client.hold("t", options), (e: unknown) => e instanceof InvalidArgument && e.field === "heartbeatInterval");
    }
    await assert.rejects(client.hold("t", { ttl: -1 }), (e: unknown) => e instanceof InvalidArgument && e.field === "ttl");
  } finally {
    await client.close();
  }
});
