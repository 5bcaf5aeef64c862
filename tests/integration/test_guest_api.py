"""`Boxd()` inside a machine (issue 13 item 7; docs/lifecycle.md#in-machine-auth).

On real machines:
* ``from boxd import Boxd; Boxd().machines.list()`` works in a guest with no environment
  variables and nothing installed: the image carries the client, the guest agent serves
  ``/run/boxd/boxd.sock`` and the daemon relays it to its API with the machine's own
  credential (``/run/boxd/key``, tmpfs);
* the credential is the machine's own: a fork child and a restored machine get a new
  one, the old one is refused there; a deleted machine's is refused everywhere; a
  machine credential is refused on the daemon's own socket;
* a machine can fork itself: the parent's call returns the child, the child's copy of
  that call fails with ConnectionError;
* an isolated machine has no credential and no socket;
* ``BOXD_URL`` / ``BOXD_API_KEY`` in the guest still win.

Each test runs on both engines: QEMU forks of the session's base, gVisor forks of a
gVisor base made here (skipped, with the probe's reason, where runsc cannot run).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid

import pytest

from boxd import errors
from tests._support.machines import _gvisor_status

pytestmark = pytest.mark.vm
ENGINES = ["qemu", "gvisor"]

KEY = "/run/boxd/key"
SOCKET = "/run/boxd/boxd.sock"

# Run in the guest: call the API, print {"ok": ...} or {"error": type, "message": ...}.
CALL = """
import json, sys
from boxd import Boxd, errors
how = sys.argv[1]
try:
    b = Boxd(api_key=sys.argv[2]) if len(sys.argv) > 2 else Boxd()
    if how == "list":
        out = sorted(m.name for m in b.machines.list())
    elif how == "where":
        out = repr(b)
    print(json.dumps({"ok": out}))
except errors.BoxdError as e:
    print(json.dumps({"error": type(e).__name__, "message": e.message}))
"""

# Run in the guest: fork this machine; the parent's and the child's copies of this process
# each record what their call gave.
SELF_FORK = """
import json, sys
from boxd import Boxd, errors
me, child = sys.argv[1], sys.argv[2]
try:
    made = Boxd().machines.fork(me, child)
    out = {"forked": made.name}
except errors.ConnectionError as e:
    out = {"error": "ConnectionError", "message": e.message}
except errors.BoxdError as e:
    out = {"error": type(e).__name__, "message": e.message}
with open("/root/self-fork.json", "w") as f:
    json.dump(out, f)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def gvisor_api_base(client):  # type: ignore[no-untyped-def]
    status, why = _gvisor_status(client)
    if status != "ok":
        pytest.skip(f"gvisor unavailable here: {why}")
    m = client.machines.new(f"gapi-{uuid.uuid4().hex[:6]}", engine="gvisor")
    client.machines.wait_until_ready(m.id, timeout=120)
    yield client.machines.get(m.id)
    with contextlib.suppress(errors.NotFound):
        client.machines.delete(m.id)


@pytest.fixture(params=ENGINES)
def engine(request) -> str:  # type: ignore[no-untyped-def]
    return str(request.param)


@pytest.fixture
def factory(request, client, engine):  # type: ignore[no-untyped-def]
    """Forks of the engine's base machine, deleted after the test."""
    if engine == "qemu":
        return request.getfixturevalue("machine_factory")
    base = request.getfixturevalue("gvisor_api_base")
    made: list[str] = []

    def make(name: str | None = None):  # type: ignore[no-untyped-def]
        m = client.machines.fork(base.id, name)
        made.append(m.id)
        return m

    def clean() -> None:
        for mid in made:
            with contextlib.suppress(Exception):
                client.machines.delete(mid)

    request.addfinalizer(clean)
    return make


@pytest.fixture
def one(factory):  # type: ignore[no-untyped-def]
    """A fresh fork of the engine's base machine."""
    return factory()


def _call(client, mid: str, how: str = "list", key: str | None = None,  # type: ignore[no-untyped-def]
          env: dict[str, str] | None = None) -> dict[str, object]:
    argv = ["python3", "-c", CALL, how, *([key] if key else [])]
    r = client.machines.exec(mid, argv, env=env or None, timeout=300)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    out: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def _key(client, mid: str) -> str:  # type: ignore[no-untyped-def]
    r = client.machines.exec(mid, f"cat {KEY}")
    assert r.exit_code == 0, r
    return str(r.stdout.strip())


