"""A machine's route to the host and its egress allow-list (issue 42 item 7): the
validation of ``expose_host`` and ``egress``, the nftables rules and passt/pasta command
lines they become, and their plumbing (Python SDK, HTTP, CLI, records, forks, a
restart) on the real app, control plane and state over the fake engine. The rules at
work on real machines are tests/integration/test_network.py's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World

from boxd import Boxd, errors, models
from boxd.api.server import Daemon
from boxd.cli import main
from boxd.control import netpolicy
from boxd.engine import netpolicy as _policy
from boxd.engine.gvisor._net import pasta_argv
from boxd.engine.qemu._net import passt_argv
from boxd.net_policy import (
    HOST_NAME,
    NetPolicy,
    check_expose_host,
    parse_egress_entry,
    resolve_egress,
)
from boxd.node._ports import bands, ephemeral_range
from boxd.state import Database, Repos

paths = support.paths  # fixtures
no_daemon = support.no_daemon
daemon = support.daemon
world = support.world


@pytest.fixture
def boxd(world: World, tmp_path: Path) -> Iterator[Boxd]:
    app, keys = support.world_app(world, tmp_path)
    key = keys.create(ACCOUNT, "sdk").secret
    with Boxd(api_key=key, transport=support.SyncASGITransport(app)) as b:
        yield b


def _lookup(table: dict[str, list[str]]) -> Any:
    def lookup(name: str) -> list[str]:
        if name not in table:
            raise OSError(f"no such name {name}")
        return table[name]
    return lookup


# ---------------------------------------------------------------- validation


def test_expose_host_is_sorted_unique_ports() -> None:
    assert check_expose_host([9000, 8000, 8000]) == (8000, 9000)
    assert check_expose_host([]) == ()


@pytest.mark.parametrize("bad", [0, 65536, -1, True, "8000", 8000.0, None])
def test_expose_host_refuses_what_is_not_a_port(bad: Any) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        check_expose_host([bad])
    assert caught.value.details["field"] == "expose_host"


def test_expose_host_refuses_too_many_and_reserved_ports() -> None:
    with pytest.raises(errors.InvalidRequest):
        check_expose_host(range(1, 18))
    with pytest.raises(errors.InvalidRequest, match="the daemon listens"):
        check_expose_host([7070], lambda p: "the daemon listens on it" if p == 7070 else None)


def test_the_daemons_ports_are_reserved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netpolicy, "LISTENING", {7070})
    assert netpolicy.reserved(7070) == "the daemon listens on it"
    band = bands(ephemeral_range())[0]
    assert "URL and forward ports" in (netpolicy.reserved(band.start) or "")
    assert netpolicy.reserved(8000) is None  # a model server's usual port
    lo, _ = ephemeral_range()
    assert netpolicy.reserved(lo) is None  # a listener on port 0 gets one of these


def test_egress_entries_parse_to_networks_names_and_ports() -> None:
    assert resolve_egress(["203.0.113.0/24", "198.51.100.7", "198.51.100.8:443",
                           "0.0.0.0/0"]) == (
        "203.0.113.0/24", "198.51.100.7/32", "198.51.100.8/32:443", "0.0.0.0/0")
    lookup = _lookup({"models.example.com": ["203.0.113.9", "10.1.2.3"]})
    # a name's addresses in blocked ranges are left out: they could never be reached
    assert resolve_egress(["Models.Example.com:8443"], lookup) == ("203.0.113.9/32:8443",)
    assert resolve_egress([]) == ()


@pytest.mark.parametrize(("entry", "why"), [
    ("10.0.0.1", "inside 10.0.0.0/8"),
    ("192.168.1.0/24", "inside 192.168.0.0/16"),
    ("169.254.169.254:80", "inside 169.254.0.0/16"),
    ("127.0.0.1:8000", "expose_host"),
    ("2001:db8::1", "IPv6"),
    ("203.0.113.1:0", "port"),
    ("203.0.113.1:http", "port"),
    ("300.1.2.3", "not a valid"),
    ("bad_name!", "not an address"),
    ("", "1-260"),
])
def test_bad_egress_entries_are_refused_with_the_reason(entry: str, why: str) -> None:
    with pytest.raises(errors.InvalidRequest, match=why) as caught:
        parse_egress_entry(entry)
    assert caught.value.details["field"] == "egress"


def test_egress_names_that_do_not_resolve_or_only_to_blocked_ranges_are_refused() -> None:
    with pytest.raises(errors.InvalidRequest, match="does not resolve"):
        resolve_egress(["nowhere.invalid"], _lookup({}))
    with pytest.raises(errors.InvalidRequest, match="no address a machine reaches"):
        resolve_egress(["intranet.example"], _lookup({"intranet.example": ["10.0.0.5"]}))
    with pytest.raises(errors.InvalidRequest, match="at most"):
        resolve_egress(["203.0.113.1"] * 65)


def test_a_policy_round_trips_through_its_column() -> None:
    for p in (NetPolicy((8000,), None), NetPolicy((), ()), NetPolicy((1, 2), ("1.2.3.4/32",))):
        assert NetPolicy.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert NetPolicy().to_json() is None and NetPolicy.from_json(None) == NetPolicy()
    assert not NetPolicy().restricted and NetPolicy((), ()).restricted


# ------------------------------------------------------------ rules and argv


def test_a_machines_chain_passes_its_exposed_ports_then_the_default_policy() -> None:
    rules = _policy.machine_script(7, NetPolicy((8000, 9000), None), ["127.0.0.53"])
    lines = [r.split(" m7 ", 1)[1] for r in rules.splitlines() if r.startswith("add rule")]
    assert lines[0] == "ip daddr 127.0.0.1 tcp dport { 8000, 9000 } accept"
    assert lines[1].startswith("ip daddr { 127.0.0.53 }") and "dport 53 accept" in lines[1]
    assert lines[2] == "fib daddr type local reject"  # every other port and address
    assert "10.0.0.0/8" in lines[3] and lines[3].endswith("reject")
    assert lines[-1] == "accept"  # no egress list: public addresses, as by default
    assert "add element inet boxd_machines machines { 7 : jump m7 }" in rules


def test_an_egress_chain_ends_in_reject_after_the_blocked_ranges() -> None:
    rules = _policy.machine_script(7, NetPolicy((), ("203.0.113.0/24", "198.51.100.7/32:443")),
                                   [])
    lines = [r.split(" m7 ", 1)[1] for r in rules.splitlines() if r.startswith("add rule")]
    assert "127.0.0.1" not in rules  # nothing of the host's loopback
    assert lines[0] == "fib daddr type local reject"
    assert lines.index("ip daddr 203.0.113.0/24 accept") > 2  # after the blocked ranges
    assert "ip daddr 198.51.100.7/32 meta l4proto { tcp, udp } th dport 443 accept" in lines
    assert lines[-1] == "reject"


def test_the_table_rejects_an_id_of_the_range_without_a_chain() -> None:
    script = _policy.table_script(1000)
    assert f"meta skuid != 1000-{1000 + _policy.SLOTS - 1} accept" in script
    assert script.rstrip().endswith("add rule inet boxd_machines output reject")
    assert "delete" not in script  # existing machines' chains survive a re-install


def test_passt_and_pasta_map_the_gateway_only_when_asked() -> None:
    plain = passt_argv("passt", fd=3, port=None, user=None, log_file=Path("/l"))
    assert "--no-map-gw" in plain
    own = passt_argv("passt", fd=3, port=None, user=None, log_file=Path("/l"), own_id=5000,
                     map_gw=True)
    assert "--no-map-gw" not in own
    assert own[own.index("--runas") + 1] == "5000:5000"
    assert "--no-map-gw" in pasta_argv("pasta")
    assert "--no-map-gw" not in pasta_argv("pasta", map_gw=True)


def test_the_id_range_must_not_overlap_the_hosts(tmp_path: Path) -> None:
    (tmp_path / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (tmp_path / "group").write_text("root:x:0:\n")
    _policy.check_ids(5000, tmp_path)
    (tmp_path / "subuid").write_text("alice:4000:1100\n")  # 4000-5099
    with pytest.raises(errors.HostSetupError, match="subuid range of 'alice'"):
        _policy.check_ids(5000, tmp_path)
    (tmp_path / "subuid").write_text("")
    (tmp_path / "group").write_text("odd:x:5001:\n")
    with pytest.raises(errors.HostSetupError, match="group entry 'odd'"):
        _policy.check_ids(5000, tmp_path)


def test_a_slot_is_never_one_a_process_runs_as_or_one_just_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "status").write_text("Name:\tpasta\nUid:\t5000\t5000\t5000\t5000\n")
    assert _policy.running_ids(5000, tmp_path) == {5000}
    monkeypatch.setattr(_policy, "running_ids", lambda base: {5000})
    slots = _policy.Slots(5000)
    assert [slots.take(), slots.take()] == [5001, 5002]


def test_a_daemon_that_cannot_filter_refuses_a_policy() -> None:
    with pytest.raises(errors.HostSetupError, match="not root"):
        _policy.Policies().prepare(NetPolicy((8000,), None), False, [])


# ------------------------------------------------------------------ plumbing


def test_new_stores_the_policy_and_forks_inherit_it(boxd: Boxd, world: World) -> None:
    m = boxd.machines.new("agent", expose_host=[8000], egress=["203.0.113.0/24:443"])
    assert m.expose_host == [8000] and m.egress == ["203.0.113.0/24:443"]
    boxd.machines.wait_until_ready("agent")
    assert world.vm(m.id).config.net == NetPolicy((8000,), ("203.0.113.0/24:443",))
    # the name resolves in the guest: a line in its /etc/hosts
    hosts = world.vm(m.id).guest.files["/etc/hosts"]
    assert f"10.0.2.2\t{HOST_NAME}" in hosts.splitlines()
    kid = boxd.machines.fork("agent", "kid")
    assert kid.expose_host == [8000] and kid.egress == ["203.0.113.0/24:443"]
    assert world.vm(kid.id).config.net == world.vm(m.id).config.net
    kids = boxd.machines.fork("agent", count=2)
    assert all(not isinstance(k, Exception) and k.expose_host == [8000] for k in kids)
    plain = boxd.machines.new("plain")
    assert plain.expose_host == [] and plain.egress is None
    none = boxd.machines.new("none", egress=[])
    assert none.egress == []  # nothing allowed, not the default


def test_the_policy_survives_hibernate_and_a_restart(boxd: Boxd, world: World) -> None:
    m = boxd.machines.new("agent", expose_host=[8000], egress=[])
    boxd.machines.wait_until_ready("agent")
    boxd.machines.hibernate("agent")
    boxd.machines.resume("agent")
    assert world.vm(m.id).config.net == NetPolicy((8000,), ())
    world.restart()
    reopened = Repos(Database(world.paths.db))
    try:
        rec = reopened.machines.get(m.id)
        assert rec is not None and rec.net == NetPolicy((8000,), ())
    finally:
        reopened.db.close()


@pytest.mark.parametrize(("body", "field"), [
    ({"expose_host": [0]}, "expose_host"),
    ({"expose_host": ["8000"]}, "expose_host"),
    ({"egress": ["10.0.0.1"]}, "egress"),
    ({"egress": "pypi.org"}, "egress"),
    ({"isolated": True, "expose_host": [8000]}, "expose_host"),
    ({"isolated": True, "egress": []}, "egress"),
])
def test_the_daemon_refuses_a_bad_policy(boxd: Boxd, world: World, body: dict[str, Any],
                                         field: str) -> None:
    resp = boxd._client().post("/v1/machines", json={"name": "m", **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_request"
    assert [r.name for r in world.repos.machines.list(ACCOUNT)] == []


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"expose_host": ["8000"]}, "expose_host"),
    ({"expose_host": [True]}, "expose_host"),
    ({"expose_host": "8000"}, "expose_host"),
    ({"egress": "pypi.org"}, "egress"),
])
def test_the_sdk_refuses_a_bad_policy_before_sending(boxd: Boxd, kwargs: dict[str, Any],
                                                     field: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        boxd.machines.new("m", **kwargs)
    assert caught.value.details["field"] == field


def _cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return r.exit_code, r.stdout


def test_cli_new_with_expose_host_and_egress(daemon: Daemon) -> None:
    code, out = _cli("machine", "new", "a", "--expose-host", "8000", "--expose-host", "9000",
                     "--egress", "203.0.113.0/24", "--egress", "198.51.100.1:443", "--json")
    assert code == 0, out
    m = json.loads(out)
    assert m["expose_host"] == [8000, 9000]
    assert m["egress"] == ["203.0.113.0/24", "198.51.100.1/32:443"]
    info = _cli("machine", "info", "a")[1]
    assert "host.boxd.internal:8000" in info and "203.0.113.0/24" in info
    code, out = _cli("machine", "new", "b", "--egress", "none", "--json")
    assert code == 0 and json.loads(out)["egress"] == []
    code, out = _cli("machine", "new", "c", "--json")
    assert code == 0 and json.loads(out)["egress"] is None
    assert _cli("machine", "new", "d", "--expose-host", "0")[0] == 2  # refused by click


def test_a_json_port_without_a_fraction_is_an_integer_as_the_schema_says() -> None:
    # The API fuzz sent expose_host [8000.0]: JSON Schema's integer; refused with a 400.
    assert models.MachineCreate(expose_host=[8000.0, 9]).expose_host == [8000, 9]
    for bad in ([True], [8000.5], ["80"], [0], [65536]):
        with pytest.raises(ValueError):
            models.MachineCreate(expose_host=bad)
