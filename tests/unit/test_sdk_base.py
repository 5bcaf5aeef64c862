"""The SDK's I/O-free logic: endpoint and key resolution, request building, error
mapping; plus the public surface (``__all__``) and sync/async signature parity."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

import boxd
from boxd import errors, models, sdk
from boxd.config import Paths
from boxd.sdk import _base


def test_target_defaults_to_local_socket() -> None:
    paths = Paths(Path("/tmp/bx"))
    t = _base.resolve_target(environ={}, paths=paths)
    assert t.local and t.uds == paths.socket and t.base_url == "http://boxd"
    assert t.api_key is None


def test_target_env_then_args() -> None:
    env = {"BOXD_URL": "http://10.0.0.1:7070/", "BOXD_API_KEY": "boxd_env"}
    t = _base.resolve_target(environ=env, paths=Paths(Path("/x")))
    assert (t.base_url, t.uds, t.api_key) == ("http://10.0.0.1:7070", None, "boxd_env")
    t = _base.resolve_target("boxd_arg", "https://h:1", environ=env, paths=Paths(Path("/x")))
    assert (t.base_url, t.api_key) == ("https://h:1", "boxd_arg")


def test_bad_url_is_invalid_request() -> None:
    with pytest.raises(errors.InvalidRequest, match="invalid boxd URL"):
        _base.resolve_target(base_url="localhost:7070", environ={})


def test_boxd_home_moves_the_socket(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BOXD_HOME", str(tmp_path))
    t = _base.resolve_target(environ={})
    assert t.uds == tmp_path.resolve() / "boxd.sock"
    assert _base.local_key_path(t.paths) == tmp_path.resolve() / "local.key"


def test_machine_create_sends_only_given_fields() -> None:
    req = _base.machine_create("rl-base", None, 2048, None, False, "env-v3")
    assert (req.method, req.path) == ("POST", "/v1/machines")
    assert req.json == {
        "isolated": False,
        "name": "rl-base",
        "memory_mib": 2048,
        "from_snapshot": "env-v3",
    }
    models.MachineCreate.model_validate(req.json)


def test_exec_request_and_no_read_timeout() -> None:
    req = _base.machine_exec("m_1", ["ls", "-la"], {"A": "1"}, "/tmp", 5.0, None)
    assert req.path == "/v1/machines/m_1/exec"
    assert req.json == {"command": ["ls", "-la"], "env": {"A": "1"}, "cwd": "/tmp", "timeout": 5.0}
    models.ExecRequest.model_validate(req.json)
    assert _base.timeout_for(300.0, req.timeout).read is None
    with pytest.raises(errors.InvalidRequest):
        _base.machine_exec("m", "", None, None, None, None)


def test_wait_extends_read_timeout() -> None:
    req = _base.machine_wait("a", 120.0)
    assert req.params == {"timeout": "120"}
    assert _base.timeout_for(60.0, req.timeout).read == 150.0


def test_upload_encodes_str_and_mode() -> None:
    req = _base.file_upload("rl-base", "/home/boxd/r.py", "print('é')\n", 0o755)
    assert req.method == "PUT" and req.content == "print('é')\n".encode()
    assert req.params == {"path": "/home/boxd/r.py", "mode": "493"}


def test_refs_are_quoted() -> None:
    assert _base.snapshot_get("env@2").path == "/v1/snapshots/env%402"
    assert _base.snapshot_get("sha256:ab").path == "/v1/snapshots/sha256%3Aab"
    assert _base.checkpoint_restore("a", "b/c").path == "/v1/machines/a/checkpoints/b%2Fc/restore"


def test_fork_single_and_batch_requests() -> None:
    assert _base.machine_fork("src", "kid").json == {"name": "kid"}
    req = _base.machine_fork_batch("src", 3, None)
    assert (req.path, req.json) == ("/v1/machines/src/fork/batch", {"count": 3})


@pytest.mark.parametrize(
    ("exc", "fields"),
    [
        (
            errors.MachineNotFound("no machine 'x'", hint="boxd machine list", machine="x"),
            {"machine": "x"},
        ),
        (
            errors.ExecTimeout("timed out", timeout=5, stdout="part", stderr=""),
            {"stdout": "part", "timeout": 5},
        ),
        (errors.QuotaExceeded("limit 50", limit=50, used=50), {"limit": 50}),
        (
            errors.StateError("bad", machine="a", state="failed", required="running"),
            {"state": "failed"},
        ),
    ],
)
def test_error_bodies_map_back_to_classes(exc: errors.BoxdError, fields: dict[str, object]) -> None:
    got = _base.error_from_response(exc.status, json.dumps(exc.to_body()).encode())
    assert type(got) is type(exc) and got.message == exc.message and got.hint == exc.hint
    for k, v in fields.items():
        assert getattr(got, k) == v
    with pytest.raises(type(exc)):
        _base.parse(models.Machine, exc.status, json.dumps(exc.to_body()).encode())


def test_non_json_error_is_internal_error() -> None:
    got = _base.error_from_response(502, b"<html>Bad gateway</html>")
    assert isinstance(got, errors.InternalError) and "502" in got.message


def test_unreadable_success_body_is_internal_error() -> None:
    with pytest.raises(errors.InternalError, match="Machine"):
        _base.parse(models.Machine, 200, b'{"id": 1}')


def test_parse_event_and_error_lines() -> None:
    assert _base.parse_event(b"  \n") is None
    ev = _base.parse_event('{"type": "stdout", "data": "hi"}')
    assert ev is not None and ev.data == "hi"
    body = errors.MachineFailed("the VM died", machine="a").to_body()
    with pytest.raises(errors.MachineFailed):
        _base.parse_event(json.dumps(body))


def test_fork_items_keep_per_child_errors() -> None:
    m = models.Machine(
        id="m_1",
        name="a",
        state="running",
        vcpus=1,
        memory_mib=1,
        disk_gib=1,
        isolated=False,
        created_at=0,
    )
    err = models.ErrorBody(code="already_exists", message="exists", details={"name": "b"})
    out = _base.fork_items(
        models.ForkResult(children=[models.ForkItem(machine=m), models.ForkItem(error=err)])
    )
    assert out[0] == m
    assert isinstance(out[1], errors.AlreadyExists) and out[1].name == "b"


def test_transport_error_names_the_log() -> None:
    import httpx

    t = _base.resolve_target(environ={}, paths=Paths(Path("/tmp/bx")))
    e = _base.map_transport_error(httpx.ConnectError("refused"), t)
    assert isinstance(e, errors.ConnectionError) and "/tmp/bx/daemon.log" in str(e)


def test_all_is_sorted_complete_and_importable() -> None:
    assert boxd.__all__ == sorted(boxd.__all__, key=lambda n: (n.startswith("_"), n))
    assert len(set(boxd.__all__)) == len(boxd.__all__)
    for name in boxd.__all__:
        assert hasattr(boxd, name), name
    error_names = {n for n in errors.__all__ if n != "error_from_body"}
    assert error_names <= set(boxd.__all__)
    assert {"Boxd", "AsyncBoxd", "Machine", "ExecResult", "Snapshot"} <= set(boxd.__all__)
    assert boxd.__version__ == "0.1.0"


_PAIRS = [
    (sdk.Boxd, sdk.AsyncBoxd),
    (sdk.Machines, sdk.AsyncMachines),
    (sdk.Files, sdk.AsyncFiles),
    (sdk.Checkpoints, sdk.AsyncCheckpoints),
    (sdk.Snapshots, sdk.AsyncSnapshots),
    (sdk.Keys, sdk.AsyncKeys),
    (sdk.Reports, sdk.AsyncReports),
]


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {
        n: inspect.signature(f)
        for n, f in inspect.getmembers(cls, inspect.isfunction)
        if not n.startswith("_") or n == "__init__"
    }


def _norm(sig: inspect.Signature) -> list[tuple[str, object, object, str]]:
    def ann(a: object) -> str:
        return str(a).replace("Async", "").replace("AsyncIterator", "Iterator")

    params = [(p.name, p.kind, p.default, ann(p.annotation)) for p in sig.parameters.values()]
    return [*params, ("return", None, None, ann(sig.return_annotation))]


@pytest.mark.parametrize(("sync_cls", "async_cls"), _PAIRS)
def test_sync_and_async_signatures_match(sync_cls: type, async_cls: type) -> None:
    s, a = _public(sync_cls), _public(async_cls)
    assert s.keys() == a.keys()
    for name in s:
        assert _norm(s[name]) == _norm(a[name]), name
        if name != "__init__":
            f = getattr(async_cls, name)
            assert inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f), name


def test_resource_attributes_match() -> None:
    b, a = sdk.Boxd(base_url="http://x:1"), sdk.AsyncBoxd(base_url="http://x:1")
    for attr in ("machines", "snapshots", "keys"):
        assert type(getattr(a, attr)).__name__ == "Async" + type(getattr(b, attr)).__name__
    assert type(a.machines.files).__name__ == "AsyncFiles"
    assert type(a.machines.checkpoints).__name__ == "AsyncCheckpoints"


def test_a_daemon_holding_the_lock_is_never_started_twice(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import fcntl
    import os

    from boxd.config import Paths
    from boxd.sdk._local import daemon_holds_lock

    paths = Paths(tmp_path)
    assert not daemon_holds_lock(paths)  # no lock file at all
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert not daemon_holds_lock(paths)  # a file nobody holds: a dead daemon's
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a serving daemon does
        assert daemon_holds_lock(paths)
    finally:
        os.close(fd)
    assert not daemon_holds_lock(paths)


def test_an_isolated_machine_says_it_has_no_route_to_the_api(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The machine's client is there (/run/boxd/py) but no API socket: Boxd() used to try
    # to start a daemon in the guest and fail with a HostSetupError about the server
    # extra; now its requests fail naming the cause.
    import httpx

    run = tmp_path / "run" / "boxd"
    (run / "py").mkdir(parents=True)
    monkeypatch.setattr(_base, "GUEST_SOCKET", run / "boxd.sock")
    t = _base.resolve_target(environ={})
    assert t.guest and not t.local  # no local daemon to start in a guest
    err = _base.map_transport_error(httpx.ConnectError("No such file or directory"), t)
    assert "no route to the boxd API" in err.message and "isolated" in (err.hint or "")


def test_inside_a_machine_the_target_is_its_api_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import httpx

    sock, key = tmp_path / "boxd.sock", tmp_path / "key"
    monkeypatch.setattr(_base, "GUEST_SOCKET", sock)
    monkeypatch.setattr(_base, "GUEST_KEY", key)
    assert not _base.resolve_target(environ={}).guest  # no socket: not in a machine
    sock.touch()
    t = _base.resolve_target(environ={})
    assert t.guest and not t.local and t.uds == sock and t.api_key is None
    assert "this machine's API socket" in t.where
    auth = t.auth()
    assert isinstance(auth, _base.GuestKeyAuth)

    def header() -> str | None:
        flow = auth.auth_flow(httpx.Request("GET", "http://boxd/v1/machines"))
        return next(flow).headers.get("Authorization")

    assert header() is None  # no credential yet
    key.write_text("boxdm_one\n")
    assert header() == "Bearer boxdm_one"
    key.write_text("boxdm_two\n")  # rotated (a fork child, a restore): read per request
    assert header() == "Bearer boxdm_two"
    # The environment wins: a key of its own over the socket, or another daemon.
    t = _base.resolve_target(environ={"BOXD_API_KEY": "boxd_env"})
    assert t.guest and t.api_key == "boxd_env" and t.auth() is None
    t = _base.resolve_target(environ={"BOXD_URL": "http://127.0.0.1:7070"})
    assert not t.guest and t.uds is None