def _new_key(client, mid: str, old: str, timeout: float = 60.0) -> str:  # type: ignore[no-untyped-def]
    """The machine's credential once it is no longer ``old`` (delivered just after a start)."""
    deadline = time.monotonic() + timeout
    while True:
        key = _key(client, mid)
        if key != old:
            return key
        assert time.monotonic() < deadline, f"{mid} still holds its old credential"
        time.sleep(0.2)


def test_list_from_inside_with_no_env(client, one) -> None:  # type: ignore[no-untyped-def]
    machine = one
    out = _call(client, machine.id)
    assert "ok" in out, out
    base = client.machines.get(machine.parent_id).name
    assert machine.name in out["ok"] and base in out["ok"]  # type: ignore[operator]
    # The credential and the socket are the guest root's, on tmpfs (not the disk image).
    r = client.machines.exec(machine.id, f"stat -c '%a %U' {KEY} {SOCKET}; "
                             f"stat -f -c %T {KEY}; env | grep ^BOXD_ || true")
    lines = r.stdout.split()
    assert lines[:4] == ["600", "root", "600", "root"], r.stdout
    assert lines[4] == "tmpfs", r.stdout
    assert len(lines) == 5, f"no BOXD_ variables in the guest: {r.stdout}"


def test_credential_rotates_on_fork_and_restore_and_old_ones_are_refused(  # type: ignore[no-untyped-def]
    client, factory
) -> None:
    parent = factory()
    assert "ok" in _call(client, parent.id)
    parent_key = _key(client, parent.id)
    child = client.machines.fork(parent.id, f"child-{uuid.uuid4().hex[:6]}")
    try:
        child_key = _new_key(client, child.id, parent_key)
        assert child_key != parent_key
        # The parent's credential, copied into the child's memory, is refused there.
        refused = _call(client, child.id, key=parent_key)
        assert refused.get("error") == "AuthError", refused
        assert "ok" in _call(client, child.id)
        assert "ok" in _call(client, parent.id)  # the parent's own still works for it

        client.machines.checkpoints.save(parent.id, "before")
        client.machines.checkpoints.restore(parent.id, "before")
        restored_key = _new_key(client, parent.id, parent_key)
        refused = _call(client, parent.id, key=parent_key)
        assert refused.get("error") == "AuthError", refused
        assert "ok" in _call(client, parent.id)
        assert len({parent_key, child_key, restored_key}) == 3
    finally:
        client.machines.delete(child.id)


def test_a_deleted_machines_credential_is_refused(client, factory) -> None:  # type: ignore[no-untyped-def]
    from boxd import Boxd

    gone, other = factory(), factory()
    key = _key(client, gone.id)
    assert "ok" in _call(client, gone.id, key=key)
    client.machines.delete(gone.id)
    refused = _call(client, other.id, key=key)  # over another machine's socket
    assert refused.get("error") == "AuthError", refused
    with Boxd(api_key=key) as outside, pytest.raises(errors.AuthError) as info:
        outside.machines.list()  # over the daemon's own socket
    assert "own API socket" in info.value.message


def _wait_for_file(client, mid: str, path: str, timeout: float) -> str:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        out = client.machines.exec(mid, f"cat {path} 2>/dev/null")
        if out.stdout.strip():
            return str(out.stdout)
        assert time.monotonic() < deadline, f"{path} never appeared in {mid}"
        time.sleep(0.3)


def test_a_machine_forks_itself(client, one) -> None:  # type: ignore[no-untyped-def]
    machine = one
    # A process of its own (not an exec: a fork of a fork child first gives it RAM of its
    # own, which waits for the requests in flight on the machine). That swap replaces the
    # VM process under the call: the call still gets its answer.
    child_name = f"self-{uuid.uuid4().hex[:6]}"
    client.machines.files.upload(machine.id, "/root/self_fork.py", SELF_FORK)
    r = client.machines.exec(
        machine.id, f"nohup python3 /root/self_fork.py {machine.name} {child_name} "
        ">/root/self-fork.log 2>&1 &")
    assert r.exit_code == 0, r
    try:
        got = json.loads(_wait_for_file(client, machine.id, "/root/self-fork.json", 600))
        assert got == {"forked": child_name}, got
        child = client.machines.get(child_name)
        assert child.parent_id == machine.id
        # The child's copy of the call in flight was cut: ConnectionError, documented.
        got = json.loads(_wait_for_file(client, child.id, "/root/self-fork.json", 60))
        assert got.get("error") == "ConnectionError", got
        assert "ok" in _call(client, child.id)  # and the child's own calls work
        assert "ok" in _call(client, machine.id)
    finally:
        for m in client.machines.list():
            if m.name == child_name:
                client.machines.delete(m.id)


