"""Standby fork children (node/_spares.py): claimed by forks, killed with their template.

A spare's QEMU process is started under a VM id of its own; the fork that claims it
records that VM id on the new machine (``machines.vm_id``).
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from pathlib import Path

import pytest

from boxd.config import Paths
from tests._support.procs import qemu_cmdlines

pytestmark = pytest.mark.vm


def _messages(log: Path) -> list[str]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            out.append(str(json.loads(line).get("msg", "")))
        except ValueError:
            continue
    return out


def _wait(what: str, ok, timeout: float = 90.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _vm_ids(paths: Paths) -> dict[str, str]:
    """Machine id -> the VM id its QEMU process runs under."""
    with sqlite3.connect(f"file:{paths.db}?mode=ro", uri=True) as db:
        return dict(db.execute("SELECT id, vm_id FROM machines").fetchall())


def _by_machine(home: Path) -> dict[str, str]:
    """VM id -> the RAM file it maps, for every QEMU process of this data directory."""
    out = {}
    for argv in qemu_cmdlines(home):
        line = " ".join(argv)
        mid = re.search(r"boxd-(m_\w+),", line)
        mem = re.search(r"mem-path=([^,\s]+)", line)
        if mid and mem:
            out[mid.group(1)] = mem.group(1)
    return out


def test_a_fork_claims_a_prepared_spare_and_a_changed_source_kills_it(  # type: ignore[no-untyped-def]
    client, machine_factory, daemon
):
    paths = Paths(daemon.home.resolve())
    src = machine_factory()  # a source of this test's own: the test controls its template
    client.machines.wait_until_ready(src.id)
    client.machines.exec(src.id, "echo from-source > /tmp/mark")

    first = client.machines.fork(src.id)
    template_ram = _by_machine(paths.home)[_vm_ids(paths)[first.id]]  # src's template

    def spares() -> set[str]:
        """QEMU processes of src's template that are no machine: its standby children."""
        listed = set(_vm_ids(paths).values())
        return {mid for mid, mem in _by_machine(paths.home).items()
                if mem == template_ram and mid not in listed}

    try:
        _wait("a spare after the first fork", lambda: len(spares()) == 1)
        (spare_id,) = spares()
        # its process exists a moment before the pool hands it out
        _wait("the spare to be ready", lambda: any(
            f"machine={spare_id} event=spare_ready" in m for m in _messages(paths.log)))
        second = client.machines.fork(src.id)
        try:
            log = [m for m in _messages(paths.log) if "spare" in m or "captured" in m]
            # the prepared child became the machine
            assert _vm_ids(paths)[second.id] == spare_id, log[-12:]
            assert any(f"machine={second.id} event=forked" in m and "spare=True" in m
                       for m in _messages(paths.log))
            out = client.machines.exec(second.id, "cat /tmp/mark; hostname; cat /etc/machine-id")
            mark, host, mid = out.stdout.split()
            first_mid = client.machines.exec(first.id, "cat /etc/machine-id").stdout.strip()
            assert (mark, host) == ("from-source", second.name)
            assert mid != first_mid and len(mid) == 32
            assert second.port is not None and second.port != first.port
            # refilled in the background; any change to the source makes spares stale
            _wait("the spare to be refilled", lambda: len(spares()) == 1)
            client.machines.exec(src.id, "true")
            _wait("stale spares to be killed", lambda: not spares(), timeout=30)
        finally:
            client.machines.delete(second.id)
    finally:
        client.machines.delete(first.id)
    # Nothing of this source's spares is left: every layer file without a record is the
    # disk of a live spare of another template (base's), and so is every machine
    # directory without a machine.
    listed = set(_vm_ids(paths).values())
    live_spares = {mid for mid, mem in _by_machine(paths.home).items()
                   if mid not in listed and Path(mem).exists()}
    spare_disks = {Path(a).name.split(".")[0]
                   for argv in qemu_cmdlines(paths.home) if any(s in " ".join(argv)
                                                                for s in live_spares)
                   for a in re.findall(r"file=([^,\s]+\.qcow2)", " ".join(argv))}
    on_disk = {p.name.split(".")[0] for p in paths.disks.glob("*.qcow2")}
    with sqlite3.connect(f"file:{paths.db}?mode=ro", uri=True) as db:
        recorded = {r[0] for r in db.execute("SELECT id FROM layers")}
    assert on_disk - recorded <= spare_disks
    assert {p.name for p in paths.machines.iterdir()} <= listed | live_spares
