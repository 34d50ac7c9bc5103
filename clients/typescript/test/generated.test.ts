/**
 * The committed stubs (src/gen) must be what buf and ts-proto make from the protos today, as
 * tests/unit/test_protos.py holds the Python stubs: generated again into a temporary folder and
 * compared file by file. A difference means `npm run generate` was not run after a proto change.
 */
import assert from "node:assert/strict";
import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";
import { test } from "node:test";
import { pathToFileURL } from "node:url";
import { PACKAGE_DIR } from "./support/server.js";

function files(dir: string): Map<string, string> {
  const found = new Map<string, string>();
  const walk = (at: string) => {
    for (const entry of readdirSync(at, { withFileTypes: true })) {
      const path = join(at, entry.name);
      if (entry.isDirectory()) walk(path);
      else found.set(relative(dir, path), readFileSync(path, "utf8"));
    }
  };
  walk(dir);
  return found;
}

test("src/gen matches the protos (npm run generate)", async () => {
  const { generate } = (await import(pathToFileURL(join(PACKAGE_DIR, "scripts", "generate.mjs")).href)) as {
    generate(out: string): string;
  };
  const out = mkdtempSync(join(tmpdir(), "leasekeeper-ts-gen-"));
  try {
    const fresh = files(generate(out));
    const committed = files(join(PACKAGE_DIR, "src", "gen"));
    assert.ok(fresh.has(join("leasekeeper", "v1", "lease_service.ts")), "buf generated nothing for the API");
    const stale = [...new Set([...fresh.keys(), ...committed.keys()])]
      .filter((path) => fresh.get(path) !== committed.get(path))
      .sort();
    assert.deepEqual(stale, [], "stubs are stale: run `npm run generate` in clients/typescript");
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
});
