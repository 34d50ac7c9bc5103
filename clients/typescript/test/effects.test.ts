/**
 * The effect ledger against a real server: an effect runs once and is then returned as
 * recorded; a refusal is recorded FAILED; an attempt that was never confirmed is in doubt for the
 * next owner, which reconciles it with the outside system instead of repeating it; ValidateFence
 * and FenceChecker refuse a stale fence.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import {
  EffectFailed,
  EffectInDoubt,
  FenceChecker,
  LeaseClient,
  LeaseLost,
  requestDigest,
  StaleFence,
} from "../src/index.js";
import { freshNamespace, serverForFile } from "./support/server.js";

const server = serverForFile();

const text = (data: Uint8Array) => Buffer.from(data).toString("utf8");

test("an effect runs once; run again, the recorded result comes back without running it", async () => {
  const c = new LeaseClient({ target: server.target, namespace: freshNamespace() });
  try {
    const lease = await c.hold("order-1", { ttl: 10 });
    let sends = 0;
    const send = async () => {
      sends += 1;
      return "msg-42";
    };
    const digest = requestDigest({ to: "a@example.com", body: "hi" });
    assert.deepEqual(requestDigest({ body: "hi", to: "a@example.com" }), digest, "key order does not matter");
    const first = await lease.effect("email:welcome", { policy: "ONCE", requestDigest: digest }).run(send);
    assert.deepEqual([text(first.result), first.fresh, first.effect.state, sends], ["msg-42", true, "SUCCEEDED", 1]);
    const again = await lease.effect("email:welcome", { policy: "ONCE", requestDigest: digest }).run(send);
    assert.deepEqual([text(again.result), again.fresh, sends], ["msg-42", false, 1]);

    await assert.rejects(
      lease.effect("charge", { policy: "ONCE" }).run(async () => {
        throw new EffectFailed("card declined", { retryable: false, result: "declined" });
      }),
      (e: unknown) => e instanceof EffectFailed && e.effect?.state === "FAILED",
    );
    let charged = 0;
    await assert.rejects(
      lease.effect("charge", { policy: "ONCE" }).run(async () => {
        charged += 1;
        return "x";
      }),
      (e: unknown) => e instanceof EffectFailed && text(e.result) === "declined",
    );
    assert.equal(charged, 0, "a FAILED outcome that may not be retried is not run again");
    await lease.close();
  } finally {
    await c.close();
  }
});

test("an attempt never confirmed is in doubt for the next owner, which reconciles instead of repeating it", async () => {
  const namespace = freshNamespace();
  const a = new LeaseClient({ target: server.target, namespace });
  const b = new LeaseClient({ target: server.target, namespace });
  const outside = new Map<string, string>(); // the outside system: what it did, by idempotency key
  let performed = 0;
  const perform = (key: string) => async () => {
    performed += 1;
    outside.set(key, `vendor-${performed}`);
    throw new Error("connection reset after sending"); // the answer never came back
  };
  try {
    const first = await a.hold("order-2", { ttl: 10 });
    for (const key of ["pay", "mail"]) {
      await assert.rejects(first.effect(key, { policy: "ONCE" }).run(perform(key)), /connection reset/);
    }
    outside.delete("mail"); // the mail never left: the outside system has no record of it
    const [reserved] = await a.listEffects("order-2", { state: "RESERVED" });
    assert.deepEqual(reserved.map((e) => [e.effectKey, e.fence]), [["mail", first.fence], ["pay", first.fence]]);
    await a.revoke("order-2", "test: the worker is gone");
    await first.close();

    const second = await b.hold("order-2", { ttl: 10 });
    await assert.rejects(
      second.effect("pay", { policy: "ONCE" }).run(async () => "must not run"),
      (e: unknown) => e instanceof EffectInDoubt && e.effect.fence === first.fence && e.effect.state === "RESERVED",
    );
    const reconcile = async (effect: { effectKey: string }) => outside.get(effect.effectKey) ?? null;
    const paid = await second.effect("pay", { policy: "ONCE", reconcile }).run(async () => "must not run");
    assert.deepEqual(
      [text(paid.result), paid.fresh, paid.effect.state, paid.effect.completeFence, performed],
      ["vendor-1", false, "SUCCEEDED", second.fence, 2],
      "found in the outside system: recorded, not repeated",
    );
    const mailed = await second.effect("mail", { policy: "ONCE", reconcile }).run(async () => "sent-by-b");
    assert.deepEqual(
      [text(mailed.result), mailed.fresh, mailed.effect.attempts],
      ["sent-by-b", true, 2],
      "absent from the outside system: recorded FAILED (retryable), then done once",
    );
    await second.close();
  } finally {
    await a.close();
    await b.close();
  }
});

test("ValidateFence and FenceChecker: the current fence is valid, a superseded one is stale", async () => {
  const c = new LeaseClient({ target: server.target, namespace: freshNamespace() });
  try {
    const lease = await c.hold("t", { ttl: 10 });
    const checker = new FenceChecker(c);
    const valid = await checker.check(c.namespace, "t", lease.fence);
    assert.equal(valid.valid, true);
    assert.ok(valid.remainingTtl > 0 && valid.expireTime instanceof Date);
    await c.revoke("t", "test");
    const stale = await c.validateFence("t", lease.fence);
    assert.deepEqual([stale.valid, stale.reason, stale.currentFence], [false, "LEASE_REVOKED", lease.fence]);
    await assert.rejects(checker.checkRef(lease.ref), (e: unknown) => e instanceof StaleFence && e.reason === "LEASE_REVOKED");
    let ran = false;
    await assert.rejects(
      lease.effect("late", { policy: "LATEST" }).run(async () => {
        ran = true;
        return null;
      }),
      LeaseLost,
    );
    assert.equal(ran, false, "a lost lease starts no effect");
    await lease.close();
  } finally {
    await c.close();
  }
});
