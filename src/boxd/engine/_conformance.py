"""Proof, checked by ``mypy --strict``, that the engines (QEMU, gVisor, fake) satisfy
`boxd.engine.base`.

Never imported at run time: mypy reads it (it is in the checked tree) and fails if an
engine, its machine handle or its agent drifts from the protocols.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from boxd.engine.agent import AgentClient
    from boxd.engine.base import Agent, Engine, MachineHandle
    from boxd.engine.fake import FakeAgent, FakeEngine, FakeMachine
    from boxd.engine.gvisor import GvisorEngine, GvisorMachine
    from boxd.engine.qemu import QemuEngine, QemuMachine

    def _qemu(engine: QemuEngine, machine: QemuMachine, agent: AgentClient) -> None:
        _e: Engine = engine
        _m: MachineHandle = machine
        _a: Agent = agent

    def _fake(engine: FakeEngine, machine: FakeMachine, agent: FakeAgent) -> None:
        _e: Engine = engine
        _m: MachineHandle = machine
        _a: Agent = agent

    def _gvisor(engine: GvisorEngine, machine: GvisorMachine) -> None:
        _e: Engine = engine
        _m: MachineHandle = machine
