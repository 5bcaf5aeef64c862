/**
 * Public types: the daemon's wire models (generated into `schema.d.ts` from its OpenAPI
 * schema) with snake_case keys turned into camelCase, as the SDK returns them.
 */
import type { components } from "./schema.js";

type Schemas = components["schemas"];

/** `exit_code` → `exitCode`, at the type level. */
export type CamelKey<S extends string> = S extends `${infer Head}_${infer Tail}`
  ? `${Head}${Capitalize<CamelKey<Tail>>}`
  : S;

/** A wire model with camelCase keys (recursively). */
export type Camel<T> = T extends readonly (infer U)[]
  ? Camel<U>[]
  : T extends object
    ? { [K in keyof T as K extends string ? CamelKey<K> : K]: Camel<T[K]> }
    : T;

export type MachineState = Schemas["MachineState"];
export type Machine = Camel<Schemas["Machine"]>;
/** Outcome of a command run to completion; a non-zero `exitCode` is a normal result. */
export type ExecResult = Camel<Schemas["ExecResult"]>;
/** One event of a streaming exec: `stdout`/`stderr` output as it arrives, then `exit`. */
export type ExecEvent = Camel<Schemas["ExecEvent"]>;
/**
 * A durable exec (`machines.execResult`): `running`, or its exit, with the last MiB of
 * each stream (`stdoutTruncated`/`stderrTruncated`: earlier output was dropped) and an
 * `error` when it ended without an exit status.
 */
export type ExecStatus = Camel<Schemas["ExecStatus"]>;
/** One kept exec of a machine, without its output (`machines.execs`). */
export type ExecSummary = Camel<Schemas["ExecSummary"]>;
/** A machine's service output after an offset (`machines.logs`). */
export type ServiceLog = Camel<Schemas["ServiceLog"]>;
/** A machine's recent CPU, memory and disk samples (`machines.metrics`), oldest first. */
export type MachineMetrics = Camel<Schemas["MachineMetrics"]>;
/** One sample: `cpuUsedPct` since the sample before, memory and disk in bytes. */
export type MetricSample = Camel<Schemas["MetricSample"]>;
export type FileInfo = Camel<Schemas["FileInfo"]>;
export type Checkpoint = Camel<Schemas["Checkpoint"]>;
export type Snapshot = Camel<Schemas["Snapshot"]>;
/** An imported container image: digest, layers and its run config (ENV, ENTRYPOINT, CMD, ...). */
export type Image = Camel<Schemas["Image"]>;
export type ApiKey = Camel<Schemas["ApiKey"]>;
/** A new API key; its `secret` is shown only here. */
export type ApiKeyCreated = Camel<Schemas["ApiKeyCreated"]>;
export type Account = Camel<Schemas["Account"]>;
export type NodeInfo = Camel<Schemas["NodeInfo"]>;
export type HostInfo = Camel<Schemas["HostInfo"]>;
export type Standby = Camel<Schemas["Standby"]>;
export type Health = Camel<Schemas["Health"]>;
export type ErrorBody = Schemas["ErrorBody"];
/** A process started with `machines.spawn` (a long-lived command with framed messages). */
export type Process = Camel<Schemas["Process"]>;
/** One page of `machines.listPage`: its machines and the cursor of the next (null: last). */
export type MachinePage = Camel<Schemas["MachineList"]>;
/** What `machines.deleteMany` removed, and each machine it could not with its error. */
export type MachinesDeleted = Camel<Schemas["MachinesDeleted"]>;

/** A label selector: every label given must match; `state` narrows it. */
export interface LabelSelector {
  /** Labels (string keys and values) a machine must all carry. */
  labels?: Record<string, string>;
  /** Only machines in this state. */
  state?: MachineState;
}

