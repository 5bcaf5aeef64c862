"""What `boxd.rl` makes carries labels naming what made it, and goes by them (issue 39,
item 6): closing a home deletes its run's machines, those whose creation answer was
lost too; a branch that fails partway deletes its forks by their branch label; a
signalled process's creations in flight are drained before its delete.

The SDK talks in process to the real app, control plane and SQLite over the fake
engine (no process streams: real branching is tests/integration/test_rl_branch.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests._support import sdk_daemon as support
from tests._support.fake_world import ACCOUNT, World

from boxd import Boxd, errors
from boxd.rl._branch import _Point, fork_slots
from boxd.rl._channel import MakeRequest
from boxd.rl._cleanup import BRANCH_LABEL, OWNER_LABEL, RUN_LABEL, Creations
from boxd.rl._machines import MachineHome
from boxd.rl._verify import _Job

paths = support.paths  # fixtures
no_daemon = support.no_daemon


world = support.world  # fixture


@pytest.fixture
def boxd(world: World, tmp_path: Path) -> Iterator[Boxd]:
    app, keys = support.world_app(world, tmp_path)
    with Boxd(api_key=keys.create(ACCOUNT, "sdk").secret,
              transport=support.SyncASGITransport(app)) as b:
        b.machines.new("base")
        b.machines.wait_until_ready("base")
        yield b


def _names(boxd: Boxd) -> list[str]:
    return [m.name for m in boxd.machines.list()]


def test_a_home_labels_its_run_and_close_deletes_it_even_unanswered(boxd: Boxd) -> None:
    home = MachineHome("base", boxd)
    other = MachineHome("base", boxd)
    assert home.labels[OWNER_LABEL] == "env"
    assert home.labels[RUN_LABEL] != other.labels[RUN_LABEL]
    # forks made for the home whose answers never reached it (a crash, a lost reply)
    lost = boxd.machines.fork("base", count=2, labels=home.labels)
    assert all(not isinstance(m, errors.BoxdError) for m in lost)
    boxd.machines.fork("base", "other-run", labels=other.labels)
    boxd.machines.fork("base", "unlabelled")
    home.close()
    assert _names(boxd) == ["base", "other-run", "unlabelled"]


def test_a_branch_whose_fork_answer_is_lost_deletes_its_forks(
    boxd: Boxd, monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = MachineHome("base", boxd)
    env_machine = boxd.machines.fork("base", "env-machine", labels=home.labels)
    real_fork = boxd.machines.fork

    def fork_then_lose_the_answer(*args: Any, **kwargs: Any) -> Any:
        real_fork(*args, **kwargs)  # the daemon makes the children...
        raise errors.ConnectionError("the connection dropped before the answer")

    monkeypatch.setattr(boxd.machines, "fork", fork_then_lose_the_answer)
    point = _Point(home, env_machine.id, "p_1", {}, MakeRequest("id", "CartPole-v1"), False)
    with pytest.raises(errors.ConnectionError):
        fork_slots(point, 4, [None] * 4)
    monkeypatch.undo()
    # ...and the failed branch deleted them by its own label: all or nothing
    assert _names(boxd) == ["base", "env-machine"]
    assert boxd.machines.list(labels={RUN_LABEL: home.labels[RUN_LABEL]})[0].name == \
        "env-machine"


def test_branch_forks_carry_the_run_and_a_branch_label(
    boxd: Boxd, monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = MachineHome("base", boxd)
    env_machine = boxd.machines.fork("base", "env-machine", labels=home.labels)
    seen: list[Any] = []

    def attach(machine: str, process: str) -> Any:
        seen.append(boxd.machines.get(machine).labels)
        raise errors.NotFound("no process to attach in the fake engine")

    monkeypatch.setattr(boxd.machines, "attach", attach)
    point = _Point(home, env_machine.id, "p_1", {}, MakeRequest("id", "CartPole-v1"), False)
    with pytest.raises(errors.NotFound):
        fork_slots(point, 2, [None] * 2)
    assert len(seen) == 2
    for labels in seen:
        assert {k: labels[k] for k in (RUN_LABEL, OWNER_LABEL)} == home.labels
        assert labels[BRANCH_LABEL].startswith("b-")
    assert _names(boxd) == ["base", "env-machine"]


def test_verify_machines_carry_one_run_labelled_verify(boxd: Boxd) -> None:
    job = _Job(sources=["base"], env="CartPole-v1", steps=1, policy=None, runs=2,
               boxd=boxd, pickle_by_value=(), make_kwargs={},
               labels={RUN_LABEL: "r-v", OWNER_LABEL: "verify"})
    home = job.home(0, 0)
    assert job.home(1, 3) is home and isinstance(home, MachineHome)
    assert home.labels == {RUN_LABEL: "r-v", OWNER_LABEL: "verify"}
    boxd.machines.fork("base", "run-0", labels=home.labels)
    job.close()
    assert _names(boxd) == ["base"]


def test_stopping_refuses_new_creations_and_waits_for_those_in_flight() -> None:
    gate = Creations()
    entered, release = threading.Event(), threading.Event()

    def creating() -> None:
        with gate.creating():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=creating)
    t.start()
    entered.wait(10)
    assert not gate.stop(timeout=0.05)  # one is in flight in another thread
    with pytest.raises(errors.Conflict, match="stopping"), gate.creating():
        pass
    threading.Timer(0.1, release.set).start()
    started = time.monotonic()
    assert gate.stop(timeout=10)
    assert time.monotonic() - started < 5
    t.join(10)
