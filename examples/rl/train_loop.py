# ruff: noqa: I001, SIM115  (the spec's code, verbatim)
"""The spec's "Fork per rollout" loop and its "Verify reproducibility" check, verbatim.

Run from this directory, after preparing ``rl-base`` as the spec does::

    boxd machine new rl-base
    boxd machine exec rl-base -- 'pip install gymnasium numpy'
    boxd machine files upload rl-base warm_up.py /home/boxd/warm_up.py
    boxd machine exec rl-base -- 'python3 warm_up.py'
    python3 train_loop.py

Everything between the two ``# --- spec`` markers is the spec's code, unchanged.
"""

# --- spec: Fork per rollout ---------------------------------------------------------
from concurrent.futures import ThreadPoolExecutor
from boxd import Boxd

boxd = Boxd()   # reads BOXD_API_KEY; authenticates automatically inside a VM

boxd.machines.files.upload(
    "rl-base", "/home/boxd/rollout.py", open("rollout.py").read()
)

def rollout(name: str, seed: int) -> str:
    fork = boxd.machines.fork("rl-base", name)
    boxd.machines.wait_until_ready(fork.id)
    result = boxd.machines.exec(
        fork.id, f"python3 /home/boxd/rollout.py --seed {seed}"
    )
    boxd.machines.delete(fork.id)
    return result.stdout.strip()

with ThreadPoolExecutor(max_workers=8) as pool:
    results = list(pool.map(
        lambda s: rollout(f"rollout-{s}", seed=s), range(8)
    ))

# --- spec: Verify reproducibility ---------------------------------------------------
a = rollout("check-a", seed=42)
b = rollout("check-b", seed=42)
assert a == b, "same starting bytes + same seed should give the same trajectory"
# --- end of spec ----------------------------------------------------------------------

for line in results:
    print(line)
print(f"check: seed 42 gave the same trajectory on two forks: {a}")
