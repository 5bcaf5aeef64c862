"""Read the host's own apt configuration: which Debian mirror and suites it uses.

The image builder and the host set-up never name a mirror of their own; they reuse
the one the host is configured with, which is also what users behind a proxy need.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

SOURCES_LIST = "/etc/apt/sources.list"
SOURCES_DIR = "/etc/apt/sources.list.d"


@dataclass(frozen=True)
class AptSource:
    """One apt source entry: a URI, its suites and components."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]


def _parse_one_line(text: str) -> list[AptSource]:
    out: list[AptSource] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        line = re.sub(r"\[[^\]]*\]", " ", line)
        parts = line.split()
        if len(parts) >= 3:
            out.append(AptSource(parts[1], (parts[2],), tuple(parts[3:])))
    return out


def _parse_deb822(text: str) -> list[AptSource]:
    out: list[AptSource] = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for raw in stanza.splitlines():
            if raw.startswith("#") or ":" not in raw:
                continue
            key, _, value = raw.partition(":")
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        for uri in fields.get("uris", "").split():
            out.append(
                AptSource(
                    uri,
                    tuple(fields.get("suites", "").split()),
                    tuple(fields.get("components", "").split()),
                )
            )
    return out


def host_sources(root: str = "/") -> list[AptSource]:
    """Every enabled `deb` entry of the host's apt configuration."""
    base = Path(root)
    out: list[AptSource] = []
    main = base / SOURCES_LIST.lstrip("/")
    if main.exists():
        out += _parse_one_line(main.read_text(errors="replace"))
    for path in sorted(glob.glob(str(base / SOURCES_DIR.lstrip("/") / "*"))):
        text = Path(path).read_text(errors="replace")
        if path.endswith(".list"):
            out += _parse_one_line(text)
        elif path.endswith(".sources"):
            out += _parse_deb822(text)
    return out


def host_codename() -> str:
    """The host's Debian codename (``bookworm``), from /etc/os-release."""
    fields = dict(
        line.split("=", 1)
        for line in Path("/etc/os-release").read_text().splitlines()
        if "=" in line
    )
    return fields.get("VERSION_CODENAME", "").strip('"') or "bookworm"


def debian_sources(codename: str | None = None) -> list[AptSource]:
    """The host's entries for the Debian release ``codename`` (main, updates, security)."""
    codename = codename or host_codename()
    found = [
        s
        for s in host_sources()
        if any(suite == codename or suite.startswith(codename + "-") for suite in s.suites)
    ]
    if not found:
        raise LookupError(
            f"no apt source for Debian {codename!r} in {SOURCES_LIST} or {SOURCES_DIR}; "
            "add the Debian mirror you use to the host's apt sources"
        )
    return found


def debian_mirror(codename: str | None = None) -> str:
    """The URI of the host's main Debian archive for ``codename``."""
    codename = codename or host_codename()
    sources = debian_sources(codename)
    for s in sources:
        if codename in s.suites and "security" not in s.uri:
            return s.uri
    return sources[0].uri


def apt_proxy_options() -> list[str]:
    """Apt proxy settings of the host, as ``Key "value";`` lines for mmdebstrap --aptopt."""
    opts = []
    for key in ("http_proxy", "https_proxy"):
        value = os.environ.get(key) or os.environ.get(key.upper())
        if value:
            scheme = key.split("_")[0]
            opts.append(f'Acquire::{scheme}::Proxy "{value}";')
    return opts


def select_suite_sources(sources: list[AptSource], suite: str) -> list[AptSource]:
    """Only the entries for ``suite``, ``suite-updates`` and ``suite-security``.

    Backports and third-party suites (``nodistro``, ``cloud-sdk-...``) are dropped;
    each kept entry lists only the wanted suites it carries.
    """
    wanted = (suite, f"{suite}-updates", f"{suite}-security")
    out: list[AptSource] = []
    for s in sources:
        suites = tuple(x for x in s.suites if x in wanted)
        if suites:
            out.append(AptSource(s.uri, suites, s.components or ("main",)))
    return out


def one_line_entries(sources: list[AptSource]) -> list[str]:
    """``deb URI SUITE COMPONENTS`` lines, one per suite (mmdebstrap's mirror arguments)."""
    lines: list[str] = []
    for s in sources:
        for suite in s.suites:
            line = f"deb {s.uri} {suite} {' '.join(s.components)}"
            if line not in lines:
                lines.append(line)
    return lines


def host_apt_proxy_options() -> list[str]:
    """Proxy settings from the host's apt configuration and environment (``--aptopt`` lines)."""
    opts = apt_proxy_options()
    try:
        import subprocess

        out = subprocess.run(["apt-config", "dump"], capture_output=True, text=True,
                             check=False).stdout
    except OSError:
        return opts
    for line in out.splitlines():
        m = re.match(r'(Acquire::(?:http|https|ftp)::Proxy(?:::\S+)?) "(.*)";$', line)
        if m and m.group(2) and m.group(2).lower() not in {"false", "direct"}:
            opt = f'{m.group(1)} "{m.group(2)}";'
            if opt not in opts:
                opts.append(opt)
    return opts