/** Options of `machines.new`. */
export interface MachineNewOptions {
  /** Virtual CPUs (daemon default if absent). */
  vcpus?: number;
  /** Memory in MiB (daemon default if absent). */
  memoryMib?: number;
  /** Disk size in GiB (daemon default if absent). */
  diskGib?: number;
  /** No network device at all. */
  isolated?: boolean;
  /** Start from a snapshot: `NAME`, `NAME@N` or `sha256:DIGEST`. */
  fromSnapshot?: string;
  /**
   * Engine to run it on: `qemu` or `gvisor` (daemon default if absent; a snapshot starts
   * on the engine it was saved on). `info().engines` lists them with their status.
   */
  engine?: string;
  /** Idle seconds before its vCPUs stop (0 never; daemon default if absent). */
  suspendAfter?: number;
  /** Idle seconds before it goes to disk (0 never; daemon default if absent). */
  hibernateAfter?: number;
  /** Cluster node to place it on (`nodes.list()`); the daemon places it if absent. */
  node?: string;
  /**
   * Its URL needs no token (the bare `http://127.0.0.1:PORT`, any TCP protocol): every
   * local user reaches its port 8080 and wakes it. Default: `Machine.url` carries the
   * machine's token; use it as given.
   */
  public?: boolean;
  /**
   * Labels to find it by (`list({ labels })`, `deleteMany(labels)`); its forks inherit
   * them. At most 32; a key is 1-128 letters, digits, `._/-`; a value 0-256 characters.
   */
  labels?: Record<string, string>;
  /**
   * A key of this logical request (e.g. `crypto.randomUUID()`), the same on each of its
   * retries (HTTP `Idempotency-Key`): a retry within 24 h resolves to the first request's
   * machine, never a new one (it waits for the first if that still runs); a key sent with
   * another request rejects with `IdempotencyKeyReused`; a failed request frees its key.
   */
  idempotencyKey?: string;
  /**
   * Its lifetime: whole seconds from now (1 to 30 days). At its end the daemon deletes
   * it, or hibernates it with `onTimeout: "hibernate"`; `Machine.endAt` says when and
   * `machines.setTimeout` moves it. Absent: it runs until deleted.
   */
  timeout?: number;
  /** What its end does: `"delete"` (default) or `"hibernate"`. */
  onTimeout?: OnTimeout;
  /**
   * A container image imported for this account (`images.import`, `boxd image import`):
   * `NAME[:TAG]` or `sha256:DIGEST`. The machine's root is the image's files; its ENV,
   * WORKDIR and USER are exec's defaults. gVisor only for now (`engine: "gvisor"`).
   */
  image?: string;
  /** With `image`: `false` does not start its ENTRYPOINT + CMD as the machine's service. */
  service?: boolean;
  /**
   * Seconds (0-3600) to wait in the account's queue when its quota or the nodes' room is
   * used up, instead of rejecting at once; at its end a `QuotaExceeded` with
   * `retryAfter`. Default 0: no wait.
   */
  wait?: number;
  /**
   * TCP ports of the host's loopback (127.0.0.1) the machine reaches at
   * `host.boxd.internal:PORT` (a trainer's model server), and nothing else of the host;
   * its forks inherit them. Not the daemon's own ports (docs/security.md).
   */
  exposeHost?: number[];
  /**
   * Allow-list of its outbound connections: CIDRs, IPv4 addresses, host names (resolved
   * when it is created), each with an optional `:PORT`; `[]` allows none. Absent: every
   * public address. Private, loopback and link-local ranges stay blocked.
   */
  egress?: string[];
}

/** What a machine's end does (`timeout`): delete it or hibernate it. */
export type OnTimeout = "delete" | "hibernate";

/** What `machines.exec` and `machines.execStream` run. */
export interface ExecOptions {
  /** A shell string (run by `/bin/sh -c`) or an argv list. */
  command: string | string[];
  /** Extra environment variables. */
  env?: Record<string, string>;
  /** Working directory in the guest. */
  cwd?: string;
  /**
   * Seconds after which the command's process group gets SIGTERM, then SIGKILL 2 s later
   * (then `ExecTimeout` is thrown by `exec`).
   */
  timeout?: number;
  /** Text fed to the command's standard input. */
  stdin?: string;
  /**
   * `NAME[:GROUP]` or `UID[:GID]` to run it as (the machine's /etc/passwd names it);
   * default: the image's USER, else root.
   */
  user?: string;
  /**
   * `exec` only: the exec's id on the machine (letters, digits, `_.-`; generated when
   * absent, returned as `execId`). The command runs on if the call's connection is lost;
   * `execResult(ref, execId)` reads it. An id the machine still keeps is not run again:
   * the call waits for that exec and returns its result (`ExecIdConflict` if the command
   * differs).
   */
  execId?: string;
}
