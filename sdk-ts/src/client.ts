/** The client, `Boxd`, and its resources (`machines`, `snapshots`, `keys`). */
import { createReadStream, createWriteStream } from "node:fs";
import { rename, unlink } from "node:fs/promises";
import type { IncomingMessage } from "node:http";
import { basename, dirname, join, resolve } from "node:path";
import { pipeline } from "node:stream/promises";

import { camelize } from "./_camel.js";
import {
  connectionError,
  errorFromResponse,
  isConnectRefused,
  readBody,
  send,
  USER_AGENT,
  type Endpoint,
  type RequestSpec,
} from "./_http.js";
import { UpgradeRefused, WebSocketClient } from "./_ws.js";
import { dataDir, ensureDaemon, logPath, readLocalKey, socketPath } from "./_local.js";
import { buildLineage, type Lineage } from "./lineage.js";
import {
  BoxdError,
  ConnectionError,
  InfrastructureError,
  InternalError,
  InvalidRequest,
  NotFound,
  errorFromBody,
} from "./errors.js";
import { ProcessHandle } from "./process.js";
import type { components } from "./schema.js";
import type {
  Account,
  ApiKey,
  ApiKeyCreated,
  Checkpoint,
  ExecEvent,
  ExecOptions,
  ExecResult,
  ExecStatus,
  ExecSummary,
  ServiceLog,
  FileInfo,
  MachineMetrics,
  Health,
  HostInfo,
  Image,
  LabelSelector,
  Machine,
  MachineNewOptions,
  MachinePage,
  MachinesDeleted,
  NodeInfo,
  OnTimeout,
  Process,
  Snapshot,
  Standby,
} from "./types.js";

type Wire = components["schemas"];

/** Milliseconds for ordinary requests (exec has no read timeout; its own `timeout` applies). */
export const DEFAULT_TIMEOUT_MS = 300_000;

export interface BoxdOptions {
  /** API key; defaults to `BOXD_API_KEY`, else the local daemon's key file. */
  apiKey?: string;
  /**
   * `http://HOST:PORT` of a daemon; defaults to `BOXD_URL`, else the local daemon on its
   * unix socket (started on first use if none runs).
   */
  baseUrl?: string;
  /** Milliseconds an ordinary request may go unanswered (default 300 000; null: forever). */
  timeout?: number | null;
}

/** Where a client connects and how it authenticates (see {@link resolveTarget}). */
export interface Target extends Endpoint {
  /** Explicit key, or null to read the local key file once the daemon runs. */
  apiKey: string | null;
  /** The local data directory (socket, key file, log). */
  home: string;
}

/**
 * Decide the endpoint and key from options, then the environment: `baseUrl`, `BOXD_URL`,
 * else the local daemon's unix socket; `apiKey`, `BOXD_API_KEY`, else the local key file.
 *
 * @throws InvalidRequest the base URL is not an `http(s)://host[:port]` URL.
 */
export function resolveTarget(options: BoxdOptions = {}, env = process.env): Target {
  const home = dataDir(env);
  const apiKey = options.apiKey || env.BOXD_API_KEY || null;
  const raw = options.baseUrl || env.BOXD_URL || null;
  if (raw === null) return { baseUrl: "http://boxd", socketPath: socketPath(home), apiKey, home };
  const baseUrl = raw.trim().replace(/\/+$/, "");
  let ok = false;
  try {
    const u = new URL(baseUrl);
    ok = (u.protocol === "http:" || u.protocol === "https:") && u.host !== "";
  } catch {
    ok = false;
  }
  if (!ok) {
    throw new InvalidRequest(`invalid boxd URL ${JSON.stringify(baseUrl)}`, {
      hint: "use http://HOST:PORT, e.g. BOXD_URL=http://127.0.0.1:7070",
      details: { field: "baseUrl" },
    });
  }
  return { baseUrl, socketPath: null, apiKey, home };
}

const seg = (ref: string): string => encodeURIComponent(String(ref));

/**
 * `port` as a guest TCP port: an integer number in 1-65535. A boolean, a fraction or a
 * string (even "80") is refused, not converted, as the Python SDK's `tcp_port` does: a
 * string port is most often a parsing step the caller forgot.
 */
function tcpPort(port: unknown): number {
  if (typeof port !== "number" || !Number.isInteger(port)) {
    const text = typeof port === "string" ? JSON.stringify(port) : String(port);
    const digits = typeof port === "string" && /^\s*\d+\s*$/.test(port);
    throw new InvalidRequest(`port must be an integer, not ${typeof port} ${text}`, {
      details: { field: "port" },
      hint: digits ? `convert it first: Number(${text})` : "give the port as a number, e.g. 8000",
    });
  }
  if (port < 1 || port > 65535) {
    throw new InvalidRequest(`port ${port} is not a TCP port (1-65535)`, {
      details: { field: "port" },
    });
  }
  return port;
}

/** Client of a boxd daemon. */
export class Boxd {
  readonly machines: Machines;
  readonly snapshots: Snapshots;
  readonly images: Images;
  readonly keys: Keys;
  readonly accounts: Accounts;
  readonly nodes: Nodes;
  /** @internal */
  readonly _target: Target;
  #timeout: number | null;
  #key: Promise<string | null> | null = null;

  /** @throws InvalidRequest `baseUrl`/`BOXD_URL` is not an http(s) URL. */
  constructor(options: BoxdOptions = {}) {
    this._target = resolveTarget(options);
    this.#timeout = options.timeout === undefined ? DEFAULT_TIMEOUT_MS : options.timeout;
    this.machines = new Machines(this);
    this.snapshots = new Snapshots(this);
    this.images = new Images(this);
    this.keys = new Keys(this);
    this.accounts = new Accounts(this);
    this.nodes = new Nodes(this);
  }

  /** Describe the host: engine, QEMU version, accelerator and why, data directory. */
  async info(): Promise<HostInfo> {
    return this._json({ method: "GET", path: "/v1/info" });
  }

