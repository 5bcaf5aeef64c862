"""Wire schemas of machine processes (``machines.spawn``): shared by daemon and SDKs.

A separate module from `boxd.models` so the process routes can grow without touching
the machine schemas. A process is a long-lived command in a machine whose stdin and
stdout carry *frames* (whole messages, each a 4-byte big-endian length and its bytes
on the process's side); the host side sees one message per frame, over a WebSocket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from boxd.models import (
    MAX_ARG_BYTES,
    MAX_ARGV_ITEMS,
    MAX_EXEC_BYTES,
    USER_DESCRIPTION,
    Argv,
    ExecEnv,
    GuestCwd,
    GuestUser,
    check_argv,
    check_argv_items,
    check_env,
)


class SpawnRequest(BaseModel):
    """Checked as `boxd.models.ExecRequest` is: a bad request is a 400 naming the field."""

    argv: Argv = Field(
        ..., description=f"the command as an argv list; no NUL bytes; at most {MAX_ARGV_ITEMS} "
        f"items of {MAX_ARG_BYTES} bytes each, {MAX_EXEC_BYTES} bytes with env")
    env: ExecEnv = Field(
        default_factory=dict,
        description="variables set for the command; names without '=', no NUL bytes")
    cwd: GuestCwd | None = Field(default=None,
                                 description="absolute path of its working directory")
    user: GuestUser | None = Field(default=None, description=USER_DESCRIPTION)

    @field_validator("argv", mode="before")
    @classmethod
    def _argv_items(cls, argv: object) -> object:
        return check_argv_items(argv)

    @field_validator("argv")
    @classmethod
    def _argv(cls, argv: list[str]) -> list[str]:
        check_argv(argv)
        return argv

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        return check_env(env, info.data.get("argv"))


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
    reason: str | None = Field(
        default=None, description="why it exited or is detached, when the node knows: e.g. killed "
        "for output nobody read past the node's bound, or its agent connection lost")


class ProcessOutput(BaseModel):
    """A process's stderr after an offset (`ProcessService.process_output`: the web
    console's live tail; not on the HTTP API). Offsets count bytes since it started; the
    node keeps the last 64 KiB."""

    start: int = Field(..., description="the offset of data's first byte: past the one "
                       "asked for when the bytes between were dropped")
    end: int = Field(..., description="the offset after data: where the next read starts")
    data: bytes
    state: str = Field(..., description="the process's state ('exited': no more will come)")
    exit_code: int | None = None


class ProcessList(BaseModel):
    processes: list[Process]


class ProcessKill(BaseModel):
    signal: int = Field(9, ge=1, le=64)


@dataclass(frozen=True)
class ExecInput:
    """One item for an interactive exec (`MachineService.exec_interactive`): bytes for
    its stdin, its stdin's end (``eof``), or a new terminal ``size`` (rows, cols) for a
    command on a pty. Not on the HTTP API: the E2B front door sends these."""

    data: bytes = b""
    eof: bool = False
    size: tuple[int, int] | None = None


@dataclass(frozen=True)
class ExecBytes:
    """Output of an interactive exec, as the command wrote it (a pty's is ``stdout``)."""

    stream: Literal["stdout", "stderr"]
    data: bytes


__all__ = [
    "ExecBytes", "ExecInput", "Process", "ProcessKill", "ProcessList", "ProcessOutput",
    "SpawnRequest",
]
