"""Build a container image from a Dockerfile with buildah, into boxd's image store.

boxd checks the Dockerfile first (each instruction is one it supports, else an error
naming its line), points every ``FROM`` that names an image of the caller's at the store
(``oci:<store>:<name>``), then runs ``buildah bud`` (``--isolation chroot``, vfs
storage, ``--layers``: buildah's layer cache, keyed by the parent layer, the
instruction and the files it reads, persists between builds) and imports the result
(``docker-archive``, which keeps HEALTHCHECK) under the given name.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from boxd.errors import HostSetupError, InvalidRequest
from boxd.storage.oci import ImageStore

from .oci import ImageInfo, import_image, parse_name

__all__ = ["SUPPORTED", "BuildRequest", "build_image", "check_dockerfile", "unpack_context"]

SUPPORTED = frozenset({
    "FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "ENTRYPOINT", "CMD",
    "EXPOSE", "HEALTHCHECK", "LABEL", "SHELL", "STOPSIGNAL",
})
BUILD_TIMEOUT = 3600.0
_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_DIRECTIVE = re.compile(r"^#\s*(syntax|escape)\s*=", re.IGNORECASE)


@dataclass(frozen=True)
class BuildRequest:
    name: str  # NAME[:TAG] as the caller gave it
    context: Path  # a directory on this host
    dockerfile: str = "Dockerfile"  # relative to the context
    build_args: Mapping[str, str] | None = None
    target: str | None = None


def check_dockerfile(text: str) -> list[tuple[int, str, str]]:
    """The instructions of a Dockerfile as (first line number, keyword, rest).

    Raises:
        InvalidRequest: an instruction boxd does not support, named with its line.
    """
    out: list[tuple[int, str, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        i += 1
        if not line.strip() or (line.lstrip().startswith("#")):
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            nxt = lines[i]
            i += 1
            if nxt.lstrip().startswith("#"):
                continue
            line = line.rstrip()[:-1] + "\n" + nxt
        keyword, _, rest = line.strip().partition(" ")
        if keyword.upper() not in SUPPORTED:
            raise InvalidRequest(
                f"Dockerfile line {start}: {keyword.upper()} is not supported by boxd",
                hint="supported: " + ", ".join(sorted(SUPPORTED)), line=start)
        out.append((start, keyword.upper(), rest.strip()))
    if not any(k == "FROM" for _, k, _ in out):
        raise InvalidRequest("the Dockerfile has no FROM", hint="start it with FROM IMAGE")
    return out


def _rewrite_froms(text: str, resolve: Callable[[str], str | None]) -> str:
    """``text`` with each FROM that names a stored image pointed at the store."""
    stages: set[str] = set()
    out = []
    for line in text.splitlines():
        m = _FROM.match(line)
        if m and not _DIRECTIVE.match(line):
            head, flags, ref, tail = m.groups()
            alias = re.search(r"\bAS\s+(\S+)", tail, re.IGNORECASE)
            if ref.lower() != "scratch" and ref not in stages and "$" not in ref:
                target = resolve(ref)
                if target is not None:
                    line = f"{head}{flags}{target}{tail}"
            if alias:
                stages.add(alias.group(1))
        out.append(line)
    return "\n".join(out) + "\n"


def build_image(store: ImageStore, req: BuildRequest, *, prefix: str, cache: Path,
                log: Callable[[str], None] | None = None) -> ImageInfo:
    """Build ``req`` and store it as ``prefix + name``; return it.

    ``prefix`` is the caller's namespace in the store (``"<account>/"``): a FROM that
    names one of its images builds on it; ``cache`` is buildah's storage (its layer
    cache), kept between builds.

    Raises:
        InvalidRequest: a missing context or Dockerfile, an unsupported instruction (its
            line named), or a failed step (the tail of buildah's output).
        HostSetupError: buildah is not installed.
    """
    target_name = prefix + parse_name(req.name)
    dockerfile = (req.context / req.dockerfile).resolve()
    if not req.context.is_dir():
        raise InvalidRequest(f"the build context {req.context} is not a directory")
    if not dockerfile.is_relative_to(req.context.resolve()) or not dockerfile.is_file():
        raise InvalidRequest(f"no Dockerfile {req.dockerfile!r} in the build context",
                             hint="name it with -f, relative to the context")
    text = dockerfile.read_text(errors="replace")
    check_dockerfile(text)
    buildah = shutil.which("buildah")
    if buildah is None:
        raise HostSetupError("buildah is not installed: boxd builds Dockerfiles with it",
                             hint="run scripts/setup-host.sh (apt-get install buildah)")
    refs = store.refs()

    def resolve(ref: str) -> str | None:
        try:
            name = prefix + parse_name(ref)
        except InvalidRequest:
            return None
        return f"oci:{link}:{name}" if name in refs else None

    store.ensure()
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)  # buildah's storage: the daemon's
    # buildah names what it builds FROM after the oci: path, and refuses a name that is
    # not lower case: the store is reached through a link whose path is (hex only).
    work = Path(tempfile.gettempdir()) / f"boxd-build-{secrets.token_hex(8)}"
    work.mkdir(mode=0o700)
    link = work / "store"
    link.symlink_to(store.root)
    try:
        (work / "Dockerfile").write_text(_rewrite_froms(text, resolve))
        archive = _bud(buildah, req, work, cache, target_name, _pulls(text, resolve), log)
        return import_image(store, f"docker-archive:{archive}", target_name, owned=prefix)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _bud(buildah: str, req: BuildRequest, work: Path, cache: Path, target_name: str,
         pull: bool, log: Callable[[str], None] | None) -> Path:
    """Run ``buildah bud`` on ``work/Dockerfile`` and push the result to a
    ``docker-archive`` in ``work``; return its path."""
    # One tag per target name: a rebuild moves it, and the image it left stays in
    # buildah's storage as cache for the next build.
    tag = "localhost/boxd-build/" + re.sub(r"[^a-z0-9._/-]", "-", target_name.lower())
    base = [buildah, "--root", str(cache / "storage"), "--runroot", str(cache / "run"),
            "--storage-driver", "vfs"]
    args = [*base, "bud", "--isolation", "chroot", "--format", "docker", "--layers",
            "--pull" if pull else "--pull-never", "-f", str(work / "Dockerfile"), "-t", tag]
    for k, v in (req.build_args or {}).items():
        args += ["--build-arg", f"{k}={v}"]
    if req.target:
        args += ["--target", req.target]
    _run([*args, str(req.context)], "build", log)
    archive = work / "image.tar"
    _run([*base, "push", tag, f"docker-archive:{archive}:{tag}:latest"], "push", log)
    return archive


def _pulls(text: str, resolve: Callable[[str], str | None]) -> bool:
    """Whether a FROM names an image that is neither stored nor ``scratch`` (a registry
    one, which buildah pulls)."""
    for line in text.splitlines():
        m = _FROM.match(line)
        if m and m.group(3).lower() != "scratch" and resolve(m.group(3)) is None \
                and "/" in m.group(3):
            return True
    return False


def _run(cmd: Sequence[str], what: str, log: Callable[[str], None] | None) -> None:
    env = {**os.environ, "BUILDAH_ISOLATION": "chroot", "STORAGE_DRIVER": "vfs"}
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=BUILD_TIMEOUT, check=False,
                           env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise InvalidRequest(f"the image {what} ran past {BUILD_TIMEOUT:.0f} s") from None
    out = (r.stdout + r.stderr).decode(errors="replace")
    if log is not None:
        for line in out.splitlines():
            log(line)
    if r.returncode != 0:
        tail = [ln for ln in out.strip().splitlines() if ln.strip()][-8:]
        raise InvalidRequest(f"the image {what} failed: " + " | ".join(tail)[-1500:],
                             hint="fix the Dockerfile step it names; the build log has all "
                                  "of buildah's output")


def unpack_context(archive: Path, dest: Path) -> None:
    """Extract a build context (a tar, optionally gzip) into ``dest``: regular files,
    directories and links inside it only (no absolute or ``..`` names, no link leading
    out, no devices); owners are not kept.

    Raises:
        InvalidRequest: not a tar, or a member that would leave ``dest``.
    """
    root = dest.resolve()
    try:
        with tarfile.open(archive, "r:*") as tar:
            for m in tar:
                _check_member(m, root)
                tar.extract(m, root, set_attrs=False, numeric_owner=True,
                            **_TRUSTED)  # type: ignore[arg-type]
    except tarfile.TarError as exc:
        raise InvalidRequest(f"the build context is not a tar archive: {exc}",
                             hint="send the context as a tar (boxd image build does)") from None


# Members are checked by _check_member; tarfile's own filter (where this Python has one)
# would refuse nothing more, so it is told to trust what passed.
_TRUSTED = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def _check_member(m: tarfile.TarInfo, root: Path) -> None:
    target = (root / m.name).resolve()
    bad = m.name.startswith("/") or ".." in Path(m.name).parts \
        or not target.is_relative_to(root) or not (m.isfile() or m.isdir() or m.issym()
                                                  or m.islnk())
    if m.issym() or m.islnk():
        base = root if m.islnk() else (root / m.name).parent
        link = (base / m.linkname).resolve()
        bad = bad or m.linkname.startswith("/") or not link.is_relative_to(root)
    if bad:
        raise InvalidRequest(f"the build context holds {m.name!r}, which leads out of it",
                             hint="a context holds plain files, directories and links "
                                  "inside it")
