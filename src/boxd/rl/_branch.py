"""Branching and saved states of `boxd.rl` envs (docs/rl.md, "Branching").

A branch is a fork of an env's machine taken between two requests, while its env
server waits in ``read``: the child runs its own copy of the server (same process id,
same memory, same files), and the branch re-attaches to it, as a slot made from a
built template does. A saved state is a checkpoint of the env's machine; loading it
restores the machine in place, and the node re-attaches the server's stream on the
restored VM. Only the host's view of the env (its last observation, its flags) is kept
here, in the `EnvState`, so that a vector env answers as it did when it was saved.
"""

from __future__ import annotations

import contextlib
import copy
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from boxd import errors
from boxd.rl._channel import Home, MakeRequest, Rpc, Slot
from boxd.rl._cleanup import BRANCH_LABEL, CREATIONS, delete_labelled, new_id
from boxd.rl._machines import READY_TIMEOUT, MachineHome, MachineSlot

if TYPE_CHECKING:
    from boxd.sdk._process_sync import ProcessHandle
    from boxd.sdk._sync import Boxd

# `Env` and `VectorEnv` call this module (it sits below them: it imports neither, so
# their arguments are typed Any here).
Env = Any
VectorEnv = Any
Pool = Any

#: Forks attached at once.
MAX_PARALLEL_OPEN = 8
#: Checkpoint names of saved states start with this.
STATE_PREFIX = "boxd-rl-state"


class _BadK(errors.InvalidRequest, ValueError):
    """A branch count that is not a positive int (also a ValueError)."""


class _BadIndex(errors.InvalidRequest, IndexError):
    """A sub-env index out of range (also an IndexError, as indexing a list raises)."""


def check_k(k: Any) -> int:
    """Raises: InvalidRequest (a ValueError too): ``k`` is not an int >= 1."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise _BadK(f"k must be an int >= 1 (the number of branches), not {k!r}", field="k")
    return k


def check_index(index: Any, n: int) -> int:
    """Raises: InvalidRequest (an IndexError too): not a sub-env index of ``n``."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise _BadIndex(f"a sub-env index must be an int, not {index!r}", field="index")
    if not -n <= index < n:
        raise _BadIndex(f"sub-env index {index!r} is out of range for {n} sub-envs "
                        f"(0..{n - 1})", field="index")
    return index % n


# ---------------------------------------------------------------------- fork points


@dataclass(frozen=True)
class _Point:
    """What a branch of one slot needs: its machine, its server's process, its env."""

    home: MachineHome
    machine: str
    process: str
    info: dict[str, Any]
    make: MakeRequest
    rewindable: bool


def _point(slot: Slot, rewindable: bool) -> _Point:
    """Raises: InvalidRequest: the slot has no machine (a local env server)."""
    if isinstance(slot, ForkSlot):
        return slot.point()
    # A MachineSlot is the only other slot with a machine (local servers cannot fork).
    if not isinstance(slot, MachineSlot) or slot.machine is None:
        raise errors.InvalidRequest(
            "branching and saved states need a machine: local env servers cannot fork",
            field="source", hint="give source= a machine name (boxd.rl.local() is for "
            "debugging an env without machines)")
    home = slot._home
    make = slot._make
    channel: ProcessHandle = slot.channel
    return _Point(home, slot.machine, channel.id, slot.info, make, rewindable)


