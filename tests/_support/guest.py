"""Helpers that run small programs inside machines for the integration tests."""

from __future__ import annotations

from typing import Any

# A process that holds a counter in its own memory: SIGUSR2 adds one, SIGUSR1 writes
# the current value to /run/counter. Only the process knows the value, so reading it
# back after a restore or fork proves the process's memory came along.
COUNTER = r"""
import os, signal, time
n = 0
def inc(*_):
    global n
    n += 1
def dump(*_):
    with open("/run/counter.tmp", "w") as f:
        f.write(str(n))
    os.rename("/run/counter.tmp", "/run/counter")
signal.signal(signal.SIGUSR2, inc)
signal.signal(signal.SIGUSR1, dump)
with open("/run/counter.pid", "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(3600)
"""


def start_counter(client: Any, machine: str) -> None:
    client.machines.files.upload(machine, "/root/counter.py", COUNTER)
    r = client.machines.exec(
        machine,
        "rm -f /run/counter.pid; nohup python3 /root/counter.py >/dev/null 2>&1 &"
        " for i in $(seq 100); do [ -s /run/counter.pid ] && break; sleep 0.1; done;"
        " cat /run/counter.pid",
    )
    assert r.exit_code == 0 and r.stdout.strip().isdigit(), r


def bump_counter(client: Any, machine: str, times: int) -> None:
    loop = f'for i in $(seq {times}); do kill -USR2 "$(cat /run/counter.pid)"; sleep 0.05; done'
    r = client.machines.exec(machine, loop)
    assert r.exit_code == 0, r


def read_counter(client: Any, machine: str) -> int:
    r = client.machines.exec(
        machine,
        'rm -f /run/counter; kill -USR1 "$(cat /run/counter.pid)";'
        " for i in $(seq 100); do [ -s /run/counter ] && break; sleep 0.05; done; cat /run/counter",
    )
    assert r.exit_code == 0, r
    return int(r.stdout)
