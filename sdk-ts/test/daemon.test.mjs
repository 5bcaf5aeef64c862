// Against a REAL daemon started here: one booted machine, forks for everything else.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync, copyFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { promisify } from "node:util";
import { gzipSync } from "node:zlib";

import * as sdk from "@boxd-sh/sdk";
import { render } from "../scripts/gen.mjs";
import { CLI, PKG, clientEnv, shmOf, startDaemon } from "./daemon.mjs";

const run = promisify(execFile);
const SPEC = process.env.BOXD_SPEC ?? "/work/shared/spec/reproducible-rl-environments.md";
const LONG = { timeout: 15 * 60_000 }; // TCG emulation on a shared 2-core host: be patient

let daemon; // startDaemon()
let boxd; // local discovery: unix socket + local.key
let tcp; // TCP + explicit key
let base; // the one booted machine
const made = new Set(); // machine names to delete at the end
const scratch = mkdtempSync(join(tmpdir(), "boxd-ts-scratch-"));

function withEnv(vars, fn) {
  const saved = { ...process.env };
  Object.assign(process.env, vars);
  try {
    return fn();
  } finally {
    for (const k of Object.keys(process.env)) if (!(k in saved)) delete process.env[k];
    Object.assign(process.env, saved);
  }
}

async function fork(name) {
  made.add(name);
  const child = await boxd.machines.fork(base.name, { name });
  await boxd.machines.waitUntilReady(child.id, { timeout: 300 });
  return child;
}

async function destroy(name) {
  await boxd.machines.delete(name).catch((e) => assert.ok(e instanceof sdk.MachineNotFound, String(e)));
  made.delete(name);
}

