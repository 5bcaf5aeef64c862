// No daemon: error mapping, key conversion, target resolution.
import assert from "node:assert/strict";
import { test } from "node:test";

import * as sdk from "@boxd-sh/sdk";

const CODES = {
  invalid_request: "InvalidRequest",
  corrupt_data: "CorruptData",
  payload_too_large: "PayloadTooLarge",
  body_timeout: "BodyTimeout",
  unauthorized: "AuthError",
  forbidden: "Forbidden",
  not_found: "NotFound",
  machine_not_found: "MachineNotFound",
  checkpoint_not_found: "CheckpointNotFound",
  snapshot_not_found: "SnapshotNotFound",
  guest_file_not_found: "GuestFileNotFound",
  exec_not_found: "ExecNotFound",
  conflict: "Conflict",
  already_exists: "AlreadyExists",
  invalid_state: "StateError",
  idempotency_key_reused: "IdempotencyKeyReused",
  exec_id_conflict: "ExecIdConflict",
  quota_exceeded: "QuotaExceeded",
  exec_timeout: "ExecTimeout",
  infrastructure_error: "InfrastructureError",
  machine_failed: "MachineFailed",
  agent_lost: "AgentLost",
  node_lost: "NodeLost",
  integrity_error: "IntegrityError",
  resource_exhausted: "ResourceExhausted",
  host_setup: "HostSetupError",
  connection_error: "ConnectionError",
  internal_error: "InternalError",
};

test("every code of the Python tree maps to its class", () => {
  for (const [code, name] of Object.entries(CODES)) {
    const err = sdk.errorFromBody({ error: { code, message: "m", hint: "h", details: {} } }, 400);
    assert.equal(err.constructor.name, name);
    assert.equal(err.name, name);
    assert.equal(err.code, code);
    assert.ok(err instanceof sdk.BoxdError && err instanceof Error);
    assert.equal(sdk[name], err.constructor, `${name} is exported`);
  }
  assert.deepEqual(
    sdk.ERROR_CLASSES.map((c) => c.code).sort(),
    ["error", ...Object.keys(CODES)].sort(),
  );
});

test("the tree has the Python parents and statuses", () => {
  assert.ok(new sdk.MachineNotFound("x") instanceof sdk.NotFound);
  assert.ok(new sdk.GuestFileNotFound("x") instanceof sdk.NotFound);
  assert.ok(new sdk.AlreadyExists("x") instanceof sdk.Conflict);
  assert.ok(new sdk.StateError("x") instanceof sdk.Conflict);
  assert.equal(new sdk.MachineNotFound("x").status, 404);
  assert.equal(new sdk.ExecTimeout("x").status, 408);
  assert.equal(new sdk.QuotaExceeded("x").status, 429);
  assert.ok(new sdk.IdempotencyKeyReused("x") instanceof sdk.Conflict);
  for (const cls of [sdk.MachineFailed, sdk.AgentLost, sdk.NodeLost, sdk.ConnectionError]) {
    const err = new cls("x");
    assert.ok(err instanceof sdk.InfrastructureError, cls.name);
    assert.equal(err.status, 503);
  }
});

test("details become fields; unknown codes and bodies degrade gracefully", () => {
  const err = sdk.errorFromBody({
    error: { code: "already_exists", message: "taken", hint: "pick another", details: { kind: "machine", name: "a" } },
  });
  assert.ok(err instanceof sdk.AlreadyExists);
  assert.equal(err.kind, "machine");
  assert.equal(err.resourceName, "a");
  assert.equal(err.message, "taken");
  assert.equal(err.hint, "pick another");
  assert.equal(String(err), "AlreadyExists: taken (pick another)");
  assert.deepEqual(err.toBody().error.details, { kind: "machine", name: "a" });

  const timeout = sdk.errorFromBody({ error: { code: "exec_timeout", message: "t", details: { stdout: "so far" } } });
  assert.equal(timeout.stdout, "so far");

  const unknown = sdk.errorFromBody({ error: { code: "brand_new", message: "?" } });
  assert.equal(unknown.constructor, sdk.BoxdError);
  assert.ok(sdk.errorFromBody("oops", 502) instanceof sdk.InternalError);
});

