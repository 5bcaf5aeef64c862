"""A route to the trainer (issue 42 item 7) on real machines, both engines:

* ``expose_host=[PORT]``: a server on the host's 127.0.0.1:PORT answers the machine at
  ``host.boxd.internal:PORT``; another host loopback port does not, nor the same port
  from a machine that does not expose it; a fork inherits the route;
* ``egress=[...]``: the machine reaches the listed test host and not another one,
  which a machine with the default policy reaches (test hosts at documentation
  addresses, TEST-NET-2/3, in a network namespace the test makes: nothing leaves the
  host).
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from boxd import errors
from boxd.net_policy import HOST_NAME
from tests.integration.test_network import _Listener, _probe, _test_hosts

pytestmark = pytest.mark.vm


@pytest.fixture
def doc_hosts() -> Iterator[tuple[list[str], int, Path]]:
    """Two test hosts at documentation addresses (not in the ranges every machine is
    denied, so only an egress list keeps a machine from them)."""
    tag = uuid.uuid4().hex[:4]
    addrs = [f"203.0.113.{int(tag[:2], 16) % 250 + 2}", f"198.51.100.{int(tag[2:], 16) % 250 + 2}"]
    with _test_hosts(addrs) as (port, seen):
        for addr in addrs:  # they answer the host itself: the set-up works
            with socket.create_connection((addr, port), timeout=10):
                pass
        deadline = time.monotonic() + 10
        while len(seen.read_text().splitlines()) < len(addrs):
            assert time.monotonic() < deadline, seen.read_text()
            time.sleep(0.05)
        yield addrs, port, seen


def _peers(seen: Path) -> list[str]:
    return seen.read_text().splitlines()


def _source(client, request, engine: str):  # type: ignore[no-untyped-def]
    return request.getfixturevalue("base" if engine == "qemu" else "gvisor_base")


@pytest.mark.parametrize("engine", ["qemu", "gvisor"])
def test_expose_host_and_egress_on_a_machine_and_its_fork(  # type: ignore[no-untyped-def]
    client, request, engine, doc_hosts,
) -> None:
    addrs, far_port, seen = doc_hosts
    allowed, denied = addrs
    exposed, other = _Listener("127.0.0.1"), _Listener("127.0.0.1")
    made: list[str] = []
    try:
        plain = client.machines.fork(_source(client, request, engine).id)
        made.append(plain.id)
        m = client.machines.new(f"route-{engine}-{uuid.uuid4().hex[:4]}", engine=engine,
                                expose_host=[exposed.port], egress=[f"{allowed}:{far_port}"])
        made.append(m.id)
        assert m.expose_host == [exposed.port]
        assert m.egress == [f"{allowed}/32:{far_port}"]
        client.machines.wait_until_ready(m.id, timeout=600)
        before = len(_peers(seen))
        targets = [f"{HOST_NAME}:{exposed.port}", f"{HOST_NAME}:{other.port}",
                   f"10.0.2.2:{other.port}", f"{allowed}:{far_port}", f"{denied}:{far_port}"]
        result = _probe(client, m.id, targets)
        assert result[f"{HOST_NAME}:{exposed.port}"] == "connected", result
        assert all(result[t] != "connected" for t in targets[1:3]), result
        assert result[f"{allowed}:{far_port}"] == "connected", result
        assert result[f"{denied}:{far_port}"] != "connected", result
        assert len(exposed.accepted) == 1 and other.accepted == []
        time.sleep(0.5)
        new = _peers(seen)[before:]
        assert [n.split()[0] for n in new] == [allowed], new  # the denied host saw nothing

        # A machine with the default policy: no route to the host, and the denied test
        # host (a public-looking address) answers it: the block above is the egress list.
        before = len(_peers(seen))
        result = _probe(client, plain.id, [f"10.0.2.2:{exposed.port}", f"{denied}:{far_port}"])
        assert result[f"10.0.2.2:{exposed.port}"] != "connected", result
        assert result[f"{denied}:{far_port}"] == "connected", result
        assert len(exposed.accepted) == 1

        # A fork inherits both (its own passt or pasta, its own rules).
        kid = client.machines.fork(m.id)
        made.append(kid.id)
        assert kid.expose_host == m.expose_host and kid.egress == m.egress
        result = _probe(client, kid.id, targets)
        assert result[f"{HOST_NAME}:{exposed.port}"] == "connected", result
        assert all(result[t] != "connected" for t in targets[1:3]), result
        assert result[f"{allowed}:{far_port}"] == "connected", result
        assert result[f"{denied}:{far_port}"] != "connected", result
        assert len(exposed.accepted) == 2 and other.accepted == []
    finally:
        for mid in reversed(made):
            with contextlib.suppress(errors.NotFound):
                client.machines.delete(mid)
        exposed.close()
        other.close()


def test_an_empty_egress_list_allows_only_the_exposed_port(  # type: ignore[no-untyped-def]
    client, request, doc_hosts,
) -> None:
    addrs, far_port, seen = doc_hosts
    exposed = _Listener("127.0.0.1")
    m = client.machines.new(f"closed-{uuid.uuid4().hex[:4]}", engine="gvisor",
                            expose_host=[exposed.port], egress=[])
    try:
        client.machines.wait_until_ready(m.id, timeout=600)
        before = len(_peers(seen))
        result = _probe(client, m.id, [f"{HOST_NAME}:{exposed.port}",
                                       *(f"{a}:{far_port}" for a in addrs)])
        assert result.pop(f"{HOST_NAME}:{exposed.port}") == "connected", result
        assert all(r != "connected" for r in result.values()), result
        time.sleep(0.5)
        assert _peers(seen)[before:] == []
        # and after a hibernate and wake (a new sandbox, a new pasta, the same policy)
        client.machines.hibernate(m.id)
        client.machines.resume(m.id)
        client.machines.wait_until_ready(m.id, timeout=600)
        again = _probe(client, m.id, [f"{HOST_NAME}:{exposed.port}", f"{addrs[0]}:{far_port}"])
        assert again[f"{HOST_NAME}:{exposed.port}"] == "connected", again
        assert again[f"{addrs[0]}:{far_port}"] != "connected", again
    finally:
        with contextlib.suppress(errors.NotFound):
            client.machines.delete(m.id)
        exposed.close()
