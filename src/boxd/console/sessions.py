"""Console logins: a short-lived, one-time login token traded for a session cookie.

``boxd console`` asks the daemon (with an API key) for a login token and opens
``/login?token=...``. The token works once and for `TOKEN_SECONDS`: a URL that stays in
a browser's history or a terminal's scroll-back opens nothing later. Its exchange sets
the session cookie, ``HttpOnly`` (no script reads it) and ``SameSite=Strict`` (no other
site's page sends it); a session lasts `SESSION_SECONDS`.

Only SHA-256 hashes of tokens and session ids are kept, in memory: a daemon restart logs
every browser out. Stdlib only.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from boxd.errors import AuthError

__all__ = [
    "COOKIE",
    "SESSION_SECONDS",
    "TOKEN_SECONDS",
    "Logins",
    "cookie_header",
]

#: The session cookie's name.
COOKIE = "boxd_console"
#: Seconds a login token may wait for its exchange.
TOKEN_SECONDS = 60.0
#: Seconds a console session lasts.
SESSION_SECONDS = 12 * 3600.0
#: Live login tokens (and sessions) one daemon keeps at most; the oldest go first.
MAX_LIVE = 1024

_HOW = "run `boxd console` (or `boxd console --print-url`) for a new login URL"


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class _Grant:
    account: str
    expires: float


class Logins:
    """Login tokens and sessions of one daemon (thread-safe).

    Args:
        clock: monotonic seconds (tests pass their own).
        token_seconds: how long a login token is good for.
        session_seconds: how long a session lasts.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        token_seconds: float = TOKEN_SECONDS,
        session_seconds: float = SESSION_SECONDS,
    ) -> None:
        self._clock = clock
        self.token_seconds = token_seconds
        self.session_seconds = session_seconds
        self._tokens: dict[str, _Grant] = {}
        self._sessions: dict[str, _Grant] = {}
        self._lock = threading.Lock()

    def _put(self, table: dict[str, _Grant], account: str, seconds: float) -> str:
        secret = secrets.token_urlsafe(32)
        now = self._clock()
        with self._lock:
            for key in [k for k, g in table.items() if g.expires <= now]:
                del table[key]
            while len(table) >= MAX_LIVE:
                del table[next(iter(table))]  # dicts keep insertion order: the oldest
            table[_digest(secret)] = _Grant(account, now + seconds)
        return secret

    def mint(self, account: str) -> str:
        """A new login token for ``account``: good once, for `token_seconds`."""
        return self._put(self._tokens, account, self.token_seconds)

    def exchange(self, token: str | None) -> tuple[str, str]:
        """Spend a login token: its account and a new session id for it.

        Raises:
            AuthError: no token, or one unknown, already used or expired.
        """
        if not token:
            raise AuthError("no login token", hint=_HOW)
        with self._lock:
            grant = self._tokens.pop(_digest(token), None)
        if grant is None or grant.expires <= self._clock():
            raise AuthError("this login token is unknown, used or expired", hint=_HOW)
        return grant.account, self._put(self._sessions, grant.account, self.session_seconds)

    def account(self, session: str | None) -> str:
        """The account of a live session.

        Raises:
            AuthError: no session id, or one unknown or expired.
        """
        if not session:
            raise AuthError("not logged in to the console", hint=_HOW)
        with self._lock:
            grant = self._sessions.get(_digest(session))
        if grant is None or grant.expires <= self._clock():
            raise AuthError("this console session is unknown or has expired", hint=_HOW)
        return grant.account

    def end(self, session: str | None) -> None:
        """Forget a session (logout); an unknown one is ignored."""
        if session:
            with self._lock:
                self._sessions.pop(_digest(session), None)


def cookie_header(session: str, max_age: float) -> str:
    """The ``Set-Cookie`` value of a session: HttpOnly, SameSite=Strict, whole site.

    No ``Secure``: the console is plain HTTP on loopback, where a browser would refuse
    to send a Secure cookie back (Chromium exempts only ``localhost`` by name).
    """
    return (f"{COOKIE}={session}; Max-Age={int(max_age)}; Path=/; HttpOnly; "
            "SameSite=Strict")
