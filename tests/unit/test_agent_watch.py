"""`connect_watched`: an agent connect raced against its VM's liveness (both engines)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from boxd.engine.agent import AgentClient, connect_watched
from boxd.errors import MachineFailed


def _failed() -> MachineFailed:
    return MachineFailed("machine m_1 failed: its VM died", machine="m_1")


async def _never() -> AgentClient:
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


def test_a_vm_that_dies_while_its_agent_is_awaited_fails_fast() -> None:
    deaths = iter([True, True, False])  # alive twice, then dead
    t0 = time.monotonic()
    with pytest.raises(MachineFailed, match="its VM died"):
        asyncio.run(connect_watched(_never(), lambda: next(deaths, False), _failed, poll=0.01))
    assert time.monotonic() - t0 < 5  # not the connect's own (hour-long) wait


def test_a_connect_that_fails_says_why_the_vm_is_gone_or_its_own_reason() -> None:
    async def refused() -> AgentClient:
        raise MachineFailed("the agent did not answer within 1s")

    with pytest.raises(MachineFailed, match="its VM died"):
        asyncio.run(connect_watched(refused(), lambda: False, _failed))
    with pytest.raises(MachineFailed, match="did not answer"):
        asyncio.run(connect_watched(refused(), lambda: True, _failed))


def test_a_connect_that_succeeds_returns_its_client() -> None:
    client: Any = object()

    async def ok() -> AgentClient:
        await asyncio.sleep(0.05)
        return client  # type: ignore[no-any-return]

    assert asyncio.run(connect_watched(ok(), lambda: True, _failed, poll=0.01)) is client
