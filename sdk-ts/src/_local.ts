/**
 * Find the local daemon on its unix socket, and start one when none answers.
 *
 * Mirrors `boxd.sdk._local`: with no `BOXD_URL`, a client talks to `<data dir>/boxd.sock`
 * and, if no daemon answers `GET /v1/health`, starts `boxd serve` detached (own session,
 * output to the daemon log), then waits for health and for `<data dir>/local.key`.
 *
 * Node has no `flock`, so concurrent starts are not serialised across processes as the
 * Python client does; the daemon itself allows one instance per data directory
 * (`daemon.lock`), and a spawned daemon that exits because another one won the race is
 * not an error as long as some daemon answers. Within one process the start runs once.
 */
import { spawn } from "node:child_process";
import { accessSync, constants, existsSync, mkdirSync, openSync, closeSync, readFileSync } from "node:fs";
import { homedir } from "node:os";
import { delimiter, isAbsolute, join, resolve } from "node:path";

import { ConnectionError } from "./errors.js";
import { isConnectRefused, readBody, send } from "./_http.js";

/** Milliseconds to wait for a freshly started daemon to answer /v1/health. */
export const START_TIMEOUT_MS = 30_000;
const POLL_MS = 100;

/**
 * The data directory, as the Python side computes it: `$BOXD_HOME`, else `/var/lib/boxd`
 * for root, else `$XDG_DATA_HOME/boxd`, else `~/.local/share/boxd`.
 */
export function dataDir(env: NodeJS.ProcessEnv = process.env): string {
  if (env.BOXD_HOME) return resolve(env.BOXD_HOME.replace(/^~(?=$|\/)/, homedir()));
  if (process.getuid?.() === 0) return "/var/lib/boxd";
  const xdg = env.XDG_DATA_HOME || join(homedir(), ".local", "share");
  return resolve(xdg, "boxd");
}

export const socketPath = (home: string): string => join(home, "boxd.sock");
export const localKeyPath = (home: string): string => join(home, "local.key");
export const logPath = (home: string): string => join(home, "daemon.log");

/** The local daemon's key for this OS user, or null if absent or unreadable. */
export function readLocalKey(home: string): string | null {
  try {
    return readFileSync(localKeyPath(home), "utf8").trim() || null;
  } catch {
    return null;
  }
}

/**
 * Whether a daemon answers `GET /v1/health` on the socket: "up"; "down" (no socket, or
 * nobody listens on it); or "busy" (something accepted the connection but did not answer
 * in time, e.g. a daemon on an overloaded host: wait for it rather than start another).
 */
export async function probe(socket: string, timeoutMs = 2000): Promise<"up" | "down" | "busy"> {
  if (!existsSync(socket)) return "down";
  try {
    const resp = await send(
      { baseUrl: "http://boxd", socketPath: socket },
      { method: "GET", path: "/v1/health", idleTimeoutMs: timeoutMs },
    );
    await readBody(resp);
    return resp.statusCode === 200 ? "up" : "busy";
  } catch (err) {
    return isConnectRefused(err) ? "down" : "busy";
  }
}

/** True when a daemon answers `GET /v1/health` on the socket. */
export async function isHealthy(socket: string, timeoutMs = 2000): Promise<boolean> {
  return (await probe(socket, timeoutMs)) === "up";
}

/** The `boxd` CLI: `$BOXD_CLI`, else `boxd` on PATH. */
export function findCli(env: NodeJS.ProcessEnv = process.env): string | null {
  if (env.BOXD_CLI) return env.BOXD_CLI;
  for (const dir of (env.PATH ?? "").split(delimiter)) {
    if (!dir || !isAbsolute(dir)) continue;
    const candidate = join(dir, "boxd");
    try {
      accessSync(candidate, constants.X_OK);
      return candidate;
    } catch {
      // not here
    }
  }
  return null;
}

