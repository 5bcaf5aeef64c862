/** snake_case wire keys → camelCase SDK keys (only for models the daemon sends). */
export function camelKey(key: string): string {
  return key.replace(/_([a-z0-9])/g, (_, c: string) => c.toUpperCase());
}

/** Deep-convert an object's keys. Used on response models, never on user data maps. */
export function camelize<T>(value: unknown): T {
  if (Array.isArray(value)) return value.map((v) => camelize(v)) as T;
  if (typeof value === "object" && value !== null) {
    const out: Record<string, unknown> = {};
    for (const [k, v] of Object.entries(value)) {
      // An error body's details and a machine's labels are user data: keep them as sent.
      out[camelKey(k)] = k === "details" || k === "labels" ? v : camelize(v);
    }
    return out as T;
  }
  return value as T;
}
