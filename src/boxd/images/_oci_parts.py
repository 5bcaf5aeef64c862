"""What `boxd.images.oci` and its registry reader share: sources, names of media types,
a manifest's JSON, and a multi-platform index's entry for this host."""

from __future__ import annotations

import base64
import json
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boxd.errors import CorruptData, InvalidRequest, NotFound
from boxd.storage.oci import (
    DOCKER_MANIFEST_MEDIA,
    INDEX_MEDIA,
    MANIFEST_MEDIA,
    REF_ANNOTATION,
    parse_digest,
)

DOCKER_LIST_MEDIA = "application/vnd.docker.distribution.manifest.list.v2+json"
INDEXES = (INDEX_MEDIA, DOCKER_LIST_MEDIA)
ACCEPT = ", ".join((MANIFEST_MEDIA, INDEX_MEDIA, DOCKER_MANIFEST_MEDIA, DOCKER_LIST_MEDIA))
NAME_RE = re.compile(r"^[a-z0-9]+(?:[._/-][a-z0-9]+)*$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64", "amd64": "amd64"}


@dataclass(frozen=True)
class Source:
    """Where an image comes from (see the module's docstring for the syntax)."""

    transport: str
    path: str = ""  # oci, oci-archive, docker-archive
    ref: str | None = None  # a name in the layout / archive
    host: str = ""  # docker
    repo: str = ""
    reference: str = "latest"  # a tag or a digest

    def __str__(self) -> str:
        if self.transport == "docker":
            sep = "@" if self.reference.startswith("sha256:") else ":"
            return f"docker://{self.host}/{self.repo}{sep}{self.reference}"
        return f"{self.transport}:{self.path}" + (f":{self.ref}" if self.ref else "")


def parse_source(text: str) -> Source:
    """Parse a source in skopeo's transport syntax.

    Raises:
        InvalidRequest: an unknown transport or a malformed reference, with the syntax.
    """
    transport, sep, rest = text.partition(":")
    if transport == "docker" and rest.startswith("//"):
        return _parse_docker(rest[2:], text)
    if not sep or transport not in ("oci", "oci-archive", "docker-archive") or not rest:
        raise InvalidRequest(
            f"unknown image source {text!r}",
            hint="use oci:DIR[:REF], oci-archive:FILE[:REF], docker-archive:FILE or "
                 "docker://HOST[:PORT]/REPO[:TAG|@DIGEST]")
    path, _, ref = rest.partition(":")
    return Source(transport, path=path, ref=ref or None)


def _parse_docker(rest: str, text: str) -> Source:
    host, _, path = rest.partition("/")
    if not path or not ("." in host or ":" in host or host == "localhost"):
        raise InvalidRequest(
            f"{text!r} names no registry host",
            hint="name the registry: docker://HOST[:PORT]/REPO[:TAG], e.g. "
                 "docker://localhost:5000/envs/cartpole:v1")
    repo, reference = path, "latest"
    if "@" in path:
        repo, reference = path.split("@", 1)
        parse_digest(reference)
    elif ":" in path.rsplit("/", 1)[-1]:
        repo, reference = path.rsplit(":", 1)
    if not NAME_RE.match(repo) or not (reference.startswith("sha256:") or TAG_RE.match(reference)):
        raise InvalidRequest(f"invalid registry reference {text!r}",
                             hint="docker://HOST[:PORT]/REPO[:TAG|@DIGEST]")
    return Source("docker", host=host, repo=repo, reference=reference)


def manifest_json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise CorruptData(f"the image's {what} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptData(f"the image's {what} is not a JSON object")
    return doc


def pick(index: dict[str, Any], ref: str | None, what: str) -> dict[str, Any]:
    """The entry of an OCI index for ``ref`` (its ref name), or for this host's platform."""
    entries = [m for m in index.get("manifests") or [] if isinstance(m, dict)]
    if ref is not None:
        named = [m for m in entries if (m.get("annotations") or {}).get(REF_ANNOTATION) == ref]
        if not named:
            raise NotFound(f"{what} has no image named {ref!r}",
                           hint="see its index.json for the names it holds")
        return named[0]
    arch = _ARCH.get(platform.machine(), platform.machine())
    for m in entries:
        p = m.get("platform") or {}
        if p.get("os", "linux") == "linux" and p.get("architecture", arch) == arch:
            return m
    raise NotFound(f"{what} holds no image for linux/{arch}",
                   hint="name one with :REF, or import an image built for this host")


def docker_credentials(host: str, config: Path | None = None) -> tuple[str, str] | None:
    """The user and password ``~/.docker/config.json`` keeps for ``host``, if any."""
    path = config or Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / \
        "config.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    for key, entry in (auths or {}).items():
        bare = re.sub(r"^https?://", "", str(key)).split("/", 1)[0]
        if bare == host and isinstance(entry, dict) and entry.get("auth"):
            try:
                user, _, pw = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return None
            return user, pw
    return None