test("exec stream lines: events camelCased, error events thrown typed", () => {
  assert.equal(sdk.parseEvent("   "), null);
  assert.deepEqual(sdk.parseEvent('{"type":"exit","exit_code":3,"signal":null,"timed_out":false,"duration":0.5}'), {
    type: "exit", exitCode: 3, signal: null, timedOut: false, duration: 0.5,
  });
  assert.throws(
    () => sdk.parseEvent('{"type":"error","error":{"code":"machine_failed","message":"died","hint":"","details":{"machine":"m"}}}'),
    (err) => err instanceof sdk.MachineFailed && err.machine === "m",
  );
  assert.throws(() => sdk.parseEvent("{not json"), sdk.InternalError);
});

test("target: options, then BOXD_URL/BOXD_API_KEY, else the unix socket of the data dir", () => {
  const local = sdk.resolveTarget({}, { BOXD_HOME: "/tmp/bx" });
  assert.equal(local.socketPath, "/tmp/bx/boxd.sock");
  assert.equal(local.apiKey, null);
  const xdg = sdk.resolveTarget({}, { XDG_DATA_HOME: "/tmp/xdg" });
  // as the Python side: root's data directory is /var/lib/boxd, others' follow XDG
  const expected = process.getuid() === 0 ? "/var/lib/boxd/boxd.sock" : "/tmp/xdg/boxd/boxd.sock";
  assert.equal(xdg.socketPath, expected);
  const env = sdk.resolveTarget({}, { BOXD_URL: "http://127.0.0.1:7070/", BOXD_API_KEY: "boxd_k" });
  assert.deepEqual([env.baseUrl, env.socketPath, env.apiKey], ["http://127.0.0.1:7070", null, "boxd_k"]);
  const explicit = sdk.resolveTarget({ baseUrl: "http://h:1", apiKey: "a" }, { BOXD_URL: "http://x:2", BOXD_API_KEY: "b" });
  assert.deepEqual([explicit.baseUrl, explicit.apiKey], ["http://h:1", "a"]);
  assert.throws(() => sdk.resolveTarget({ baseUrl: "ftp://x" }, {}), (e) => e instanceof sdk.InvalidRequest && e.field === "baseUrl");
});

test("an unreachable daemon is a ConnectionError", async () => {
  const boxd = new sdk.Boxd({ baseUrl: "http://127.0.0.1:9", apiKey: "boxd_x" });
  await assert.rejects(boxd.info(), sdk.ConnectionError);
});

test("exec sends its execId; execResult asks the exec's route with its wait", async () => {
  const { createServer } = await import("node:http");
  const seen = [];
  const server = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => (body += c));
    req.on("end", () => {
      seen.push([req.method, req.url, body && JSON.parse(body)]);
      res.setHeader("content-type", "application/json");
      res.end(JSON.stringify(req.method === "POST"
        ? { exec_id: "j-1", stdout: "x\n", stderr: "", exit_code: 0, duration: 0.1 }
        : { exec_id: "j-1", running: true, stdout: "so far", stderr: "", started_at: 1,
            stdout_truncated: true }));
    });
  });
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  try {
    const boxd = new sdk.Boxd({ baseUrl: `http://127.0.0.1:${server.address().port}`, apiKey: "boxd_x" });
    const r = await boxd.machines.exec("m", { command: "echo x", execId: "j-1" });
    assert.equal(r.execId, "j-1");
    const st = await boxd.machines.execResult("m", "j-1", { wait: 2.5 });
    assert.deepEqual([st.running, st.stdout, st.stdoutTruncated], [true, "so far", true]);
    assert.equal(seen[0][2].exec_id, "j-1");
    assert.deepEqual(seen[1].slice(0, 2), ["GET", "/v1/machines/m/execs/j-1?wait=2.5"]);
  } finally {
    await new Promise((ok) => server.close(ok));
  }
});

