"""The Connect protocol's pieces the envd shim needs: envelopes and errors.

A server-streaming call's request and response bodies (``application/connect+json``)
are envelopes: one flags byte, a 4-byte big-endian length, then that many bytes of
JSON. The last response envelope has flag `END_STREAM` and carries ``{}`` or
``{"error": {"code", "message"}}``. A unary call is plain JSON both ways; its error is
the same ``{"code", "message"}`` at an HTTP status for the code.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

__all__ = [
    "END_STREAM",
    "MAX_MESSAGE",
    "ConnectError",
    "decode_envelopes",
    "encode_envelope",
    "end_stream",
    "read_envelopes",
]

#: Flag of the last envelope of a response stream.
END_STREAM = 0x02
#: Flag of a compressed envelope (the SDKs never compress: refused).
COMPRESSED = 0x01
#: Bytes one request message may have: requests are small (a command, a path).
MAX_MESSAGE = 4 << 20

_HEADER = struct.Struct(">BI")

#: Connect's codes and the HTTP status a unary error is answered with.
STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}


class ConnectError(Exception):
    """An error answered in Connect's shape: ``code`` is one of `STATUS`'s keys."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        assert code in STATUS, code
        self.code = code
        self.message = message

    @property
    def status(self) -> int:
        return STATUS[self.code]

    def body(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def encode_envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    """One envelope holding ``message`` as compact JSON."""
    data = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(flags, len(data)) + data


def end_stream(error: ConnectError | None = None) -> bytes:
    """The last envelope of a response stream: ``{}`` or the error."""
    return encode_envelope({"error": error.body()} if error else {}, END_STREAM)


def _check_header(data: bytes | bytearray, at: int) -> int:
    """The message length in the envelope header at ``data[at:]``.

    Raises:
        ConnectError: ``invalid_argument`` for a compressed message,
            ``resource_exhausted`` for one over `MAX_MESSAGE` bytes.
    """
    flags, length = _HEADER.unpack_from(data, at)
    if flags & COMPRESSED:
        raise ConnectError("invalid_argument", "compressed messages are not supported: "
                           "send them uncompressed")
    if length > MAX_MESSAGE:
        raise ConnectError("resource_exhausted", f"a message of {length} bytes is over "
                           f"the limit of {MAX_MESSAGE}")
    return int(length)


def decode_envelopes(body: bytes) -> list[dict[str, Any]]:
    """The JSON messages of a request body made of envelopes.

    Raises:
        ConnectError: ``invalid_argument`` for a truncated or compressed envelope or
            JSON that is not an object; ``resource_exhausted`` for one over
            `MAX_MESSAGE` bytes.
    """
    messages: list[dict[str, Any]] = []
    at = 0
    while at < len(body):
        if len(body) - at < _HEADER.size:
            raise ConnectError("invalid_argument", "truncated envelope: fewer than 5 header "
                               "bytes")
        length = _check_header(body, at)
        at += _HEADER.size
        if len(body) - at < length:
            raise ConnectError("invalid_argument", f"truncated envelope: {length} bytes "
                               f"announced, {len(body) - at} sent")
        messages.append(parse_json(body[at:at + length]))
        at += length
    return messages


def parse_json(data: bytes) -> dict[str, Any]:
    """A request message: a JSON object (an empty body is ``{}``).

    Raises:
        ConnectError: ``invalid_argument`` when it is not a JSON object.
    """
    if not data.strip():
        return {}
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConnectError("invalid_argument", f"the message is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConnectError("invalid_argument", "the message must be a JSON object")
    return value


async def read_envelopes(body: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any]]:
    """A client stream's messages, each as soon as its envelope is complete (at most one
    message and a chunk are held).

    Raises:
        ConnectError: as `decode_envelopes`, for a bad or truncated envelope.
    """
    buf = bytearray()
    async for chunk in body:
        buf += chunk
        while len(buf) >= _HEADER.size:
            length = _check_header(buf, 0)
            if len(buf) - _HEADER.size < length:
                break
            data = bytes(buf[_HEADER.size:_HEADER.size + length])
            del buf[:_HEADER.size + length]
            yield parse_json(data)
    if buf:
        raise ConnectError("invalid_argument", f"truncated envelope: {len(buf)} bytes left "
                           "at the end of the stream")
