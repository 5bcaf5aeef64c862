/**
 * A minimal WebSocket client (RFC 6455) over `node:http`'s upgrade, so that a process
 * stream works on the local daemon's unix socket as on TCP, with no runtime dependency
 * (Node 20 has no WebSocket client, and none that takes a socket path).
 */
import { createHash, randomBytes } from "node:crypto";
import * as http from "node:http";
import * as https from "node:https";
import type { Duplex } from "node:stream";

import type { Endpoint } from "./_http.js";

const GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

export type Message = Buffer | string;

/** The HTTP answer when the daemon refused the upgrade (status and body). */
export class UpgradeRefused extends Error {
  constructor(
    readonly status: number,
    readonly body: Buffer,
  ) {
    super(`WebSocket upgrade refused with HTTP ${status}`);
  }
}

export class WebSocketClient {
  #socket: Duplex;
  #buf: Buffer = Buffer.alloc(0);
  #frags: Buffer[] = [];
  #fragOp = 0;
  #queue: Message[] = [];
  #waiters: { resolve: (m: Message | null) => void; reject: (e: Error) => void }[] = [];
  #closed = false;
  #error: Error | null = null;

  private constructor(socket: Duplex, head: Buffer) {
    this.#socket = socket;
    socket.on("data", (chunk: Buffer) => this.#feed(chunk));
    socket.on("close", () => this.#end(null));
    socket.on("error", (err: Error) => this.#end(err));
    if (head.length) this.#feed(head);
  }

  /** Open a WebSocket at `path` of the endpoint (headers: e.g. Authorization). */
  static connect(
    endpoint: Endpoint,
    path: string,
    headers: Record<string, string>,
    timeoutMs: number,
  ): Promise<WebSocketClient> {
    const key = randomBytes(16).toString("base64");
    const u = new URL(endpoint.baseUrl.replace(/\/+$/, "") + path);
    const secure = u.protocol === "https:" && endpoint.socketPath === null;
    const options: http.RequestOptions = {
      method: "GET",
      path: u.pathname + u.search,
      headers: {
        ...headers,
        Connection: "Upgrade",
        Upgrade: "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": key,
      },
    };
    if (endpoint.socketPath !== null) {
      options.socketPath = endpoint.socketPath;
      (options.headers as Record<string, string>).Host = "boxd";
    } else {
      options.hostname = u.hostname.replace(/^\[|\]$/g, "");
      options.port = u.port || (secure ? 443 : 80);
    }
    return new Promise((resolve, reject) => {
      const req = (secure ? https : http).request(options);
      req.setTimeout(timeoutMs, () => req.destroy(new Error(`no WebSocket answer within ${timeoutMs} ms`)));
      req.on("error", reject);
      req.on("response", (resp) => {
        const chunks: Buffer[] = [];
        resp.on("data", (c: Buffer) => chunks.push(c));
        resp.on("end", () => reject(new UpgradeRefused(resp.statusCode ?? 0, Buffer.concat(chunks))));
      });
      req.on("upgrade", (resp, socket, head) => {
        const want = createHash("sha1").update(key + GUID).digest("base64");
        if (resp.headers["sec-websocket-accept"] !== want) {
          socket.destroy();
          reject(new Error("the daemon's WebSocket handshake did not match"));
          return;
        }
        socket.setTimeout(0);
        resolve(new WebSocketClient(socket, head));
      });
      req.end();
    });
  }

  get closed(): boolean {
    return this.#closed;
  }

  /** Send one message: binary for a Buffer, text for a string. */
  send(data: Message): void {
    if (this.#closed) throw this.#error ?? new Error("the WebSocket is closed");
    const payload = typeof data === "string" ? Buffer.from(data, "utf8") : data;
    this.#frame(typeof data === "string" ? 1 : 2, payload);
  }

  #frame(opcode: number, payload: Buffer): void {
    const n = payload.length;
    const head = n < 126 ? Buffer.alloc(2) : n < 65536 ? Buffer.alloc(4) : Buffer.alloc(10);
    head[0] = 0x80 | opcode;
    if (n < 126) head[1] = 0x80 | n;
    else if (n < 65536) {
      head[1] = 0x80 | 126;
      head.writeUInt16BE(n, 2);
    } else {
      head[1] = 0x80 | 127;
      head.writeBigUInt64BE(BigInt(n), 2);
    }
    const mask = randomBytes(4);
    const masked = Buffer.allocUnsafe(n);
    for (let i = 0; i < n; i++) masked[i] = payload[i]! ^ mask[i & 3]!;
    this.#socket.write(Buffer.concat([head, mask, masked]));
  }

  /** The next message; null once the connection closed cleanly. Rejects after `timeoutMs`. */
  recv(timeoutMs?: number): Promise<Message | null> {
    const next = this.#queue.shift();
    if (next !== undefined) return Promise.resolve(next);
    if (this.#closed) return this.#error ? Promise.reject(this.#error) : Promise.resolve(null);
    return new Promise((resolve, reject) => {
      let timer: NodeJS.Timeout | undefined;
      const waiter = {
        resolve: (m: Message | null) => {
          if (timer) clearTimeout(timer);
          resolve(m);
        },
        reject: (e: Error) => {
          if (timer) clearTimeout(timer);
          reject(e);
        },
      };
      this.#waiters.push(waiter);
      if (timeoutMs !== undefined) {
        timer = setTimeout(() => {
          const i = this.#waiters.indexOf(waiter);
          if (i >= 0) this.#waiters.splice(i, 1);
          const err = new Error(`nothing arrived within ${timeoutMs} ms`);
          err.name = "TimeoutError";
          reject(err);
        }, timeoutMs);
      }
    });
  }

  close(): void {
    if (!this.#closed) {
      try {
        this.#frame(8, Buffer.from([0x03, 0xe8]));
      } catch {
        /* the socket is gone already */
      }
      this.#socket.end();
    }
    this.#end(null);
  }

  #deliver(m: Message): void {
    const w = this.#waiters.shift();
    if (w) w.resolve(m);
    else this.#queue.push(m);
  }

  #end(err: Error | null): void {
    if (this.#closed) return;
    this.#closed = true;
    this.#error = err;
    for (const w of this.#waiters.splice(0)) (err ? w.reject(err) : w.resolve(null));
  }

  #feed(chunk: Buffer): void {
    this.#buf = this.#buf.length ? Buffer.concat([this.#buf, chunk]) : chunk;
    for (;;) {
      const b = this.#buf;
      if (b.length < 2) return;
      const fin = (b[0]! & 0x80) !== 0;
      const opcode = b[0]! & 0x0f;
      let n = b[1]! & 0x7f;
      let off = 2;
      if (n === 126) {
        if (b.length < 4) return;
        n = b.readUInt16BE(2);
        off = 4;
      } else if (n === 127) {
        if (b.length < 10) return;
        n = Number(b.readBigUInt64BE(2));
        off = 10;
      }
      if ((b[1]! & 0x80) !== 0) off += 4; // servers never mask; tolerate it anyway
      if (b.length < off + n) return;
      const payload = b.subarray(off, off + n);
      this.#buf = b.subarray(off + n);
      if (opcode === 8) {
        this.close();
        return;
      }
      if (opcode === 9) {
        this.#frame(10, Buffer.from(payload));
        continue;
      }
      if (opcode === 10) continue;
      if (opcode !== 0) this.#fragOp = opcode;
      this.#frags.push(Buffer.from(payload));
      if (!fin) continue;
      const whole = this.#frags.length === 1 ? this.#frags[0]! : Buffer.concat(this.#frags);
      this.#frags = [];
      this.#deliver(this.#fragOp === 1 ? whole.toString("utf8") : whole);
    }
  }
}
