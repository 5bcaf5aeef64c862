/**
 * The one error tree of boxd, mirroring `boxd.errors` in the Python package:
 *
 * ```
 * BoxdError                      every error boxd raises; .code, .message, .hint, .details
 * ├── InvalidRequest             malformed input (bad name, bad size, bad path)     400
 * │   └── CorruptData            client data failing an integrity check             400
 * ├── AuthError                  missing, unknown or revoked API key                401
 * │   └── Forbidden              the key is valid but may not do this               403
 * ├── NotFound                   no such resource for this account                  404
 * │   ├── MachineNotFound        .machine
 * │   ├── CheckpointNotFound     .machine, .checkpoint
 * │   ├── SnapshotNotFound       .snapshot
 * │   └── GuestFileNotFound      .path (inside the machine)
 * ├── Conflict                   the request clashes with what exists               409
 * │   ├── AlreadyExists          .kind, .resourceName (duplicate name)
 * │   ├── StateError             .machine, .state, .required (wrong lifecycle state)
 * │   └── IdempotencyKeyReused   .key: the key was used for another request
 * ├── QuotaExceeded              .limit, .used, .retryAfter                         429
 * ├── ExecTimeout                .timeout, .stdout, .stderr (partial output)        408
 * ├── InfrastructureError        the machine, engine, agent or node failed, not the  503
 * │   │                          command: an exec's outcome is unknown; .machine
 * │   ├── MachineFailed          the machine's VM (engine process) died or stopped answering
 * │   │   ├── AgentLost          the connection to its guest agent broke; the VM still ran
 * │   │   └── NodeLost           its cluster node is gone; .machine, .node
 * │   └── ConnectionError        the client cannot reach the daemon, or lost it     (client only)
 * ├── IntegrityError             a stored blob does not match its digest            500
 * ├── ResourceExhausted          host disk or memory is full                        507
 * ├── HostSetupError             QEMU, an image or another host prerequisite is missing  500
 * └── InternalError              a bug; the daemon's log has the details            500
 * ```
 *
 * Each API error body is `{"error": {code, message, hint, details}}`; {@link errorFromBody}
 * rebuilds the class named by `code`. Codes are stable API.
 *
 * `AlreadyExists` exposes the duplicate's name as `resourceName` because `Error.name`
 * is the class name in JavaScript; `details.name` holds it too.
 */

export type ErrorDetails = Record<string, unknown>;

export interface ErrorOptions {
  hint?: string;
  details?: ErrorDetails;
  cause?: unknown;
}

/** Root of every error boxd raises. */
export class BoxdError extends Error {
  /** Stable machine-readable code, e.g. `machine_not_found`. */
  static readonly code: string = "error";
  /** HTTP status the daemon answers with. */
  static readonly status: number = 500;

  /** What to do about it, or "". */
  readonly hint: string;
  /** Machine-readable fields of the error (as sent by the daemon). */
  readonly details: ErrorDetails;

  constructor(message: string, options: ErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.hint = options.hint ?? "";
    this.details = options.details ?? {};
  }

  /** The error's code (that of its class). */
  get code(): string {
    return (this.constructor as typeof BoxdError).code;
  }

  /** The HTTP status of its class. */
  get status(): number {
    return (this.constructor as typeof BoxdError).status;
  }

  override toString(): string {
    return `${this.name}: ${this.message}${this.hint ? ` (${this.hint})` : ""}`;
  }

  /** The JSON error body the API sends for this error. */
  toBody(): { error: { code: string; message: string; hint: string; details: ErrorDetails } } {
    return {
      error: { code: this.code, message: this.message, hint: this.hint, details: this.details },
    };
  }

  protected detail<T = unknown>(key: string): T | undefined {
    return this.details[key] as T | undefined;
  }
}

/** Malformed input: a bad name, size, path or argument. */
export class InvalidRequest extends BoxdError {
  static override readonly code: string = "invalid_request";
  static override readonly status: number = 400;
  /** The offending field, when known. */
  get field(): string | undefined {
    return this.detail("field");
  }
}

/** Data the client sent (an imported snapshot file) fails an integrity check: a 4xx. */
export class CorruptData extends InvalidRequest {
  static override readonly code: string = "corrupt_data";
  /** What failed its check, when known. */
  get digest(): string | undefined {
    return this.detail("digest");
  }
}

