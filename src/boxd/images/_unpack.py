"""Apply an image's layers to a root tree, inside a chroot of that tree.

Run as ``python -m boxd.images._unpack DEST FD[:gzip]...``: each FD is an open layer
blob, applied in order. The process first makes DEST its root (``chroot``: as root, or
as root of a user namespace its parent made with ``unshare -r``), so whatever a layer
holds, an absolute symlink (``/var/run -> /run``), a ``..`` in a name, a link to a
host path, every file it writes and every path it removes is inside DEST: the kernel
resolves them there, not this code.

Whiteouts (the OCI layer format): ``.wh.NAME`` removes NAME as the lower layers left
it; ``.wh..wh..opq`` empties its directory of what lower layers put there. Ownership is
numeric (the image's uids, not this host's names); modes, setuid bits, times and
xattrs (PAX ``SCHILY.xattr.*`` records: file capabilities) are kept. Stdlib only: it
runs in a fresh interpreter before anything else is imported.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tarfile
from collections.abc import Mapping

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
XATTR = "SCHILY.xattr."
#: The xattr names (prefixes) a layer may set on its files.
KEPT_XATTRS = ("user.", "security.capability", "system.posix_acl_access",
               "system.posix_acl_default")


def _clean(name: str) -> str | None:
    """The member's path relative to /, or None for the root itself."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        # Inside the chroot a ".." cannot leave the root, but a layer that names one is
        # malformed: its member is skipped rather than guessed at.
        return None
    return "/".join(parts) or None


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _empty(directory: str, keep: set[str]) -> None:
    """Remove what lower layers put in ``directory`` (this layer's own entries stay)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return
    for n in names:
        path = f"{directory}/{n}" if directory != "/" else f"/{n}"
        if path not in keep:
            _remove(path)


def apply(layer: tarfile.TarFile) -> None:
    made: set[str] = set()  # this layer's paths, which its own whiteouts must not remove
    for m in layer:
        rel = _clean(m.name)
        if rel is None:
            continue
        path = "/" + rel
        head, _, base = path.rpartition("/")
        head = head or "/"
        if base == OPAQUE:
            _empty(head, made)
            continue
        if base.startswith(WHITEOUT):
            _remove(f"{head.rstrip('/')}/{base[len(WHITEOUT):]}")
            continue
        if not (m.isdir() and os.path.isdir(path)):
            _remove(path)  # a layer replaces what it names (a dir only by a non-dir)
        m.name = rel
        if m.islnk():
            link = _clean(m.linkname)
            if link is None:
                continue
            m.linkname = link
        # The chroot is the boundary: no tarfile filter second-guesses the image's own
        # absolute symlinks or setuid bits (where this Python has filters at all).
        trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") \
            else {}
        layer.extract(m, "/", set_attrs=True, numeric_owner=True, **trusted)  # type: ignore[arg-type]
        if not m.islnk():  # a hard link's xattrs are its file's, set where that was made
            _set_xattrs(path, m.pax_headers)
        made.add(path)


def _set_xattrs(path: str, pax: Mapping[str, str]) -> None:
    """The entry's xattrs (PAX ``SCHILY.xattr.NAME`` records, as docker and buildah
    write them; tarfile applies none), set after the owner: a chown clears a file's
    security.capability. A value is bytes (tarfile decoded it with surrogateescape).
    Only the names an image's files mean for their guest (`KEPT_XATTRS`): trusted.*
    and other security.* names are the host's (overlayfs metadata, LSM labels) and are
    left out, as is one the kernel refuses (as before xattrs were applied at all)."""
    for key, value in pax.items():
        if key.startswith(XATTR) and key[len(XATTR):].startswith(KEPT_XATTRS):
            try:
                os.setxattr(path, key[len(XATTR):], value.encode("utf-8", "surrogateescape"),
                            follow_symlinks=False)
            except OSError:
                continue


def main(argv: list[str]) -> int:
    dest, layers = argv[0], argv[1:]
    files = []
    for spec in layers:
        fd, _, how = spec.partition(":")
        files.append(tarfile.open(fileobj=os.fdopen(int(fd), "rb"),  # noqa: SIM115 - closed below
                                  mode="r|gz" if how == "gzip" else "r|"))
    os.chroot(dest)
    os.chdir("/")
    os.umask(0)
    for f in files:
        with f:
            apply(f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