  /** `GET /v1/health` (no key needed): the daemon's version and pid. */
  async health(): Promise<Health> {
    return this._json({ method: "GET", path: "/v1/health", idleTimeoutMs: 10_000 });
  }

  toString(): string {
    return `Boxd(${this.#where()})`;
  }

  // --- plumbing ----------------------------------------------------------------------

  #where(): string {
    const t = this._target;
    return t.socketPath !== null ? `unix socket ${t.socketPath}` : t.baseUrl;
  }

  #hint(): string {
    return this._target.socketPath !== null
      ? `is the daemon running? its log is ${logPath(this._target.home)}`
      : "check BOXD_URL and that the daemon is running";
  }

  /** The key to send; for the local daemon, start it first (once) when none answers. */
  #apiKey(): Promise<string | null> {
    this.#key ??= (async () => {
      const t = this._target;
      if (t.socketPath !== null) await ensureDaemon(t.home);
      return t.apiKey ?? readLocalKey(t.home);
    })().catch((err: unknown) => {
      this.#key = null; // let a later call try again
      throw err;
    });
    return this.#key;
  }

  /** @internal Send a request; resolves with the 2xx response (body unread). */
  async _send(spec: RequestSpec, opts: { retry?: boolean } = {}): Promise<IncomingMessage> {
    const key = await this.#apiKey();
    const full: RequestSpec = {
      ...spec,
      idleTimeoutMs: spec.idleTimeoutMs === undefined ? this.#timeout : spec.idleTimeoutMs,
      headers: { ...spec.headers, ...(key ? { Authorization: `Bearer ${key}` } : {}) },
    };
    let resp: IncomingMessage;
    try {
      try {
        resp = await send(this._target, full);
      } catch (err) {
        // The local daemon may have stopped since we connected: start it and retry once
        // (safe: nothing was processed). Not for streamed bodies, which are consumed.
        if (this._target.socketPath === null || !isConnectRefused(err) || opts.retry === false) {
          throw err;
        }
        await ensureDaemon(this._target.home);
        resp = await send(this._target, full);
      }
    } catch (err) {
      if (err instanceof BoxdError) throw err;
      throw connectionError(err, this.#where(), this.#hint());
    }
    const status = resp.statusCode ?? 0;
    if (status < 200 || status >= 300) {
      throw errorFromResponse(status, await this.#read(resp));
    }
    return resp;
  }

  async #read(resp: IncomingMessage): Promise<Buffer> {
    try {
      return await readBody(resp);
    } catch (err) {
      throw connectionError(err, this.#where(), this.#hint());
    }
  }

  /** @internal A request whose 2xx body is raw bytes. */
  async _bytes(spec: RequestSpec): Promise<Buffer> {
    return this.#read(await this._send(spec));
  }

  /** @internal A request whose 2xx body is a JSON model, returned with camelCase keys. */
  async _json<T>(spec: RequestSpec): Promise<T> {
    const content = await this._bytes(spec);
    try {
      return camelize<T>(JSON.parse(content.toString("utf8")));
    } catch (err) {
      throw new InternalError(`boxd sent a body this client cannot read: ${content.toString("utf8").slice(0, 200)}`, {
        hint: "are the client and daemon versions compatible?",
        cause: err,
      });
    }
  }

  /** @internal A request without a useful body (204). */
  async _void(spec: RequestSpec): Promise<void> {
    await this._bytes(spec);
  }

  /** @internal Open a WebSocket at `path` (process streams), authenticated. */
  async _openStream(path: string): Promise<WebSocketClient> {
    const key = await this.#apiKey();
    const headers: Record<string, string> = { "User-Agent": USER_AGENT };
    if (key) headers.Authorization = `Bearer ${key}`;
    try {
      return await WebSocketClient.connect(this._target, path, headers, 60_000);
    } catch (err) {
      if (err instanceof UpgradeRefused) throw errorFromResponse(err.status, err.body);
      throw connectionError(err, this.#where(), this.#hint());
    }
  }

  /** @internal For the streaming helpers. */
  _connectionError(err: unknown): ConnectionError {
    return connectionError(err, this.#where(), this.#hint());
  }
}

function execBody(opts: ExecOptions): Wire["ExecRequest"] {
  const { command } = opts ?? {};
  const ok =
    (typeof command === "string" && command.length > 0) ||
    (Array.isArray(command) && command.length > 0 && command.every((a) => typeof a === "string"));
  if (!ok) {
    throw new InvalidRequest("command must be a non-empty shell string or argv list", {
      details: { field: "command" },
    });
  }
  const body: Wire["ExecRequest"] = { command, env: { ...opts.env } };
  if (opts.cwd !== undefined) body.cwd = opts.cwd;
  if (opts.timeout !== undefined) body.timeout = opts.timeout;
  if (opts.stdin !== undefined) body.stdin = opts.stdin;
  if (opts.user !== undefined) body.user = opts.user;
  return body;
}

/**
 * Options of `machines.fork`: one child (`name`), or a batch (`count` and/or `names`);
 * `node` puts the children on that cluster node (QEMU machines only).
 */
export type ForkOptions = {
  name?: string; node?: string; labels?: Record<string, string>; count?: undefined;
  names?: undefined; idempotencyKey?: string;
} & Lifetime;
export type ForkBatchOptions =
  | ({ count: number; names?: string[]; node?: string; labels?: Record<string, string>;
      name?: undefined; idempotencyKey?: string } & Lifetime)
  | ({ names: string[]; count?: number; node?: string; labels?: Record<string, string>;
      name?: undefined; idempotencyKey?: string } & Lifetime);

/** The `Idempotency-Key` header of a create or fork (none without a key). */
function idempotencyHeaders(key: string | undefined): Record<string, string> {
  if (key === undefined) return {};
  if (typeof key !== "string" || !/^[\x21-\x7e]{1,255}$/.test(key)) {
    throw new InvalidRequest(
      `invalid idempotency key ${JSON.stringify(String(key).slice(0, 80))}: use 1-255 ` +
        "printable ASCII characters without spaces",
      { details: { field: "idempotencyKey" },
        hint: "e.g. crypto.randomUUID() per logical request, the same on its retries" },
    );
  }
  return { "Idempotency-Key": key };
}

/**
 * A child's lifetime on fork: `timeout` whole seconds from now (1 to 30 days), then
 * deleted (or hibernated with `onTimeout: "hibernate"`). A child never inherits its
 * source's lifetime.
 */
export type Lifetime = { timeout?: number; onTimeout?: OnTimeout; wait?: number };

/** The longest admission wait (`wait` on new and fork), in seconds. */
export const MAX_WAIT = 3600;

/** The `wait` body field of new and fork (none for 0). @throws InvalidRequest */
function waitBody(wait: unknown): Record<string, unknown> {
  if (wait === undefined || wait === 0) return {};
  if (typeof wait !== "number" || !Number.isFinite(wait) || wait < 0 || wait > MAX_WAIT) {
    throw new InvalidRequest(`wait must be 0-${MAX_WAIT} seconds, not ${String(wait)}`,
                             { details: { field: "wait" },
                               hint: "how long a create or fork may wait for room" });
  }
  return { wait };
}

/** The longest lifetime (`timeout`, `setTimeout`): 30 days, in seconds. */
export const MAX_TIMEOUT = 30 * 24 * 3600;

function checkTimeout(timeout: unknown): number {
  if (typeof timeout !== "number" || !Number.isInteger(timeout) || timeout < 1
      || timeout > MAX_TIMEOUT) {
    throw new InvalidRequest(
      `timeout must be a whole number of seconds, 1-${MAX_TIMEOUT}, not ${String(timeout)}`,
      { details: { field: "timeout" }, hint: "setTimeout(ref, null) clears a lifetime" },
    );
  }
  return timeout;
}

function checkOnTimeout(action: unknown): OnTimeout {
  if (action !== "delete" && action !== "hibernate") {
    throw new InvalidRequest(`onTimeout must be "delete" or "hibernate", not ${String(action)}`,
                             { details: { field: "on_timeout" } });
  }
  return action;
}

/** The body fields of a lifetime (none without `timeout`). @throws InvalidRequest */
function lifetimeBody(opts: Lifetime): Record<string, unknown> {
  const action = checkOnTimeout(opts.onTimeout ?? "delete");
  if (opts.timeout === undefined || opts.timeout === null) return {};
  const out: Record<string, unknown> = { timeout: checkTimeout(opts.timeout) };
  if (action !== "delete") out.on_timeout = action;
  return out;
}

/** Query parameters of a label selector: `label=K=V` once per label. */
function selectorQuery(sel: LabelSelector): Record<string, string | string[] | undefined> {
  const label = Object.entries(sel.labels ?? {}).map(([k, v]) => `${k}=${v}`);
  return { label: label.length ? label : undefined, state: sel.state };
}

/**
 * The `expose_host` and `egress` fields of a create (none for the defaults).
 * @throws InvalidRequest `exposeHost` is not an array of port integers, or `egress` not an
 *   array of strings (the daemon checks the entries)
 */
export function netPolicyBody(opts: { exposeHost?: number[]; egress?: string[] }): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  const ports = opts.exposeHost ?? [];
  if (!Array.isArray(ports) || !ports.every((p) => Number.isInteger(p))) {
    throw new InvalidRequest(`exposeHost must be an array of TCP port integers, not ${String(ports)}`,
                             { details: { field: "expose_host" }, hint: "e.g. exposeHost: [8000]" });
  }
  if (ports.length) out.expose_host = [...ports];
  if (opts.egress !== undefined) {
    if (!Array.isArray(opts.egress) || !opts.egress.every((e) => typeof e === "string")) {
      throw new InvalidRequest(`egress must be an array of strings, not ${String(opts.egress)}`,
                               { details: { field: "egress" } });
    }
    out.egress = [...opts.egress];
  }
  return out;
}

/** Machines: create, inspect, run commands in, fork and delete (`boxd.machines`). */
export class Machines {
  readonly files: Files;
  readonly checkpoints: Checkpoints;

  constructor(private readonly c: Boxd) {
    this.files = new Files(c);
    this.checkpoints = new Checkpoints(c);
  }

  /**
   * Create and boot a machine; resolves while it starts (see {@link waitUntilReady}).
   * @param name DNS-label name, unique per account; generated if absent.
   * @throws InvalidRequest, AlreadyExists, QuotaExceeded, SnapshotNotFound, HostSetupError,
   *   NotFound (`options.image` is not imported for this account)
   */
  async new(name?: string | null, options: MachineNewOptions = {}): Promise<Machine> {
    const body: Record<string, unknown> = { isolated: Boolean(options.isolated) };
    if (options.public) body.public = true;
    if (options.service === false) body.service = false;
    const fields: [string, unknown][] = [
      ["name", name],
      ["vcpus", options.vcpus],
      ["memory_mib", options.memoryMib],
      ["disk_gib", options.diskGib],
      ["from_snapshot", options.fromSnapshot],
      ["engine", options.engine],
      ["suspend_after", options.suspendAfter],
      ["hibernate_after", options.hibernateAfter],
      ["node", options.node],
      ["image", options.image],
    ];
    for (const [k, v] of fields) if (v !== undefined && v !== null) body[k] = v; // daemon defaults
    if (options.labels && Object.keys(options.labels).length) body.labels = { ...options.labels };
    Object.assign(body, lifetimeBody(options), waitBody(options.wait), netPolicyBody(options));
    return this.c._json({
      method: "POST", path: "/v1/machines", json: body,
      headers: idempotencyHeaders(options.idempotencyKey),
      ...(body.wait !== undefined ? { idleTimeoutMs: null } : {}),
    });
  }

  /**
   * Give a machine a new end, `timeout` whole seconds from now (1 to 30 days), extending
   * or shortening its lifetime; `null` clears it (it runs until deleted). 0 is refused.
   * `onTimeout` absent keeps what its end did ("delete" if it had no lifetime).
   * @throws InvalidRequest a bad timeout or onTimeout
   * @throws MachineNotFound
   */
  async setTimeout(
    ref: string, timeout: number | null, options: { onTimeout?: OnTimeout } = {},
  ): Promise<Machine> {
    const body: Record<string, unknown> = {
      timeout: timeout === null ? null : checkTimeout(timeout),
    };
    if (options.onTimeout !== undefined) body.on_timeout = checkOnTimeout(options.onTimeout);
    return this.c._json({ method: "POST", path: `/v1/machines/${seg(ref)}/timeout`, json: body });
  }

  /** The machine with this name or id. @throws MachineNotFound */
  async get(ref: string): Promise<Machine> {
    return this.c._json({ method: "GET", path: `/v1/machines/${seg(ref)}` });
  }

  /**
   * The machine's URL for a guest TCP port: its `url` for 8080 (the default),
   * `http://127.0.0.1:PORT/TOKEN.N` for port N. Any HTTP or WebSocket client uses it as
   * given; a request through it wakes the machine and keeps it awake.
   *
   * @throws InvalidRequest a port that is not an integer number (a string of digits
   *   such as "80" included: convert it first) or is outside 1-65535, checked before the
   *   machine is looked up; an isolated machine; or another port of a public machine
   *   (its bare URL relays raw TCP to port 8080 only).
   */
  async url(ref: string, options: { port?: number } = {}): Promise<string> {
    const port = tcpPort(options.port ?? 8080);
    const m = await this.get(ref);
    if (m.url == null) {
      throw new InvalidRequest(`machine ${JSON.stringify(m.name)} has no URL (isolated)`, {
        details: { field: "port" },
      });
    }
    if (port === 8080) return m.url;
    if (m.public) {
      throw new InvalidRequest(
        `machine ${JSON.stringify(m.name)} is public: its URL relays raw TCP to port 8080 only`,
        { details: { field: "port" }, hint: "create it without public for a URL per guest port" },
      );
    }
    return `${m.url.replace(/\/+$/, "")}.${port}`;
  }

  /**
   * Every machine of this account (oldest first) that carries all of `labels` and is in
   * `state` if given; the pages are followed ({@link listPage} takes one at a time).
   * @throws InvalidRequest a bad label or state
   */
  async list(options: LabelSelector = {}): Promise<Machine[]> {
    const out: Machine[] = [];
    let cursor: string | undefined;
    for (;;) {
      const page = await this.listPage({ ...options, cursor });
      out.push(...page.machines);
      if (page.nextCursor == null) return out;
      cursor = page.nextCursor;
    }
  }

  /**
   * One page of {@link list}: up to `limit` machines (the daemon's default, at most 1000)
   * after `cursor` (a page's `nextCursor`), and the next page's cursor (null on the last).
   * @throws InvalidRequest a bad label, state, limit or cursor
   */
  async listPage(
    options: LabelSelector & { limit?: number; cursor?: string } = {},
  ): Promise<MachinePage> {
    const query = { ...selectorQuery(options), limit: options.limit, cursor: options.cursor };
    return this.c._json({ method: "GET", path: "/v1/machines", query });
  }

  /**
   * Delete every machine that carries all of `labels` (and is in `options.state`): a
   * crashed run's cleanup. One failure does not stop the others: the result lists what
   * was deleted and each machine that could not be, with its error.
   * @throws InvalidRequest no label (an empty selector is refused), or a bad one
   */
  async deleteMany(
    labels: Record<string, string>,
    options: { state?: LabelSelector["state"] } = {},
  ): Promise<MachinesDeleted> {
    if (!labels || Object.keys(labels).length === 0) {
      throw new InvalidRequest(
        "deleteMany needs at least one label: an empty selector would delete every machine",
        { details: { field: "labels" }, hint: "e.g. deleteMany({ run: 'r-7' })" },
      );
    }
    return this.c._json({
      method: "DELETE", path: "/v1/machines", query: selectorQuery({ labels, ...options }),
      idleTimeoutMs: null,
    });
  }

  /**
   * Fork trees and snapshot lineage, built from the machine and snapshot lists (no
   * daemon endpoint of its own; the same trees as the Python SDK's `machines.lineage`).
   * @param ref a machine name or id: only its subtree, and the snapshots saved from it or
   *   that it was made from. Absent: every machine of this account.
   * @throws MachineNotFound
   */
  async lineage(ref?: string): Promise<Lineage> {
    const [machines, snapshots] = await Promise.all([this.list(), this.c.snapshots.list()]);
    if (ref === undefined) return buildLineage(machines, snapshots);
    const target = await this.get(ref);
    const all = machines.some((m) => m.id === target.id) ? machines : await this.list();
    return buildLineage(all, snapshots, target.id);
  }

  /** Stop the machine and remove its files (its checkpoints die with it). @throws MachineNotFound */
  async delete(ref: string): Promise<void> {
    await this.c._void({ method: "DELETE", path: `/v1/machines/${seg(ref)}` });
  }

  /** Stop the machine's vCPUs; memory stays resident; any request wakes it. @throws StateError */
  async suspend(ref: string): Promise<Machine> {
    return this.c._json({ method: "POST", path: `/v1/machines/${seg(ref)}/suspend` });
  }

  /** Write the machine's memory to disk and end its VM; any request wakes it. @throws StateError */
  async hibernate(ref: string): Promise<Machine> {
    return this.c._json({
      method: "POST", path: `/v1/machines/${seg(ref)}/hibernate`, idleTimeoutMs: 300_000,
    });
  }

  /** Wake a suspended or hibernated machine. @throws MachineFailed, QuotaExceeded */
  async resume(ref: string): Promise<Machine> {
    return this.c._json({
      method: "POST", path: `/v1/machines/${seg(ref)}/resume`, idleTimeoutMs: 300_000,
    });
  }

  /**
   * Resolve once the machine's agent answers.
   * @param options.timeout seconds the daemon waits (default 120).
   * @throws MachineNotFound, MachineFailed (died, or not ready within the timeout)
   */
  async waitUntilReady(ref: string, options: { timeout?: number } = {}): Promise<Machine> {
    const timeout = options.timeout ?? 120;
    return this.c._json({
      method: "POST",
      path: `/v1/machines/${seg(ref)}/wait`,
      query: { timeout },
      // The daemon holds the request up to `timeout`; give the socket some slack on top.
      idleTimeoutMs: (timeout + 30) * 1000,
    });
  }

  /**
   * Run a command to completion. A non-zero `exitCode` is a normal result, not an error;
   * a failure of the machine, its engine, agent or node is never an exit code. The
   * result carries its `execId` (see {@link execResult}).
   * @throws ExecTimeout the command ran past `timeout` (`.stdout`/`.stderr`: partial output)
   * @throws ExecIdConflict `execId` is kept for another command on this machine
   * @throws MachineNotFound
   * @throws InfrastructureError the machine, engine, agent or node failed (MachineFailed,
   *   AgentLost, NodeLost) or the daemon's connection was lost (ConnectionError)
   */
  async exec(ref: string, options: ExecOptions): Promise<ExecResult> {
    const body = execBody(options);
    if (options.execId !== undefined) body.exec_id = options.execId;
    return this.c._json({
      method: "POST",
      path: `/v1/machines/${seg(ref)}/exec`,
      json: body,
      idleTimeoutMs: null,
    });
  }

  /**
   * The output and exit of an exec started by `exec` (its `execId`), running or finished,
   * also after the connection that started it was lost. A running exec is waited for up
   * to `wait` seconds (default 0); if it still runs, `running` is true. Only the last MiB
   * of each stream is kept; results are kept 15 minutes after the exec ends (the last 64
   * per machine), also across a daemon restart (an exec that still ran when the daemon
   * died has `error` with code `agent_lost`).
   * @throws ExecNotFound no exec of that id is kept for the machine
   * @throws MachineNotFound
   */
  async execResult(ref: string, execId: string, options: { wait?: number } = {}): Promise<ExecStatus> {
    const wait = options.wait ?? 0;
    return this.c._json({
      method: "GET",
      path: `/v1/machines/${seg(ref)}/execs/${seg(execId)}`,
      query: { wait },
      // The daemon holds the request up to `wait`; give the socket some slack on top.
      idleTimeoutMs: (wait + 30) * 1000,
    });
  }

  /**
   * The machine's service output (its image's ENTRYPOINT + CMD, stdout and stderr as
   * written) after offset `after` (absent: the last 64 KiB the node keeps), waiting up
   * to `wait` seconds (at most 60) for more; follow it with `after: log.end`.
   * @throws MachineNotFound; NotFound the machine has no service
   */
  async logs(ref: string, options: { after?: number; wait?: number } = {}): Promise<ServiceLog> {
    const wait = options.wait ?? 0;
    return this.c._json({
      method: "GET",
      path: `/v1/machines/${seg(ref)}/logs`,
      query: { after: options.after, wait },
      idleTimeoutMs: (wait + 30) * 1000,
    });
  }

  /**
   * The machine's recent CPU, memory and disk samples (oldest first) from `start` to
   * `end` (Unix times in seconds; absent: no bound), read inside its guest. Asking takes
   * a sample now if the machine runs and samples it every 5 s for the next 5 minutes
   * (the node keeps the last 120); a sleeping machine is not woken.
   * @throws MachineNotFound; InvalidRequest `start` after `end`, or an agent older
   *   than this boxd
   */
  async metrics(ref: string, options: { start?: number; end?: number } = {}): Promise<MachineMetrics> {
    return this.c._json({
      method: "GET",
      path: `/v1/machines/${seg(ref)}/metrics`,
      query: { start: options.start, end: options.end },
    });
  }

  /**
   * The machine's last `limit` (1-64, default 20) kept execs, newest first: each one's
   * `execId`, `command`, `exitCode` (or `running`, or `error`), `startedAt` and
   * `duration`, without output (read that with `execResult`).
   * @throws MachineNotFound; InvalidRequest `limit` outside 1-64
   */
  async execs(ref: string, options: { limit?: number } = {}): Promise<ExecSummary[]> {
    const listed: { execs: ExecSummary[] } = await this.c._json({
      method: "GET",
      path: `/v1/machines/${seg(ref)}/execs`,
      query: { limit: options.limit ?? 20 },
    });
    return listed.execs;
  }

  /**
   * Run a command, yielding `stdout`/`stderr` events as they arrive, then one `exit` event
   * (`exitCode`, `signal`, `timedOut`, `duration`). Breaking out of the loop closes the
   * stream.
   * @throws MachineNotFound; InfrastructureError (MachineFailed, AgentLost, NodeLost,
   *   ConnectionError) when the machine, its engine, agent or node failed or the stream
   *   ended without its `exit` event: never an exit code. A failure midway is thrown as
   *   the typed error of the stream's final `error` event.
   */
  async *execStream(ref: string, options: ExecOptions): AsyncGenerator<ExecEvent, void, undefined> {
    const resp = await this.c._send({
      method: "POST",
      path: `/v1/machines/${seg(ref)}/exec/stream`,
      json: execBody(options),
      idleTimeoutMs: null,
      headers: { Accept: "application/x-ndjson" },
    });
    let buffered = "";
    let sawExit = false;
    try {
      resp.setEncoding("utf8");
      try {
        for await (const chunk of resp) {
          buffered += chunk as string;
          let nl: number;
          while ((nl = buffered.indexOf("\n")) >= 0) {
            const event = parseEvent(buffered.slice(0, nl));
            buffered = buffered.slice(nl + 1);
            if (event !== null) {
              sawExit ||= event.type === "exit";
              yield event;
            }
          }
        }
      } catch (err) {
        if (err instanceof BoxdError) throw err;
        throw this.c._connectionError(err);
      }
      const last = parseEvent(buffered);
      if (last !== null) yield last;
      if (last?.type !== "exit" && !sawExit) {
        throw new InfrastructureError(
          `the exec stream of machine ${JSON.stringify(ref)} ended without an exit status`,
          { details: { machine: ref },
            hint: "the daemon or the connection went away; check `boxd machine info` and " +
              "run the command again" },
        );
      }
    } finally {
      resp.destroy();
    }
  }

  /**
   * Fork a running machine: the child continues from the same instruction.
   *
   * With `{ count }` or `{ names }`, fork several children in one call and resolve to one
   * entry per child: its `Machine` or the `BoxdError` that stopped it (one failure doesn't
   * sink the batch). Otherwise resolve to the single child. `node` puts the children on
   * that cluster node (by default: the source's node while it has room, then the others).
   * With `idempotencyKey` (the same on each retry of this request), a retry within 24 h
   * resolves to the first request's children, never new ones; a request that made no
   * child frees its key; the key sent with another request rejects with
   * `IdempotencyKeyReused`.
   * Children without room wait up to `wait` seconds for it (see `MachineNewOptions.wait`).
   * @throws MachineNotFound, StateError, AlreadyExists, QuotaExceeded (a batch throws only
   *   for errors that concern the whole request); NotFound (no such node), InvalidRequest
   *   (the source's forks cannot go to that node: a gVisor machine, or no cluster)
   */
  fork(src: string, options?: ForkOptions): Promise<Machine>;
  fork(src: string, options: ForkBatchOptions): Promise<(Machine | BoxdError)[]>;
  async fork(
    src: string,
    options: ForkOptions | ForkBatchOptions = {},
  ): Promise<Machine | (Machine | BoxdError)[]> {
    const { name, count, names, node, labels, idempotencyKey } = options as {
      name?: string;
      count?: number;
      names?: string[];
      node?: string;
      labels?: Record<string, string>;
      idempotencyKey?: string;
    };
    const headers = idempotencyHeaders(idempotencyKey);
    const lifetime = { ...lifetimeBody(options as Lifetime),
                       ...waitBody((options as Lifetime).wait) };
    if (count === undefined && names === undefined) {
      const one: Wire["ForkRequest"] = {};
      if (name !== undefined && name !== null) one.name = name;
      if (node !== undefined) one.node = node;
      if (labels !== undefined) one.labels = { ...labels };
      Object.assign(one, lifetime);
      return this.c._json({
        method: "POST", path: `/v1/machines/${seg(src)}/fork`, json: one, headers,
        ...(one.wait !== undefined ? { idleTimeoutMs: null } : {}),
      });
    }
    if (name !== undefined) {
      throw new InvalidRequest("pass either name or count/names", { details: { field: "name" } });
    }
    const body: Wire["ForkBatchRequest"] = {};
    if (count !== undefined) body.count = count;
    if (names !== undefined) body.names = [...names];
    if (node !== undefined) body.node = node;
    if (labels !== undefined) body.labels = { ...labels };
    Object.assign(body, lifetime);
    // Raw JSON: the per-item errors are rebuilt from their snake_case bodies.
    const raw = await this.c._bytes({
      method: "POST",
      path: `/v1/machines/${seg(src)}/fork/batch`,
      json: body,
      idleTimeoutMs: null,
      headers,
    });
    const result = JSON.parse(raw.toString("utf8")) as Wire["ForkResult"];
    return result.children.map((item) => {
      if (item.machine) return camelize<Machine>(item.machine);
      if (item.error) return errorFromBody({ error: item.error });
      return new InternalError("batch fork returned an empty item");
    });
  }

  /**
   * Prepare `forks` standby forks of the machine's current state; resolve once they are
   * ready. The next `forks` forks of the unchanged machine (one `fork(ref, { count })` or
   * that many concurrent `fork` calls) claim them instead of starting children. They use
   * no CPU while they wait; `memoryBytes` says the host memory they hold. A change to the
   * machine (an exec, an upload, a restore) discards them; `{ forks: 0 }` releases them.
   * They count against no quota until claimed, but an account holds no more than its
   * quota would let it claim, and at most its share of the node's (docs/fork.md).
   * @throws MachineNotFound, StateError, InvalidRequest, ResourceExhausted
   */
  async warm(ref: string, options: { forks: number }): Promise<Standby> {
    return this.c._json({
      method: "POST",
      path: `/v1/machines/${seg(ref)}/warm`,
      json: { forks: options.forks },
      idleTimeoutMs: null,
    });
  }

  // --- processes with a framed stream (boxd.rl) ------------------------------------

  /**
   * Start a long-lived process whose stdin and stdout carry framed messages (each a
   * 4-byte big-endian length and the bytes, on the process's side). The handle's
   * `send` writes one, `recv` returns the next. A fork of the machine runs its own
   * copy (same id): `attach(child, handle.id)`.
   * @throws InvalidRequest, MachineNotFound, MachineFailed
   */
  async spawn(
    ref: string,
    argv: string[],
    options: { env?: Record<string, string>; cwd?: string; user?: string } = {},
  ): Promise<ProcessHandle> {
    if (!Array.isArray(argv) || argv.length === 0) {
      throw new InvalidRequest("argv must be a non-empty list of strings", { details: { field: "argv" } });
    }
    const body: Record<string, unknown> = { argv, env: options.env ?? {} };
    if (options.cwd !== undefined) body.cwd = options.cwd;
    if (options.user !== undefined) body.user = options.user;
    const info = await this.c._json<Process>({
      method: "POST",
      path: `/v1/machines/${seg(ref)}/processes`,
      json: body,
    });
    return new ProcessHandle(this.c, ref, info);
  }

  /** The machine's processes (a fork child lists its copies of its source's). */
  async processes(ref: string): Promise<Process[]> {
    const out = await this.c._json<{ processes: Process[] }>({
      method: "GET",
      path: `/v1/machines/${seg(ref)}/processes`,
    });
    return out.processes;
  }

  /** A handle on a process of `ref` (e.g. a fork child's copy), its stream open. */
  async attach(ref: string, processId: string): Promise<ProcessHandle> {
    const found = (await this.processes(ref)).find((p) => p.id === processId);
    if (!found) throw new NotFound(`no process ${JSON.stringify(processId)} in machine ${JSON.stringify(ref)}`);
    const handle = new ProcessHandle(this.c, ref, found);
    await handle.attach();
    return handle;
  }
}

/** One NDJSON line of an exec stream as an event (null for a blank line). */
export function parseEvent(line: string): ExecEvent | null {
  if (!line.trim()) return null;
  let obj: unknown;
  try {
    obj = JSON.parse(line);
  } catch (err) {
    throw new InternalError(`malformed exec stream line: ${line.slice(0, 200)}`, { cause: err });
  }
  if (typeof obj !== "object" || obj === null || Array.isArray(obj)) {
    throw new InternalError(`malformed exec event: ${line.slice(0, 200)}`);
  }
  const rec = obj as Record<string, unknown>;
  if (typeof rec.error === "object" && rec.error !== null) {
    // A final {"type": "error", "error": {...}} event, or a bare error body.
    throw errorFromBody({ error: rec.error });
  }
  if (typeof rec.type !== "string") throw new InternalError(`malformed exec event: ${line.slice(0, 200)}`);
  return camelize<ExecEvent>(rec);
}

/** Files inside a machine (`boxd.machines.files`). */
export class Files {
  constructor(private readonly c: Boxd) {}

  /**
   * Write a file in the machine (parent directories are created).
   * @param data the content; a string is encoded as UTF-8.
   * @param options.mode permission bits (default 0o644).
   * @param options.user the file's owner, `NAME[:GROUP]` or `UID[:GID]` from the guest's
   *   /etc/passwd and /etc/group (the parents the upload makes are theirs too); default root.
   * @throws MachineNotFound, InvalidRequest (a user the guest does not have)
   */
  async upload(
    ref: string,
    path: string,
    data: string | Uint8Array,
    options: { mode?: number; user?: string } = {},
  ): Promise<FileInfo> {
    const body = typeof data === "string" ? Buffer.from(data, "utf8") : Buffer.from(data);
    return this.c._json({
      method: "PUT",
      path: `/v1/machines/${seg(ref)}/files`,
      query: { path, mode: Math.trunc(options.mode ?? 0o644), user: options.user },
      body,
    });
  }

  /** Read a file from the machine. @throws MachineNotFound, GuestFileNotFound */
  async download(ref: string, path: string): Promise<Buffer> {
    return this.c._bytes({ method: "GET", path: `/v1/machines/${seg(ref)}/files`, query: { path } });
  }
}

/** Per-machine checkpoints: rewind one machine in place (`boxd.machines.checkpoints`). */
export class Checkpoints {
  constructor(private readonly c: Boxd) {}

  /** Capture the machine's memory and disk under `name`. @throws MachineNotFound, AlreadyExists, StateError */
  async save(ref: string, name: string): Promise<Checkpoint> {
    return this.c._json({
      method: "POST",
      path: `/v1/machines/${seg(ref)}/checkpoints`,
      json: { name },
      idleTimeoutMs: null,
    });
  }

  /** Rewind the machine in place (same id, name and URL). @throws MachineNotFound, CheckpointNotFound */
  async restore(ref: string, name: string): Promise<Machine> {
    return this.c._json({
      method: "POST",
      path: `/v1/machines/${seg(ref)}/checkpoints/${seg(name)}/restore`,
      idleTimeoutMs: null,
    });
  }

  /** The machine's checkpoints. @throws MachineNotFound */
  async list(ref: string): Promise<Checkpoint[]> {
    const out = await this.c._json<{ checkpoints: Checkpoint[] }>({
      method: "GET",
      path: `/v1/machines/${seg(ref)}/checkpoints`,
    });
    return out.checkpoints;
  }

  /** Delete one checkpoint. @throws MachineNotFound, CheckpointNotFound */
  async delete(ref: string, name: string): Promise<void> {
    await this.c._void({
      method: "DELETE",
      path: `/v1/machines/${seg(ref)}/checkpoints/${seg(name)}`,
    });
  }
}

/** Durable, named, versioned machine images (`boxd.snapshots`). */
/** `/v1/images/NAME:TAG`: a name's `/` and `:` stay as they are. */
const imagePath = (name: string): string =>
  "/v1/images/" + String(name).split("/").map((p) => encodeURIComponent(p).replace(/%3A/gi, ":")).join("/");

/** Container images machines can start from: imported from an OCI layout, an archive or a registry. */
export class Images {
  constructor(private readonly c: Boxd) {}

  /**
   * Import `source` as `name` (`NAME[:TAG]`; tag `latest` when absent); layers are stored once.
   * `source`: `oci:DIR[:REF]`, `oci-archive:FILE[:REF]`, `docker-archive:FILE` or
   * `docker://HOST[:PORT]/REPO[:TAG|@DIGEST]` (paths are on the daemon's host).
   * @param options.creds `USER:PASSWORD` for the registry.
   * @param options.insecure allow a registry on plain HTTP.
   * @throws InvalidRequest, NotFound, AuthError, IntegrityError
   */
  async import(source: string, name: string, options: { creds?: string; insecure?: boolean } = {}): Promise<Image> {
    const json: Record<string, unknown> = { source, name, insecure: Boolean(options.insecure) };
    if (options.creds !== undefined) json.creds = options.creds;
    return this.c._json({ method: "POST", path: "/v1/images", json, idleTimeoutMs: null });
  }

  /** One image: digest, layers and run config. @throws NotFound */
  async get(name: string): Promise<Image> {
    return this.c._json({ method: "GET", path: imagePath(name) });
  }

  /** This account's images, by name. */
  async list(): Promise<Image[]> {
    const out = await this.c._json<{ images: Image[] }>({ method: "GET", path: "/v1/images" });
    return out.images;
  }

  /** Remove an image's name; layers no other image holds are freed. @throws NotFound */
  async remove(name: string): Promise<Image> {
    return this.c._json({ method: "DELETE", path: imagePath(name) });
  }
}

export class Snapshots {
  constructor(private readonly c: Boxd) {}

  /**
   * Save a machine as snapshot `name` (the machine keeps running).
   * @param options.newVersion add a version when `name` exists (else that is an error).
   * @throws MachineNotFound, AlreadyExists
   */
  async save(machine: string, name: string, options: { newVersion?: boolean } = {}): Promise<Snapshot> {
    return this.c._json({
      method: "POST",
      path: "/v1/snapshots",
      json: { machine, name, new_version: Boolean(options.newVersion) },
      idleTimeoutMs: null,
    });
  }

  /** The snapshot `NAME` (latest version), `NAME@N` or `sha256:DIGEST`. @throws SnapshotNotFound */
  async get(ref: string): Promise<Snapshot> {
    return this.c._json({ method: "GET", path: `/v1/snapshots/${seg(ref)}` });
  }

  /** Every snapshot version of this account. */
  async list(): Promise<Snapshot[]> {
    const out = await this.c._json<{ snapshots: Snapshot[] }>({ method: "GET", path: "/v1/snapshots" });
    return out.snapshots;
  }

  /** Delete a snapshot version. @throws SnapshotNotFound */
  async delete(ref: string): Promise<void> {
    await this.c._void({ method: "DELETE", path: `/v1/snapshots/${seg(ref)}` });
  }

  /**
   * Stream the snapshot into one file at `path` (written atomically); resolves to the path.
   * @throws SnapshotNotFound; InvalidRequest when `path` cannot be written
   */
  async export(ref: string, path: string): Promise<string> {
    const dest = resolve(path);
    const tmp = join(dirname(dest), `.${basename(dest)}.part`);
    const resp = await this.c._send({
      method: "GET",
      path: `/v1/snapshots/${seg(ref)}/export`,
      idleTimeoutMs: null,
      headers: { Accept: "application/octet-stream" },
    });
    try {
      await pipeline(resp, createWriteStream(tmp));
      await rename(tmp, dest);
    } catch (err) {
      resp.destroy();
      await unlink(tmp).catch(() => undefined);
      const e = err as NodeJS.ErrnoException;
      if (e?.syscall && ["open", "write", "rename"].includes(e.syscall)) {
        throw new InvalidRequest(`cannot write ${dest}: ${e.message}`, {
          details: { field: "path" },
          cause: err,
        });
      }
      throw this.c._connectionError(err);
    }
    return dest;
  }

  /**
   * Import a file written by {@link export}.
   * @param options.name import under this name (default: the name in the file).
   * @throws IntegrityError the file is corrupt; InvalidRequest not a snapshot file, or
   *   `path` cannot be read
   */
  async import(path: string, options: { name?: string } = {}): Promise<Snapshot> {
    const src = resolve(path);
    const stream = createReadStream(src);
    await new Promise<void>((ok, fail) => {
      stream.once("open", () => ok());
      stream.once("error", (err) =>
        fail(new InvalidRequest(`cannot read ${src}: ${err.message}`, { details: { field: "path" }, cause: err })),
      );
    });
    return this.c._json({
      method: "POST",
      path: "/v1/snapshots/import",
      query: { name: options.name },
      body: stream,
      idleTimeoutMs: null,
    });
  }
}

/** API keys (`boxd.keys`). */
export class Keys {
  constructor(private readonly c: Boxd) {}

  /**
   * Create an API key; its `secret` is shown only in this result.
   * @param options.account the account the key acts for (local admin only); the caller's if absent.
   * @throws AuthError, InvalidRequest
   */
  async create(name = "default", options: { account?: string } = {}): Promise<ApiKeyCreated> {
    const body: Wire["ApiKeyCreate"] = { name };
    if (options.account !== undefined) body.account = options.account;
    return this.c._json({ method: "POST", path: "/v1/keys", json: body });
  }

  /** The keys of this key's account, revoked ones included, never secrets. */
  async list(): Promise<ApiKey[]> {
    const out = await this.c._json<{ keys: ApiKey[] }>({ method: "GET", path: "/v1/keys" });
    return out.keys;
  }

  /** Revoke a key; requests with it fail from now on. @throws NotFound */
  async revoke(keyId: string): Promise<void> {
    await this.c._void({ method: "DELETE", path: `/v1/keys/${seg(keyId)}` });
  }
}

/** The nodes machines run on (`boxd.nodes`): this host, or each boxd node of a Ray cluster. */
export class Nodes {
  constructor(private readonly c: Boxd) {}

  /** Each node: id, address, health, machines, cap and free memory. */
  async list(): Promise<NodeInfo[]> {
    const out = await this.c._json<{ nodes: NodeInfo[] }>({ method: "GET", path: "/v1/nodes" });
    return out.nodes;
  }
}

/** Accounts and their machine limits (`boxd.accounts`); the operator changes them. */
export class Accounts {
  constructor(private readonly c: Boxd) {}

  /** Every account (the operator's key), else only the caller's own. */
  async list(): Promise<Account[]> {
    const out = await this.c._json<{ accounts: Account[] }>({ method: "GET", path: "/v1/accounts" });
    return out.accounts;
  }

  /** One account: its limit and the machines counting against it. @throws NotFound */
  async get(name: string): Promise<Account> {
    return this.c._json({ method: "GET", path: `/v1/accounts/${seg(name)}` });
  }

  /** Change an account's concurrent-machine limit. @throws AuthError (not the operator), NotFound */
  async update(name: string, options: { maxMachines: number }): Promise<Account> {
    return this.c._json({
      method: "PATCH",
      path: `/v1/accounts/${seg(name)}`,
      json: { max_machines: options.maxMachines },
    });
  }
}
