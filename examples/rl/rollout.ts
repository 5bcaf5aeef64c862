// The spec's TypeScript rollout loop ("Fork per rollout"), verbatim. Run it from this
// directory after preparing rl-base (see README.md): install the SDK with
// `npm install ../../sdk-ts` (or the tarball from `npm pack`), then
// `npx tsx rollout.ts` or compile with tsc. sdk-ts/test runs the same block in CI.
import { readFileSync } from "node:fs";
import { Boxd } from "@boxd-sh/sdk";

const boxd = new Boxd();   // reads BOXD_API_KEY; authenticates automatically inside a VM

await boxd.machines.files.upload(
  "rl-base", "/home/boxd/rollout.py", readFileSync("rollout.py", "utf8")
);

async function rollout(name: string, seed: number): Promise<string> {
  const fork = await boxd.machines.fork("rl-base", { name });
  await boxd.machines.waitUntilReady(fork.id);
  const result = await boxd.machines.exec(fork.id, {
    command: `python3 /home/boxd/rollout.py --seed ${seed}`,
  });
  await boxd.machines.delete(fork.id);
  return result.stdout.trim();
}

const results = await Promise.all(
  [...Array(8).keys()].map((s) => rollout(`rollout-${s}`, s))
);
console.log(results);