class ForkSlot:
    """A `Slot` in a fork of another slot's machine, attached to its copy of the
    server. Its first rewind or refork makes it an ordinary slot of the home (a fork
    of the env's built template: a branch has no build-time checkpoint of its own)."""

    def __init__(self, point: _Point, machine: str, proc: ProcessHandle,
                 index: int | None) -> None:
        self._point = point
        self._machine: str | None = machine
        self._proc: ProcessHandle | None = proc
        self._index = index
        self._inner: Slot | None = None

    def point(self) -> _Point:
        if self._inner is not None:
            return _point(self._inner, self._point.rewindable)
        assert self._machine is not None and self._proc is not None
        return _Point(self._point.home, self._machine, self._proc.id, self._point.info,
                      self._point.make, self._point.rewindable)

    @property
    def channel(self) -> Any:
        if self._inner is not None:
            return self._inner.channel
        assert self._proc is not None
        return self._proc

    @property
    def machine(self) -> str | None:
        return self._inner.machine if self._inner is not None else self._machine

    @property
    def info(self) -> dict[str, Any]:
        return self._inner.info if self._inner is not None else self._point.info

    def rewind(self) -> None:
        if self._inner is not None:
            self._inner.rewind()
        else:
            self._replace()

    def refork(self) -> None:
        if self._inner is not None:
            self._inner.refork()
        else:
            self._replace()

    def _replace(self) -> None:
        self._close_own()
        p = self._point
        self._inner = p.home.open(p.make, rewindable=p.rewindable, index=self._index,
                                  shared=True)

    def _close_own(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.close()
        machine, self._machine = self._machine, None
        if machine is not None:
            with contextlib.suppress(errors.NotFound):
                self._point.home.boxd.machines.delete(machine)

    def close(self) -> None:
        self._close_own()
        if self._inner is not None:
            self._inner.close()


def fork_slots(point: _Point, k: int, indices: Sequence[int | None]) -> list[ForkSlot]:
    """``k`` forks of ``point``'s machine, each attached to its copy of the server.

    All or nothing: when one fails, the others are deleted and its error is raised.
    The forks carry the env's labels (inherited) and one ``boxd.rl/branch`` label of
    their own, by which the failure path deletes them all, those whose answer was lost
    too (the fork request itself failed: a daemon killed midway).
    """
    c = point.home.boxd
    names = [f"rl-branch-{secrets.token_hex(4)}" for _ in range(k)]
    labels = {**point.home.labels, BRANCH_LABEL: new_id("b")}
    try:
        with CREATIONS.creating():
            items = c.machines.fork(point.machine, names=names, labels=labels)
    except BaseException:
        delete_labelled(c, labels)
        raise
    made = [m.id for m in items if not isinstance(m, errors.BoxdError)]
    failed: BaseException | None = next(
        (m for m in items if isinstance(m, errors.BoxdError)), None)

    def attach(machine: str) -> ProcessHandle:
        c.machines.wait_until_ready(machine, timeout=READY_TIMEOUT)
        return c.machines.attach(machine, point.process)

    procs: list[Any] = []
    if failed is None:
        with ThreadPoolExecutor(max_workers=max(1, min(k, MAX_PARALLEL_OPEN))) as ex:
            futures = [ex.submit(attach, m) for m in made]
        procs = [f.exception() or f.result() for f in futures]
        failed = next((p for p in procs if isinstance(p, BaseException)), None)
    if failed is not None:
        for p in procs:
            if not isinstance(p, BaseException):
                with contextlib.suppress(Exception):
                    p.close()
        for m in made:
            with contextlib.suppress(errors.BoxdError):
                c.machines.delete(m)
        delete_labelled(c, labels)  # and any the daemon made that no answer named
        raise failed
    return [ForkSlot(point, m, p, i) for m, p, i in zip(made, procs, indices, strict=True)]


class SharedHome:
    """A home several envs (an env and its branches) use: closed with the last of them."""

    def __init__(self, inner: Home) -> None:
        self.inner = inner
        self._users = [1]

    def share(self) -> SharedHome:
        other = SharedHome.__new__(SharedHome)
        other.inner, other._users = self.inner, self._users
        self._users[0] += 1
        return other

    def open(self, make: MakeRequest, *, rewindable: bool, index: int | None = None,
             shared: bool = False) -> Slot:
        return self.inner.open(make, rewindable=rewindable, index=index, shared=shared)

    def close(self) -> None:
        self._users[0] -= 1
        if self._users[0] == 0:
            self.inner.close()

    def __getattr__(self, name: str) -> Any:  # source, boxd, template...
        if name in ("inner", "_users"):  # not set yet (copy, pickle)
            raise AttributeError(name)
        return getattr(self.inner, name)


def _shared(home: Home) -> SharedHome:
    return home if isinstance(home, SharedHome) else SharedHome(home)


# ---------------------------------------------------------------------- saved states


@dataclass(frozen=True)
class EnvState:
    """A mid-episode moment an env can return to any number of times (`Env.load`,
    `VectorEnv.load`): a checkpoint of the env's machine, and the host's view of the
    env at that moment. It lives as long as the machine (a refork reset, or closing
    the env, deletes it with the machine) or until `delete`."""

    machine: str
    checkpoint: str
    _host: dict[str, Any] = field(repr=False, compare=False)
    _boxd: Boxd = field(repr=False, compare=False)

    def delete(self) -> None:
        """Delete the checkpoint (nothing happens if it or its machine is gone)."""
        with contextlib.suppress(errors.NotFound):
            self._boxd.machines.checkpoints.delete(self.machine, self.checkpoint)


def _save(point: _Point, host: dict[str, Any]) -> EnvState:
    name = f"{STATE_PREFIX}-{secrets.token_hex(4)}"
    point.home.boxd.machines.checkpoints.save(point.machine, name)
    return EnvState(point.machine, name, host, point.home.boxd)


def _load(point: _Point, state: EnvState) -> dict[str, Any]:
    if not isinstance(state, EnvState):
        raise errors.InvalidRequest(f"load takes an EnvState (from save()), not "
                                    f"{type(state).__name__}", field="state")
    if state.machine != point.machine:
        raise errors.InvalidRequest(
            f"this state was saved in machine {state.machine}, and the env runs in "
            f"{point.machine}", field="state",
            hint="load a state into the env (or sub-env) that saved it; a branch or a "
            "refork reset has a machine of its own")
    # The node re-attaches the server's stream on the restored VM (the server was
    # waiting in read at the checkpoint, as it is now).
    point.home.boxd.machines.checkpoints.restore(point.machine, state.checkpoint)
    return dict(state._host)


# ---------------------------------------------------------------------- Env


def _open_env(env: Env) -> _Point:
    if env._closed:
        raise errors.StateError("the env is closed (its machine is gone)", state="closed",
                                required="open")
    if env._broken is not None:
        raise env._broken
    return _point(env._slot, env.reset_mode == "rewind")


def env_branch(env: Env, k: int) -> list[Env]:
    """`Env.branch`."""
    check_k(k)
    point = _open_env(env)
    slots = fork_slots(point, k, [None] * k)
    home = env._home
    if env._owns_home:
        home = env._home = _shared(home)
    out = []
    for slot in slots:
        new = copy.copy(env)
        new.__dict__.update(
            _slot=slot, _rpc=Rpc(slot), _closed=False, _broken=None,
            _home=home.share() if isinstance(home, SharedHome) else home,
            observation_space=copy.deepcopy(env.observation_space),
            action_space=copy.deepcopy(env.action_space),
            _np_random=copy.deepcopy(getattr(env, "_np_random", None)),
            metadata=dict(env.metadata))
        out.append(new)
    return out


def env_save(env: Env) -> EnvState:
    """`Env.save`."""
    return _save(_open_env(env), {"pristine": env._pristine})


def env_load(env: Env, state: EnvState) -> None:
    """`Env.load`."""
    host = _load(_open_env(env), state)
    env._pristine = host["pristine"]


# ---------------------------------------------------------------------- VectorEnv

_PER_ENV = ("_rewards", "_terminations", "_truncations", "_autoreset_envs")


def _open_vector(venv: VectorEnv, what: str) -> None:
    venv._check_open()
    venv._check_no_pending(what)


def _vector_point(venv: VectorEnv, i: int) -> _Point:
    pool = venv._pool
    if pool.envs_per_machine > 1:
        raise errors.InvalidRequest(
            f"a sub-env shares its machine with others (envs_per_machine="
            f"{pool.envs_per_machine}): a machine's branch or checkpoint would take them "
            "all", field="index",
            hint="branch, save and load sub-envs of a VectorEnv with envs_per_machine=1")
    g = pool.group_of[i]
    broken = pool.broken[g]
    if broken is not None:
        raise broken
    return _point(pool.slots[g], pool.reset_mode == "rewind")


def vector_branch(venv: VectorEnv, index: int | Sequence[int], k: int | None) -> VectorEnv:
    """`VectorEnv.branch`."""
    _open_vector(venv, "branch")
    n = venv.num_envs
    if isinstance(index, int) and not isinstance(index, bool):
        sources = [check_index(index, n)] * check_k(1 if k is None else k)
    elif isinstance(index, list | tuple | range):
        if k is not None:
            raise errors.InvalidRequest("give k with one index, not with a list of "
                                        "indices (each index gets one branch)", field="k")
        sources = [check_index(i, n) for i in index]
    else:
        raise _BadIndex(f"index must be an int or a list of ints, not {index!r}",
                        field="index")
    if not sources:
        raise _BadK("give at least one index to branch", field="index")
    pool = venv._pool
    placed: dict[int, Slot] = {}
    try:
        for i in sorted(set(sources)):
            at = [j for j, s in enumerate(sources) if s == i]
            placed.update(zip(at, fork_slots(_vector_point(venv, i), len(at), at),
                              strict=True))
    except BaseException:
        for s in placed.values():
            s.close()
        raise
    slots = [placed[j] for j in range(len(sources))]
    pool.home = _shared(pool.home)
    new_pool = _pool_of(pool, slots, sources)
    new = copy.copy(venv)
    new.__dict__.update(
        _pool=new_pool, num_envs=len(sources), _pending=None,
        _obs=[copy.deepcopy(venv._obs[i]) for i in sources],
        single_observation_space=copy.deepcopy(venv.single_observation_space),
        single_action_space=copy.deepcopy(venv.single_action_space),
        metadata=dict(venv.metadata))
    for name in _PER_ENV:
        setattr(new, name, getattr(venv, name)[sources].copy())
    from gymnasium.vector.utils import batch_space, concatenate, create_empty_array

    new.observation_space = batch_space(new.single_observation_space, new.num_envs)
    new.action_space = batch_space(new.single_action_space, new.num_envs)
    new._np_random = copy.deepcopy(getattr(venv, "_np_random", None))
    import numpy as np

    empty: Any = create_empty_array(new.single_observation_space, n=new.num_envs, fn=np.zeros)
    new._observations = (
        empty if any(o is None for o in new._obs)
        else concatenate(new.single_observation_space, new._obs, empty))
    return new


def _pool_of(pool: Pool, slots: list[Slot], sources: list[int]) -> Pool:
    """A pool of already-open ``slots`` (the branches), sharing ``pool``'s home."""
    new: Any = object.__new__(type(pool))
    assert isinstance(pool.home, SharedHome)
    new.__dict__.update(pool.__dict__)
    new.home = pool.home.share()
    new.makes = [pool.makes[i] for i in sources]
    new.n = len(slots)
    new.pristine = [pool.pristine[i] for i in sources]
    new.infos = [copy.deepcopy(pool.infos[i]) for i in sources]
    new.envs_per_machine = 1  # one branch per machine
    new.groups = [[j] for j in range(new.n)]
    new.group_of = list(range(new.n))
    new.broken = [None] * new.n
    new.slots = slots
    new.rpcs = [Rpc(s, j) for j, s in enumerate(slots)]
    return new


def vector_save(venv: VectorEnv, index: int) -> EnvState:
    """`VectorEnv.save`."""
    _open_vector(venv, "save")
    i = check_index(index, venv.num_envs)
    host = {"obs": copy.deepcopy(venv._obs[i]),
            "pristine": venv._pool.pristine[i]}
    host.update({name: getattr(venv, name)[i].copy() for name in _PER_ENV})
    return _save(_vector_point(venv, i), host)


def vector_load(venv: VectorEnv, index: int, state: EnvState) -> None:
    """`VectorEnv.load`."""
    _open_vector(venv, "load")
    i = check_index(index, venv.num_envs)
    host = _load(_vector_point(venv, i), state)
    venv._obs[i] = copy.deepcopy(host["obs"])
    venv._pool.pristine[i] = host["pristine"]
    for name in _PER_ENV:
        getattr(venv, name)[i] = host[name]
    from gymnasium.vector.utils import concatenate

    venv._observations = concatenate(venv.single_observation_space, venv._obs,
                                     venv._observations)


__all__ = ["EnvState", "ForkSlot", "SharedHome", "check_index", "check_k", "env_branch",
           "env_load", "env_save", "fork_slots", "vector_branch", "vector_load",
           "vector_save"]
