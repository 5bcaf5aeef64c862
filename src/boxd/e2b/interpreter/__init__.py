"""E2B's ``code-interpreter-v1`` template: built by boxd on an account's first use.

The template is a boxd snapshot of the account named ``code-interpreter-v1``: a machine
of boxd's default image with ipykernel and jupyter_client installed and boxd's own
interpreter service (`boxd.e2b.interpreter.server`) listening on port 49999 with its
default Python kernel already running. A create of the template restores (or, with
``boxd e2b warm``, forks) that running machine, so the first cell finds a warm kernel.

The build (`InterpreterTemplate.ensure`, once per account; creates of the template meanwhile
wait for it): the wheels are downloaded on the host with the host's pip configuration
(`boxd.images` does the same for every guest image, so no package index is named here
and the guest needs no network), cached under ``<data dir>/e2b/interpreter-wheels``,
uploaded into a builder machine and installed with ``pip --no-index``; the service is
uploaded and started; once ``/health`` answers, the machine is saved as the snapshot and
deleted. A snapshot of that name that exists already (an operator's own) is used as is;
deleting it makes the next create build it again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from pathlib import Path

from boxd import models
from boxd.errors import BoxdError, InfrastructureError, SnapshotNotFound
from boxd.images._rootfs import download_wheels
from boxd.services import MachineService, SnapshotService

__all__ = ["CODE_INTERPRETER", "INTERPRETER_PORT", "PACKAGES", "InterpreterTemplate"]

log = logging.getLogger("boxd.e2b")

#: The code interpreter SDK's default template.
CODE_INTERPRETER = "code-interpreter-v1"
#: Where the SDK sends its calls in the sandbox (``E2b-Sandbox-Port``).
INTERPRETER_PORT = 49999
#: What the guest gets, as wheels for its Python (pins: a kernel protocol 5.3 pair).
PACKAGES = ("ipykernel>=6.29,<8", "jupyter_client>=8.6,<9")
GUEST_DIR = "/opt/boxd-interpreter"
_SERVER = Path(__file__).with_name("server.py")
_BUILD_TIMEOUT = 600.0
_HEALTH = (
    "import time, urllib.request\n"
    "for _ in range(600):\n"
    "    try:\n"
    f"        urllib.request.urlopen('http://127.0.0.1:{INTERPRETER_PORT}/health', timeout=2)\n"
    "        break\n"
    "    except OSError:\n"
    "        time.sleep(0.2)\n"
    "else:\n"
    "    raise SystemExit('the interpreter service did not answer')\n"
)


class InterpreterTemplate:
    """Makes sure an account has the ``code-interpreter-v1`` snapshot, building it once."""

    def __init__(self, machines: MachineService, snapshots: SnapshotService,
                 cache: Path) -> None:
        self.machines = machines
        self.snapshots = snapshots
        self.cache = cache  # the wheels, downloaded once per daemon data dir
        self._locks: dict[str, asyncio.Lock] = {}

    async def ensure(self, account: str) -> None:
        """Build the account's template snapshot unless it has one.

        Raises:
            InfrastructureError: the build failed (its step and output in the message);
            HostSetupError: the wheels could not be downloaded; QuotaExceeded.
        """
        if await self._exists(account):
            return
        lock = self._locks.setdefault(account, asyncio.Lock())
        async with lock:
            if await self._exists(account):
                return
            start = time.monotonic()
            log.info("building the E2B code interpreter template for account %s", account)
            await self._build(account)
            log.info("built the E2B code interpreter template for account %s in %.1f s",
                     account, time.monotonic() - start)

    async def _exists(self, account: str) -> bool:
        try:
            await self.snapshots.get(account, CODE_INTERPRETER)
        except SnapshotNotFound:
            return False
        return True

    async def _wheels(self) -> list[Path]:
        wheels = sorted(self.cache.glob("*.whl"))
        if not wheels:
            staging = self.cache.with_name(self.cache.name + f".{secrets.token_hex(4)}")
            try:
                await asyncio.to_thread(download_wheels, PACKAGES, staging)
                staging.rename(self.cache)
            except OSError:
                if not any(self.cache.glob("*.whl")):  # another build's download won
                    raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            wheels = sorted(self.cache.glob("*.whl"))
        return wheels

    async def _build(self, account: str) -> None:
        wheels = await self._wheels()
        name = f"e2b-interpreter-build-{secrets.token_hex(4)}"
        # Its lifetime ends it should the daemon stop mid-build.
        await self.machines.create(account, models.MachineCreate.model_validate({
            "name": name, "suspend_after": 0, "hibernate_after": 0,
            "timeout": int(_BUILD_TIMEOUT * 3), "on_timeout": "delete"}))
        try:
            await self.machines.wait_until_ready(account, name, _BUILD_TIMEOUT)
            for wheel in wheels:
                await self.machines.upload(account, name, f"{GUEST_DIR}/wheels/{wheel.name}",
                                           wheel.read_bytes())
            await self.machines.upload(account, name, f"{GUEST_DIR}/server.py",
                                       _SERVER.read_bytes())
            await self._run(account, name, "install the kernel", (
                f"python3 -m pip install -q --no-index --find-links {GUEST_DIR}/wheels "
                + " ".join(f"'{p}'" for p in PACKAGES)
                + f" && rm -rf {GUEST_DIR}/wheels && mkdir -p /home/user"))
            await self._run(account, name, "start the service", (
                f"cd /home/user && nohup python3 {GUEST_DIR}/server.py "
                ">/var/log/boxd-interpreter.log 2>&1 &"))
            await self._run(account, name, "wait for the service",
                            ["python3", "-c", _HEALTH], log_file=True)
            await self.snapshots.save(account, name, CODE_INTERPRETER)
        finally:
            try:
                await self.machines.delete(account, name)
            except BoxdError:
                log.warning("could not delete the template builder %s", name, exc_info=True)

    async def _run(self, account: str, name: str, step: str, command: str | list[str], *,
                   log_file: bool = False) -> None:
        result = await self.machines.exec(account, name, models.ExecRequest(
            command=command, timeout=_BUILD_TIMEOUT))
        if result.exit_code == 0:
            return
        output = (result.stdout + result.stderr).strip()
        if log_file:
            service_log = await self.machines.exec(account, name, models.ExecRequest(
                command=["tail", "-n", "40", "/var/log/boxd-interpreter.log"], timeout=30))
            output += "\n" + service_log.stdout
        raise InfrastructureError(
            f"building the {CODE_INTERPRETER} template failed at '{step}' (exit "
            f"{result.exit_code}): {output[-2000:]}", machine=name)
