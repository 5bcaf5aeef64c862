"""The in-machine env server of boxd.rl, and the wire format both sides speak.

This one file is uploaded into a machine and run there with the machine's own
``python3``; the host imports the same file for the codec. So it imports only the
standard library, numpy, gymnasium and cloudpickle, never ``boxd`` (like
``boxd/guest/agent.py``).

Framing: each message is a 4-byte big-endian length and that many bytes, on the
server's stdin (requests) and on a private copy of its stdout (replies). The server
points file descriptor 1 at stderr before it builds anything, so an env that prints
cannot corrupt the stream.

Codec: a small tagged binary format that keeps what Gymnasium's checks compare --
container types (tuple stays tuple, list stays list, dict keys and order), numpy
dtypes and shapes (float32 stays float32, ``np.bool_`` stays ``np.bool_``) and Python
scalars (a Python ``bool`` stays ``bool``). Data from the machine is never unpickled
on the host: a machine is a sandbox, and unpickling its bytes would run its code in
the training process. Host to machine, the env factory travels as cloudpickle bytes
(the machine trusts the host anyway). Spaces are encoded structurally, once, when the
env is built.

Requests are tuples ``(op, *args)``; replies are ``("ok", value)`` or ``("err", kind,
message, details)``.
"""

from __future__ import annotations

import os
import struct
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO

PROTOCOL = 1
# A frame larger than this is a bug (or a hostile peer). The node kills a process whose
# frame header claims more than its 64 MiB per-process bound (boxd.node._processes), so
# an env refuses such a frame itself first, with a message, on both ends.
MAX_FRAME = 64 << 20

_LEN = struct.Struct(">I")
_Q = struct.Struct(">Q")
_q = struct.Struct(">q")
_d = struct.Struct(">d")

try:  # numpy is optional for the codec itself (the host may encode plain Python)
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with gymnasium
    np = None  # type: ignore[assignment]


class WireError(ValueError):
    """A value the codec cannot carry, or bytes that are not a valid message."""


# ---------------------------------------------------------------------- codec


def encode(value: Any) -> bytes:
    """Encode ``value`` (None, bool, int, float, str, bytes, tuple, list, dict, numpy
    arrays and scalars).

    Raises:
        WireError: the value (or something inside it) has another type; the message
            names where it is.
    """
    out: list[bytes] = []
    _enc(value, out, "value")
    return b"".join(out)


def _enc(v: Any, out: list[bytes], where: str) -> None:
    """Append ``v``'s encoding to ``out``; ``where`` names it in error messages."""
    _ENCODERS.get(type(v), _enc_by_base)(v, out, where)


def _enc_none(v: None, out: list[bytes], where: str) -> None:
    out.append(b"N")


def _enc_bool(v: bool, out: list[bytes], where: str) -> None:
    out.append(b"T" if v else b"F")


def _enc_int(v: int, out: list[bytes], where: str) -> None:
    if -(1 << 63) <= v < (1 << 63):
        out.append(b"i" + _q.pack(v))
    else:  # beyond int64: its decimal digits
        s = str(v).encode()
        out.append(b"I" + _LEN.pack(len(s)) + s)


def _enc_float(v: float, out: list[bytes], where: str) -> None:
    out.append(b"f" + _d.pack(v))


def _enc_str(v: str, out: list[bytes], where: str) -> None:
    s = v.encode("utf-8", "surrogatepass")
    out.append(b"s" + _LEN.pack(len(s)) + s)


def _enc_bytes(v: bytes | bytearray, out: list[bytes], where: str) -> None:
    out.append(b"b" + _LEN.pack(len(v)) + bytes(v))


def _enc_tuple(v: tuple[Any, ...], out: list[bytes], where: str) -> None:
    out.append(b"t" + _LEN.pack(len(v)))
    for i, item in enumerate(v):
        _enc(item, out, f"{where}[{i}]")


def _enc_list(v: list[Any], out: list[bytes], where: str) -> None:
    out.append(b"l" + _LEN.pack(len(v)))
    for i, item in enumerate(v):
        _enc(item, out, f"{where}[{i}]")


def _enc_dict(v: dict[Any, Any], out: list[bytes], where: str) -> None:
    out.append(b"d" + _LEN.pack(len(v)))
    for k, item in v.items():
        _enc(k, out, f"{where} key {k!r}")
        _enc(item, out, f"{where}[{k!r}]")


