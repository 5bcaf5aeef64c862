// A real boxd daemon for the tests: temp BOXD_HOME, the repo's venv, the shared image cache.
import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const PKG = resolve(dirname(fileURLToPath(import.meta.url)), "..");
export const REPO = resolve(PKG, "..");
export const PYTHON = process.env.BOXD_PYTHON ?? join(REPO, ".venv", "bin", "python");
export const CLI = process.env.BOXD_CLI ?? join(dirname(PYTHON), "boxd");
export const IMAGE_CACHE = process.env.BOXD_IMAGE_CACHE ?? join(REPO, ".cache", "images");

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function freePort() {
  return new Promise((ok, fail) => {
    const srv = createServer();
    srv.once("error", fail);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => ok(port));
    });
  });
}

/** The daemon's tmpfs folder for a data directory (boxd.config.Paths.shm). */
export function shmOf(home) {
  const digest = createHash("sha256").update(home).digest("hex").slice(0, 12);
  return join(process.env.BOXD_SHM ?? "/dev/shm", `boxd-${digest}`);
}

/** The environment a client process of this daemon sees (local discovery, no URL/key). */
export function clientEnv(home, extra = {}) {
  const env = { ...process.env, BOXD_HOME: home, BOXD_CLI: CLI, ...extra };
  delete env.BOXD_URL;
  delete env.BOXD_API_KEY;
  return env;
}

/**
 * Start `python -m boxd serve --listen 127.0.0.1:PORT` on a fresh data directory and wait
 * until it answers on TCP and has written local.key.
 */
export async function startDaemon({ timeoutMs = 120_000 } = {}) {
  const home = mkdtempSync(join(tmpdir(), "boxd-ts-"));
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  const env = clientEnv(home, { BOXD_IMAGE_CACHE: IMAGE_CACHE });
  const proc = spawn(PYTHON, ["-m", "boxd", "serve", "--listen", `127.0.0.1:${port}`], {
    env,
    cwd: home,
    stdio: ["ignore", "pipe", "pipe"],
  });
  let output = "";
  proc.stdout.on("data", (d) => (output += d));
  proc.stderr.on("data", (d) => (output += d));
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (proc.exitCode !== null) throw new Error(`boxd serve exited ${proc.exitCode}: ${output}`);
    try {
      const resp = await fetch(`${url}/v1/health`);
      if (resp.ok && existsSync(join(home, "local.key"))) break;
    } catch {
      // not yet
    }
    if (Date.now() > deadline) {
      proc.kill("SIGTERM");
      throw new Error(`boxd serve did not answer within ${timeoutMs / 1000} s: ${output}`);
    }
    await sleep(200);
  }
  const key = readFileSync(join(home, "local.key"), "utf8").trim();
  return {
    home,
    port,
    url,
    key,
    output: () => output,
    log: () => {
      try {
        return readFileSync(join(home, "daemon.log"), "utf8");
      } catch {
        return "";
      }
    },
    async stop() {
      // Machines outlive their daemon by design: delete what is left first.
      const auth = { Authorization: `Bearer ${key}` };
      try {
        const { machines } = await (await fetch(`${url}/v1/machines`, { headers: auth })).json();
        for (const m of machines) await fetch(`${url}/v1/machines/${m.id}`, { method: "DELETE", headers: auth });
      } catch {
        // the daemon is gone already
      }
      if (proc.exitCode === null) {
        proc.kill("SIGTERM");
        const t = Date.now();
        while (proc.exitCode === null && Date.now() - t < 30_000) await sleep(100);
        if (proc.exitCode === null) proc.kill("SIGKILL");
      }
      rmSync(shmOf(home), { recursive: true, force: true, maxRetries: 3 });
      rmSync(home, { recursive: true, force: true, maxRetries: 3 });
    },
  };
}
