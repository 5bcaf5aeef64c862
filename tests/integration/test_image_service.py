"""A container image's service on gVisor, through the daemon (issue 41, item 3): the
image's ENTRYPOINT + CMD run as the machine's service once it boots; `machines.logs`
reads its output; its first EXPOSEd port (or its HEALTHCHECK) decides when
`wait_until_ready` returns, and the port is reachable through the machine's URL; a
fork's copy of the service serves too; ``service=False`` starts nothing.

The images are made here, offline, from a static busybox (its ``httpd`` serves).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import httpx
import pytest

from boxd import errors
from tests._support.machines import _gvisor_status
from tests._support.oci import make_image, write_layout
from tests.integration.test_image_machines import _files

pytestmark = pytest.mark.vm

SERVE = ("echo service up; echo to stderr >&2; "
         "exec /bin/busybox httpd -f -p 8000 -h /srv/www")
WEB = {"Env": ["PATH=/bin"], "WorkingDir": "/srv", "Entrypoint": ["/bin/sh", "-c"],
       "Cmd": [SERVE], "ExposedPorts": {"8000/tcp": {}}}
# Ready only once /tmp/ready exists, two seconds after the service starts.
SLOW = {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh", "-c", "sleep 2; touch /tmp/ready; "
                                      "echo now ready; exec sleep 3600"],
        "Healthcheck": {"Test": ["CMD", "/bin/cat", "/tmp/ready"]}}


@pytest.fixture(scope="module")
def images(client, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:  # type: ignore[no-untyped-def]
    status, why = _gvisor_status(client)
    if status != "ok":
        pytest.skip(f"gvisor unavailable here: {why}")
    root = tmp_path_factory.mktemp("svc-layouts")
    www = {"srv/www/index.html": b"served by the image\n"}
    for name, config in (("web", WEB), ("slow", SLOW)):
        write_layout(root / name, {"v1": make_image([_files(www)], config=config)})
        client.images.import_(f"oci:{root / name}:v1", f"svc/{name}:v1")
    yield
    for name in ("svc/web:v1", "svc/slow:v1"):
        with contextlib.suppress(errors.NotFound):
            client.images.remove(name)


@pytest.fixture
def made(client) -> Iterator[list[str]]:  # type: ignore[no-untyped-def]
    ids: list[str] = []
    yield ids
    for mid in ids:
        with contextlib.suppress(Exception):
            client.machines.delete(mid)


def _get(client, ref: str) -> str:  # type: ignore[no-untyped-def]
    r = httpx.get(client.machines.url(ref, port=8000), timeout=30)
    r.raise_for_status()
    return r.text


def test_the_service_runs_logs_serves_its_exposed_port_and_forks(client, images, made) -> None:  # type: ignore[no-untyped-def]
    m = client.machines.new("svc-web", engine="gvisor", image="svc/web:v1")
    made.append(m.id)
    assert m.image is not None and m.image.service == ["/bin/sh", "-c", SERVE]
    # ready means its EXPOSEd port accepts: the page is served at once
    client.machines.wait_until_ready(m.id, timeout=120)
    assert _get(client, m.id) == "served by the image\n"
    log = client.machines.logs(m.id)
    assert "service up\n" in log.data and "to stderr\n" in log.data, log
    assert log.state == "running" and log.start == 0 and log.end == len(log.data.encode())
    # nothing new after its end: a wait returns empty when it passes
    later = client.machines.logs(m.id, after=log.end, wait=0.5)
    assert (later.start, later.data) == (log.end, "")
    # a fork runs its copy of the service: it serves, and its log is its own
    child = client.machines.fork(m.id, "svc-web-child")
    made.append(child.id)
    assert _get(client, child.id) == "served by the image\n"
    assert "service up\n" in client.machines.logs(child.id).data


def test_a_healthcheck_decides_when_it_is_ready(client, images, made) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    m = client.machines.new("svc-slow", engine="gvisor", image="svc/slow:v1")
    made.append(m.id)
    client.machines.wait_until_ready(m.id, timeout=120)
    assert time.monotonic() - t0 >= 2  # not before its check passed
    assert client.machines.exec(m.id, ["/bin/cat", "/tmp/ready"]).exit_code == 0
    assert "now ready" in client.machines.logs(m.id).data


def test_service_false_starts_nothing(client, images, made) -> None:  # type: ignore[no-untyped-def]
    m = client.machines.new("svc-off", engine="gvisor", image="svc/web:v1", service=False)
    made.append(m.id)
    client.machines.wait_until_ready(m.id, timeout=120)  # no service: ready when it runs
    assert m.image is not None and m.image.service == []
    with pytest.raises(errors.NotFound, match="no service"):
        client.machines.logs(m.id)
    r = client.machines.exec(m.id, ["/bin/busybox", "nc", "-z", "127.0.0.1", "8000"])
    assert r.exit_code != 0  # nothing listens
