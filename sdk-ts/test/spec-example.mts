// The TypeScript example of the spec "Reproducible RL environments", verbatim, between
// the markers (test/sdk.test.mjs runs it and checks the block against the spec when the
// spec file is available). The one line after the block prints the results for the test.
// --- spec block ---
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
// --- end of spec block ---
console.log(JSON.stringify(results));