describe("against a real daemon", LONG, () => {
  before(async () => {
    daemon = await startDaemon();
    // Local discovery, as a user with no BOXD_URL / BOXD_API_KEY sees it.
    Object.assign(process.env, clientEnv(daemon.home));
    delete process.env.BOXD_URL;
    delete process.env.BOXD_API_KEY;
    boxd = new sdk.Boxd();
    tcp = new sdk.Boxd({ baseUrl: daemon.url, apiKey: daemon.key });
    base = await boxd.machines.new("ts-base");
    made.add("ts-base");
    base = await boxd.machines.waitUntilReady(base.id, { timeout: 600 });
  });

  after(async () => {
    for (const name of [...made].reverse()) await boxd?.machines.delete(name).catch(() => undefined);
    if (daemon) {
      if (process.env.BOXD_TEST_LOG) writeFileSync(process.env.BOXD_TEST_LOG, daemon.log());
      await daemon.stop();
    }
    rmSync(scratch, { recursive: true, force: true });
  });

  test("the checked-in types match the schema the daemon serves", async () => {
    const resp = await fetch(`${daemon.url}/openapi.json`);
    assert.equal(resp.status, 200);
    const fresh = await render(await resp.json());
    const checkedIn = readFileSync(join(PKG, "src", "schema.ts"), "utf8");
    assert.ok(fresh === checkedIn, "src/schema.ts is stale: run `npm run gen` and commit it");
  });

  test("info and health over the unix socket with the local key", async () => {
    assert.equal(boxd._target.socketPath, join(daemon.home, "boxd.sock"));
    const info = await boxd.info();
    assert.equal(info.dataDir, daemon.home);
    assert.equal(typeof info.qemuVersion, "string");
    assert.equal(typeof info.accelerator, "string");
    const health = await boxd.health();
    assert.equal(health.ok, true);
    assert.equal(typeof health.pid, "number");
  });

  test("nodes: one host is one alive node, camelCase fields", async () => {
    const nodes = await boxd.nodes.list();
    assert.equal(nodes.length, 1);
    assert.equal(nodes[0].id, "local");
    assert.equal(nodes[0].health, "alive");
    assert.equal(typeof nodes[0].memoryFreeMib, "number");
    assert.ok(nodes[0].maxMachines >= 1);
  });

  test("machines: get, list, camelCase fields, over TCP too", async () => {
    const got = await boxd.machines.get("ts-base");
    assert.equal(got.id, base.id);
    assert.equal(got.state, "running");
    assert.equal(typeof got.memoryMib, "number");
    assert.equal(typeof got.createdAt, "number");
    assert.ok(!("memory_mib" in got));
    const viaTcp = await tcp.machines.get(base.id);
    assert.equal(viaTcp.name, "ts-base");
    const list = await tcp.machines.list();
    assert.ok(list.some((m) => m.id === base.id));
  });

  test("exec: output, exit code, env, cwd, stdin, argv", async () => {
    const r = await boxd.machines.exec(base.id, { command: 'python3 -c "print(1+1)"' });
    assert.deepEqual(
      { stdout: r.stdout, exitCode: r.exitCode, signal: r.signal, timedOut: r.timedOut },
      { stdout: "2\n", exitCode: 0, signal: null, timedOut: false },
    );
    assert.equal(typeof r.duration, "number");
    const failed = await boxd.machines.exec(base.id, { command: "echo oops >&2; exit 3" });
    assert.equal(failed.exitCode, 3);
    assert.equal(failed.stderr, "oops\n");
    const env = await boxd.machines.exec(base.id, {
      command: 'echo "$GREETING"; pwd; cat',
      env: { GREETING: "hi" },
      cwd: "/tmp",
      stdin: "from stdin",
    });
    assert.equal(env.stdout, "hi\n/tmp\nfrom stdin");
    const argv = await boxd.machines.exec(base.id, { command: ["echo", "a b", "$HOME"] });
    assert.equal(argv.stdout, "a b $HOME\n");
  });

  test("an exec with an execId is read again by execResult", async () => {
    const r = await boxd.machines.exec(base.id, { command: "echo durable", execId: "ts-1" });
    assert.equal(r.execId, "ts-1");
    const st = await boxd.machines.execResult(base.id, "ts-1", { wait: 1 });
    assert.deepEqual(
      { running: st.running, stdout: st.stdout, exitCode: st.exitCode, error: st.error },
      { running: false, stdout: "durable\n", exitCode: 0, error: null },
    );
    await assert.rejects(boxd.machines.execResult(base.id, "no-such-exec"), sdk.ExecNotFound);
    await assert.rejects(boxd.machines.exec(base.id, { command: "echo other", execId: "ts-1" }),
      sdk.ExecIdConflict);
    // the machine's recent execs list it (newest first), without output
    const listed = await boxd.machines.execs(base.id, { limit: 64 });
    const mine = listed.find((e) => e.execId === "ts-1");
    assert.ok(mine, JSON.stringify(listed));
    assert.deepEqual({ command: mine.command, exitCode: mine.exitCode, running: mine.running },
                     { command: "echo durable", exitCode: 0, running: false });
    assert.equal(mine.stdout, undefined);
    await assert.rejects(boxd.machines.execs(base.id, { limit: 65 }), sdk.InvalidRequest);
  });

  test("exec past its timeout throws ExecTimeout with the partial output", async () => {
    await assert.rejects(
      boxd.machines.exec(base.id, { command: "echo started; sleep 30", timeout: 2 }),
      (err) => {
        assert.ok(err instanceof sdk.ExecTimeout, String(err));
        assert.equal(err.status, 408);
        assert.match(String(err.stdout ?? ""), /started/);
        return true;
      },
    );
  });

  test("execStream yields events as they arrive, then exit", async () => {
    const events = [];
    const arrived = [];
    for await (const event of boxd.machines.execStream(base.id, {
      command: "echo one; sleep 1; echo two >&2; sleep 1; echo three; exit 4",
    })) {
      events.push(event);
      arrived.push(Date.now());
    }
    const last = events.at(-1);
    assert.equal(last.type, "exit");
    assert.equal(last.exitCode, 4);
    assert.equal(last.timedOut, false);
    const out = events.filter((e) => e.type === "stdout").map((e) => e.data).join("");
    const err = events.filter((e) => e.type === "stderr").map((e) => e.data).join("");
    assert.equal(out, "one\nthree\n");
    assert.equal(err, "two\n");
    // Streamed, not buffered: the first output came before the exit (no exact timing).
    assert.ok(arrived[0] < arrived.at(-1));
    // Leaving the loop early closes the stream without error.
    for await (const event of boxd.machines.execStream(base.id, { command: "echo x; sleep 5" })) {
      assert.equal(event.type, "stdout");
      break;
    }
  });

  test("files: upload, download, mode, missing file", async () => {
    const info = await boxd.machines.files.upload(base.id, "/home/boxd/dir/hello.sh", "#!/bin/sh\necho hello\n", {
      mode: 0o755,
    });
    assert.equal(info.path, "/home/boxd/dir/hello.sh");
    assert.equal(info.size, 21);
    assert.equal(info.mode & 0o777, 0o755);
    assert.match(info.sha256, /^[0-9a-f]{64}$/);
    const run = await boxd.machines.exec(base.id, { command: "/home/boxd/dir/hello.sh" });
    assert.equal(run.stdout, "hello\n");
    const bytes = new Uint8Array([0, 1, 2, 255]);
    await boxd.machines.files.upload(base.id, "/tmp/bin.dat", bytes);
    const back = await boxd.machines.files.download(base.id, "/tmp/bin.dat");
    assert.deepEqual([...back], [0, 1, 2, 255]);
    await assert.rejects(
      boxd.machines.files.download(base.id, "/nope/missing"),
      (e) => e instanceof sdk.GuestFileNotFound && e instanceof sdk.NotFound,
    );
  });

  test("fork one child, then a batch by count and by names (per-item results)", async () => {
    await boxd.machines.exec(base.id, { command: "echo parent-state > /tmp/state" });
    const child = await fork("ts-child");
    assert.equal(child.parentId, base.id);
    const r = await boxd.machines.exec(child.id, { command: "cat /tmp/state; hostname" });
    assert.equal(r.stdout, "parent-state\nts-child\n");

    const byCount = await boxd.machines.fork(base.id, { count: 2 });
    assert.equal(byCount.length, 2);
    for (const m of byCount) {
      assert.ok(!(m instanceof sdk.BoxdError), String(m));
      made.add(m.name);
      assert.equal(m.parentId, base.id);
    }
    const byNames = await boxd.machines.fork("ts-base", { names: ["ts-batch-a", "ts-child"] });
    made.add("ts-batch-a");
    assert.equal(byNames.length, 2);
    assert.equal(byNames[0].name, "ts-batch-a");
    assert.ok(byNames[1] instanceof sdk.AlreadyExists, String(byNames[1]));
    assert.equal(byNames[1].resourceName, "ts-child");

    for (const name of [...byCount.map((m) => m.name), "ts-batch-a", "ts-child"]) await destroy(name);
    await assert.rejects(boxd.machines.get("ts-child"), sdk.MachineNotFound);
  });

  test("checkpoints: save, list, restore rewinds in place, delete", async () => {
    const m = await fork("ts-ckpt");
    await boxd.machines.exec(m.id, { command: "echo before > /home/boxd/episode" });
    const ck = await boxd.machines.checkpoints.save(m.id, "episode-start");
    assert.equal(ck.name, "episode-start");
    assert.equal(ck.machineId, m.id);
    assert.deepEqual((await boxd.machines.checkpoints.list(m.id)).map((c) => c.name), ["episode-start"]);
    await assert.rejects(boxd.machines.checkpoints.save(m.id, "episode-start"), sdk.AlreadyExists);

    await boxd.machines.exec(m.id, { command: "echo after > /home/boxd/episode" });
    const restored = await boxd.machines.checkpoints.restore("ts-ckpt", "episode-start");
    assert.equal(restored.id, m.id);
    await boxd.machines.waitUntilReady(m.id, { timeout: 300 });
    const r = await boxd.machines.exec(m.id, { command: "cat /home/boxd/episode" });
    assert.equal(r.stdout, "before\n");

    await assert.rejects(boxd.machines.checkpoints.restore(m.id, "nope"), (e) => e instanceof sdk.CheckpointNotFound);
    await boxd.machines.checkpoints.delete(m.id, "episode-start");
    assert.deepEqual(await boxd.machines.checkpoints.list(m.id), []);
    await destroy("ts-ckpt");
  });

  test("images: import an OCI layout, get, list, remove", async () => {
    // An OCI layout written here: one layer (its bytes are only stored and verified by
    // an import, not unpacked), a config that says how the image runs, a manifest.
    const dir = join(scratch, "layout");
    mkdirSync(join(dir, "blobs", "sha256"), { recursive: true });
    const put = (bytes) => {
      const hex = createHash("sha256").update(bytes).digest("hex");
      writeFileSync(join(dir, "blobs", "sha256", hex), bytes);
      return { digest: `sha256:${hex}`, size: bytes.length };
    };
    const layer = put(gzipSync(Buffer.from("a layer's bytes")));
    const config = put(Buffer.from(JSON.stringify({
      architecture: "amd64", os: "linux", config: { Cmd: ["/bin/app"], Env: ["A=1"], WorkingDir: "/app" },
      rootfs: { type: "layers", diff_ids: [] },
    })));
    const manifest = put(Buffer.from(JSON.stringify({
      schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
      config: { mediaType: "application/vnd.oci.image.config.v1+json", ...config },
      layers: [{ mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", ...layer }],
    })));
    writeFileSync(join(dir, "oci-layout"), '{"imageLayoutVersion":"1.0.0"}');
    writeFileSync(join(dir, "index.json"), JSON.stringify({ schemaVersion: 2, manifests: [
      { mediaType: "application/vnd.oci.image.manifest.v1+json", ...manifest,
        annotations: { "org.opencontainers.image.ref.name": "v1" } }] }));

    const img = await boxd.images.import(`oci:${dir}:v1`, "ts/app:v1");
    assert.equal(img.name, "ts/app:v1");
    assert.equal(img.digest, manifest.digest);
    assert.deepEqual(img.config.cmd, ["/bin/app"]);
    assert.equal(img.config.workingDir, "/app");
    assert.equal((await boxd.images.get("ts/app:v1")).digest, manifest.digest);
    assert.ok((await boxd.images.list()).some((i) => i.name === "ts/app:v1"));
    await assert.rejects(boxd.images.import("ftp:x", "a"), sdk.InvalidRequest);
    await assert.rejects(boxd.images.get("ts/app:v2"), sdk.NotFound);
    assert.equal((await boxd.images.remove("ts/app:v1")).digest, manifest.digest);
    await assert.rejects(boxd.images.get("ts/app:v1"), sdk.NotFound);
  });

  test("snapshots: save, get, list, export, import, delete", async () => {
    const snap = await boxd.snapshots.save(base.id, "ts-env");
    assert.equal(snap.name, "ts-env");
    assert.equal(snap.version, 1);
    assert.match(snap.digest, /^sha256:/);
    const v2 = await boxd.snapshots.save("ts-base", "ts-env", { newVersion: true });
    assert.equal(v2.version, 2);
    await assert.rejects(boxd.snapshots.save(base.id, "ts-env"), sdk.AlreadyExists);
    assert.equal((await boxd.snapshots.get("ts-env@1")).digest, snap.digest);
    assert.equal((await boxd.snapshots.get("ts-env")).version, 2);
    assert.equal((await boxd.snapshots.get(snap.digest)).id, snap.id);
    const names = (await boxd.snapshots.list()).map((s) => `${s.name}@${s.version}`);
    assert.ok(names.includes("ts-env@1") && names.includes("ts-env@2"), names.join(","));

    const file = join(scratch, "ts-env.boxd");
    assert.equal(await boxd.snapshots.export("ts-env@1", file), file);
    assert.ok(existsSync(file));
    const imported = await boxd.snapshots.import(file, { name: "ts-imported" });
    assert.equal(imported.name, "ts-imported");
    assert.equal(imported.digest, snap.digest);
    await assert.rejects(boxd.snapshots.import(join(scratch, "missing.boxd")), sdk.InvalidRequest);

    for (const ref of ["ts-imported", "ts-env@2", "ts-env@1"]) await boxd.snapshots.delete(ref);
    await assert.rejects(boxd.snapshots.get("ts-env"), (e) => e instanceof sdk.SnapshotNotFound);
  });

  test("keys: create, list, use, revoke", async () => {
    const created = await boxd.keys.create("ts-ci");
    assert.match(created.secret, /^boxd_/);
    assert.ok(created.secret.startsWith(created.prefix));
    const withKey = new sdk.Boxd({ baseUrl: daemon.url, apiKey: created.secret });
    assert.ok((await withKey.machines.list()).some((m) => m.id === base.id));
    const listed = await boxd.keys.list();
    assert.ok(listed.some((k) => k.id === created.id && k.revokedAt == null));
    assert.ok(listed.every((k) => !("secret" in k)));
    await boxd.keys.revoke(created.id);
    assert.ok((await boxd.keys.list()).find((k) => k.id === created.id).revokedAt > 0);
    await assert.rejects(withKey.machines.list(), sdk.AuthError);

    // Another account's key sees none of ours.
    const alice = await boxd.keys.create("alice-key", { account: "ts-alice" });
    const asAlice = new sdk.Boxd({ baseUrl: daemon.url, apiKey: alice.secret });
    assert.deepEqual(await asAlice.machines.list(), []);
    await assert.rejects(asAlice.machines.get(base.id), sdk.MachineNotFound);
    await assert.rejects(asAlice.keys.create("x", { account: "local" }), (e) => e instanceof sdk.Forbidden && e.status === 403);
    await asAlice.keys.revoke(alice.id); // a key may revoke itself; local cannot see it
    await assert.rejects(boxd.keys.revoke(alice.id), sdk.NotFound);
  });

  test("errors: unknown machine, invalid name, missing and invalid keys", async () => {
    await assert.rejects(boxd.machines.get("no-such-machine"), (e) => {
      assert.ok(e instanceof sdk.MachineNotFound && e instanceof sdk.NotFound && e instanceof sdk.BoxdError);
      assert.equal(e.code, "machine_not_found");
      assert.equal(e.machine, "no-such-machine");
      assert.ok(e.message.length > 0);
      return true;
    });
    await assert.rejects(boxd.machines.exec("no-such-machine", { command: "true" }), sdk.MachineNotFound);
    await assert.rejects(boxd.machines.fork("no-such-machine", { name: "x" }), sdk.MachineNotFound);
    await assert.rejects(boxd.machines.new("Not_A_Valid_Name!"), (e) => {
      assert.ok(e instanceof sdk.InvalidRequest, String(e));
      assert.equal(e.field, "name");
      return true;
    });
    await assert.rejects(boxd.machines.fork(base.id, { name: "UPPER" }), sdk.InvalidRequest);
    // machines.url: port 8080 is Machine.url, another port its token with the port
    const got = await boxd.machines.get(base.id);
    assert.equal(await boxd.machines.url(base.id), got.url);
    assert.equal(await boxd.machines.url(base.id, { port: 8000 }), `${got.url}.8000`);
    await assert.rejects(boxd.machines.url(base.id, { port: 0 }), (e) => e instanceof sdk.InvalidRequest && e.field === "port");
    await assert.rejects(boxd.machines.url("no-such-machine"), sdk.MachineNotFound);
    await assert.rejects(boxd.machines.new("ts-base"), (e) => e instanceof sdk.AlreadyExists && e.kind === "machine");

    // Like the Python SDK, a client without a key falls back to <data dir>/local.key, so
    // point it at an empty data directory to send no key at all.
    const noKey = withEnv({ BOXD_HOME: scratch }, () => new sdk.Boxd({ baseUrl: daemon.url }));
    assert.equal(noKey._target.apiKey, null);
    await assert.rejects(noKey.machines.list(), (e) => {
      assert.ok(e instanceof sdk.AuthError, String(e));
      assert.equal(e.status, 401);
      assert.ok(e.hint.length > 0);
      return true;
    });
    const badKey = new sdk.Boxd({ baseUrl: daemon.url, apiKey: "boxd_not-a-real-key-000000000000000" });
    await assert.rejects(badKey.info(), sdk.AuthError);
    // Health needs no key.
    assert.equal((await noKey.health()).ok, true);
  });

  test("with no daemon answering, the client starts one through the boxd CLI", LONG, async () => {
    const home = mkdtempSync(join(tmpdir(), "boxd-ts-auto-"));
    const saved = { ...process.env };
    let pid = null;
    try {
      Object.assign(process.env, clientEnv(home, { BOXD_CLI: CLI }));
      const auto = new sdk.Boxd();
      const health = await auto.health();
      pid = health.pid;
      assert.ok(existsSync(join(home, "boxd.sock")));
      assert.ok(existsSync(join(home, "local.key")));
      const keys = await auto.keys.list(); // authenticated with the fresh local.key
      assert.ok(keys.length >= 1);
      // A second client finds the same daemon instead of starting another.
      assert.equal((await new sdk.Boxd().health()).pid, pid);
    } finally {
      for (const k of Object.keys(process.env)) if (!(k in saved)) delete process.env[k];
      Object.assign(process.env, saved);
      if (pid !== null) {
        process.kill(pid, "SIGTERM");
        for (let i = 0; i < 100; i++) {
          try {
            process.kill(pid, 0);
          } catch {
            break;
          }
          await new Promise((r) => setTimeout(r, 100));
        }
      }
      rmSync(shmOf(home), { recursive: true, force: true });
      rmSync(home, { recursive: true, force: true });
    }
  });

  test("the spec's TypeScript example runs verbatim: 8 rollouts come back", LONG, async () => {
    const example = readFileSync(join(PKG, "test", "spec-example.mts"), "utf8");
    const block = example.split("// --- spec block ---\n")[1].split("// --- end of spec block ---\n")[0];
    if (existsSync(SPEC)) {
      assert.ok(readFileSync(SPEC, "utf8").includes(block), "test/spec-example.mts differs from the spec");
    }
    const rl = await fork("rl-base");
    const cwd = mkdtempSync(join(scratch, "rl-"));
    copyFileSync(join(PKG, "test", "fixtures", "rollout.py"), join(cwd, "rollout.py"));
    const { stdout } = await run(process.execPath, [join(PKG, "dist-test", "spec-example.mjs")], {
      cwd,
      env: clientEnv(daemon.home),
      timeout: 15 * 60_000,
    });
    const results = JSON.parse(stdout.trim().split("\n").at(-1));
    assert.equal(results.length, 8);
    // Each rollout printed its seeded trajectory, the same one the host computes.
    for (const [seed, line] of results.entries()) {
      const expected = (await run("python3", [join(cwd, "rollout.py"), "--seed", String(seed)])).stdout.trim();
      assert.deepEqual(JSON.parse(line), JSON.parse(expected));
    }
    const left = (await boxd.machines.list()).map((m) => m.name);
    assert.ok(!left.some((n) => n.startsWith("rollout-")), `forks left behind: ${left}`);
    await destroy(rl.name);
  });

  // --- machines.spawn: a process with framed messages (boxd.rl's step channel) ---------

  test("spawn: framed messages both ways, list, kill, exit as Conflict", async () => {
    const echo = [
      "import sys",
      "r, w = sys.stdin.buffer, sys.stdout.buffer",
      "while True:",
      "    h = r.read(4)",
      "    if len(h) < 4: break",
      "    w.write(h + r.read(int.from_bytes(h, 'big'))); w.flush()",
    ].join("\n");
    const proc = await boxd.machines.spawn(base.id, ["python3", "-u", "-c", echo]);
    assert.equal(proc.info.state, "running");
    for (const msg of [Buffer.alloc(0), Buffer.from("x".repeat(100)), Buffer.alloc(200_000, 7)]) {
      await proc.send(msg);
      assert.ok((await proc.recv({ timeout: 60_000 })).equals(msg));
    }
    await assert.rejects(proc.recv({ timeout: 50 }), { name: "TimeoutError" });
    assert.deepEqual((await boxd.machines.processes(base.id)).map((p) => p.id), [proc.id]);
    await proc.kill();
    await assert.rejects(proc.recv({ timeout: 60_000 }), sdk.Conflict);
    await assert.rejects(boxd.machines.attach(base.id, "p-nope"), sdk.NotFound);
  });
});