test("exec rejects an empty command before sending", async () => {
  const boxd = new sdk.Boxd({ baseUrl: "http://127.0.0.1:9", apiKey: "boxd_x" });
  await assert.rejects(boxd.machines.exec("m", { command: "" }), sdk.InvalidRequest);
});

test("machines.url refuses a port that is not a TCP port, before any request", async () => {
  // 127.0.0.1:9 answers nothing: a lookup would be a ConnectionError
  const boxd = new sdk.Boxd({ baseUrl: "http://127.0.0.1:9", apiKey: "boxd_x" });
  for (const [port, why] of [
    [8000.5, /not number 8000.5/], [true, /not boolean true/], ["80", /not string "80"/],
    [Number.NaN, /not number NaN/], [0, /port 0 is not a TCP port/], [65536, /port 65536 is not/],
  ]) {
    await assert.rejects(boxd.machines.url("m", { port }), (e) =>
      e instanceof sdk.InvalidRequest && e.field === "port" && why.test(e.message), String(port));
  }
  await assert.rejects(boxd.machines.url("m", { port: "80" }),
    (e) => e instanceof sdk.InvalidRequest && e.hint === 'convert it first: Number("80")');
  // a valid port gets as far as the lookup
  await assert.rejects(boxd.machines.url("m", { port: 8000 }), sdk.ConnectionError);
});

test("the tree matches boxd.errors in the Python package (codes, names, parents, statuses)", async () => {
  const { execFileSync } = await import("node:child_process");
  const { PYTHON } = await import("./daemon.mjs");
  const dump = `
import json
from boxd.errors import _BY_CODE
print(json.dumps({code: [cls.__name__, cls.__mro__[1].__name__, cls.status] for code, cls in _BY_CODE.items()}))
`;
  const python = JSON.parse(execFileSync(PYTHON, ["-c", dump], { encoding: "utf8" }));
  const ts = Object.fromEntries(
    sdk.ERROR_CLASSES.map((cls) => [cls.code, [cls.name, Object.getPrototypeOf(cls).name, cls.status]]),
  );
  ts.error[1] = "Exception"; // the root's parent
  assert.deepEqual(ts, python);
});

test("local discovery: a silent daemon is waited for, never doubled; a dead socket is down", async () => {
  const { createServer } = await import("node:net");
  const { mkdtempSync, rmSync, writeFileSync } = await import("node:fs");
  const { tmpdir } = await import("node:os");
  const { join } = await import("node:path");
  const local = await import("../dist/_local.js");
  const home = mkdtempSync(join(tmpdir(), "boxd-ts-unit-"));
  const socket = join(home, "boxd.sock");
  const saved = process.env.BOXD_CLI;
  try {
    assert.equal(await local.probe(socket), "down"); // no socket file
    writeFileSync(socket, ""); // a stale file nobody listens on
    assert.equal(await local.probe(socket), "down");
    rmSync(socket);
    const held = [];
    const silent = createServer((conn) => held.push(conn)); // accepts, never answers
    await new Promise((ok) => silent.listen(socket, ok));
    try {
      assert.equal(await local.probe(socket, 300), "busy");
      process.env.BOXD_CLI = join(home, "must-not-run");
      await assert.rejects(local.ensureDaemon(home, 1500), (e) => {
        assert.ok(e instanceof sdk.ConnectionError);
        assert.match(e.message, /did not answer/);
        return true;
      });
    } finally {
      for (const conn of held) conn.destroy();
      await new Promise((ok) => silent.close(ok));
    }
  } finally {
    if (saved === undefined) delete process.env.BOXD_CLI;
    else process.env.BOXD_CLI = saved;
    rmSync(home, { recursive: true, force: true });
  }
});