def _enc_array(a: Any, out: list[bytes], where: str) -> None:
    dt = a.dtype
    if dt.hasobject or dt.fields is not None:
        raise WireError(f"{where}: numpy array of dtype {dt} cannot be sent")
    ds = dt.str.encode()
    raw = np.ascontiguousarray(a).tobytes()
    out.append(b"a" + bytes([len(ds)]) + ds + bytes([a.ndim]))
    out.append(b"".join(_Q.pack(n) for n in a.shape))
    out.append(_Q.pack(len(raw)) + raw)


def _enc_numpy_scalar(v: Any, out: list[bytes], where: str) -> None:
    dt = v.dtype
    if dt.hasobject or dt.fields is not None:
        raise WireError(f"{where}: numpy scalar of dtype {dt} cannot be sent")
    ds = dt.str.encode()
    raw = v.tobytes()
    out.append(b"g" + bytes([len(ds)]) + ds + _LEN.pack(len(raw)) + raw)


#: The Python types whose subclasses travel as the type itself (a NamedTuple as a
#: tuple, an OrderedDict or defaultdict as a dict, an IntEnum or IntFlag as an int...),
#: in the order they are tried.
_BASES: tuple[type, ...] = (tuple, list, dict, int, float, str, bytes)


def _enc_by_base(v: Any, out: list[bytes], where: str) -> None:
    """Encode a value whose exact type `_ENCODERS` lacks: a numpy scalar, an instance
    of an ndarray subclass, or of a subclass of one of `_BASES` (converted to it first).

    Raises:
        WireError: any other type.
    """
    if np is not None and isinstance(v, np.ndarray):
        _enc_array(v, out, where)
    elif np is not None and isinstance(v, np.generic):
        _enc_numpy_scalar(v, out, where)
    else:
        base = next((b for b in _BASES if isinstance(v, b)), None)
        if base is None:
            t = type(v)
            raise WireError(
                f"{where} is a {t.__module__}.{t.__qualname__}, which boxd.rl cannot send "
                "between the machine and the host (supported: None, bool, int, float, "
                "str, bytes, tuple, list, dict, numpy arrays and scalars)"
            )
        _enc(base(v), out, where)


#: The encoder of each type the codec carries as it is, by exact type (a dict lookup,
#: on the step path; anything else goes through `_enc_by_base`).
_ENCODERS: dict[type, Callable[[Any, list[bytes], str], None]] = {
    type(None): _enc_none, bool: _enc_bool, int: _enc_int, float: _enc_float,
    str: _enc_str, bytes: _enc_bytes, bytearray: _enc_bytes,
    tuple: _enc_tuple, list: _enc_list, dict: _enc_dict,
}
if np is not None:
    _ENCODERS[np.ndarray] = _enc_array


def decode(data: bytes) -> Any:
    """Decode bytes made by `encode`.

    Raises:
        WireError: the bytes are truncated or malformed.
    """
    try:
        value, pos = _dec(memoryview(data), 0)
    except WireError:
        raise
    except (IndexError, struct.error, UnicodeDecodeError, TypeError, ValueError) as exc:
        # ValueError: a big int's digits, an array's dtype or size that do not parse
        raise WireError(f"malformed message: {exc}") from exc
    if pos != len(data):
        raise WireError(f"malformed message: {len(data) - pos} trailing bytes")
    return value


def _dec(m: memoryview, p: int) -> tuple[Any, int]:
    """The value encoded at ``m[p:]``, and the position after it."""
    dec = _DECODERS.get(m[p])
    if dec is None:
        raise WireError(f"malformed message: unknown tag {m[p]:#x}")
    return dec(m, p + 1)


def _dec_none(m: memoryview, p: int) -> tuple[None, int]:
    return None, p


def _dec_true(m: memoryview, p: int) -> tuple[bool, int]:
    return True, p


def _dec_false(m: memoryview, p: int) -> tuple[bool, int]:
    return False, p


def _dec_int(m: memoryview, p: int) -> tuple[int, int]:
    return _q.unpack_from(m, p)[0], p + 8


def _dec_float(m: memoryview, p: int) -> tuple[float, int]:
    return _d.unpack_from(m, p)[0], p + 8


def _dec_bytes(m: memoryview, p: int) -> tuple[bytes, int]:
    (n,) = _LEN.unpack_from(m, p)
    p += 4
    raw = bytes(m[p : p + n])
    if len(raw) != n:
        raise WireError("malformed message: truncated")
    return raw, p + n


def _dec_str(m: memoryview, p: int) -> tuple[str, int]:
    raw, p = _dec_bytes(m, p)
    return raw.decode("utf-8", "surrogatepass"), p