/** A request body over the daemon's limit (`limit` bytes): a 413. */
export class PayloadTooLarge extends InvalidRequest {
  static override readonly code: string = "payload_too_large";
  static override readonly status: number = 413;
  /** The limit in bytes. */
  get limit(): number | undefined {
    return this.detail("limit");
  }
}

/** The API key is missing, unknown or revoked. */
/** The request body stopped arriving before it was complete (`BOXD_BODY_TIMEOUT`). */
export class BodyTimeout extends InvalidRequest {
  static override readonly code: string = "body_timeout";
  static override readonly status: number = 408;
  get seconds(): number | undefined {
    return this.detail("seconds");
  }
}

export class AuthError extends BoxdError {
  static override readonly code: string = "unauthorized";
  static override readonly status: number = 401;
}

/** The API key is valid, but its account may not do this. */
export class Forbidden extends AuthError {
  static override readonly code: string = "forbidden";
  static override readonly status: number = 403;
}

/** No such resource for this account (another account's resources look the same). */
export class NotFound extends BoxdError {
  static override readonly code: string = "not_found";
  static override readonly status: number = 404;
}

/** No machine with this name or id. */
export class MachineNotFound extends NotFound {
  static override readonly code: string = "machine_not_found";
  get machine(): string | undefined {
    return this.detail("machine");
  }
}

/** The machine has no checkpoint of this name. */
export class CheckpointNotFound extends NotFound {
  static override readonly code: string = "checkpoint_not_found";
  get machine(): string | undefined {
    return this.detail("machine");
  }
  get checkpoint(): string | undefined {
    return this.detail("checkpoint");
  }
}

/** No snapshot matches this reference. */
export class SnapshotNotFound extends NotFound {
  static override readonly code: string = "snapshot_not_found";
  get snapshot(): string | undefined {
    return this.detail("snapshot");
  }
}

/** A path inside the machine does not exist. */
export class GuestFileNotFound extends NotFound {
  static override readonly code: string = "guest_file_not_found";
  get path(): string | undefined {
    return this.detail("path");
  }
}

/** No exec with this id is kept for the machine (unknown, or past its keeping). */
export class ExecNotFound extends NotFound {
  static override readonly code: string = "exec_not_found";
  get machine(): string | undefined {
    return this.detail("machine");
  }
  get execId(): string | undefined {
    return this.detail("exec_id");
  }
}

/** The request clashes with what exists. */
export class Conflict extends BoxdError {
  static override readonly code: string = "conflict";
  static override readonly status: number = 409;
}

/** A resource of this kind and name exists already. */
export class AlreadyExists extends Conflict {
  static override readonly code: string = "already_exists";
  get kind(): string | undefined {
    return this.detail("kind");
  }
  /** The duplicate name (`details.name`; `Error.name` is the class name). */
  get resourceName(): string | undefined {
    return this.detail("name");
  }
}

/** The machine is in a state that does not allow this operation. */
export class StateError extends Conflict {
  static override readonly code: string = "invalid_state";
  get machine(): string | undefined {
    return this.detail("machine");
  }
  get state(): string | undefined {
    return this.detail("state");
  }
  get required(): unknown {
    return this.detail("required");
  }
}

/** An `Idempotency-Key` already named a different request of this account (another
 * route, source or body): a key names one request, whose retries send it unchanged. */
export class IdempotencyKeyReused extends Conflict {
  static override readonly code: string = "idempotency_key_reused";
  get key(): string | undefined {
    return this.detail("key");
  }
}

/** An exec id the machine keeps for another command. */
export class ExecIdConflict extends Conflict {
  static override readonly code: string = "exec_id_conflict";
  get machine(): string | undefined {
    return this.detail("machine");
  }
  get execId(): string | undefined {
    return this.detail("exec_id");
  }
}

/** An account limit would be exceeded. */
export class QuotaExceeded extends BoxdError {
  static override readonly code: string = "quota_exceeded";
  static override readonly status: number = 429;
  get limit(): number | undefined {
    return this.detail("limit");
  }
  get used(): number | undefined {
    return this.detail("used");
  }
  /** Seconds after which a retry likely finds room (set when a `wait` ended). */
  get retryAfter(): number | undefined {
    return this.detail("retry_after");
  }
}

