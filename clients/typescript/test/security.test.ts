/**
 * TLS and bearer tokens against a real server that requires both, and the address and token
 * taken from LEASEKEEPER_TARGET and LEASEKEEPER_TOKEN as the Python client and the leasekeeper
 * command take them.
 */
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { status as Code } from "@grpc/grpc-js";
import { AccessDenied, FenceChecker, LeaseClient, LeaseUnavailable, StaleFence } from "../src/index.js";
import { python, Server, type TestDatabase, testDatabase } from "./support/server.js";

/** A CA and a server certificate for 127.0.0.1 (the venv's cryptography, as tests/integration/test_tls.py). */
const CERTS = `
import ipaddress, sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
out, now = Path(sys.argv[1]), datetime.now(UTC)
def cert(subject, issuer, key, signer, ca, names=()):
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(hours=1))
         .not_valid_after(now + timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names: b = b.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return b.sign(signer, hashes.SHA256())
name = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
ca = cert(name("test ca"), name("test ca"), ca_key, ca_key, True)
server = cert(name("leasekeeper"), ca.subject, key, ca_key, False,
              [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
pem = serialization.Encoding.PEM
(out / "ca.pem").write_bytes(ca.public_bytes(pem))
(out / "server.pem").write_bytes(server.public_bytes(pem))
(out / "server.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
`;

const NAMESPACE = "secure";
const WORKER_TOKEN = randomBytes(16).toString("hex");
const EFFECT_TOKEN = randomBytes(16).toString("hex");
const sha256 = (text: string) => createHash("sha256").update(text).digest("hex");

let db: TestDatabase;
let server: Server;
let dir: string;
let ca: Buffer;
before(async () => {
  dir = mkdtempSync(join(tmpdir(), "leasekeeper-ts-tls-"));
  python(CERTS, [dir]);
  ca = readFileSync(join(dir, "ca.pem"));
  const entry = (tokenName: string, token: string, role: string) =>
    `[[token]]\nname = "${tokenName}"\nsha256 = "${sha256(token)}"\nrole = "${role}"\nnamespaces = ["${NAMESPACE}"]\n`;
  writeFileSync(join(dir, "tokens.toml"), entry("ts-worker", WORKER_TOKEN, "worker") + entry("ts-effect", EFFECT_TOKEN, "effect"));
  db = testDatabase();
  server = await Server.start(db, {
    auth: "on",
    tokens_file: join(dir, "tokens.toml"),
    tls_cert_file: join(dir, "server.pem"),
    tls_key_file: join(dir, "server.key"),
  });
});
after(async () => {
  await server?.stop();
  db?.drop();
  rmSync(dir, { recursive: true, force: true });
});

test("over TLS with a worker token: hold a lease; the effect role checks its fence", async () => {
  const worker = new LeaseClient({ target: server.target, namespace: NAMESPACE, tls: { ca }, token: WORKER_TOKEN });
  const effects = new LeaseClient({ target: server.target, namespace: NAMESPACE, tls: { ca }, token: EFFECT_TOKEN });
  try {
    const lease = await worker.hold("t", { ttl: 10 });
    await lease.saveCheckpoint(1, "one"); // the heartbeat stream carries the token too
    const checker = new FenceChecker(effects);
    assert.equal((await checker.checkRef(lease.ref)).valid, true);
    await assert.rejects(
      worker.validateFence("t", lease.fence),
      (e: unknown) => e instanceof AccessDenied && e.code === Code.PERMISSION_DENIED,
      "the worker role may not call ValidateFence",
    );
    await lease.close();
    await assert.rejects(checker.checkRef(lease.ref), (e: unknown) => e instanceof StaleFence && e.reason === "LEASE_RELEASED");
  } finally {
    await worker.close();
    await effects.close();
  }
});

test("refused: no token (UNAUTHENTICATED), another namespace (PERMISSION_DENIED), plaintext (UNAVAILABLE)", async () => {
  const previous = process.env.LEASEKEEPER_TOKEN;
  delete process.env.LEASEKEEPER_TOKEN;
  const anonymous = new LeaseClient({ target: server.target, namespace: NAMESPACE, tls: { ca } });
  const elsewhere = new LeaseClient({ target: server.target, namespace: "other", tls: { ca }, token: WORKER_TOKEN });
  const plaintext = new LeaseClient({ target: server.target, namespace: NAMESPACE, token: WORKER_TOKEN, callTimeout: 5 });
  try {
    await assert.rejects(anonymous.claim("t"), (e: unknown) => e instanceof AccessDenied && e.code === Code.UNAUTHENTICATED);
    await assert.rejects(elsewhere.claim("t"), (e: unknown) => e instanceof AccessDenied && e.code === Code.PERMISSION_DENIED);
    await assert.rejects(plaintext.claim("t"), LeaseUnavailable);
  } finally {
    if (previous !== undefined) process.env.LEASEKEEPER_TOKEN = previous;
    await anonymous.close();
    await elsewhere.close();
    await plaintext.close();
  }
});

test("LEASEKEEPER_TARGET and LEASEKEEPER_TOKEN are the defaults; token '' sends none", async () => {
  const saved = { target: process.env.LEASEKEEPER_TARGET, token: process.env.LEASEKEEPER_TOKEN };
  process.env.LEASEKEEPER_TARGET = server.target;
  process.env.LEASEKEEPER_TOKEN = WORKER_TOKEN;
  const fromEnv = new LeaseClient({ namespace: NAMESPACE, tls: { ca } });
  const without = new LeaseClient({ namespace: NAMESPACE, tls: { ca }, token: "" });
  try {
    assert.equal(fromEnv.target, server.target);
    assert.equal((await fromEnv.claim("env", { ttl: 5 })).acquired, true);
    await assert.rejects(without.claim("env"), (e: unknown) => e instanceof AccessDenied && e.code === Code.UNAUTHENTICATED);
    delete process.env.LEASEKEEPER_TARGET;
    const defaulted = new LeaseClient({ token: "" });
    assert.equal(defaulted.target, "127.0.0.1:9457");
    await defaulted.close();
  } finally {
    for (const [key, value] of [["LEASEKEEPER_TARGET", saved.target], ["LEASEKEEPER_TOKEN", saved.token]] as const) {
      if (value === undefined) delete process.env[key];
      else process.env[key] = value;
    }
    await fromEnv.close();
    await without.close();
  }
});