test("lineage: forks, a fork of a fork, snapshots saved and machines made from them", () => {
  const m = (id, name, parentId = null, snapshot = null, createdAt = 0) => ({
    id, name, parentId, snapshot, createdAt, state: "running",
  });
  const s = (id, name, version, hex, sourceMachine, createdAt) => ({
    id, name, version, digest: `sha256:${hex}`, sourceMachine, createdAt,
  });
  const machines = [
    m("m1", "rl-base", null, null, 1),
    m("m3", "rollout-2", "m1", null, 3),
    m("m2", "rollout-1", "m1", null, 2),
    m("m4", "rollout-1a", "m2", null, 4),
    m("m5", "rl-base-2", null, "aa".repeat(32), 6),
    m("m6", "child-of-2", "m5", "aa".repeat(32), 7),
  ];
  const snapshots = [
    s("s2", "env-v3", 2, "bb".repeat(32), "rollout-1a", 9),
    s("s1", "env-v3", 1, "aa".repeat(32), "rl-base", 5),
  ];
  const names = (nodes) => nodes.map((n) => [n.machine.name, names(n.children)]);
  const lin = sdk.buildLineage(machines, snapshots);
  assert.deepEqual(names(lin.machines), [
    ["rl-base", [["rollout-1", [["rollout-1a", []]]], ["rollout-2", []]]],
    ["rl-base-2", [["child-of-2", []]]],
  ]);
  assert.deepEqual(lin.machines[0].snapshots.map((x) => x.version), [1]);
  assert.equal(lin.machines[1].fromSnapshot.id, "s1");
  assert.equal(lin.machines[1].children[0].fromSnapshot, null); // inherited
  assert.deepEqual(
    lin.snapshots.map((n) => [n.snapshot.version, n.source?.name, n.machines.map((x) => x.machine.name)]),
    [[1, "rl-base", ["rl-base-2"]], [2, "rollout-1a", []]],
  );
  const sub = sdk.buildLineage(machines, snapshots, "m2");
  assert.deepEqual(names(sub.machines), [["rollout-1", [["rollout-1a", []]]]]);
  assert.deepEqual(sub.snapshots.map((n) => n.snapshot.id), ["s2"]);
  assert.throws(() => sdk.buildLineage(machines, snapshots, "nope"));
});

test("labels: sent on new and fork, kept verbatim, selectors as repeated label=K=V", async () => {
  const { createServer } = await import("node:http");
  const seen = [];
  const machine = (name, labels) => ({
    id: `m_${name}`, name, state: "running", vcpus: 1, memory_mib: 128, disk_gib: 1,
    isolated: false, created_at: 1, labels,
  });
  const srv = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => (body += c));
    req.on("end", () => {
      const u = new URL(req.url, "http://x");
      seen.push({ method: req.method, path: u.pathname, labels: u.searchParams.getAll("label"),
                  query: Object.fromEntries(u.searchParams), body: body && JSON.parse(body) });
      res.setHeader("content-type", "application/json");
      let out;
      if (req.method === "DELETE") out = { deleted: [{ id: "m_a", name: "a" }], errors: [] };
      else if (req.method === "GET" && !u.searchParams.get("cursor")) {
        out = { machines: [machine("a", { exp_run: "1" })], next_cursor: "c1" };
      } else if (req.method === "GET") out = { machines: [machine("b", {})], next_cursor: null };
      else out = machine("a", { "boxd.rl/run": "r-1", exp_run: "1" });
      res.end(JSON.stringify(out));
    });
  });
  await new Promise((ok) => srv.listen(0, "127.0.0.1", ok));
  try {
    const boxd = new sdk.Boxd({ baseUrl: `http://127.0.0.1:${srv.address().port}`, apiKey: "k" });
    const m = await boxd.machines.new("a", { labels: { "boxd.rl/run": "r-1", exp_run: "1" } });
    assert.deepEqual(m.labels, { "boxd.rl/run": "r-1", exp_run: "1" }); // not camelCased
    assert.deepEqual(seen[0].body.labels, { "boxd.rl/run": "r-1", exp_run: "1" });
    await boxd.machines.fork("a", { name: "b", labels: { x: "y" } });
    assert.deepEqual(seen[1].body, { name: "b", labels: { x: "y" } });
    await boxd.machines.fork("a", { count: 2, labels: { x: "y" } }).catch(() => {});
    assert.deepEqual(seen[2].body, { count: 2, labels: { x: "y" } });
    const all = await boxd.machines.list({ labels: { run: "1", team: "a" }, state: "running" });
    assert.deepEqual(all.map((x) => x.name), ["a", "b"]); // both pages
    assert.deepEqual(seen[3].labels, ["run=1", "team=a"]);
    assert.equal(seen[3].query.state, "running");
    assert.equal(seen[4].query.cursor, "c1");
    const gone = await boxd.machines.deleteMany({ run: "1" });
    assert.deepEqual(gone.deleted, [{ id: "m_a", name: "a" }]);
    assert.equal(seen[5].method, "DELETE");
    assert.deepEqual(seen[5].labels, ["run=1"]);
    const before = seen.length;
    await assert.rejects(boxd.machines.deleteMany({}), sdk.InvalidRequest);
    assert.equal(seen.length, before); // an empty selector is never sent
  } finally {
    srv.close();
  }
});

