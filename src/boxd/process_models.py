"""Wire schemas of machine processes (``machines.spawn``): shared by daemon and SDKs.

A separate module from `boxd.models` so the process routes can grow without touching
the machine schemas. A process is a long-lived command in a machine whose stdin and
stdout carry *frames* (whole messages, each a 4-byte big-endian length and its bytes
on the process's side); the host side sees one message per frame, over a WebSocket.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class SpawnRequest(BaseModel):
    argv: list[str] = Field(..., min_length=1, description="the command as an argv list")
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None


class Process(BaseModel):
    """A process started with ``machines.spawn``."""

    id: str = Field(..., description="stable across forks: a fork child's copy has the same id")
    machine: str = Field(..., description="id of the machine it runs in")
    argv: list[str]
    state: str = Field(..., description="'running', 'detached' (its stream must be re-attached)"
                       " or 'exited'")
    attached: bool = Field(False, description="a client is connected to its stream")
    exit_code: int | None = None
    signal: int | None = None
    started_at: float
    stderr_tail: str = Field("", description="the last few KiB of its stderr")


class ProcessList(BaseModel):
    processes: list[Process]


class ProcessKill(BaseModel):
    signal: int = Field(9, ge=1, le=64)


__all__ = ["Process", "ProcessKill", "ProcessList", "SpawnRequest"]
