"""The pieces of a gVisor machine's network that need no sandbox (see engine/gvisor/_net)."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import pytest

from boxd.engine.gvisor import _net, _spec
from boxd.engine.gvisor._spec import Roots, RunFiles
from boxd.engine.qemu._net import NetUser


def test_an_isolated_machine_gets_an_empty_namespace_and_the_image_resolv_conf() -> None:
    spec = _spec.build("h", Roots(Path("/r"), Path("/a")), 256)
    assert {"type": "network"} in spec["linux"]["namespaces"]
    assert all(m["destination"] != "/etc/resolv.conf" for m in spec["mounts"])


def test_a_networked_machine_joins_its_namespace_and_uses_pasta_dns(tmp_path: Path) -> None:
    files = RunFiles(tmp_path)
    _spec.write_bundle(files, "h", Roots(Path("/r"), Path("/a")), 256, "/proc/42/ns/net")
    import json

    spec = json.loads((files.bundle / "config.json").read_text())
    assert {"type": "network", "path": "/proc/42/ns/net"} in spec["linux"]["namespaces"]
    mount = next(m for m in spec["mounts"] if m["destination"] == "/etc/resolv.conf")
    assert Path(mount["source"]).read_text() == "nameserver 10.0.2.3\n"


def test_pasta_does_not_map_the_gateway_to_the_host_and_forwards_nothing() -> None:
    argv = _net.pasta_argv("/usr/bin/pasta")
    assert "--no-map-gw" in argv
    for flag in ("--tcp-ports", "--udp-ports", "--tcp-ns", "--udp-ns"):
        assert argv[argv.index(flag) + 1] == "none"
    assert argv[-3:] == ["--", *_net.HOLDER]


def test_runsc_runs_in_the_namespace_with_net_core_hidden() -> None:
    ns = _net.Namespace(pasta_pid=10, holder_pid=11)
    prefix = ns.runsc_prefix()
    assert prefix[:2] == ["nsenter", "--net=/proc/11/ns/net"]
    assert "/proc/sys/net/core" in " ".join(prefix)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown of a file to another group needs root")
def test_the_tap_device_is_opened_to_the_net_users_group_only(tmp_path: Path) -> None:
    tun = tmp_path / "tun"
    tun.write_bytes(b"")
    os.chmod(tun, 0o600)
    pw = pwd.getpwnam("nobody")
    _net.ensure_tun_access(NetUser("nobody", pw.pw_uid), tun)
    st = tun.stat()
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == pw.pw_gid
    os.chmod(tun, 0o666)  # already open to all: left alone
    _net.ensure_tun_access(NetUser("nobody", pw.pw_uid), tun)
    assert stat.S_IMODE(tun.stat().st_mode) == 0o666


def test_a_missing_tap_device_is_a_host_setup_error(tmp_path: Path) -> None:
    from boxd.errors import HostSetupError

    with pytest.raises(HostSetupError, match="missing"):
        _net.ensure_tun_access(NetUser("nobody", 65534), tmp_path / "none")


def test_a_run_directory_without_a_namespace_loads_none(tmp_path: Path) -> None:
    assert _net.load(tmp_path) is None
    (tmp_path / "net.json").write_text('{"pasta": 5, "holder": 6}')
    assert _net.load(tmp_path) == _net.Namespace(5, 6)


# /proc/net/tcp as gVisor shows it: a socket listening, one established, one whose SYN
# is sent (02), one loopback SYN_SENT (saved whatever its state).
_TCP = """  sl  local_address rem_address   st tx_queue rx_queue ...
   3: 00000000:1F90 00000000:0000 0A 00000000:00000000 9
  12: 0F02000A:A504 0202000A:1F40 01 00000000:00000000 13
  13: 0F02000A:A506 0202000A:1F41 02 00000000:00000000 14
  14: 0100007F:A508 0100007F:1F90 02 00000000:00000000 15
"""
_TCP6 = """  sl  local_address                         remote_address                        st
   1: 00000000000000000000000001000000:A50A 00000000000000000000000001000000:1F90 02
   2: 0000000000000000FFFF00000F02000A:A50C 0000000000000000FFFF00000202000A:1F40 03
"""


def test_handshakes_counts_connections_being_opened_to_the_outside() -> None:
    assert _net.handshakes(_TCP) == 1
    assert _net.handshakes(_TCP6) == 1  # ::1 is loopback; the v4-mapped SYN_RECV counts
    assert _net.handshakes(_TCP.splitlines()[0]) == 0
    assert _net.handshakes("") == 0


def test_a_namespace_made_for_a_cancelled_launch_is_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A standby copy's launch cancelled while pasta started (its thread cannot be
    # stopped) left pasta and its holder running for good (seen after whole runs).
    import asyncio
    import threading
    from types import SimpleNamespace

    from boxd.engine.gvisor import _engine

    ended: list[int] = []
    release = threading.Event()

    class Made(_net.Namespace):
        def signal_end(self) -> None:
            ended.append(self.pasta_pid)

    def slow_start(*_: object) -> _net.Namespace:
        release.wait(5)  # pasta comes up after the launch is cancelled
        return Made(4242, 4243)

    monkeypatch.setattr(_net, "start", slow_start)
    config = SimpleNamespace(id="m_x", net=None)

    async def main() -> None:
        launch = asyncio.ensure_future(
            _engine.start_net(object(), tmp_path, config))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        launch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await launch
        assert ended == []  # still starting
        release.set()
        for _ in range(100):
            if ended:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert ended == [4242]