test("lifetimes: timeout and onTimeout on new and fork, setTimeout, checked before sending", async () => {
  const { createServer } = await import("node:http");
  const seen = [];
  const machine = {
    id: "m_a", name: "a", state: "running", vcpus: 1, memory_mib: 128, disk_gib: 1,
    isolated: false, created_at: 1, end_at: "2026-12-05T14:00:00Z", on_timeout: "hibernate",
  };
  const srv = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => (body += c));
    req.on("end", () => {
      seen.push({ method: req.method, path: new URL(req.url, "http://x").pathname,
                  body: body && JSON.parse(body) });
      res.setHeader("content-type", "application/json");
      const batch = req.url.endsWith("/fork/batch");
      res.end(JSON.stringify(batch ? { children: [{ machine }] } : machine));
    });
  });
  await new Promise((ok) => srv.listen(0, "127.0.0.1", ok));
  try {
    const boxd = new sdk.Boxd({ baseUrl: `http://127.0.0.1:${srv.address().port}`, apiKey: "k" });
    const m = await boxd.machines.new("a", { timeout: 60, onTimeout: "hibernate" });
    assert.equal(m.endAt, "2026-12-05T14:00:00Z");
    assert.equal(m.onTimeout, "hibernate");
    assert.equal(seen[0].body.timeout, 60);
    assert.equal(seen[0].body.on_timeout, "hibernate");
    await boxd.machines.new("b");
    assert.equal(seen[1].body.timeout, undefined); // no lifetime unless asked
    await boxd.machines.fork("a", { name: "c", timeout: 5 });
    assert.deepEqual(seen[2].body, { name: "c", timeout: 5 });
    await boxd.machines.fork("a", { count: 2, timeout: 7, onTimeout: "hibernate" });
    assert.deepEqual(seen[3].body, { count: 2, timeout: 7, on_timeout: "hibernate" });
    await boxd.machines.setTimeout("a", 90);
    assert.deepEqual(seen[4], { method: "POST", path: "/v1/machines/a/timeout",
                                body: { timeout: 90 } });
    await boxd.machines.setTimeout("a", null, { onTimeout: "delete" });
    assert.deepEqual(seen[5].body, { timeout: null, on_timeout: "delete" });
    const before = seen.length;
    for (const bad of [0, -1, 1.5, sdk.MAX_TIMEOUT + 1, "3"]) {
      await assert.rejects(boxd.machines.new("x", { timeout: bad }), sdk.InvalidRequest);
      await assert.rejects(boxd.machines.setTimeout("a", bad), sdk.InvalidRequest);
      await assert.rejects(boxd.machines.fork("a", { timeout: bad }), sdk.InvalidRequest);
    }
    await assert.rejects(boxd.machines.new("x", { timeout: 5, onTimeout: "stop" }),
                         sdk.InvalidRequest);
    assert.equal(seen.length, before); // nothing bad is sent
  } finally {
    srv.close();
  }
});

