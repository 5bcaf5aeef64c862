/**
 * `@boxd-sh/sdk`: TypeScript client of boxd, QEMU microVMs with cheap fork, checkpoint and
 * snapshot.
 *
 * ```ts
 * import { Boxd } from "@boxd-sh/sdk";
 * const boxd = new Boxd(); // BOXD_URL / BOXD_API_KEY, else the local daemon
 * ```
 */
export {
  Accounts,
  Boxd,
  Checkpoints,
  DEFAULT_TIMEOUT_MS,
  Files,
  Images,
  Keys,
  MAX_TIMEOUT,
  MAX_WAIT,
  Machines,
  Nodes,
  Snapshots,
  parseEvent,
  resolveTarget,
  type BoxdOptions,
  type ForkBatchOptions,
  type ForkOptions,
  type Lifetime,
  type Target,
} from "./client.js";
export { dataDir } from "./_local.js";
export { ProcessHandle } from "./process.js";
export { buildLineage, digestKey, type Lineage, type MachineNode, type SnapshotNode } from "./lineage.js";
export * from "./errors.js";
export type * from "./types.js";
export type { components, paths, operations } from "./schema.js";