def test_env_vars_in_the_guest_win(client, one) -> None:  # type: ignore[no-untyped-def]
    machine = one
    out = _call(client, machine.id, how="where", env={"BOXD_URL": "http://127.0.0.1:9"})
    assert out == {"ok": "Boxd('http://127.0.0.1:9')"}, out
    out = _call(client, machine.id, env={"BOXD_URL": "http://127.0.0.1:9"})
    assert out.get("error") == "ConnectionError", out
    out = _call(client, machine.id, env={"BOXD_API_KEY": "boxd_not-a-key"})
    assert out.get("error") == "AuthError" and "unknown API key" in str(out["message"]), out
    # The local account's key works over the socket too (an account key is valid anywhere).
    local = (client._target.paths.home / "local.key").read_text().strip()
    out = _call(client, machine.id, env={"BOXD_API_KEY": local})
    assert "ok" in out, out


def test_isolated_machine_has_no_credential_and_no_route(client, engine) -> None:  # type: ignore[no-untyped-def]
    if engine == "gvisor":
        status, why = _gvisor_status(client)
        if status != "ok":
            pytest.skip(f"gvisor unavailable here: {why}")
    m = client.machines.new(f"iso-{uuid.uuid4().hex[:6]}", isolated=True, engine=engine)
    try:
        client.machines.wait_until_ready(m.id, timeout=300)
        r = client.machines.exec(m.id, f"ls {KEY} {SOCKET} 2>&1; ls /run/boxd")
        assert "No such file" in r.stdout and r.stdout.count("No such file") == 2, r.stdout
        assert "boxd.sock" not in r.stdout.split() and "key" not in r.stdout.split()
        # The machine's directory is root's alone (gVisor made it 0777), and Boxd() in
        # it says why it cannot work (it said the guest lacked the server extra).
        assert client.machines.exec(m.id, "stat -c %a /run/boxd").stdout.strip() == "755"
        out = _call(client, m.id)
        assert out.get("error") == "ConnectionError", out
        assert "no route to the boxd API" in str(out["message"]), out
        fork = client.machines.fork(m.id)
        try:
            r = client.machines.exec(fork.id, f"ls {KEY} {SOCKET} 2>&1")
            assert r.stdout.count("No such file") == 2, r.stdout
        finally:
            client.machines.delete(fork.id)
    finally:
        client.machines.delete(m.id)


# Run in the guest: 20 requests on the API socket, each on a connection of its own with
# ``Connection: close`` (as urllib and http.client send it). Most are small answers read
# at once; every fifth is a 2 MiB download of the machine's own file whose body is read
# only after the daemon has surely sent all of it (twice the time a first download took,
# read at once), so that its end waits in the agent's relay when the daemon's close
# comes. Prints how many were answered whole.
CLOSE_EACH = """
import http.client, json, os, socket, sys, time
key, sock_path, me = open(sys.argv[1]).read().strip(), sys.argv[2], sys.argv[3]
big = os.urandom(2 << 20)
with open("/root/big.bin", "wb") as f:
    f.write(big)
class Conn(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(120)
        self.sock.connect(sock_path)
def get(path, pause=0.0):
    conn = Conn("boxd")
    try:
        conn.request("GET", path,
                     headers={"Authorization": "Bearer " + key, "Connection": "close"})
        resp = conn.getresponse()
        time.sleep(pause)
        return resp.status, resp.read()
    finally:
        conn.close()
download = "/v1/machines/" + me + "/files?path=/root/big.bin"
t = time.monotonic()
status, body = get(download)  # keep-alive or not, the first download sets the pause
assert status == 200 and body == big, (status, len(body))
pause = 2 * (time.monotonic() - t) + 1
answered, failed = 0, []
for i in range(20):
    path, want = (download, big) if i % 5 == 4 else ("/v1/machines", None)
    try:
        status, body = get(path, pause if want else 0.0)
        if status == 200 and (body == want if want else json.loads(body) is not None):
            answered += 1
        else:
            failed.append(f"{i}: {status} {len(body)} bytes {body[:80]!r}")
    except Exception as e:
        failed.append(f"{i}: {type(e).__name__}: {e}")
print(json.dumps({"answered": answered, "failed": failed}))
"""


def test_connection_close_requests_are_all_answered(client, one) -> None:  # type: ignore[no-untyped-def]
    """Issue 39 item 4: a request that sends ``Connection: close`` gets its whole answer
    (the agent closed the guest's socket on the host's close while the answer's last
    bytes were still queued for it)."""
    argv = ["python3", "-c", CLOSE_EACH, KEY, SOCKET, one.name]
    r = client.machines.exec(one.id, argv, timeout=600)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"answered": 20, "failed": []}, out