test("admission: wait on new and fork is sent, a 429's retryAfter is read, bad waits refused unsent", async () => {
  const { createServer } = await import("node:http");
  const seen = [];
  const srv = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => (body += c));
    req.on("end", () => {
      seen.push(JSON.parse(body || "{}"));
      res.setHeader("content-type", "application/json");
      res.setHeader("retry-after", "7");
      res.statusCode = 429;
      res.end(JSON.stringify({ error: { code: "quota_exceeded", hint: "",
        message: "no room after waiting 2.0 s: machine quota reached",
        details: { limit: 1, used: 1, retry_after: 7 } } }));
    });
  });
  await new Promise((ok) => srv.listen(0, "127.0.0.1", ok));
  try {
    const boxd = new sdk.Boxd({ baseUrl: `http://127.0.0.1:${srv.address().port}`, apiKey: "k" });
    await assert.rejects(boxd.machines.new("a", { wait: 2 }), (e) =>
      e instanceof sdk.QuotaExceeded && e.retryAfter === 7 && e.limit === 1);
    assert.equal(seen[0].wait, 2);
    await assert.rejects(boxd.machines.fork("a", { name: "b", wait: 1.5 }), sdk.QuotaExceeded);
    assert.equal(seen[1].wait, 1.5);
    await assert.rejects(boxd.machines.new("c"), sdk.QuotaExceeded);
    assert.equal(seen[2].wait, undefined); // no wait unless asked
    const before = seen.length;
    for (const bad of [-1, sdk.MAX_WAIT + 1, "3", Number.NaN]) {
      await assert.rejects(boxd.machines.new("x", { wait: bad }), sdk.InvalidRequest);
      await assert.rejects(boxd.machines.fork("a", { count: 2, wait: bad }), sdk.InvalidRequest);
    }
    assert.equal(seen.length, before); // nothing bad is sent
  } finally {
    srv.close();
  }
});

test("service: logs asks the logs route with after and wait; service: false is sent", async () => {
  const { createServer } = await import("node:http");
  const seen = [];
  const srv = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => (body += c));
    req.on("end", () => {
      const url = new URL(req.url, "http://x");
      seen.push({ path: url.pathname, query: Object.fromEntries(url.searchParams),
                  body: body && JSON.parse(body) });
      res.setHeader("content-type", "application/json");
      if (url.pathname.endsWith("/logs")) {
        res.end(JSON.stringify({ start: 5, end: 9, data: "up\n", state: "running",
                                 exit_code: null, argv: ["srv"] }));
      } else {
        res.end(JSON.stringify({ id: "m_a", name: "a", state: "running", vcpus: 1,
          memory_mib: 128, disk_gib: 1, isolated: false, created_at: 1, labels: {} }));
      }
    });
  });
  await new Promise((ok) => srv.listen(0, "127.0.0.1", ok));
  try {
    const boxd = new sdk.Boxd({ baseUrl: `http://127.0.0.1:${srv.address().port}`, apiKey: "k" });
    const log = await boxd.machines.logs("a", { after: 5, wait: 2 });
    assert.deepEqual({ start: log.start, end: log.end, data: log.data, exitCode: log.exitCode },
                     { start: 5, end: 9, data: "up\n", exitCode: null });
    assert.deepEqual(seen[0], { path: "/v1/machines/a/logs", query: { after: "5", wait: "2" },
                                body: "" });
    await boxd.machines.logs("a");
    assert.deepEqual(seen[1].query, { wait: "0" }); // no offset: all that is kept
    await boxd.machines.new("a", { image: "env:v1", service: false });
    assert.equal(seen[2].body.service, false);
    await boxd.machines.new("b", { image: "env:v1" });
    assert.equal(seen[3].body.service, undefined); // started unless asked not to
  } finally {
    srv.close();
  }
});

