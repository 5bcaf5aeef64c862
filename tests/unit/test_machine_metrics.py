"""Machine metrics through the control plane and node runtime, on the fake engine: what a
request samples, what the node keeps, and that a sleeping machine is not woken.

The guest side (agent.py's ``metrics`` reading /proc) is in tests/unit/test_agent.py;
real machines in tests/integration/test_e2b.py (the E2B SDK's ``get_metrics``) and
tests/integration/test_gvisor.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World, run, running

from boxd import Boxd, cli, errors, models
from boxd.models import MachineState

S = MachineState
paths = support.paths  # fixtures
no_daemon = support.no_daemon
world = support.world


transport = support.transport  # fixture: the app over world, keyed


def test_a_request_samples_a_running_machine_from_its_guest(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        got = await world.machines.metrics(ACCOUNT, m.name)
        assert got.machine == m.name and got.state == S.RUNNING
        [s] = got.samples
        # the fake guest's counters: 100 busy ticks of 400 per reading
        assert s.cpu_used_pct == 25.0 and s.cpu_count == m.vcpus
        assert s.mem_total == m.memory_mib << 20 and s.mem_used == 64 << 20
        assert s.disk_used == 256 << 20 and s.disk_total == 1 << 30
        assert world.vm(m.id).guest.metric_reads == 1
        # a second request within a second reuses the fresh sample
        again = await world.machines.metrics(ACCOUNT, m.name)
        assert again.samples == got.samples and world.vm(m.id).guest.metric_reads == 1
        # start/end select by time
        none = await world.machines.metrics(ACCOUNT, m.name, start=s.timestamp + 1)
        assert none.samples == []
        with pytest.raises(errors.InvalidRequest, match="after end"):
            await world.machines.metrics(ACCOUNT, m.name, start=10, end=5)

    run(main())


def test_a_watched_machine_is_sampled_on_and_the_history_is_bounded(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        world.node.metrics.interval = 0.02
        await world.machines.metrics(ACCOUNT, m.name)
        await asyncio.sleep(0.3)
        got = await world.machines.metrics(ACCOUNT, m.name)
        assert len(got.samples) >= 5
        stamps = [s.timestamp for s in got.samples]
        assert stamps == sorted(stamps)
        for _ in range(world.node.metrics.kept + 10):
            await world.node.metrics.take(m.id)
        assert len(world.node.metrics.samples[m.id]) == models.METRICS_KEPT
        await world.machines.delete(ACCOUNT, m.id)
        assert m.id not in world.node.metrics.samples  # forgotten with the machine

    run(main())


def test_a_sleeping_machine_is_not_woken_and_keeps_its_samples(world: World) -> None:
    async def main() -> None:
        m = await running(world)
        before = await world.machines.metrics(ACCOUNT, m.name)
        await world.machines.hibernate(ACCOUNT, m.name)
        got = await world.machines.metrics(ACCOUNT, m.name)
        assert got.state == S.HIBERNATED and got.samples == before.samples
        assert world.state(m.id) == S.HIBERNATED  # not woken
        fresh = await running(world, "fresh")
        await world.machines.suspend(ACCOUNT, fresh.name)
        empty = await world.machines.metrics(ACCOUNT, fresh.name)
        assert empty.state == S.SUSPENDED and empty.samples == []
        assert world.state(fresh.id) == S.SUSPENDED
        with pytest.raises(errors.MachineNotFound):
            await world.machines.metrics("another-account", m.name)

    run(main())


def test_the_sdk_and_the_http_api_answer_metrics(
        transport: support.SyncASGITransport) -> None:
    with Boxd(api_key=transport.key, transport=transport) as b:  # type: ignore[attr-defined]
        b.machines.new("m")
        assert b.machines.metrics("m").samples == []  # starting: not sampled yet
        b.machines.wait_until_ready("m")
        got = b.machines.metrics("m")
        assert got.machine == "m" and got.interval == models.METRICS_INTERVAL
        assert [s.cpu_used_pct for s in got.samples] == [25.0]
        assert b.machines.metrics("m", start=got.samples[0].timestamp + 60).samples == []
        with pytest.raises(errors.InvalidRequest):
            b.machines.metrics("m", start=5, end=1)
        with pytest.raises(errors.MachineNotFound):
            b.machines.metrics("nope")


def test_cli_machine_metrics(transport: support.SyncASGITransport,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "Boxd", lambda **_: Boxd(
        api_key=transport.key, transport=support.KeptTransport(transport)))  # type: ignore[attr-defined]

    def invoke(*args: str) -> tuple[int, str]:
        r = CliRunner().invoke(cli.main, list(args), catch_exceptions=False)
        return r.exit_code, r.stdout

    assert invoke("machine", "new", "m")[0] == 0
    code, out = invoke("machine", "metrics", "m")
    assert code == 0 and "25.0%" in out and "CPU" in out, out
    code, out = invoke("machine", "metrics", "m", "--json", "--since", "60")
    body = json.loads(out)
    assert code == 0 and body["machine"] == "m" and len(body["samples"]) == 1
    assert set(body["samples"][0]) == set(models.MetricSample.model_fields)
    assert invoke("machine", "suspend", "m")[0] == 0
    code, out = invoke("machine", "metrics", "m", "--since", "0")
    assert code == 0 and "no samples kept (the machine is suspended" in out, out
