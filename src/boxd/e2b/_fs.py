"""envd's Filesystem service as one small Python program run in the guest per call.

Watching (``WatchDir``, ``CreateWatcher``) runs `WATCH_PROGRAM` in the guest for as long
as the watcher lives: it lists the directory every `WATCH_INTERVAL` seconds and prints
the differences. Polling, not inotify: boxd's guest agent has no inotify, a listing
works alike on every engine and file system (and on a forked or restored sandbox),
and it costs one exec per watcher, not one per poll.

``stat``, ``list``, ``mkdir``, ``remove`` and ``move`` each run `GUEST_PROGRAM` with
the guest's python3 through boxd's exec; it prints one JSON line, the answer or
``{"error": {"code", "message"}}`` in Connect's codes. Entries are envd's
``EntryInfo`` in proto3 JSON (64-bit ``size`` as a string, times in RFC 3339).

The program runs as root, as envd does, whoever the call is for: the call's user
(`boxd.e2b._users`) owns the directories ``mkdir`` and ``move`` make (envd's
``EnsureDirs``), and a name the guest lacks is ``unauthenticated``, as envd answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import posixpath
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from boxd import models
from boxd.e2b._connect import ConnectError
from boxd.errors import BoxdError
from boxd.services import MachineService

__all__ = ["GUEST_PROGRAM", "WATCH_PROGRAM", "Watcher", "Watchers", "absolute", "fs_call"]

GUEST_PROGRAM = r'''
import datetime, grp, json, os, pwd, shutil, stat, sys

def owner(uid, names, by):
    try:
        return getattr(by(uid), names)
    except KeyError:
        return str(uid)

def entry(p):
    st = os.lstat(p)
    link = stat.S_ISLNK(st.st_mode)
    real = st
    if link:
        try:
            real = os.stat(p)
        except OSError:
            pass
    kind = "FILE_TYPE_DIRECTORY" if stat.S_ISDIR(real.st_mode) else "FILE_TYPE_FILE"
    t = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc)
    e = {"name": os.path.basename(p) or p, "type": kind, "path": p, "size": str(st.st_size),
         "mode": stat.S_IMODE(st.st_mode), "permissions": stat.filemode(st.st_mode),
         "owner": owner(st.st_uid, "pw_name", pwd.getpwuid),
         "group": owner(st.st_gid, "gr_name", grp.getgrgid),
         "modifiedTime": t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
    if link:
        e["symlinkTarget"] = os.path.realpath(p)
        e["isSymlink"] = True
    return e

class UnknownUser(Exception):
    pass

def owner_ids(name):
    if not name:
        return None
    try:
        e = pwd.getpwnam(name)
    except KeyError:
        raise UnknownUser(name)
    return e.pw_uid, e.pw_gid

def ensure_dirs(p, ids):
    missing = []
    while not os.path.exists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        os.mkdir(d, 0o755)
        if ids:
            os.chown(d, *ids)

def walk(p, depth):
    out = []
    for name in sorted(os.listdir(p)):
        c = os.path.join(p, name)
        out.append(entry(c))
        if depth > 1 and os.path.isdir(c) and not os.path.islink(c):
            out.extend(walk(c, depth - 1))
    return out

def main(op, user, args):
    ids = owner_ids(user)
    p = args[0]
    if op == "stat":
        return {"entry": entry(p)}
    if op == "list":
        if not os.path.isdir(p):
            raise NotADirectoryError(20, "not a directory", p)
        return {"entries": walk(p, max(int(args[1]), 1))}
    if op == "mkdir":
        if os.path.lexists(p):
            return {"error": {"code": "already_exists", "message": "%s already exists" % p}}
        ensure_dirs(p, ids)
        return {"entry": entry(p)}
    if op == "remove":
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)
        return {}
    if op == "move":
        parent = os.path.dirname(args[1])
        if parent:
            ensure_dirs(parent, ids)
        os.rename(p, args[1])
        return {"entry": entry(args[1])}
    return {"error": {"code": "unimplemented", "message": op}}

try:
    out = main(sys.argv[1], sys.argv[2], sys.argv[3:])
except UnknownUser as e:
    out = {"error": {"code": "unauthenticated", "message": "invalid username: '%s'" % e.args[0]}}
except FileNotFoundError as e:
    out = {"error": {"code": "not_found", "message": "%s: no such file or directory" % e.filename}}
except FileExistsError as e:
    out = {"error": {"code": "already_exists", "message": "%s already exists" % e.filename}}
except PermissionError as e:
    out = {"error": {"code": "permission_denied", "message": "%s: permission denied" % e.filename}}
except OSError as e:
    out = {"error": {"code": "invalid_argument", "message": "%s: %s" % (e.filename, e.strerror)}}
print(json.dumps(out))
'''

#: What a command's or a path's relative form is relative to (E2B's user home).
HOME = "/home/user"


def absolute(path: object, field: str = "path") -> str:
    """A guest path made absolute (relative to `HOME`), as envd resolves it.

    Raises:
        ConnectError: ``invalid_argument`` for an empty path, a non-string or a NUL byte.
    """
    if not isinstance(path, str) or not path or "\0" in path:
        raise ConnectError("invalid_argument", f"{field} must be a non-empty path without "
                           "NUL bytes")
    return posixpath.normpath(posixpath.join(HOME, path))


async def fs_call(machines: MachineService, account: str, sandbox_id: str, op: str,
                  *args: str, user: str | None = None) -> dict[str, Any]:
    """Run one filesystem operation in the sandbox for ``user`` (None: root), who owns
    the directories it makes; its JSON answer.

    Raises:
        ConnectError: the operation's own error (``not_found``, ``already_exists``,
            ``unauthenticated`` for a user the guest lacks, ...) or ``internal`` when the
            guest's answer cannot be read.
        BoxdError: the machine could not run it (the caller maps it).
    """
    result = await machines.exec(account, sandbox_id, models.ExecRequest(
        command=["python3", "-c", GUEST_PROGRAM, op, user or "", *args], timeout=120))
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise ConnectError("internal", f"filesystem {op} failed in the sandbox: "
                           f"{result.stderr.strip()[-500:] or 'no answer'}") from exc
    if not isinstance(answer, dict):
        raise ConnectError("internal", f"filesystem {op}: unexpected answer")
    error = answer.get("error")
    if isinstance(error, dict):
        raise ConnectError(str(error.get("code", "internal")), str(error.get("message", "")))
    return answer


# -- WatchDir and the watchers -----------------------------------------------------------

#: The watch program: lists the directory (stat of each entry) every ``interval``
#: seconds in the guest and prints one JSON line per change, after a first
#: ``{"start": true}`` (or one ``{"error": ...}``). At most ``MAX_WATCHED`` entries are
#: looked at, so its memory stays bounded whatever the directory holds.
WATCH_PROGRAM = r'''
import json, os, pwd, stat, sys, time
root, recursive = sys.argv[1], sys.argv[2] == "1"
interval, limit, user = float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

def snap():
    out, todo = {}, [""]
    while todo and len(out) < limit:
        rel = todo.pop()
        try:
            it = list(os.scandir(os.path.join(root, rel)))
        except OSError:
            continue
        for e in it:
            if len(out) >= limit:
                break
            name = os.path.join(rel, e.name) if rel else e.name
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            out[name] = (st.st_mtime_ns, st.st_size, stat.S_IMODE(st.st_mode))
            if recursive and stat.S_ISDIR(st.st_mode):
                todo.append(name)
    return out

def say(msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()

if user:
    try:
        pwd.getpwnam(user)
    except KeyError:
        say({"error": {"code": "unauthenticated", "message": "invalid username: '%s'" % user}})
        sys.exit(0)
if not os.path.isdir(root):
    code = "not_found" if not os.path.exists(root) else "invalid_argument"
    say({"error": {"code": code, "message": "%s is not a directory" % root}})
    sys.exit(0)
before = snap()
say({"start": True})
while True:
    time.sleep(interval)
    now = snap()
    for name in sorted(now.keys() - before.keys()):
        say({"name": name, "type": "EVENT_TYPE_CREATE"})
    for name in sorted(before.keys() - now.keys()):
        say({"name": name, "type": "EVENT_TYPE_REMOVE"})
    for name in sorted(now.keys() & before.keys()):
        old, new = before[name], now[name]
        if old[:2] != new[:2]:
            say({"name": name, "type": "EVENT_TYPE_WRITE"})
        elif old[2] != new[2]:
            say({"name": name, "type": "EVENT_TYPE_CHMOD"})
    before = now
'''
#: Seconds between two listings of a watched directory.
WATCH_INTERVAL = 0.5
#: Entries of a watched tree the program looks at (the rest are not watched).
MAX_WATCHED = 20000
#: Events a watcher keeps for `GetWatcherEvents` (the oldest are dropped past it).
MAX_KEPT_EVENTS = 4096
#: Watchers (streams and ``CreateWatcher`` ones) one sandbox may have.
MAX_WATCHERS = 32


class Watcher:
    """One watched directory: the watch program's exec and the events it printed."""

    def __init__(self, watcher_id: str, sandbox_id: str) -> None:
        self.id = watcher_id
        self.sandbox_id = sandbox_id
        self.kept: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=MAX_KEPT_EVENTS)
        self.changed = asyncio.Event()
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None
        self.ended = False

    def take(self) -> list[dict[str, Any]]:
        """The events kept since the last call."""
        out = list(self.kept)
        self.kept.clear()
        self.changed.clear()
        return out

    async def run(self, events: AsyncIterator[models.ExecEvent]) -> None:
        line = ""
        try:
            async for ev in events:
                if ev.type != "stdout" or not ev.data:
                    continue
                line += ev.data
                *whole, line = line.split("\n")
                for text in whole:
                    self._line(text)
                if len(line) > 1 << 16:  # no event line is this long: not the program's
                    line = ""
            self._fail(ConnectError("internal", "the watch program ended"))
        except BoxdError as exc:
            self._fail(ConnectError("unavailable", f"watching stopped: {exc.message}"))
        finally:
            self.ended = True
            self.changed.set()
            await cast("AsyncGenerator[object, None]", events).aclose()

    def _line(self, text: str) -> None:
        try:
            msg = json.loads(text)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        if msg.get("start") is True and not self.started.done():
            self.started.set_result(None)
        elif isinstance(msg.get("error"), dict):
            err = msg["error"]
            self._fail(ConnectError(str(err.get("code", "internal")),
                                    str(err.get("message", ""))))
        elif isinstance(msg.get("name"), str) and isinstance(msg.get("type"), str):
            self.kept.append({"name": msg["name"], "type": msg["type"]})
            self.changed.set()

    def _fail(self, exc: ConnectError) -> None:
        if not self.started.done():
            self.started.set_exception(exc)