def _dec_big_int(m: memoryview, p: int) -> tuple[int, int]:
    raw, p = _dec_bytes(m, p)
    return int(raw.decode("utf-8", "surrogatepass")), p


def _dec_list(m: memoryview, p: int) -> tuple[list[Any], int]:
    (n,) = _LEN.unpack_from(m, p)
    p += 4
    items = []
    for _ in range(n):
        item, p = _dec(m, p)
        items.append(item)
    return items, p


def _dec_tuple(m: memoryview, p: int) -> tuple[tuple[Any, ...], int]:
    items, p = _dec_list(m, p)
    return tuple(items), p


def _dec_dict(m: memoryview, p: int) -> tuple[dict[Any, Any], int]:
    (n,) = _LEN.unpack_from(m, p)
    p += 4
    d: dict[Any, Any] = {}
    for _ in range(n):
        k, p = _dec(m, p)
        v, p = _dec(m, p)
        d[k] = v
    return d, p


def _dec_dtype(m: memoryview, p: int) -> tuple[Any, int]:
    dlen = m[p]
    text = bytes(m[p + 1 : p + 1 + dlen]).decode()
    try:
        dtype = np.dtype(text)
    except Exception as exc:  # numpy's parser raises TypeError, ValueError, SyntaxError
        raise WireError(f"malformed message: dtype {text!r} ({exc})") from None
    return dtype, p + 1 + dlen


def _dec_array(m: memoryview, p: int) -> tuple[Any, int]:
    dt, p = _dec_dtype(m, p)
    ndim = m[p]
    p += 1
    shape = tuple(_Q.unpack_from(m, p + 8 * i)[0] for i in range(ndim))
    p += 8 * ndim
    (n,) = _Q.unpack_from(m, p)
    p += 8
    if p + n > len(m):
        raise WireError("malformed message: truncated array")
    arr = np.frombuffer(m[p : p + n], dtype=dt).reshape(shape).copy()
    return arr, p + n


def _dec_numpy_scalar(m: memoryview, p: int) -> tuple[Any, int]:
    dt, p = _dec_dtype(m, p)
    (n,) = _LEN.unpack_from(m, p)
    p += 4
    return np.frombuffer(m[p : p + n], dtype=dt)[0], p + n


#: The decoder of each tag byte (the encoders above write them).
_DECODERS: dict[int, Callable[[memoryview, int], tuple[Any, int]]] = {
    ord("N"): _dec_none, ord("T"): _dec_true, ord("F"): _dec_false,
    ord("i"): _dec_int, ord("I"): _dec_big_int, ord("f"): _dec_float,
    ord("s"): _dec_str, ord("b"): _dec_bytes,
    ord("t"): _dec_tuple, ord("l"): _dec_list, ord("d"): _dec_dict,
    ord("a"): _dec_array, ord("g"): _dec_numpy_scalar,
}


# ---------------------------------------------------------------------- spaces


def space_to_wire(space: Any) -> Any:
    """A Gymnasium space as plain data (no pickle).

    Raises:
        WireError: a space type boxd.rl does not carry (the message names it).
    """
    from gymnasium import spaces as S

    if isinstance(space, S.Box):
        return ("Box", space.low, space.high, tuple(space.shape), space.dtype.str)
    if isinstance(space, S.Discrete):
        return ("Discrete", int(space.n), int(space.start), space.dtype.str)
    if isinstance(space, S.MultiDiscrete):
        return ("MultiDiscrete", space.nvec, space.start, space.dtype.str)
    if isinstance(space, S.MultiBinary):
        n = space.n
        return ("MultiBinary", tuple(n) if not isinstance(n, int) else int(n))
    if isinstance(space, S.Tuple):
        return ("Tuple", tuple(space_to_wire(s) for s in space.spaces))
    if isinstance(space, S.Dict):
        return ("Dict", {k: space_to_wire(s) for k, s in space.spaces.items()})
    if isinstance(space, S.Text):
        return ("Text", int(space.min_length), int(space.max_length),
                "".join(sorted(space.character_set)))
    raise WireError(
        f"boxd.rl cannot carry a {type(space).__name__} space yet "
        "(supported: Box, Discrete, MultiDiscrete, MultiBinary, Tuple, Dict, Text)"
    )


