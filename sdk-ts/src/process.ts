/**
 * `ProcessHandle`: a process started with `boxd.machines.spawn`, with framed messages
 * both ways over a WebSocket (`/v1/machines/{ref}/processes/{id}/stream`). Mirrors the
 * Python SDK's `ProcessHandle`.
 */
import type { WebSocketClient } from "./_ws.js";
import { Conflict, ConnectionError, InternalError, errorFromBody, type BoxdError } from "./errors.js";
import type { Process } from "./types.js";

/** What a handle needs of its client (implemented by `Boxd`). */
export interface StreamOpener {
  /** @internal */
  _openStream(path: string): Promise<WebSocketClient>;
  /** @internal */
  _json<T>(spec: { method: string; path: string; json?: unknown }): Promise<T>;
}

const seg = (s: string): string => encodeURIComponent(s);

export class ProcessHandle {
  #ws: WebSocketClient | null = null;
  #exit: Record<string, unknown> | null = null;

  constructor(
    private readonly c: StreamOpener,
    private readonly ref: string,
    public info: Process,
  ) {}

  /** The process's id (the same in a fork child's copy). */
  get id(): string {
    return this.info.id;
  }

  /** Its exit status once `recv` has seen it exit, else null. */
  get exitCode(): number | null {
    return this.#exit ? ((this.#exit.exit_code as number | null) ?? null) : null;
  }

  /** Open the stream now (`send` and `recv` open it on first use). */
  async attach(): Promise<void> {
    await this.#conn();
  }

  async #conn(): Promise<WebSocketClient> {
    if (this.#ws && !this.#ws.closed) return this.#ws;
    const ws = await this.c._openStream(
      `/v1/machines/${seg(this.ref)}/processes/${seg(this.id)}/stream`,
    );
    const first = await ws.recv(60_000);
    const msg = typeof first === "string" ? (JSON.parse(first) as Record<string, unknown>) : null;
    if (!msg || msg.type !== "attached") {
      ws.close();
      throw msg && msg.error ? errorFromBody({ error: msg.error }) : new InternalError("malformed stream answer");
    }
    this.#ws = ws;
    return ws;
  }

  /** Write one message (one frame on the process's stdin). */
  async send(data: Uint8Array | string): Promise<void> {
    const ws = await this.#conn();
    ws.send(typeof data === "string" ? Buffer.from(data, "utf8") : Buffer.from(data));
  }

  /**
   * The next message the process wrote.
   * @throws Conflict once the process has exited (`details.exit_code`); an Error named
   *   TimeoutError after `timeout` ms; ConnectionError when the stream broke.
   */
  async recv(options: { timeout?: number } = {}): Promise<Buffer> {
    if (this.#exit) throw exited(this.id, this.#exit);
    const ws = await this.#conn();
    const m = await ws.recv(options.timeout);
    if (m === null) {
      this.#ws = null;
      throw new ConnectionError(`the stream of process ${this.id} closed`, {
        hint: "attach() again; the process may still run",
      });
    }
    if (typeof m !== "string") return m;
    const control = JSON.parse(m) as Record<string, unknown>;
    this.close();
    if (control.type === "exit") {
      this.#exit = control;
      throw exited(this.id, control);
    }
    throw errorFromBody({ error: control.error });
  }

  /** Signal the process's group (SIGKILL by default). */
  async kill(signal = 9): Promise<Process> {
    this.info = await this.c._json<Process>({
      method: "POST",
      path: `/v1/machines/${seg(this.ref)}/processes/${seg(this.id)}/kill`,
      json: { signal },
    });
    return this.info;
  }

  /** Detach from the stream; the process keeps running. */
  close(): void {
    this.#ws?.close();
    this.#ws = null;
  }
}

function exited(id: string, msg: Record<string, unknown>): BoxdError {
  const code = msg.exit_code;
  const signal = msg.signal;
  const status = signal ? `killed by signal ${String(signal)}` : `exit status ${String(code)}`;
  return new Conflict(`process ${id} has exited (${status})`, {
    hint: "spawn it again",
    details: { exit_code: code, signal, process: id },
  });
}