class Watchers:
    """The watchers of every sandbox, by id."""

    def __init__(self) -> None:
        self._all: dict[str, Watcher] = {}

    async def create(self, machines: MachineService, account: str, sandbox_id: str,
                     path: str, recursive: bool, user: str | None = None) -> Watcher:
        """Start watching ``path`` (as root, as envd does; ``user``, the one the call
        names, must exist); returns once the first listing is taken.

        Raises:
            ConnectError: ``not_found`` / ``invalid_argument`` (no such directory),
                ``resource_exhausted`` (too many watchers), ``unauthenticated`` (no such
                user).
            BoxdError: the machine could not run it.
        """
        if sum(w.sandbox_id == sandbox_id for w in self._all.values()) >= MAX_WATCHERS:
            raise ConnectError("resource_exhausted", f"sandbox {sandbox_id} has "
                               f"{MAX_WATCHERS} watchers: remove some first")
        watcher = Watcher(secrets.token_hex(8), sandbox_id)
        req = models.ExecRequest(command=[
            "python3", "-c", WATCH_PROGRAM, path, "1" if recursive else "0",
            str(WATCH_INTERVAL), str(MAX_WATCHED), user or ""], timeout=None)
        watcher.task = asyncio.create_task(
            watcher.run(machines.exec_stream(account, sandbox_id, req)))
        self._all[watcher.id] = watcher
        # A watcher whose program ended (its sandbox was killed) leaves the table; its
        # client's next call is answered not_found, and a stream ends with an error.
        watcher.task.add_done_callback(lambda _: self._all.pop(watcher.id, None))
        try:
            await watcher.started
        except BaseException:
            await self.remove(sandbox_id, watcher.id)
            raise
        return watcher

    def get(self, sandbox_id: str, watcher_id: object) -> Watcher:
        """Raises: ConnectError ``not_found``."""
        watcher = self._all.get(watcher_id) if isinstance(watcher_id, str) else None
        if watcher is None or watcher.sandbox_id != sandbox_id:
            raise ConnectError("not_found", f"watcher {watcher_id!r} not found")
        return watcher

    async def remove(self, sandbox_id: str, watcher_id: object) -> None:
        """Stop a watcher (its program ends with its exec stream).

        Raises: ConnectError ``not_found``."""
        watcher = self.get(sandbox_id, watcher_id)
        self._all.pop(watcher.id, None)
        if watcher.task is not None:
            watcher.task.cancel()
            with contextlib.suppress(BaseException):
                await watcher.task