test("metrics: asks the metrics route with start and end; samples come back camelCase", async () => {
  const { createServer } = await import("node:http");
  const seen = [];
  const srv = createServer((req, res) => {
    const url = new URL(req.url, "http://x");
    seen.push({ path: url.pathname, query: Object.fromEntries(url.searchParams) });
    res.setHeader("content-type", "application/json");
    res.end(JSON.stringify({ machine: "a", state: "running", interval: 5, samples: [
      { timestamp: 10.5, cpu_count: 2, cpu_used_pct: 12.5, mem_total: 4, mem_used: 2,
        mem_cache: 1, disk_total: 8, disk_used: 3 }] }));
  });
  await new Promise((ok) => srv.listen(0, "127.0.0.1", ok));
  try {
    const boxd = new sdk.Boxd({ baseUrl: `http://127.0.0.1:${srv.address().port}`, apiKey: "k" });
    const got = await boxd.machines.metrics("a", { start: 10, end: 20 });
    assert.deepEqual(seen[0], { path: "/v1/machines/a/metrics", query: { start: "10", end: "20" } });
    assert.equal(got.samples[0].cpuUsedPct, 12.5);
    assert.equal(got.samples[0].memCache, 1);
    await boxd.machines.metrics("a");
    assert.deepEqual(seen[1].query, {}); // no bounds: all that is kept
  } finally {
    srv.close();
  }
});

test("idempotency keys: sent as Idempotency-Key on new and fork, bad ones refused unsent", async () => {
  const { createServer } = await import("node:http");
  const seen = [];
  const srv = createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      seen.push({ path: new URL(req.url, "http://x").pathname, key: req.headers["idempotency-key"] });
      res.setHeader("content-type", "application/json");
      const m = { id: "m_a", name: "a", state: "running", vcpus: 1, memory_mib: 128, disk_gib: 1,
                  isolated: false, created_at: 1, labels: {} };
      res.end(JSON.stringify(req.url.endsWith("/batch") ? { children: [{ machine: m }] } : m));
    });
  });
  await new Promise((ok) => srv.listen(0, "127.0.0.1", ok));
  try {
    const boxd = new sdk.Boxd({ baseUrl: `http://127.0.0.1:${srv.address().port}`, apiKey: "k" });
    await boxd.machines.new("a", { idempotencyKey: "create-1" });
    await boxd.machines.fork("a", { name: "b", idempotencyKey: "fork-1" });
    await boxd.machines.fork("a", { count: 1, idempotencyKey: "fork-2" });
    await boxd.machines.new("c");
    assert.deepEqual(seen, [
      { path: "/v1/machines", key: "create-1" },
      { path: "/v1/machines/a/fork", key: "fork-1" },
      { path: "/v1/machines/a/fork/batch", key: "fork-2" },
      { path: "/v1/machines", key: undefined },
    ]);
    for (const bad of ["", "a b", "k".repeat(256), "é"]) {
      await assert.rejects(boxd.machines.new("a", { idempotencyKey: bad }), sdk.InvalidRequest);
      await assert.rejects(boxd.machines.fork("a", { idempotencyKey: bad }), sdk.InvalidRequest);
    }
    assert.equal(seen.length, 4); // never sent
  } finally {
    srv.close();
  }
});

test("an exec stream that ends without its exit event throws InfrastructureError", async () => {
  const { createServer } = await import("node:http");
  const srv = createServer((req, res) => {
    req.resume();
    req.on("end", () => {
      res.setHeader("content-type", "application/x-ndjson");
      res.end(JSON.stringify({ type: "stdout", data: "started\n" }) + "\n");
    });
  });
  await new Promise((ok) => srv.listen(0, "127.0.0.1", ok));
  try {
    const boxd = new sdk.Boxd({ baseUrl: `http://127.0.0.1:${srv.address().port}`, apiKey: "k" });
    const got = [];
    await assert.rejects(async () => {
      for await (const ev of boxd.machines.execStream("m", { command: "sleep 30" })) got.push(ev.type);
    }, (e) => e instanceof sdk.InfrastructureError && e.machine === "m");
    assert.deepEqual(got, ["stdout"]);
  } finally {
    srv.close();
  }
});

