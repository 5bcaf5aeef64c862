"""A WebSocket echo server on the standard library alone (RFC 6455), for a guest whose
python3 has no ``websockets``: ``python3 ws_echo.py PORT LOG``.

Text comes back as text, binary as binary; a path starting ``/deny`` is refused (403,
body ``no way``). Commands (text): ``whoami`` answers the
request's path, Origin and chosen subprotocol as JSON; ``close CODE REASON`` closes
with that code; ``big N`` sends one binary message of N bytes (streamed, never held).
It offers subprotocol ``echo.v1`` only; a client's close is echoed and its code and
reason appended to LOG (``CODE REASON`` a line).
"""

import base64
import hashlib
import json
import socketserver
import struct
import sys

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline().decode("latin-1").split()
        headers = {}
        while (h := self.rfile.readline().decode("latin-1").strip()):
            k, _, v = h.partition(":")
            headers[k.strip().lower()] = v.strip()
        if line[1].startswith("/deny"):
            self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 6\r\n"
                             b"X-Why: test\r\n\r\nno way")
            return
        accept = base64.b64encode(hashlib.sha1(headers["sec-websocket-key"].encode()
                                               + GUID).digest()).decode()
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
        proto = "echo.v1" if "echo.v1" in offered else None
        self.wfile.write((f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                          f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n"
                          + (f"Sec-WebSocket-Protocol: {proto}\r\n" if proto else "")
                          + "\r\n").encode())
        who = {"path": line[1], "origin": headers.get("origin"), "protocol": proto}
        while (frame := self.read()) is not None:
            op, data = frame
            text = data.decode() if op == 1 else ""
            if op == 8:
                code = struct.unpack("!H", data[:2])[0] if data else 1005
                with open(sys.argv[2], "a") as log:
                    log.write(f"{code} {data[2:].decode()}\n")
                self.send(8, data)
                return
            if op == 9:
                self.send(10, data)
            elif text == "whoami":
                self.send(1, json.dumps(who).encode())
            elif text.startswith("close "):
                _, code, reason = text.split(" ", 2)
                self.send(8, struct.pack("!H", int(code)) + reason.encode())
                self.read()  # the client's answering close
                return
            elif text.startswith("big "):
                n = int(text.split()[1])
                self.wfile.write(b"\x82\x7f" + struct.pack("!Q", n))
                for _ in range(n // 65536):
                    self.wfile.write(bytes(65536))
                self.wfile.write(bytes(n % 65536))
            elif op in (1, 2):
                self.send(op, data)

    def read(self) -> "tuple[int, bytes] | None":
        head = self.rfile.read(2)
        if len(head) < 2:
            return None
        n = head[1] & 0x7F
        if n >= 126:
            n = struct.unpack("!H" if n == 126 else "!Q", self.rfile.read(2 if n == 126 else 8))[0]
        mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
        data = self.rfile.read(n)
        key = (mask * (n // 4 + 1))[:n]
        return head[0] & 0x0F, (int.from_bytes(data, "big")
                                ^ int.from_bytes(key, "big")).to_bytes(n, "big")

    def send(self, op: int, data: bytes) -> None:
        n = len(data)
        size = bytes([n]) if n < 126 else (b"\x7e" + struct.pack("!H", n) if n < 65536
                                           else b"\x7f" + struct.pack("!Q", n))
        self.wfile.write(bytes([0x80 | op]) + size + data)


if __name__ == "__main__":
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer.daemon_threads = True
    socketserver.ThreadingTCPServer(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
