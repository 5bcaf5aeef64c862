"""envd's Filesystem service as one small Python program run in the guest per call.

``stat``, ``list``, ``mkdir``, ``remove`` and ``move`` each run `GUEST_PROGRAM` with
the guest's python3 through boxd's exec; it prints one JSON line, the answer or
``{"error": {"code", "message"}}`` in Connect's codes. Entries are envd's
``EntryInfo`` in proto3 JSON (64-bit ``size`` as a string, times in RFC 3339).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from boxd import models
from boxd.e2b._connect import ConnectError
from boxd.services import MachineService

__all__ = ["GUEST_PROGRAM", "absolute", "fs_call"]

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

def walk(p, depth):
    out = []
    for name in sorted(os.listdir(p)):
        c = os.path.join(p, name)
        out.append(entry(c))
        if depth > 1 and os.path.isdir(c) and not os.path.islink(c):
            out.extend(walk(c, depth - 1))
    return out

def main(op, args):
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
        os.makedirs(p)
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
            os.makedirs(parent, exist_ok=True)
        os.rename(p, args[1])
        return {"entry": entry(args[1])}
    return {"error": {"code": "unimplemented", "message": op}}

try:
    out = main(sys.argv[1], sys.argv[2:])
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
                  *args: str) -> dict[str, Any]:
    """Run one filesystem operation in the sandbox; its JSON answer.

    Raises:
        ConnectError: the operation's own error (``not_found``, ``already_exists``, ...)
            or ``internal`` when the guest's answer cannot be read.
        BoxdError: the machine could not run it (the caller maps it).
    """
    result = await machines.exec(account, sandbox_id, models.ExecRequest(
        command=["python3", "-c", GUEST_PROGRAM, op, *args], timeout=120))
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