test("image: sent on new and shown on the machine; exec and spawn send user", async () => {
  const { createServer } = await import("node:http");
  const seen = [];
  const srv = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => (body += c));
    req.on("end", () => {
      seen.push({ path: new URL(req.url, "http://x").pathname, body: body && JSON.parse(body) });
      res.setHeader("content-type", "application/json");
      const u = req.url;
      const out = u.endsWith("/exec")
        ? { stdout: "", stderr: "", exit_code: 0, duration: 0 }
        : u.endsWith("/processes")
          ? { id: "p_1", machine_id: "m_a", argv: ["cat"], state: "running", created_at: 1 }
          : { id: "m_a", name: "a", state: "running", vcpus: 1, memory_mib: 128, disk_gib: 1,
              isolated: false, created_at: 1, engine: "gvisor",
              image: { name: "envs/app:v1", digest: "sha256:" + "a".repeat(64) } };
      res.end(JSON.stringify(out));
    });
  });
  await new Promise((ok) => srv.listen(0, "127.0.0.1", ok));
  try {
    const boxd = new sdk.Boxd({ baseUrl: `http://127.0.0.1:${srv.address().port}`, apiKey: "k" });
    const m = await boxd.machines.new("a", { image: "envs/app:v1", engine: "gvisor" });
    assert.deepEqual(seen[0].body, { isolated: false, name: "a", engine: "gvisor", image: "envs/app:v1" });
    assert.equal(m.image.name, "envs/app:v1");
    await boxd.machines.exec("a", { command: ["id"], user: "app" });
    assert.equal(seen[1].body.user, "app");
    await boxd.machines.spawn("a", ["cat"], { user: "1000:1000" }).catch(() => {});
    assert.equal(seen[2].body.user, "1000:1000");
  } finally {
    srv.close();
  }
});

test("network policy: exposeHost and egress sent on new as expose_host and egress, checked before sending", async () => {
  const { createServer } = await import("node:http");
  const seen = [];
  const machine = {
    id: "m_a", name: "a", state: "running", vcpus: 1, memory_mib: 128, disk_gib: 1,
    isolated: false, created_at: 1, expose_host: [8000], egress: ["203.0.113.0/24"],
  };
  const srv = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => (body += c));
    req.on("end", () => {
      seen.push(body && JSON.parse(body));
      res.setHeader("content-type", "application/json");
      res.end(JSON.stringify(machine));
    });
  });
  await new Promise((ok) => srv.listen(0, "127.0.0.1", ok));
  try {
    const boxd = new sdk.Boxd({ baseUrl: `http://127.0.0.1:${srv.address().port}`, apiKey: "k" });
    const m = await boxd.machines.new("a", { exposeHost: [8000], egress: ["203.0.113.0/24"] });
    assert.deepEqual(m.exposeHost, [8000]);
    assert.deepEqual(m.egress, ["203.0.113.0/24"]);
    assert.deepEqual(seen[0].expose_host, [8000]);
    assert.deepEqual(seen[0].egress, ["203.0.113.0/24"]);
    await boxd.machines.new("b");
    assert.equal(seen[1].expose_host, undefined); // the defaults are not sent
    assert.equal(seen[1].egress, undefined);
    await boxd.machines.new("c", { egress: [] });
    assert.deepEqual(seen[2].egress, []); // an empty allow-list is sent: nothing allowed
    const before = seen.length;
    for (const bad of [["8000"], [1.5], "8000"]) {
      await assert.rejects(boxd.machines.new("x", { exposeHost: bad }), sdk.InvalidRequest);
    }
    await assert.rejects(boxd.machines.new("x", { egress: "pypi.org" }), sdk.InvalidRequest);
    assert.equal(seen.length, before); // nothing bad is sent
  } finally {
    srv.close();
  }
});
