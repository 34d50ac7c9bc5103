/**
 * A real `leasekeeper serve` for the tests: the repository's venv (`.venv/bin/leasekeeper`, or
 * `$LEASEKEEPER_VENV/bin/leasekeeper`), on a free loopback port, on a database of its own.
 *
 * The database is a fresh one on the machine's PostgreSQL (127.0.0.1:5432, user postgres),
 * created by {@link testDatabase} and dropped at its `drop()`; when no PostgreSQL answers there
 * (or `LEASEKEEPER_TEST_EMBEDDED=1`), each server runs the embedded PostgreSQL in a temporary
 * data directory. Nothing waits with a fixed sleep: the server is ready when it prints its
 * listening line, and tests poll real state.
 */
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { closeSync, existsSync, mkdtempSync, openSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { after, before } from "node:test";
import { fileURLToPath } from "node:url";

/** The repository's root (this file is clients/typescript/{build/,}test/support/server.*). */
export const ROOT = (() => {
  let dir = dirname(fileURLToPath(import.meta.url));
  while (!existsSync(join(dir, "protos", "leasekeeper"))) {
    const parent = dirname(dir);
    if (parent === dir) throw new Error("not inside a leasekeeper checkout");
    dir = parent;
  }
  return dir;
})();
export const VENV = process.env.LEASEKEEPER_VENV ?? join(ROOT, ".venv");
export const PYTHON = join(VENV, "bin", "python");
const LEASEKEEPER = join(VENV, "bin", "leasekeeper");
const START_TIMEOUT_MS = 60_000;
const ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres";

/** Runs a Python snippet with the venv's interpreter (asyncpg, cryptography); returns its stdout. */
export function python(code: string, args: string[] = []): string {
  if (!existsSync(PYTHON)) throw new Error(`${PYTHON} is missing: run \`make\` at the repository's root first`);
  return execFileSync(PYTHON, ["-c", code, ...args], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
}

const ADMIN = `
import asyncio, sys, asyncpg
async def main(sql):
    try:
        conn = await asyncpg.connect(${JSON.stringify(ADMIN_URL)}, timeout=2)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        print("absent"); return
    try:
        if sql: await conn.execute(sql)
    finally:
        await conn.close()
    print("ok")
asyncio.run(main(sys.argv[1]))
`;

/** A database for the servers of one test file: `url` is null for the embedded PostgreSQL. */
export interface TestDatabase {
  url: string | null;
  drop(): void;
}

/** A fresh database on 127.0.0.1:5432, or the embedded PostgreSQL when none answers there. */
export function testDatabase(): TestDatabase {
  if (process.env.LEASEKEEPER_TEST_EMBEDDED === "1" || python(ADMIN, [""]).trim() !== "ok") {
    return { url: null, drop: () => {} };
  }
  const name = `leasekeeper_ts_${randomBytes(5).toString("hex")}`;
  python(ADMIN, [`CREATE DATABASE "${name}"`]);
  return {
    url: `postgresql://postgres@127.0.0.1:5432/${name}`,
    drop: () => {
      python(ADMIN, [`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`]);
    },
  };
}

/** A running server: its address, its process (to pause it), its log. */
export class Server {
  private constructor(
    readonly target: string,
    readonly process: ChildProcess,
    readonly logPath: string,
    private readonly workdir: string,
  ) {}

  /**
   * Start `leasekeeper serve` with `settings` (LEASEKEEPER_<NAME> environment variables, e.g.
   * `{ auth: "on", tokens_file: path }`) and wait for its listening line.
   */
  static async start(database: TestDatabase, settings: Record<string, string | number> = {}): Promise<Server> {
    const workdir = mkdtempSync(join(tmpdir(), "leasekeeper-ts-server-"));
    const env: Record<string, string> = {};
    for (const [key, value] of Object.entries(process.env)) {
      if (value !== undefined && !key.startsWith("LEASEKEEPER_") && !key.startsWith("FAKETIME")) env[key] = value;
    }
    env.LEASEKEEPER_LISTEN = "127.0.0.1:0";
    env.LEASEKEEPER_CONSOLE_LISTEN = "off";
    env.LEASEKEEPER_LOG_LEVEL = "WARNING";
    if (database.url !== null) env.LEASEKEEPER_DATABASE_URL = database.url;
    else env.LEASEKEEPER_DATA_DIR = join(workdir, "pgdata");
    for (const [name, value] of Object.entries(settings)) env[`LEASEKEEPER_${name.toUpperCase()}`] = String(value);
    const logPath = join(workdir, "server.log");
    const log = openSync(logPath, "w");
    const child = spawn(LEASEKEEPER, ["serve"], { cwd: workdir, env, stdio: ["ignore", log, log] });
    closeSync(log);
    const started = Date.now();
    for (;;) {
      const text = readFileSync(logPath, "utf8");
      const match = /leasekeeper listening on (\S+):(\d+)/.exec(text);
      if (match) return new Server(`127.0.0.1:${match[2]}`, child, logPath, workdir);
      if (child.exitCode !== null || Date.now() - started > START_TIMEOUT_MS) {
        child.kill("SIGKILL");
        throw new Error(`leasekeeper serve did not start (exit ${child.exitCode}):\n${text}`);
      }
      await new Promise((r) => setTimeout(r, 50));
    }
  }

  /** SIGSTOP: the server answers nothing, its connections stay open. */
  pause(): void {
    this.process.kill("SIGSTOP");
  }

  resume(): void {
    this.process.kill("SIGCONT");
  }

  log(): string {
    return readFileSync(this.logPath, "utf8");
  }

  /** SIGTERM (after SIGCONT), then SIGKILL if it is not gone within 15 s; removes its folder. */
  async stop(): Promise<void> {
    const child = this.process;
    if (child.exitCode === null && child.signalCode === null) {
      const exited = new Promise<void>((r) => child.once("exit", () => r()));
      child.kill("SIGCONT");
      child.kill("SIGTERM");
      const timer = setTimeout(() => child.kill("SIGKILL"), 15_000);
      await exited;
      clearTimeout(timer);
    }
    rmSync(this.workdir, { recursive: true, force: true });
  }
}

/** A namespace no other test uses. */
export function freshNamespace(): string {
  return `ts-${randomBytes(6).toString("hex")}`;
}

/** Poll `probe` until it returns a value other than undefined/false, or fail after `withinS`. */
export async function pollUntil<T>(
  probe: () => Promise<T | undefined | false> | T | undefined | false,
  what: string,
  withinS = 20,
): Promise<T> {
  const deadline = performance.now() + withinS * 1000;
  for (;;) {
    const value = await probe();
    if (value !== undefined && value !== false) return value as T;
    if (performance.now() > deadline) throw new Error(`not within ${withinS} s: ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

export const PACKAGE_DIR = resolve(ROOT, "clients", "typescript");

/**
 * One server on a fresh database for a whole test file: started before its first test,
 * stopped (and the database dropped) after its last. Returns where to reach it, and its
 * database (for a second server of the same file).
 */
export function serverForFile(): { readonly target: string; readonly database: TestDatabase } {
  let db: TestDatabase | undefined;
  let server: Server | undefined;
  before(async () => {
    db = testDatabase();
    server = await Server.start(db);
  });
  after(async () => {
    await server?.stop();
    db?.drop();
  });
  return {
    get target(): string {
      if (server === undefined) throw new Error("the file's server has not started");
      return server.target;
    },
    get database(): TestDatabase {
      if (db === undefined) throw new Error("the file's database has not been made");
      return db;
    },
  };
}