function logTail(home: string, lines = 5): string {
  try {
    const text = readFileSync(logPath(home), "utf8").trim().split("\n");
    return text.slice(-lines).map((l) => l.trim()).join(" | ").slice(0, 600);
  } catch {
    return "";
  }
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

const starting = new Map<string, Promise<void>>();

/**
 * Make sure a daemon answers on `<home>/boxd.sock`, starting one if needed.
 *
 * @throws ConnectionError the daemon could not be started or did not answer in time;
 *   the message says what failed and names the log file.
 */
export function ensureDaemon(home: string, timeoutMs = START_TIMEOUT_MS): Promise<void> {
  let p = starting.get(home);
  if (p === undefined) {
    p = start(home, timeoutMs).finally(() => starting.delete(home));
    starting.set(home, p);
  }
  return p;
}

async function start(home: string, timeoutMs: number): Promise<void> {
  const socket = socketPath(home);
  const state = await probe(socket);
  if (state === "up") return;
  if (state === "busy") {
    // A daemon holds the socket but is slow to answer: wait for it, start nothing.
    const deadline = Date.now() + timeoutMs;
    let now: string = state;
    while (now === "busy" && Date.now() < deadline) {
      now = await probe(socket, Math.max(500, Math.min(5000, deadline - Date.now())));
      if (now === "busy") await sleep(POLL_MS);
    }
    if (now === "up") return waitForKey(home);
    if (now === "busy") {
      throw new ConnectionError(
        `the boxd daemon on ${socket} did not answer within ${Math.round(timeoutMs / 1000)} s`,
        { hint: `it may be overloaded; see its log: ${logPath(home)}` },
      );
    }
    // It went away: start one below.
  }
  const cli = findCli();
  if (cli === null) {
    throw new ConnectionError(`no boxd daemon answers on ${socket}, and the boxd CLI is not on PATH`, {
      hint: "install boxd (its CLI starts the daemon), set BOXD_CLI to its path, or BOXD_URL to a running daemon",
    });
  }
  let log: number;
  try {
    mkdirSync(home, { recursive: true, mode: 0o700 });
    log = openSync(logPath(home), "a");
  } catch (err) {
    throw new ConnectionError(
      `cannot start the boxd daemon: cannot create ${home}: ${(err as Error).message}`,
      { hint: "set BOXD_HOME to a writable directory, or BOXD_URL to a running daemon", cause: err },
    );
  }
  const env: NodeJS.ProcessEnv = { ...process.env, BOXD_HOME: home }; // the daemon serves the dir we looked in
  delete env.BOXD_URL;
  let exited: number | null = null;
  let spawnError: Error | null = null;
  try {
    const child = spawn(cli, ["serve"], {
      cwd: home,
      env,
      detached: true, // own session: survives the client, no terminal signals
      stdio: ["ignore", log, log], // a crash at start-up leaves its traceback in the log
    });
    child.on("error", (err) => (spawnError = err));
    child.on("exit", (code, signal) => (exited = code ?? (signal ? 128 : 1)));
    child.unref();
  } finally {
    closeSync(log);
  }
  const deadline = Date.now() + timeoutMs;
  let exitSeenAt: number | null = null;
  while (Date.now() < deadline) {
    if (await isHealthy(socket, 1000)) {
      await waitForKey(home);
      return;
    }
    if (spawnError !== null) {
      throw new ConnectionError(`cannot start the boxd daemon (${cli} serve): ${(spawnError as Error).message}`, {
        hint: `set BOXD_CLI to the boxd CLI; see ${logPath(home)}`,
      });
    }
    if (exited !== null) {
      // Another client's daemon may have won the race for daemon.lock: give it a moment.
      exitSeenAt ??= Date.now();
      if (Date.now() - exitSeenAt > 5000) {
        const tail = logTail(home);
        throw new ConnectionError(
          `the boxd daemon exited at start-up with status ${exited}${tail ? `: ${tail}` : ""}`,
          { hint: `full log: ${logPath(home)}` },
        );
      }
    }
    await sleep(POLL_MS);
  }
  throw new ConnectionError(
    `the boxd daemon did not answer on ${socket} within ${Math.round(timeoutMs / 1000)} s`,
    { hint: `see its log: ${logPath(home)}` },
  );
}

async function waitForKey(home: string, timeoutMs = 5000): Promise<void> {
  // The daemon writes local.key before it listens; allow a short race anyway.
  const deadline = Date.now() + timeoutMs;
  while (readLocalKey(home) === null && Date.now() < deadline) await sleep(POLL_MS);
}
