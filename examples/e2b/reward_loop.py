"""An open-r1-style code reward: each candidate program a policy wrote is run in its own
E2B sandbox against test cases, and its reward is the fraction it passes.

Plain E2B code: nothing here knows about boxd. Point it at boxd with

    eval "$(boxd e2b env)"
    boxd e2b warm base --forks 8      # optional: every create is then a fork
    python examples/e2b/reward_loop.py

(as open-r1 does with E2B, the rewards of a batch are computed concurrently).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

from e2b import Sandbox

#: The task: read two integers, print their sum. Each case is (stdin, expected stdout).
CASES = [("1 2", "3"), ("10 -4", "6"), ("0 0", "0"), ("123456789 1", "123456790")]

#: What a policy might have written for it: right, wrong on negatives, crashing.
CANDIDATES = {
    "right": "a, b = map(int, input().split())\nprint(a + b)\n",
    "abs": "a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n",
    "crash": "print(int(input()) + 1)\n",
}

HARNESS = """
import json, subprocess, sys
cases = json.loads(sys.argv[1])
passed = 0
for stdin, want in cases:
    try:
        out = subprocess.run([sys.executable, "/home/user/solution.py"], input=stdin,
                             capture_output=True, text=True, timeout=5).stdout.strip()
    except subprocess.TimeoutExpired:
        out = None
    passed += out == want
print(passed / len(cases))
"""


def reward(code: str) -> float:
    """The fraction of CASES the program passes, run in a fresh sandbox."""
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/home/user/solution.py", code)
        sbx.files.write("/home/user/harness.py", HARNESS)
        arg = json.dumps(CASES).replace("'", "'\\''")
        result = sbx.commands.run(f"python3 /home/user/harness.py '{arg}'", timeout=60)
        return float(result.stdout.strip())
    finally:
        sbx.kill()


def main() -> int:
    with ThreadPoolExecutor(max_workers=len(CANDIDATES)) as pool:
        rewards = dict(zip(CANDIDATES, pool.map(reward, CANDIDATES.values()), strict=True))
    for name, r in rewards.items():
        print(f"{name}: reward {r:.2f}")
    return 0 if rewards == {"right": 1.0, "abs": 0.75, "crash": 0.0} else 1


if __name__ == "__main__":
    sys.exit(main())
