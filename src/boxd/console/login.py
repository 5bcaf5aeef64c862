"""What ``boxd console`` needs: the daemon's console URL and a login URL minted there.

The daemon writes its console listener's URL to ``<data dir>/console.url`` once it
listens (the port may be chosen by the kernel). ``POST /login-tokens`` with an API key
answers a one-time login URL for that key's account (`boxd.console.sessions`).
"""

from __future__ import annotations

from pathlib import Path

import httpx

from boxd.errors import AuthError, BoxdError, ConnectionError

__all__ = ["TOKENS_PATH", "login_url", "url_file"]

#: Where a client mints a login token (Bearer API key).
TOKENS_PATH = "/login-tokens"


def url_file(home: Path) -> Path:
    """Where a daemon serving data directory ``home`` writes its console URL."""
    return home / "console.url"


def login_url(console_url: str, api_key: str, timeout: float = 10.0) -> str:
    """A one-time login URL of the console at ``console_url`` for ``api_key``'s account.

    Raises:
        AuthError: the key is missing, unknown or revoked.
        ConnectionError: the console does not answer.
        BoxdError: any other answer than a login URL.
    """
    base = console_url.rstrip("/")
    try:
        r = httpx.post(base + TOKENS_PATH, headers={"Authorization": f"Bearer {api_key}"},
                       timeout=timeout)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"the console at {base} does not answer: {exc}",
                          hint="is the daemon running? see BOXD_CONSOLE_LISTEN") from exc
    if r.status_code == 401:
        raise AuthError("the console refused the API key", hint="pass --api-key or set "
                        "BOXD_API_KEY (the local one is in <data dir>/local.key)")
    try:
        url = r.json()["url"] if r.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        url = None
    if not isinstance(url, str):
        raise BoxdError(f"the console at {base} answered {r.status_code} without a "
                        "login URL", hint="see the daemon's log")
    return url