/** A command ran past its timeout and was killed; `stdout`/`stderr` hold partial output. */
export class ExecTimeout extends BoxdError {
  static override readonly code: string = "exec_timeout";
  static override readonly status: number = 408;
  get timeout(): number | undefined {
    return this.detail("timeout");
  }
  get stdout(): string | undefined {
    return this.detail("stdout");
  }
  get stderr(): string | undefined {
    return this.detail("stderr");
  }
  get execId(): string | undefined {
    return this.detail("exec_id");
  }
}

/**
 * The machine, its engine, its guest agent or its node failed: not the command. An exec
 * that rejects with it has no exit status (its outcome is unknown), so a trainer retries
 * or drops the rollout instead of scoring it; the subclasses say which part failed.
 */
export class InfrastructureError extends BoxdError {
  static override readonly code: string = "infrastructure_error";
  static override readonly status: number = 503;
  get machine(): string | undefined {
    return this.detail("machine");
  }
}

/** The machine's VM process (its engine: QEMU, the gVisor sandbox) died or stopped answering. */
export class MachineFailed extends InfrastructureError {
  static override readonly code: string = "machine_failed";
}

/** The connection to the machine's guest agent broke mid-request while its VM still ran. */
export class AgentLost extends MachineFailed {
  static override readonly code: string = "agent_lost";
}

/** The cluster node that ran the machine is gone; only delete applies. */
export class NodeLost extends MachineFailed {
  static override readonly code: string = "node_lost";
  get node(): string | undefined {
    return this.detail("node");
  }
}

/** A stored blob does not match its recorded digest. */
export class IntegrityError extends BoxdError {
  static override readonly code: string = "integrity_error";
  static override readonly status: number = 500;
  get digest(): string | undefined {
    return this.detail("digest");
  }
  get path(): string | undefined {
    return this.detail("path");
  }
}

/** The host ran out of disk or memory. */
export class ResourceExhausted extends BoxdError {
  static override readonly code: string = "resource_exhausted";
  static override readonly status: number = 507;
}

/** A host prerequisite (QEMU, an image, a tool) is missing or broken. */
export class HostSetupError extends BoxdError {
  static override readonly code: string = "host_setup";
  static override readonly status: number = 500;
}

/** The client could not reach the boxd daemon, or lost its connection mid-request. */
export class ConnectionError extends InfrastructureError {
  static override readonly code: string = "connection_error";
}

/** An unexpected failure; the daemon's log has the details. */
export class InternalError extends BoxdError {
  static override readonly code: string = "internal_error";
  static override readonly status: number = 500;
}

/** Every class of the tree, root first. */
export const ERROR_CLASSES: readonly (typeof BoxdError)[] = [
  BoxdError,
  InvalidRequest,
  CorruptData,
  PayloadTooLarge,
  BodyTimeout,
  AuthError,
  Forbidden,
  NotFound,
  MachineNotFound,
  CheckpointNotFound,
  SnapshotNotFound,
  GuestFileNotFound,
  ExecNotFound,
  Conflict,
  AlreadyExists,
  StateError,
  IdempotencyKeyReused,
  ExecIdConflict,
  QuotaExceeded,
  ExecTimeout,
  InfrastructureError,
  MachineFailed,
  AgentLost,
  NodeLost,
  IntegrityError,
  ResourceExhausted,
  HostSetupError,
  ConnectionError,
  InternalError,
];

const BY_CODE: ReadonlyMap<string, typeof BoxdError> = new Map(
  ERROR_CLASSES.map((cls) => [cls.code, cls]),
);

function isRecord(x: unknown): x is Record<string, unknown> {
  return typeof x === "object" && x !== null && !Array.isArray(x);
}

/** Rebuild the typed error from an API error body (the inverse of {@link BoxdError.toBody}). */
export function errorFromBody(body: unknown, status = 500): BoxdError {
  const err = isRecord(body) ? body.error : undefined;
  if (!isRecord(err)) {
    const text = JSON.stringify(body) ?? String(body);
    return new InternalError(`unexpected error response (HTTP ${status}): ${text}`.slice(0, 500));
  }
  const cls = BY_CODE.get(String(err.code)) ?? BoxdError;
  const details = isRecord(err.details) ? err.details : {};
  return new cls(String(err.message ?? ""), { hint: String(err.hint ?? ""), details });
}
