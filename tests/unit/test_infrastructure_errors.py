"""Infrastructure errors are not exit codes (issue 42, item 6): an exec whose machine,
engine, agent or node fails raises a `boxd.InfrastructureError` subclass through the
control plane, the HTTP API (503, its code) and both SDKs; a stream cut without its exit
event is one too; `boxd.rl` surfaces a lost env server as one.

On the fake engine (tests/_support/fake_world.py): an exec is parked at its start
(`FakeEngine.gate`) while its VM is killed or its agent connection breaks. The same on a
real gVisor sandbox killed with SIGKILL: tests/integration/test_idempotency.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World, running

import boxd
from boxd import AsyncBoxd, Boxd, errors, models
from boxd.config import Paths

no_daemon = support.no_daemon  # fixtures
paths = support.paths

pytestmark = pytest.mark.timeout(60)


world = support.world  # fixture


def test_the_tree() -> None:
    for cls in (errors.MachineFailed, errors.AgentLost, errors.NodeLost,
                errors.ConnectionError):
        assert issubclass(cls, errors.InfrastructureError), cls
        assert cls.status == 503
    assert issubclass(errors.AgentLost, errors.MachineFailed)
    assert boxd.InfrastructureError is errors.InfrastructureError
    assert boxd.AgentLost is errors.AgentLost
    body = errors.AgentLost("lost", machine="m").to_body()
    again = errors.error_from_body(body, 503)
    assert type(again) is errors.AgentLost and again.machine == "m"
    assert isinstance(errors.error_from_body({"error": {"code": "infrastructure_error",
                                                        "message": "x"}}),
                      errors.InfrastructureError)


def test_rl_surfaces_a_lost_env_server_as_an_infrastructure_error() -> None:
    from boxd.rl import EnvServerLost, EnvTimeout

    assert issubclass(EnvServerLost, errors.InfrastructureError)
    assert not issubclass(EnvTimeout, errors.InfrastructureError)  # the env's own slowness


def _exec_killed(world: World, how: str, stream: bool) -> BaseException:
    """An exec parked at its start while the VM dies (``kill``) or its agent connection
    breaks (``agent``); what it raised."""

    async def main() -> BaseException:
        m = await running(world)
        reached, release = world.engine.gate("exec")
        req = models.ExecRequest(command="echo hi")

        async def call() -> object:
            if stream:
                return [e async for e in world.machines.exec_stream(ACCOUNT, m.id, req)]
            return await world.machines.exec(ACCOUNT, m.id, req)

        task = asyncio.create_task(call())
        await reached.wait()
        if how == "kill":
            world.vm(m.id).kill()
        else:
            world.engine.failures["exec"] = errors.AgentLost("agent connection lost: EOF")
        release.set()
        try:
            got = await task
        except BaseException as exc:
            return exc
        raise AssertionError(f"the exec returned {got!r}")

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["exec", "exec_stream"])
def test_an_exec_whose_vm_dies_raises_machine_failed(world: World, stream: bool) -> None:
    err = _exec_killed(world, "kill", stream)
    assert isinstance(err, errors.MachineFailed) and not isinstance(err, errors.AgentLost)
    assert isinstance(err, errors.InfrastructureError)
    assert "SIGKILL" in err.message  # the VM's exit reason, not only the broken channel


@pytest.mark.parametrize("stream", [False, True], ids=["exec", "exec_stream"])
def test_an_exec_whose_agent_connection_breaks_raises_agent_lost(
    world: World, stream: bool,
) -> None:
    err = _exec_killed(world, "agent", stream)
    assert isinstance(err, errors.AgentLost) and isinstance(err, errors.InfrastructureError)


def test_the_sdks_raise_it_typed_from_the_api(world: World, tmp_path: Path) -> None:
    """A failed machine's exec: HTTP 503 machine_failed; both SDKs raise the class."""
    app, keys = support.world_app(world, tmp_path)
    key = keys.create(ACCOUNT, "sdk").secret
    with Boxd(api_key=key, transport=support.SyncASGITransport(app)) as b:
        m = b.machines.new("m")
        b.machines.wait_until_ready("m")
        world.vm(m.id).kill()
        resp = b._client().post(f"/v1/machines/{m.id}/exec", json={"command": "echo"})
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "machine_failed"
        with pytest.raises(errors.InfrastructureError) as caught:
            b.machines.exec("m", "echo hi")
        assert isinstance(caught.value, errors.MachineFailed)
        with pytest.raises(errors.MachineFailed):
            list(b.machines.exec_stream("m", "echo hi"))

    async def async_sdk() -> None:
        async with AsyncBoxd(api_key=key, transport=httpx.ASGITransport(app)) as a:
            with pytest.raises(errors.MachineFailed):
                await a.machines.exec("m", "echo hi")

    asyncio.run(async_sdk())


def _cut_stream(request: httpx.Request) -> httpx.Response:
    """A daemon whose exec stream stops after one event (no exit, no error line)."""
    return httpx.Response(200, headers={"content-type": "application/x-ndjson"},
                          content=b'{"type": "stdout", "data": "started\\n"}\n')


def test_a_stream_cut_without_its_exit_event_raises_infrastructure_error(
    no_daemon: Paths,
) -> None:
    with Boxd(api_key="k", transport=httpx.MockTransport(_cut_stream)) as b:
        seen: list[str] = []
        with pytest.raises(errors.InfrastructureError, match="without an exit status"):
            for ev in b.machines.exec_stream("m", "sleep 30"):
                seen.append(ev.type)
        assert seen == ["stdout"]

    async def async_sdk() -> None:
        async with AsyncBoxd(api_key="k", transport=httpx.MockTransport(_cut_stream)) as a:
            with pytest.raises(errors.InfrastructureError):
                async for _ in a.machines.exec_stream("m", "sleep 30"):
                    pass

    asyncio.run(async_sdk())
