"""A smolagents-style code agent loop on E2B: the agent writes a code action, the
sandbox runs it, the observation goes back into the agent's memory, until it answers.
Then the same episode is branched: `Sandbox.fork` copies the live sandbox (on boxd a
copy-on-write fork of the running machine), and two different next actions run from
the same state.

Plain E2B code: nothing here knows about boxd. Point it at boxd with

    eval "$(boxd e2b env)"
    python examples/e2b/code_agent.py

The "model" is a scripted policy so the example runs offline; put an LLM call in
`policy` and it is the loop smolagents' CodeAgent runs with its E2B executor.
"""

from __future__ import annotations

import sys

from e2b import CommandExitException, Sandbox

TASK = "How many lines of /etc/passwd name a login shell ending in 'sh'?"


def policy(memory: list[str]) -> str:
    """The next code action, given the observations so far (scripted here)."""
    step = len(memory)
    if step == 0:
        return "head -3 /etc/passwd"
    if step == 1:
        return "grep -c 'sh$' /etc/passwd"
    return f"echo FINAL ANSWER: {memory[-1].strip()}"


def run_episode(sbx: Sandbox, max_steps: int = 5) -> str:
    memory: list[str] = []
    for _ in range(max_steps):
        action = policy(memory)
        try:
            observation = sbx.commands.run(action, timeout=30).stdout
        except CommandExitException as exc:  # an error is an observation too
            observation = f"error (exit {exc.exit_code}): {exc.stderr}"
        print(f"> {action}\n{observation.rstrip()}")
        if observation.startswith("FINAL ANSWER:"):
            return observation.removeprefix("FINAL ANSWER:").strip()
        memory.append(observation)
    return "no answer"


def main() -> int:
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.commands.run("echo 'agent:x:1000:1000::/home/agent:/bin/zsh' >> /etc/passwd",
                         user="root")
        answer = run_episode(sbx)
        print(f"{TASK}\n-> {answer}")
        # Branch the finished episode: both children start from this sandbox's state.
        left, right = sbx.fork(count=2)
        try:
            left.commands.run("echo 'x:x:1:1::/:/bin/sh' >> /etc/passwd", user="root")
            counts = [int(s.commands.run("grep -c 'sh$' /etc/passwd").stdout)
                      for s in (left, right)]
        finally:
            left.kill()
            right.kill()
        print(f"branches: {counts[0]} and {counts[1]} login shells (from {answer})")
        return 0 if counts == [int(answer) + 1, int(answer)] else 1
    finally:
        sbx.kill()


if __name__ == "__main__":
    sys.exit(main())
