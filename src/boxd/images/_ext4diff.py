"""What one layer chain changed, as debugfs commands that make the ext4 of the chain
below into the ext4 of this chain (`boxd.images._disk` applies them to a copy).

The two trees are hard-linked layer chains (`boxd.images.oci.unpack_image`): a file
the layer did not touch is the same inode in both, so an unchanged file is found by
its ``st_ino`` without reading it; a directory is made anew per chain and is compared
by its attributes. The commands are the ones ``mkfs.ext4 -d`` would have turned the
new tree into: removed paths deepest first, then new directories, files (``write``
from the tree), symlinks, device nodes and fifos, hard links (``ln`` + links_count),
and each new or changed inode's mode (setuid bits included), owner, mtime and xattrs
(``ea_set -f``: a value is bytes, security.capability is binary).

An entry debugfs cannot make (a socket, a name with a newline: its command language is
line based) raises `Unsupported`; the caller then packs the whole tree instead.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

#: Longest command line debugfs reads from a script (its fgets buffer is BUFSIZ).
_MAX_LINE = 8000


class Unsupported(Exception):
    """An entry of the tree that debugfs cannot make; the message says which."""


@dataclass(frozen=True)
class Entry:
    """One path of a tree, as ``lstat`` and ``readlink`` see it."""

    ino: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    rdev: int
    blocks: int
    target: str = ""  # a symlink's

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    def attrs(self) -> tuple[int, int, int, int]:
        return (self.mode, self.uid, self.gid, self.mtime_ns)


@dataclass
class Tree:
    """Every path of a tree (``""`` is its root), parents before children."""

    root: Path
    entries: dict[str, Entry] = field(default_factory=dict)

    @classmethod
    def walk(cls, root: Path) -> Tree:
        tree = cls(root)
        tree.entries[""] = _entry(str(root))
        stack = [""]
        while stack:
            rel = stack.pop()
            with os.scandir(root / rel if rel else root) as it:
                names = sorted(e.name for e in it)
            subdirs = []
            for name in names:
                path = f"{rel}/{name}" if rel else name
                e = tree.entries[path] = _entry(str(root / path))
                if e.is_dir:
                    subdirs.append(path)
            stack.extend(reversed(subdirs))
        return tree

    def used(self) -> tuple[int, int]:
        """(bytes allocated, entries), each hard-linked inode counted once."""
        seen = {e.ino: e.blocks for e in self.entries.values()}
        return sum(seen.values()) * 512, len(self.entries)

    def xattrs(self, rel: str) -> dict[str, bytes]:
        path = self.root / rel if rel else self.root
        try:
            names = os.listxattr(path, follow_symlinks=False)
        except OSError:  # a file system without xattrs
            return {}
        return {n: os.getxattr(path, n, follow_symlinks=False) for n in sorted(names)}


def _entry(path: str) -> Entry:
    st = os.lstat(path)
    target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
    return Entry(st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_rdev,
                 st.st_blocks, target)


def _q(text: str) -> str:
    """``text`` as one debugfs argument (double quotes; a quote inside doubled)."""
    if "\n" in text or "\r" in text or "\0" in text:
        raise Unsupported(f"the name {text!r} has a line break")
    return '"' + text.replace('"', '""') + '"'


def _abs(rel: str) -> str:
    return _q("/" + rel)


class Script:
    """The debugfs commands that turn ``below``'s ext4 into ``here``'s; xattr values go
    to files under ``values`` (``ea_set -f``)."""

    def __init__(self, below: Tree, here: Tree, values: Path) -> None:
        self.below, self.here, self.values = below, here, values
        self.lines: list[str] = []
        self._n = 0
        # the paths of each non-directory inode, in each tree
        self.links = _groups(here)
        self.links_below = _groups(below)
        self.made: dict[int, str] = {}  # a new inode: the path it was written at

    def build(self) -> list[str]:
        """The commands, in order.

        Raises:
            Unsupported: an entry debugfs cannot make.
        """
        self._removals()
        for rel, e in self.here.entries.items():
            old = self.below.entries.get(rel)
            if old is not None and _same(old, e):
                if e.is_dir:
                    self._dir_attrs(rel, old, e)
            else:
                self._make(rel, e)
        self._link_counts()
        for line in self.lines:
            if len(line.encode(errors="surrogateescape")) > _MAX_LINE:
                raise Unsupported(f"a path is too long for a debugfs command: {line[:80]}...")
        return self.lines

    def _removals(self) -> None:
        gone = [rel for rel, old in self.below.entries.items()
                if rel and not _same(old, self.here.entries.get(rel))]
        for rel in sorted(gone, key=lambda r: r.count("/"), reverse=True):
            verb = "rmdir" if self.below.entries[rel].is_dir else "rm"
            self.lines.append(f"{verb} {_abs(rel)}")

    def _make(self, rel: str, e: Entry) -> None:
        if e.is_dir:
            self.lines.append(f"mkdir {_abs(rel)}")
            self._set_attrs(rel, e)
            self._set_xattrs(rel, {}, self.here.xattrs(rel))
            return
        anchor = self._anchor(e.ino) or self.made.get(e.ino)
        if anchor is not None:
            self._cd_parent(rel)
            self.lines.append(f"ln {_abs(anchor)} {_q(rel.rpartition('/')[2])}")
            return
        self._cd_parent(rel)
        name = _q(rel.rpartition("/")[2])
        if stat.S_ISREG(e.mode):
            self.lines.append(f"write {_q(str(self.here.root / rel))} {name}")
        elif stat.S_ISLNK(e.mode):
            self.lines.append(f"symlink {name} {_q(e.target)}")
        elif stat.S_ISFIFO(e.mode):
            self.lines.append(f"mknod {name} p")
        elif stat.S_ISCHR(e.mode) or stat.S_ISBLK(e.mode):
            kind = "c" if stat.S_ISCHR(e.mode) else "b"
            self.lines.append(f"mknod {name} {kind} {os.major(e.rdev)} {os.minor(e.rdev)}")
        else:
            raise Unsupported(f"/{rel} is a {stat.filemode(e.mode)[0]!r} entry (a socket?)")
        self.made[e.ino] = rel
        self._set_attrs(rel, e)
        self._set_xattrs(rel, {}, self.here.xattrs(rel))

    def _anchor(self, ino: int) -> str | None:
        """A path the inode has in both trees (so it is already on the disk, and stays)."""
        return next((p for p in self.links.get(ino, ())
                     if (old := self.below.entries.get(p)) is not None and old.ino == ino),
                    None)

    def _cd_parent(self, rel: str) -> None:
        self.lines.append(f"cd {_abs(rel.rpartition('/')[0])}")

    def _dir_attrs(self, rel: str, old: Entry, e: Entry) -> None:
        if old.attrs() != e.attrs():
            self._set_attrs(rel, e)
        before, after = self.below.xattrs(rel), self.here.xattrs(rel)
        if before != after:
            self._set_xattrs(rel, before, after)

    def _set_attrs(self, rel: str, e: Entry) -> None:
        p = _abs(rel)
        if not stat.S_ISLNK(e.mode):
            self.lines.append(f"sif {p} mode 0{e.mode:o}")
        if rel:  # the root stays root's (mkfs.ext4 -E root_owner=0:0)
            self.lines += [f"sif {p} uid {e.uid}", f"sif {p} gid {e.gid}"]
        # whole seconds, as mkfs.ext4 -d keeps them
        self.lines.append(f"sif {p} mtime @{e.mtime_ns // 10**9}")

    def _set_xattrs(self, rel: str, before: dict[str, bytes], after: dict[str, bytes]) -> None:
        p = _abs(rel)
        for name in before.keys() - after.keys():
            self.lines.append(f"ea_rm {p} {_q(name)}")
        for name, value in after.items():
            if before.get(name) == value:
                continue
            self._n += 1
            f = self.values / str(self._n)
            f.write_bytes(value)
            self.lines.append(f"ea_set -f {_q(str(f))} {p} {_q(name)}")

    def _link_counts(self) -> None:
        """Hard links: ``ln`` and ``rm`` leave links_count as it was; set it where an
        inode's set of paths changed."""
        for ino, paths in self.links.items():
            old = self.links_below.get(ino, [])
            if old != paths and (old or len(paths) > 1):
                self.lines.append(f"sif {_abs(paths[0])} links_count {len(paths)}")


def _same(old: Entry, new: Entry | None) -> bool:
    """The path holds the same thing in both trees: both directories (their attributes
    compared apart), or the same file inode."""
    if new is None:
        return False
    if old.is_dir or new.is_dir:
        return old.is_dir and new.is_dir
    return old.ino == new.ino


def _groups(tree: Tree) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for rel, e in tree.entries.items():
        if not e.is_dir:
            out.setdefault(e.ino, []).append(rel)
    return out


__all__ = ["Entry", "Script", "Tree", "Unsupported"]
