/**
 * The one place that does HTTP. Node's `fetch` cannot use a unix socket, so requests go
 * through `node:http` (`socketPath` for the local daemon, a URL for TCP) with keep-alive
 * agents; no runtime dependency.
 */
import * as http from "node:http";
import * as https from "node:https";
import type { Readable } from "node:stream";

import { ConnectionError, InternalError, errorFromBody, type BoxdError } from "./errors.js";

/** Where requests go: the local daemon's unix socket, or an http(s) base URL. */
export interface Endpoint {
  /** `http(s)://host[:port][/prefix]`; the host is ignored when `socketPath` is set. */
  baseUrl: string;
  socketPath: string | null;
}

export interface RequestSpec {
  method: string;
  path: string;
  /** Query parameters; an array repeats the parameter once per item. */
  query?: Record<string, string | number | string[] | undefined>;
  json?: unknown;
  body?: Buffer | Readable;
  /**
   * Milliseconds the socket may stay idle: a number, or null for no limit (exec, whose
   * command's own timeout the daemon enforces; long exports and imports).
   */
  idleTimeoutMs?: number | null;
  headers?: Record<string, string>;
}

export const USER_AGENT = "boxd-typescript/0.1.0";

/**
 * Errors of the socket layer that mean "nobody listens there" (start a daemon, retry).
 * A reset or a timeout is not one of them: a daemon is there, and starting a second one
 * for the same data directory would only fight it.
 */
export function isConnectRefused(err: unknown): boolean {
  const code = (err as { code?: string } | null)?.code;
  return code === "ECONNREFUSED" || code === "ENOENT";
}

export function url(endpoint: Endpoint, spec: RequestSpec): URL {
  const u = new URL(endpoint.baseUrl.replace(/\/+$/, "") + spec.path);
  for (const [k, v] of Object.entries(spec.query ?? {})) {
    if (Array.isArray(v)) for (const item of v) u.searchParams.append(k, item);
    else if (v !== undefined) u.searchParams.set(k, String(v));
  }
  return u;
}

const agents = {
  http: new http.Agent({ keepAlive: true, maxSockets: 64, maxFreeSockets: 32 }),
  https: new https.Agent({ keepAlive: true, maxSockets: 64, maxFreeSockets: 32 }),
};

/**
 * Send one request; resolves with the response as soon as its headers arrive.
 * Socket errors reject with the raw Node error (callers translate them).
 *
 * A pooled keep-alive socket may have been closed by the daemon (uvicorn drops idle
 * connections after a few seconds) just as we reuse it; the request then fails with
 * ECONNRESET or EPIPE before the daemon saw it, so it is sent once more on a new
 * connection, as Node's documentation advises. Streamed bodies cannot be replayed.
 */
export async function send(endpoint: Endpoint, spec: RequestSpec): Promise<http.IncomingMessage> {
  try {
    return await sendOnce(endpoint, spec);
  } catch (err) {
    const e = err as NodeJS.ErrnoException & { reusedSocket?: boolean };
    const stale = e.reusedSocket === true && (e.code === "ECONNRESET" || e.code === "EPIPE");
    if (!stale || (spec.body !== undefined && !Buffer.isBuffer(spec.body))) throw err;
    return sendOnce(endpoint, spec);
  }
}

function sendOnce(endpoint: Endpoint, spec: RequestSpec): Promise<http.IncomingMessage> {
  const u = url(endpoint, spec);
  const headers: Record<string, string> = {
    "User-Agent": USER_AGENT,
    Accept: "application/json",
    ...spec.headers,
  };
  let payload: Buffer | Readable | undefined = spec.body;
  if (spec.json !== undefined) {
    payload = Buffer.from(JSON.stringify(spec.json), "utf8");
    headers["Content-Type"] = "application/json";
  }
  if (Buffer.isBuffer(payload)) {
    headers["Content-Length"] = String(payload.length);
    if (!headers["Content-Type"]) headers["Content-Type"] = "application/octet-stream";
  } else if (payload !== undefined) {
    headers["Content-Type"] ??= "application/octet-stream";
  }
  const secure = u.protocol === "https:" && endpoint.socketPath === null;
  const options: http.RequestOptions = {
    method: spec.method,
    path: u.pathname + u.search,
    headers,
    agent: secure ? agents.https : agents.http,
  };
  if (endpoint.socketPath !== null) {
    options.socketPath = endpoint.socketPath;
    headers.Host = "boxd";
  } else {
    options.hostname = u.hostname.replace(/^\[|\]$/g, "");
    options.port = u.port || (secure ? 443 : 80);
  }
  return new Promise((resolve, reject) => {
    const req = (secure ? https : http).request(options, resolve);
    req.on("error", (err: NodeJS.ErrnoException & { reusedSocket?: boolean }) => {
      err.reusedSocket = req.reusedSocket;
      reject(err);
    });
    const idle = spec.idleTimeoutMs;
    if (idle !== null && idle !== undefined) {
      req.setTimeout(idle, () => {
        const err = new Error(`no answer within ${Math.round(idle / 1000)} s`);
        (err as NodeJS.ErrnoException).code = "ETIMEDOUT";
        req.destroy(err);
      });
    }
    if (payload === undefined) {
      req.end();
    } else if (Buffer.isBuffer(payload)) {
      req.end(payload);
    } else {
      payload.on("error", (err) => req.destroy(err));
      payload.pipe(req);
    }
  });
}

/** Read the whole body of a response. */
export async function readBody(resp: http.IncomingMessage): Promise<Buffer> {
  const chunks: Buffer[] = [];
  for await (const chunk of resp) chunks.push(chunk as Buffer);
  return Buffer.concat(chunks);
}

/** The typed error for a non-2xx response body. */
export function errorFromResponse(status: number, content: Buffer): BoxdError {
  if (content.length === 0) {
    return new InternalError(`unexpected HTTP ${status} from boxd (empty body)`);
  }
  let body: unknown;
  try {
    body = JSON.parse(content.toString("utf8"));
  } catch {
    const text = content.toString("utf8").trim().slice(0, 300);
    return new InternalError(`unexpected HTTP ${status} from boxd: ${text}`, {
      hint: "is BOXD_URL pointing at a boxd daemon?",
    });
  }
  return errorFromBody(body, status);
}

/** Translate a socket-level failure into boxd's ConnectionError. */
export function connectionError(err: unknown, where: string, hint: string): ConnectionError {
  const e = err as NodeJS.ErrnoException;
  if (e?.code === "ETIMEDOUT") {
    return new ConnectionError(`request to boxd at ${where} timed out (${e.message})`, {
      hint: "the daemon may be overloaded; raise new Boxd({ timeout })",
      cause: err,
    });
  }
  const what = e?.code ? `${e.code}: ${e.message}` : String(err);
  return new ConnectionError(`cannot reach boxd at ${where}: ${what}`, { hint, cause: err });
}
