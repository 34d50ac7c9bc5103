// The package as a user gets it: `npm run test:pack` (make test-ts runs it after `npm test`).
//
// 1. `npm pack` makes the tarball (prepack builds dist/ with tsc); its files are checked: the
//    compiled code and its types, no sources or tests.
// 2. An empty project installs the tarball with `npm install` (its dependencies come from the
//    npm registry, as for a user).
// 3. A TypeScript file importing the package type-checks against the shipped types.
// 4. The quickstart of docs/guides/node-worker.md (its first js block) runs in that project
//    against a real `leasekeeper serve` on a fresh database, and prints its output block.
// The test's server and database come from build/test/support/server.js (`npm run build:test`).
import assert from "node:assert/strict";
import { execFileSync, spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const PACKAGE_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const ROOT = resolve(PACKAGE_DIR, "../..");
const GUIDE = join(ROOT, "docs", "guides", "node-worker.md");
const { Server, testDatabase } = await import(join(PACKAGE_DIR, "build", "test", "support", "server.js"));

const npm = (args, cwd) => execFileSync("npm", args, { cwd, encoding: "utf8", stdio: ["ignore", "pipe", "inherit"] });

/** The first ```js block of the guide and the ```output block right after it. */
function quickstart() {
  const text = readFileSync(GUIDE, "utf8");
  const found = /```js\n([\s\S]*?)```\s*```output\n([\s\S]*?)```/.exec(text);
  assert.ok(found, `${GUIDE} has no js block followed by its output`);
  return { source: found[1], output: found[2] };
}

/** `printed` matches `expected`, where `...` stands for any text (as tests/docs/blocks.py). */
function matches(expected, printed) {
  const lines = (t) => t.replace(/^\n+|\n+$/g, "").split("\n").map((l) => l.trimEnd()).join("\n");
  const escape = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  return new RegExp(`^${lines(expected).split("...").map(escape).join("[\\s\\S]*?")}$`).test(lines(printed));
}

const work = mkdtempSync(join(tmpdir(), "leasekeeper-ts-pack-"));
let server;
let database;
let passed = 0;
let failed = 0;
const step = async (name, body) => {
  try {
    await body();
    passed += 1;
    console.log(`ok - ${name}`);
  } catch (error) {
    failed += 1;
    console.log(`not ok - ${name}\n${error?.stack ?? error}`);
    throw error;
  }
};
try {
  let tarball;
  await step("npm pack makes a tarball of the compiled package and its types", () => {
    const [packed] = JSON.parse(npm(["pack", "--json", "--pack-destination", work], PACKAGE_DIR));
    tarball = join(work, packed.filename);
    const files = packed.files.map((f) => f.path);
    for (const needed of ["package.json", "README.md", "dist/index.js", "dist/index.d.ts", "dist/gen/leasekeeper/v1/lease_service.js"]) {
      assert.ok(files.includes(needed), `${needed} is not in the tarball`);
    }
    const stray = files.filter((f) => /^(src|test|build|scripts|protos)\//.test(f) || f.endsWith(".ts") && !f.endsWith(".d.ts"));
    assert.deepEqual(stray, [], "sources or tests in the tarball");
  });

  const project = join(work, "project");
  await step("an empty project installs the tarball", () => {
    execFileSync("mkdir", ["-p", project]);
    writeFileSync(join(project, "package.json"), JSON.stringify({ name: "quickstart", private: true, type: "module" }, null, 2));
    npm(["install", "--no-audit", "--no-fund", tarball], project);
    const installed = JSON.parse(readFileSync(join(project, "node_modules", "@leasekeeper", "client", "package.json"), "utf8"));
    assert.equal(installed.name, "@leasekeeper/client");
  });

  await step("a TypeScript file type-checks against the shipped types", () => {
    writeFileSync(
      join(project, "check.ts"),
      [
        'import { LeaseClient, LeaseLost, type HeldLease } from "@leasekeeper/client";',
        "const client: LeaseClient = new LeaseClient({ namespace: \"types\" });",
        "const use = async (lease: HeldLease): Promise<bigint> => { lease.check(); return lease.fence; };",
        "void use; void LeaseLost; void client.close();",
        "",
      ].join("\n"),
    );
    const tsc = join(PACKAGE_DIR, "node_modules", "typescript", "bin", "tsc");
    const run = spawnSync(
      process.execPath,
      [tsc, "--noEmit", "--strict", "--module", "nodenext", "--moduleResolution", "nodenext", "--target", "es2022", "--types", "node",
        "--typeRoots", join(PACKAGE_DIR, "node_modules", "@types"), "check.ts"],
      { cwd: project, encoding: "utf8" },
    );
    assert.equal(run.status, 0, `tsc failed:\n${run.stdout}${run.stderr}`);
  });

  await step("the docs' quickstart runs in it against a real server and prints its output", async () => {
    database = testDatabase();
    server = await Server.start(database);
    const { source, output } = quickstart();
    writeFileSync(join(project, "quickstart.mjs"), source);
    const env = { ...process.env, LEASEKEEPER_TARGET: server.target };
    delete env.LEASEKEEPER_TOKEN;
    const run = spawnSync(process.execPath, ["quickstart.mjs"], { cwd: project, env, encoding: "utf8", timeout: 120_000 });
    assert.equal(run.status, 0, `the quickstart exited ${run.status}:\n${run.stdout}${run.stderr}`);
    assert.ok(matches(output, run.stdout), `the quickstart printed:\n${run.stdout}\nexpected:\n${output}`);
  });
} catch {
  process.exitCode = 1;
} finally {
  await server?.stop();
  database?.drop();
  rmSync(work, { recursive: true, force: true });
  console.log(`pack: ${passed} passed, ${failed} failed`);
}
