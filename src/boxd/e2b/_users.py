"""Who an envd call is for: E2B's users on boxd's machines.

E2B's SDKs name a user only when the caller passes one (envd >= 0.4.0, so boxd's
0.5.2): ``Authorization: Basic base64("<name>:")`` on the Connect RPCs, the
``username`` query parameter on ``/files``. Without one, envd uses the template's
default user: ``user`` on E2B's base template, which boxd's default guest image has
too (uid 1000, home ``/home/user``, passwordless sudo). A sandbox of a container image
runs as the image's own USER (boxd's exec applies it when no user is sent), and a
sandbox whose guest lacks the account (a snapshot template saved from an older guest
image) falls back to root; `Sandboxes.default_user` finds out which, once per sandbox.

As E2B's envd (which runs as root), the filesystem calls and ``/files`` act as root
and the user decides who owns what they make (a directory, an upload and the parents
it makes) and who a command runs as. A name the guest does not have is envd's
``unauthenticated`` "invalid username", which the SDKs raise as their
``AuthenticationException`` / ``AuthenticationError``.
"""

from __future__ import annotations

import base64
import binascii
import re

from starlette.requests import Request

from boxd.e2b._connect import ConnectError
from boxd.errors import BoxdError, InvalidRequest

__all__ = ["DEFAULT_USER", "ROOT", "files_user", "invalid_user", "is_unknown_user",
           "rpc_user"]

#: The default user of E2B's base template and of boxd's default guest image.
DEFAULT_USER = "user"
ROOT = "root"
#: A user name boxd's exec takes (`boxd.models.GuestUser` without a group).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}")


def invalid_user(name: str, why: str = "") -> ConnectError:
    """envd's answer for a user the sandbox does not have."""
    return ConnectError("unauthenticated", f"invalid username: '{name}'"
                        + (f" ({why})" if why else ""))


def _checked(name: str) -> str | None:
    if not name:
        return None
    if not _NAME.fullmatch(name):
        raise invalid_user(name, "not a user name the sandbox can have")
    return name


def rpc_user(request: Request) -> str | None:
    """The user a Connect call names (``Authorization: Basic``), None when it names
    none.

    Raises:
        ConnectError: ``unauthenticated`` for a header that is not Basic auth or a
            name no user can have.
    """
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        raise ConnectError("unauthenticated", "Authorization must be Basic base64(user:)")
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise ConnectError("unauthenticated", "Authorization is not base64(user:)") from exc
    return _checked(decoded.partition(":")[0])


def files_user(request: Request) -> str | None:
    """The user a ``/files`` request names (``username``), None when it names none.

    Raises:
        ConnectError: ``unauthenticated`` for a name no user can have.
    """
    return _checked(request.query_params.get("username", ""))


def is_unknown_user(exc: BoxdError) -> bool:
    """Whether boxd refused a call's user: the guest lacks it, or its agent is too old
    to act as one (both are `InvalidRequest` on field ``user``)."""
    return isinstance(exc, InvalidRequest) and exc.details.get("field") == "user"
