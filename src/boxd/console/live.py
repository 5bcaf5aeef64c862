"""The console's live streams, as server-sent events (``text/event-stream``).

`changes`: a page's data, looked at every `POLL_SECONDS`; each named part is sent as an
event of its name whenever it changed (the machines table, a machine's page). `tail`: a
process's output, its last bytes the node keeps and then each new bytes as they come
(`ProcessService.process_output` reads after an offset and waits a while for more); the
offset is each event's ``id``, so a browser that reconnects resumes where it was
(``Last-Event-ID``). Both end when the daemon stops (``stopping()``), and when the page
closes: Starlette cancels a streaming response whose client disconnected. Neither holds
more than one answer at a time: the memory is the node's tail, never per-reader buffers.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from boxd.errors import BoxdError
from boxd.services import ProcessService

__all__ = ["KEEPALIVE_SECONDS", "POLL_SECONDS", "changes", "event", "tail"]

#: Seconds between two looks at what a page shows.
POLL_SECONDS = 1.0
#: Seconds after which an idle stream sends a comment (proxies keep it open).
KEEPALIVE_SECONDS = 15.0
#: How long a browser waits before it reconnects a stream that ended (milliseconds).
RETRY = "retry: 2000\n\n"

Fetch = Callable[[], Awaitable[Mapping[str, Any] | None]]
"""The parts a page follows, by event name; None: what it follows is gone."""


def event(name: str, data: Any, event_id: int | None = None) -> str:
    """One server-sent event: ``data`` as JSON (one line: JSON escapes newlines)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {json.dumps(data, sort_keys=True)}\n\n"


async def changes(fetch: Fetch, stopping: Callable[[], bool],
                  poll: float | None = None) -> AsyncGenerator[str, None]:
    """Each part of ``fetch()`` as an event of its name when it changed, looked at every
    ``poll`` seconds (default `POLL_SECONDS`); ``gone`` (and the end) once ``fetch``
    answers None."""
    poll = POLL_SECONDS if poll is None else poll
    last: dict[str, str] = {}
    quiet = 0.0
    yield RETRY
    while not stopping():
        parts = await fetch()
        if parts is None:
            yield event("gone", None)
            return
        sent = False
        for name, value in parts.items():
            data = event(name, value)
            if last.get(name) != data:
                last[name] = data
                sent = True
                yield data
        if sent:
            quiet = 0.0
        elif quiet >= KEEPALIVE_SECONDS:
            quiet = 0.0
            yield ": keepalive\n\n"
        await asyncio.sleep(poll)
        quiet += poll


async def tail(processes: ProcessService, account: str, ref: str, process_id: str,
               after: int | None, stopping: Callable[[], bool],
               wait: float | None = None) -> AsyncGenerator[str, None]:
    """A process's output from offset ``after`` (None: all the node keeps): ``output``
    events (text; ``id`` the offset after it), ``gap`` when bytes were dropped before
    they were read, then ``end`` with its exit code once it exited and all is sent (or
    with the error that ended the stream: the machine or process is gone). Each read
    waits up to ``wait`` seconds (default `POLL_SECONDS`) for more."""
    wait = POLL_SECONDS if wait is None else wait
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace")
    quiet = 0.0
    yield RETRY
    while not stopping():
        try:
            out = await processes.process_output(account, ref, process_id, after, wait)
        except BoxdError as exc:
            yield event("end", {"error": exc.message})
            return
        if after is not None and out.start > after:
            decode.reset()  # a character cut in two by the gap is not completed
            yield event("gap", out.start - after)
        after = out.end
        text = decode.decode(out.data, final=out.state == "exited")
        if text:
            quiet = 0.0
            yield event("output", text, after)
        if out.state == "exited" and not out.data:
            yield event("end", {"exit_code": out.exit_code})
            return
        if not text and not out.data:
            quiet += wait
            if quiet >= KEEPALIVE_SECONDS:
                quiet = 0.0
                yield ": keepalive\n\n"
