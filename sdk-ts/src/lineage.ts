/**
 * Fork and snapshot lineage, built on the client from `machines.list()` and
 * `snapshots.list()` (the same trees as the Python SDK's `machines.lineage()`).
 *
 * A machine's `parentId` says which machine it was forked from, its `snapshot` which
 * snapshot (bare digest) it or its first ancestor started from; a snapshot's
 * `sourceMachine` names the machine it was saved from, matched by name as things are
 * now (a source deleted since, or a newer namesake, leaves `source` null).
 */
import type { Machine, Snapshot } from "./types.js";

/** One machine in the fork tree. */
export interface MachineNode {
  machine: Machine;
  /** The snapshot it was made from, when it (not an ancestor in the tree) was. */
  fromSnapshot: Snapshot | null;
  /** Snapshot versions saved from this machine, oldest first. */
  snapshots: Snapshot[];
  /** Machines forked from it, oldest first. */
  children: MachineNode[];
}

/** One snapshot version and what came of it. */
export interface SnapshotNode {
  snapshot: Snapshot;
  /** The machine it was saved from, if that machine still exists. */
  source: Machine | null;
  /** Fork trees of the machines made from this version. */
  machines: MachineNode[];
}

/** Root machines (no living parent, or the machine asked for) and snapshot versions. */
export interface Lineage {
  machines: MachineNode[];
  snapshots: SnapshotNode[];
}

/** A digest without its `sha256:` prefix (machines record the bare hex). */
export function digestKey(digest: string | null | undefined): string {
  return (digest ?? "").replace(/^sha256:/, "");
}

function walk(node: MachineNode): MachineNode[] {
  return [node, ...node.children.flatMap(walk)];
}

const byCreated = (a: { createdAt: number }, b: { createdAt: number }) => a.createdAt - b.createdAt;

/**
 * The lineage of `machines` and `snapshots`; of machine id `refId` only, if given.
 * @throws Error when `refId` is not the id of one of `machines`.
 */
export function buildLineage(machines: Machine[], snapshots: Snapshot[], refId?: string): Lineage {
  const byId = new Map(machines.map((m) => [m.id, m]));
  const byName = new Map(machines.map((m) => [m.name, m]));
  const byDigest = new Map(snapshots.map((s) => [digestKey(s.digest), s]));
  const kids = new Map<string, Machine[]>();
  for (const m of machines) {
    if (m.parentId && byId.has(m.parentId)) kids.set(m.parentId, [...(kids.get(m.parentId) ?? []), m]);
  }
  const saved = new Map<string, Snapshot[]>();
  const sourceOf = new Map<string, Machine>();
  for (const s of snapshots) {
    const src = byName.get(s.sourceMachine ?? "");
    if (src && src.createdAt <= s.createdAt) {
      saved.set(src.id, [...(saved.get(src.id) ?? []), s]);
      sourceOf.set(s.id, src);
    }
  }
  const node = (m: Machine): MachineNode => {
    const parent = m.parentId ? byId.get(m.parentId) : undefined;
    const inherited = parent !== undefined && parent.snapshot === m.snapshot;
    return {
      machine: m,
      fromSnapshot: inherited ? null : (byDigest.get(digestKey(m.snapshot)) ?? null),
      snapshots: [...(saved.get(m.id) ?? [])].sort(byCreated),
      children: [...(kids.get(m.id) ?? [])].sort(byCreated).map(node),
    };
  };
  let roots: MachineNode[];
  if (refId !== undefined) {
    const m = byId.get(refId);
    if (!m) throw new Error(`no machine ${refId} in the list`);
    roots = [node(m)];
  } else {
    roots = [...machines]
      .sort(byCreated)
      .filter((m) => !m.parentId || !byId.has(m.parentId))
      .map(node);
  }
  const every = roots.flatMap(walk);
  const started = new Map<string, MachineNode[]>();
  for (const n of every) {
    if (n.fromSnapshot) {
      const k = digestKey(n.fromSnapshot.digest);
      started.set(k, [...(started.get(k) ?? []), n]);
    }
  }
  let wanted = [...snapshots];
  if (refId !== undefined) {
    const inTree = new Set(every.map((n) => n.machine.id));
    wanted = wanted.filter(
      (s) => started.has(digestKey(s.digest)) || inTree.has(sourceOf.get(s.id)?.id ?? ""),
    );
  }
  wanted.sort((a, b) => (a.name === b.name ? a.version - b.version : a.name < b.name ? -1 : 1));
  return {
    machines: roots,
    snapshots: wanted.map((s) => ({
      snapshot: s,
      source: sourceOf.get(s.id) ?? null,
      machines: started.get(digestKey(s.digest)) ?? [],
    })),
  };
}
