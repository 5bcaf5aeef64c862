"""What ``boxd e2b env`` needs: the E2B spelling of a key, and the daemon's E2B URL.

E2B API keys are an ``e2b_<hex>`` spelling of a boxd API key.

E2B's SDKs (Python 2.25-2.45) refuse a key that does not match ``^e2b_[0-9a-f]+$``, so
a boxd key ``boxd_...`` is handed to them as ``e2b_`` + the hex of its bytes. Nothing
new is stored: the E2B key is the boxd key, its account is that key's account, and
revoking the boxd key revokes it.

The daemon writes the URL of its E2B listener to ``<data dir>/e2b.url`` once it
listens (the port may be chosen by the kernel). Stdlib only: the CLI imports it.

A **warm template** is a running machine of the account labelled
`source_labels(template)` (``boxd e2b warm TEMPLATE`` makes one and its standby forks):
an E2B create of that template forks it (claiming a standby fork) instead of booting
or restoring a machine. Its sandboxes carry ``boxd.e2b/role=sandbox`` over the
source's role, so they are never taken for a source.
"""

from __future__ import annotations

import binascii
from pathlib import Path

__all__ = ["E2B_PREFIX", "ROLE_LABEL", "SANDBOX_LABELS", "TEMPLATE_LABEL", "from_e2b_key",
           "source_labels", "to_e2b_key", "url_file"]

E2B_PREFIX = "e2b_"

#: The label naming the E2B template a warm source machine serves.
TEMPLATE_LABEL = "boxd.e2b/template"
#: ``source`` on a warm template's machine, ``sandbox`` on the sandboxes forked of it.
ROLE_LABEL = "boxd.e2b/role"
#: The labels a sandbox forked of a warm source gets over the source's.
SANDBOX_LABELS = {ROLE_LABEL: "sandbox"}


def source_labels(template: str) -> dict[str, str]:
    """The labels of the machine that makes ``template`` warm."""
    return {TEMPLATE_LABEL: template, ROLE_LABEL: "source"}


def to_e2b_key(secret: str) -> str:
    """The E2B spelling of a boxd API key's secret."""
    return E2B_PREFIX + secret.encode().hex()


def from_e2b_key(key: str) -> str | None:
    """The boxd secret an ``e2b_<hex>`` key spells, or None if ``key`` is not one."""
    if not key.startswith(E2B_PREFIX):
        return None
    try:
        return binascii.unhexlify(key[len(E2B_PREFIX):]).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def url_file(home: Path) -> Path:
    """Where a daemon serving data directory ``home`` writes its E2B URL."""
    return home / "e2b.url"
