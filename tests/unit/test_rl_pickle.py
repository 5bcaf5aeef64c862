"""`MakeRequest.of` with ``pickle_by_value`` from many threads at once (`rl.verify`
builds its Envs in a thread pool): every payload carries the module's code."""

from __future__ import annotations

import functools
import io
import pickle
import threading
from typing import Any

import cloudpickle
import pytest
from tests._support import rl_envs as _rl_envs

from boxd.rl._channel import MakeRequest


class _NoTestsUnpickler(pickle.Unpickler):
    """Loads a payload as a machine would, where the ``tests`` package does not exist."""

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "tests":
            raise AssertionError(f"pickled by reference, not by value: {module}.{name}")
        return super().find_class(module, name)


def _by_value(payload: bytes) -> None:
    _NoTestsUnpickler(io.BytesIO(payload)).load()


def test_concurrent_requests_each_pickle_the_module_by_value() -> None:
    threads, rounds = 8, 40
    start = threading.Barrier(threads)
    payloads: list[bytes] = []
    lock = threading.Lock()

    def work() -> None:
        start.wait()
        for _ in range(rounds):
            req = MakeRequest.of(functools.partial(_rl_envs.ClockEnv, reads_at=7),
                                 pickle_by_value=[_rl_envs])
            assert isinstance(req.payload, bytes)
            with lock:
                payloads.append(req.payload)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert len(payloads) == threads * rounds
    for p in payloads:
        _by_value(p)
    # Nothing stays registered after the calls...
    assert _rl_envs.__name__ not in cloudpickle.list_registry_pickle_by_value()


def test_a_module_the_caller_registered_stays_registered() -> None:
    """...and a registration the caller made itself is not undone."""
    cloudpickle.register_pickle_by_value(_rl_envs)
    try:
        req = MakeRequest.of(_rl_envs.BoxEnv, pickle_by_value=[_rl_envs])
        assert _rl_envs.__name__ in cloudpickle.list_registry_pickle_by_value()
        assert isinstance(req.payload, bytes)
        _by_value(req.payload)
    finally:
        cloudpickle.unregister_pickle_by_value(_rl_envs)
    with pytest.raises(AssertionError, match="by reference"):
        _by_value(cloudpickle.dumps(_rl_envs.BoxEnv))
