// Regenerates src/gen from the protos: `npm run generate` (or `node scripts/generate.mjs OUT`).
//
// buf compiles ../../protos (leasekeeper's API) and protos/ (google.rpc's status and error
// details) and hands them to ts-proto (buf.gen.yaml). buf is the one in the repository's root
// node_modules (`npm ci` at the root, or `make protos-check`, installs it). OUT (default: this
// package's folder) receives src/gen/...; test/generated.test.ts generates into a temporary
// OUT and compares it with the committed src/gen.
import { spawnSync } from "node:child_process";
import { existsSync, rmSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const PACKAGE_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const BUF = resolve(PACKAGE_DIR, "../../node_modules/.bin/buf");

/** Generates into `outDir/src/gen`, emptied first; throws with buf's output when it fails. */
export function generate(outDir = PACKAGE_DIR) {
  if (!existsSync(BUF)) {
    throw new Error(`${BUF} is missing: run \`npm ci\` at the repository's root (make protos-check does)`);
  }
  rmSync(join(outDir, "src", "gen"), { recursive: true, force: true });
  const run = spawnSync(BUF, ["generate", "--template", "buf.gen.yaml", "-o", outDir], {
    cwd: PACKAGE_DIR,
    encoding: "utf8",
  });
  if (run.status !== 0) {
    throw new Error(`buf generate failed (exit ${run.status}):\n${run.stdout}${run.stderr}`);
  }
  return join(outDir, "src", "gen");
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  console.log(generate(process.argv[2] ? resolve(process.argv[2]) : PACKAGE_DIR));
}