def space_from_wire(w: Any) -> Any:
    """Rebuild a space made by `space_to_wire`."""
    from gymnasium import spaces as S

    kind = w[0]
    if kind == "Box":
        _, low, high, shape, dt = w
        return S.Box(low=low, high=high, shape=shape, dtype=np.dtype(dt))
    if kind == "Discrete":
        return S.Discrete(w[1], start=w[2], dtype=np.dtype(w[3]))
    if kind == "MultiDiscrete":
        return S.MultiDiscrete(w[1], start=w[2], dtype=np.dtype(w[3]))
    if kind == "MultiBinary":
        return S.MultiBinary(w[1] if isinstance(w[1], int) else list(w[1]))
    if kind == "Tuple":
        return S.Tuple(tuple(space_from_wire(s) for s in w[1]))
    if kind == "Dict":
        return S.Dict({k: space_from_wire(s) for k, s in w[1].items()})
    if kind == "Text":
        return S.Text(w[2], min_length=w[1], charset=w[3])
    raise WireError(f"unknown space kind {kind!r}")


def _plain(value: Any) -> Any:
    """``value`` if the codec can carry it, else its repr (for metadata, not for data)."""
    try:
        encode(value)
        return value
    except WireError:
        if isinstance(value, dict):
            return {k: _plain(v) for k, v in value.items() if _encodable(k)}
        return repr(value)


def _encodable(value: Any) -> bool:
    try:
        encode(value)
    except WireError:
        return False
    return True


# ---------------------------------------------------------------------- framing


def read_frame(stream: BinaryIO) -> bytes | None:
    """One frame, or None at a clean end of stream.

    Raises:
        WireError: the stream ended inside a frame or announced an oversized one.
    """
    head = stream.read(4)
    if not head:
        return None
    if len(head) < 4:
        raise WireError("stream ended inside a frame header")
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    body = stream.read(n)
    if len(body) != n:
        raise WireError("stream ended inside a frame")
    return body


def frame(payload: bytes) -> bytes:
    """``payload`` with its length header."""
    return _LEN.pack(len(payload)) + payload


# ---------------------------------------------------------------------- the server


