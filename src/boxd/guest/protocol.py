"""Wire constants of the boxd agent protocol, shared by the guest agent and the host client.

Stdlib only and dependency free: this file is copied into every guest next to ``agent.py``.
The protocol is documented in ``docs/agent-protocol.md``; bump ``PROTOCOL_MINOR`` for
backward-compatible additions and ``PROTOCOL_MAJOR`` for anything else.
"""

from __future__ import annotations

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 9
PROTOCOL_VERSION = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"

#: Name of the virtio-serial port (``-device virtserialport,name=...``).
PORT_NAME = "boxd.agent"

#: Messages are single JSON objects, UTF-8, one per line, ``\n`` terminated.
#: Binary payloads travel base64-encoded in ``data`` fields.
MAX_LINE = 64 * 1024 * 1024

#: Seconds between the SIGTERM an exec's process group gets at its timeout and the
#: SIGKILL that follows if the command has not exited by then.
EXEC_KILL_GRACE = 2.0
EXEC_CHUNK = 64 * 1024  # bytes read from a command's stdout/stderr at a time
FILE_CHUNK = 1024 * 1024  # bytes per file chunk, both directions
#: 1.3: a read or exec asking for flow control carries ``window``: the agent keeps at most
#: that many bytes of output sent and not yet acknowledged (``ack``), then waits.
DEFAULT_WINDOW = 8 * 1024 * 1024

DEFAULT_CWD = "/home/boxd"
#: Per-instance identity files (hostname, machine-id) live on tmpfs; the guest's init links
#: /etc/hostname and /etc/machine-id to them (1.1). Writing them costs no disk I/O, which
#: matters on a fork's critical path, and every start (boot, fork, restore) sets them anew.
IDENTITY_DIR = "/run/boxd"
#: The in-guest API (1.5): the socket a guest's ``Boxd()`` connects to and the machine's
#: credential, both under IDENTITY_DIR (tmpfs: never on the disk image).
API_SOCKET = "boxd.sock"
API_KEY_FILE = "key"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_ENV = {
    "PATH": DEFAULT_PATH,
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm-256color",
    "USER": "root",
}

# Operations (host -> agent, field "op").
OP_HELLO = "hello"
OP_PING = "ping"
OP_EXEC = "exec"
OP_STDIN = "stdin"
OP_KILL = "kill"
OP_WRITE = "write"
OP_READ = "read"
OP_STAT = "stat"
OP_IDENTITY = "identity"
OP_ATTACH = "attach"  # 1.2: follow a running exec again on this connection
OP_SYNC = "sync"  # 1.1: flush the guest page cache to disk (in the agent, no process)
OP_ACK = "ack"  # 1.3: the host consumed N bytes of a read's or exec's output (flow control)
OP_CANCEL = "cancel"  # 1.3: stop a read (the host no longer wants it)
OP_RELAY_LISTEN = "relay_listen"  # 1.5: serve the in-guest API socket, with a new key
OP_RELAY_SEND = "relay_send"  # 1.5: bytes for one relayed stream (no reply)
OP_RESIZE = "resize"  # 1.7: a new terminal size for an exec started with "pty"
OP_METRICS = "metrics"  # 1.8: the guest's CPU counters, memory and root disk use

# Events (agent -> host, field "ev"). RESULT and ERROR end a request.
EV_STARTED = "started"  # exec: the process is running (pid)
EV_STDOUT = "stdout"
EV_STDERR = "stderr"
EV_DATA = "data"  # read: one chunk of the file
EV_RESULT = "result"
EV_RELAY_OPEN = "relay_open"  # 1.5: a guest process connected to the API socket
EV_RELAY_DATA = "relay_data"  # 1.5: bytes it sent
EV_RELAY_EOF = "relay_eof"  # 1.5: it shut down its sending side (or went away)
EV_ERROR = "error"
TERMINAL_EVENTS = frozenset({EV_RESULT, EV_ERROR})

# Error codes (field "code" of an error event). File errors use errno names.
ERR_NOT_FOUND = "ENOENT"
ERR_IS_DIR = "EISDIR"
ERR_NOT_DIR = "ENOTDIR"
ERR_ACCESS = "EACCES"
ERR_PERM = "EPERM"
ERR_INVALID = "EINVAL"  # malformed request
ERR_UNKNOWN_OP = "EOPNOTSUPP"
ERR_VERSION = "EVERSION"  # major protocol version mismatch
ERR_NO_EXEC = "ESRCH"  # stdin/kill for an exec id the agent does not know (or that finished)
ERR_INTERNAL = "EINTERNAL"  # a bug in the agent; its stderr has the traceback
