"""Sandbox ids: E2B's 20 characters ``[a-z0-9]``, which are also the machine's name."""

from __future__ import annotations

import re
import secrets
import string

__all__ = ["SANDBOX_ID_RE", "is_sandbox_id", "new_sandbox_id"]

_ALPHABET = string.ascii_lowercase + string.digits
#: What a sandbox id is. The id is the boxd machine's name (a valid name: letters and
#: digits only), so the alias survives a daemon restart with the machine itself.
SANDBOX_ID_RE = re.compile(r"[a-z0-9]{20}\Z")


def new_sandbox_id() -> str:
    """A fresh random sandbox id (103 bits)."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(20))


def is_sandbox_id(text: str) -> bool:
    """Whether ``text`` has the shape of a sandbox id."""
    return bool(SANDBOX_ID_RE.match(text))