class _Server:
    def __init__(self) -> None:
        self.env: Any = None

    def make(self, kind: str, payload: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        import gymnasium as gym

        if self.env is not None:
            self.env.close()
        if kind == "id":
            env = gym.make(payload, **kwargs)
        elif kind == "ref":
            import importlib

            mod, _, name = payload.partition(":")
            env = getattr(importlib.import_module(mod), name)(**kwargs)
        else:
            import cloudpickle

            factory: Callable[..., Any] = cloudpickle.loads(payload)
            env = factory(**kwargs) if kwargs else factory()
        self.env = env
        spec = getattr(env, "spec", None)
        return {
            "protocol": PROTOCOL,
            "observation_space": space_to_wire(env.observation_space),
            "action_space": space_to_wire(env.action_space),
            "metadata": _plain(dict(getattr(env, "metadata", {}) or {})),
            "render_mode": getattr(env, "render_mode", None),
            "spec_id": getattr(spec, "id", None),
            "max_episode_steps": getattr(spec, "max_episode_steps", None),
            "pid": os.getpid(),
        }

    def _need_env(self) -> Any:
        if self.env is None:
            raise RuntimeError("no env has been built in this server yet (send 'make' first)")
        return self.env

    def reset(self, seed: Any, options: Any) -> Any:
        obs, info = self._need_env().reset(seed=seed, options=options)
        return (obs, info)

    def step(self, action: Any, autoreset: Any) -> Any:
        """One step; with ``autoreset`` (``(seed, options)``) a finished episode is
        reset in the same round trip (Gymnasium's SAME_STEP mode)."""
        env = self._need_env()
        obs, reward, terminated, truncated, info = env.step(action)
        if autoreset is not None and (terminated or truncated):
            seed, options = autoreset
            final = (obs, info)
            obs, info = env.reset(seed=seed, options=options)
            return (obs, reward, terminated, truncated, info, final)
        return (obs, reward, terminated, truncated, info, None)

    def call(self, name: str, args: Any, kwargs: Any) -> Any:
        attr = self._need_env().get_wrapper_attr(name)
        return attr(*args, **kwargs) if callable(attr) else attr

    def get_attr(self, name: str) -> Any:
        return self._need_env().get_wrapper_attr(name)

    def set_attr(self, name: str, value: Any) -> None:
        self._need_env().set_wrapper_attr(name, value)

    def has_wrapper(self, qualname: str) -> bool:
        """SB3's ``env_is_wrapped``: is a wrapper of this class (``module.QualName``, or
        a subclass of it) around the env? The env itself does not count."""
        import gymnasium as gym

        env = self._need_env()
        while isinstance(env, gym.Wrapper):
            if any(f"{c.__module__}.{c.__qualname__}" == qualname for c in type(env).__mro__):
                return True
            env = env.env
        return False

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


def _error_reply(exc: BaseException) -> tuple[Any, ...]:
    details: dict[str, Any] = {"type": type(exc).__qualname__,
                               "traceback": traceback.format_exc(limit=20)}
    kind = "env"
    if isinstance(exc, ModuleNotFoundError):
        kind = "module"
        details["module"] = exc.name or ""
    elif isinstance(exc, WireError):
        kind = "wire"
    return ("err", kind, f"{type(exc).__name__}: {exc}", details)


def _ops(server: _Server, stats: dict[str, list[float]]) -> dict[str, Callable[..., Any]]:
    return {
        "make": server.make, "reset": server.reset, "step": server.step,
        "call": server.call, "get_attr": server.get_attr, "set_attr": server.set_attr,
        "has_wrapper": server.has_wrapper, "close": server.close,
        "ping": lambda: PROTOCOL,
        "stats": lambda: {k: (int(v[0]), v[1]) for k, v in stats.items()},
    }


def _answer(ops: dict[str, Callable[..., Any]], stats: dict[str, list[float]],
            req: Any) -> tuple[Any, ...]:
    """One request's reply tuple (``("ok", value)`` or an ``err`` reply)."""
    try:
        op = req[0]
        fn = ops.get(op)
        if fn is None:
            raise WireError(f"unknown request {op!r}")
        t0 = time.perf_counter()
        value = fn(*req[1:])
        st = stats.setdefault(op, [0.0, 0.0])
        st[0] += 1
        st[1] += time.perf_counter() - t0
        return ("ok", value)
    except Exception as exc:  # every failure goes back to the host, typed
        return _error_reply(exc)


class _Group:
    """The k envs of one machine (``envs_per_machine``): ``make_group`` builds them in
    order, ``batch`` carries one request (or None) per env in one frame each way."""

    def __init__(self) -> None:
        self.members: list[tuple[_Server, dict[str, list[float]],
                                 dict[str, Callable[..., Any]]]] = []

    def make_group(self, makes: Any) -> dict[str, Any]:
        self.close()
        self.members = []
        replies = []
        for kind, payload, kwargs in makes:
            server = _Server()
            stats: dict[str, list[float]] = {}
            ops = _ops(server, stats)
            self.members.append((server, stats, ops))
            replies.append(_answer(ops, stats, ("make", kind, payload, kwargs)))
        # make's replies are plain data (spaces on the wire, _plain metadata)
        return {"protocol": PROTOCOL, "group": replies}

    def batch(self, requests: Any) -> list[bytes | None]:
        """Per env None (no request) or its encoded reply: encoded one by one, so a
        value the codec cannot carry fails that env's request, not the batch."""
        if len(requests) != len(self.members):
            raise WireError(f"a batch of {len(requests)} requests for {len(self.members)} envs")
        out: list[bytes | None] = []
        for (_, stats, ops), req in zip(self.members, requests, strict=True):
            if req is None:
                out.append(None)
                continue
            try:
                out.append(encode(_answer(ops, stats, req)))
            except WireError as exc:
                out.append(encode(_error_reply(exc)))
        return out

    def close(self) -> None:
        for server, _, _ in self.members:
            server.close()


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """Answer framed requests on ``inp`` until it ends or a ``close`` arrives."""
    server = _Server()
    group = _Group()
    stats: dict[str, list[float]] = {}  # op -> [count, seconds inside the op]
    ops = _ops(server, stats)
    ops["make_group"] = group.make_group
    ops["batch"] = group.batch
    while True:
        raw = read_frame(inp)
        if raw is None:
            break
        op = "?"
        try:
            req = decode(raw)
            op = req[0]
            reply = encode(_answer(ops, stats, req))
        except Exception as exc:  # every failure goes back to the host, typed
            reply = encode(_error_reply(exc))
        out.write(frame(reply))
        out.flush()
        if op == "close":
            break
    server.close()
    group.close()


def main() -> None:
    # Replies go to a private copy of stdout; fd 1 becomes stderr so prints from the
    # env (Python or C) cannot interleave with frames.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    home = "/home/boxd"
    if os.path.isdir(home) and home not in sys.path:
        sys.path.insert(0, home)
    with os.fdopen(0, "rb", buffering=0) as raw_in, os.fdopen(reply_fd, "wb") as out:
        import io

        serve(io.BufferedReader(raw_in), out)


if __name__ == "__main__":
    main()
