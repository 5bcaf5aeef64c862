"""Recipes, the image cache and ``ensure_image``: the public face of the image builder.

Cache layout (``$BOXD_IMAGE_CACHE`` if set, else ``paths.images``)::

    <recipe key>/            one per recipe; renamed into place only when complete
        recipe.json          the recipe, kernel release, sizes, build time
        vmlinux | vmlinuz    the kernel (uncompressed PVH ELF, else the bzImage)
        rootfs.img           raw ext4; machines put qcow2 overlays on top
        busybox, modules/    inputs of the initramfs, so it can be rebuilt alone
        initrd-<key>.img     one per (kernel, /init, agent files); milliseconds to build
    <recipe key>.lock        fcntl lock: one builder per recipe at a time
    <recipe key>.tmp-<pid>   a build in progress (removed by the next build if stale)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from boxd.config import IMAGE_CACHE_ENV, Paths, Settings
from boxd.errors import HostSetupError
from boxd.storage._files import fsync_dir, write_atomic

from . import _apt, _initramfs, _kernel, _rootfs
from ._util import Progress, fsync_tree, remove_build_tree

# 2: the boxd client's dependencies and its .pth (in-machine Boxd());
# 3: login scripts that fork no program bash answers itself (`_rootfs.fast_login`)
BUILDER_VERSION = "3"
CACHE_ENV = IMAGE_CACHE_ENV
GUEST_DIR = Path(__file__).resolve().parent.parent / "guest"
RECIPE_FILE = "recipe.json"


def _default_suite() -> str:
    return _apt.host_codename()


@dataclass(frozen=True)
class Recipe:
    """What goes into a guest root filesystem.

    Attributes:
        suite: Debian codename (the host's by default).
        apt: extra apt packages, added to mmdebstrap's ``--include``.
        pip: extra pip packages, installed from wheels downloaded on the host.
    """

    suite: str = field(default_factory=_default_suite)
    apt: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()

    @classmethod
    def for_machines(cls, settings: Settings) -> Recipe:
        """The daemon's image for new machines: the default recipe plus the packages of
        ``BOXD_IMAGE_APT`` and ``BOXD_IMAGE_PIP``."""
        return cls(apt=settings.image_apt, pip=settings.image_pip)

    def canonical(self) -> dict[str, object]:
        """The recipe as a JSON-able dict with sorted, de-duplicated package lists."""
        return {
            "suite": self.suite,
            "apt": sorted(set(self.apt)),
            "pip": sorted(set(self.pip)),
        }

    def key(self) -> str:
        """Short hex sha256 of the canonical recipe and the builder version."""
        blob = json.dumps({"builder": BUILDER_VERSION, "client": list(_rootfs.CLIENT_PIP),
                           **self.canonical()},
                          sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class GuestImage:
    """A built guest image: kernel, initramfs and root filesystem, all read-only.

    Attributes:
        key: covers the recipe and the initramfs (kernel, /init, agent files).
        dir: the recipe's cache directory.
        kernel: vmlinux (PVH ELF) or, as a fallback, the bzImage.
        initrd: the initramfs (uncompressed newc cpio).
        rootfs: raw ext4 image, to be used as a read-only qcow2 backing file.
        recipe: what was built.
        kernel_version: the kernel release, e.g. ``6.1.0-57-amd64``.
        cmdline_hint: kernel command-line words the engine should append.
    """

    key: str
    dir: Path
    kernel: Path
    initrd: Path
    rootfs: Path
    recipe: Recipe
    kernel_version: str
    cmdline_hint: str


def cache_dir(paths: Paths) -> Path:
    """Where images live: ``$BOXD_IMAGE_CACHE`` if set, else ``paths.images``."""
    cache = Settings.from_env().image_cache
    return cache.resolve() if cache else paths.images


def host_tsc_khz() -> int | None:
    """The host TSC frequency in kHz; under TCG the guest's TSC ticks at the same rate."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    if "constant_tsc" not in flags.split():
        return None
    for line in text.splitlines():
        if line.startswith("cpu MHz"):
            try:
                return int(float(line.split(":", 1)[1]) * 1000)
            except ValueError:
                return None
    return None


def cmdline_hint_for(tsc_khz: int | None, hz: int = 250) -> str:
    """Kernel words the engine should append (see docs/images.md).

    ``tsc_early_khz``/``lpj`` skip TSC and delay-loop calibration, which has no PIT
    to calibrate against on microvm and hangs or takes seconds under TCG; ``pci=off``
    skips probing a bus microvm does not have.
    """
    words = ["pci=off"]
    if tsc_khz:
        words += [f"tsc_early_khz={tsc_khz}", f"lpj={tsc_khz * 1000 // hz}"]
    return " ".join(words)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _noop(_step: str, _fraction: float | None) -> None:
    return None


def ensure_image(
    paths: Paths,
    recipe: Recipe | None = None,
    *,
    progress: Progress | None = None,
    force: bool = False,
    guest_dir: Path | None = None,
) -> GuestImage:
    """Return the guest image for ``recipe``, building what is missing.

    The root filesystem and kernel are built once per recipe key; the initramfs is
    rebuilt (in milliseconds) whenever /init or the agent files change. Concurrent
    callers for the same recipe wait for one build and share its result.

    Args:
        paths: boxd's paths; images go to ``paths.images`` unless ``BOXD_IMAGE_CACHE`` is set.
        recipe: what to build; the default recipe when None.
        progress: called as ``progress(step, fraction or None)`` before each step.
        force: rebuild even when a complete image exists.
        guest_dir: where the agent's ``*.py`` files are (default: ``boxd/guest``).

    Returns:
        The image, ready to boot.

    Raises:
        HostSetupError: a build step failed; the message names it and says what to do.
    """
    recipe = recipe or Recipe()
    report = progress or _noop
    root = cache_dir(paths)
    key = recipe.key()
    final = root / key
    with _locked(root / f"{key}.lock"):
        if force or not (final / RECIPE_FILE).exists():
            _build_base(root, key, recipe, report)
        return _with_initrd(final, guest_dir or GUEST_DIR, report)


def _build_base(root: Path, key: str, recipe: Recipe, report: Progress) -> None:
    for stale in root.glob(f"{key}.tmp-*"):
        remove_build_tree(stale)
    tmp = root / f"{key}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    started = time.monotonic()
    try:
        info = _build_into(tmp, recipe, report)
        info["build_seconds"] = round(time.monotonic() - started, 1)
        (tmp / RECIPE_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        report("sync to disk", 0.97)
        fsync_tree(tmp)
        final = root / key
        if final.exists():
            old = root / f"{key}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        remove_build_tree(tmp)
        raise


def _build_into(out: Path, recipe: Recipe, report: Progress) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="build-", dir=out) as scratch_name:
        scratch = Path(scratch_name)
        kernel = _build_kernel(out, scratch, report)
        size = _build_rootfs(out, scratch, recipe, report)
    return {
        "recipe": recipe.canonical(),
        "key": recipe.key(),
        "builder": BUILDER_VERSION,
        "kernel_package": kernel.package,
        "kernel_version": kernel.release,
        "kernel": kernel.name,
        "modules": kernel.modules,
        "rootfs_bytes": size,
        "cmdline_hint": cmdline_hint_for(host_tsc_khz()),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


@dataclass(frozen=True)
class _Kernel:
    """What `_build_kernel` put in the image: the kernel file's name and its modules."""

    package: str
    release: str
    name: str  # vmlinux or vmlinuz
    modules: list[str]  # in load order


def _build_kernel(out: Path, scratch: Path, report: Progress) -> _Kernel:
    """Put the host's Debian kernel, its modules and busybox into ``out``."""
    report("resolve kernel version", 0.0)
    package, release = _kernel.resolve_kernel_package()
    report(f"download {package} and busybox-static", 0.02)
    debs = _kernel.download_debs([package, "busybox-static"], scratch / "debs")
    report("unpack kernel and busybox", 0.08)
    tree = scratch / "tree"
    for deb in debs:
        _kernel.unpack_deb(deb, tree)
    bzimage = tree / "boot" / f"vmlinuz-{release}"
    busybox = tree / "bin" / "busybox"
    if not bzimage.exists() or not busybox.exists():
        raise HostSetupError(
            f"unpacked packages lack boot/vmlinuz-{release} or bin/busybox",
            hint="the Debian package layout changed; report this")
    report("extract vmlinux from bzImage", 0.1)
    vmlinux = _kernel.extract_vmlinux(bzimage.read_bytes())
    if vmlinux is not None and _kernel.has_pvh_note(vmlinux):
        (out / "vmlinux").write_bytes(vmlinux)
        kernel_name = "vmlinux"
    else:
        shutil.copyfile(bzimage, out / "vmlinuz")
        kernel_name = "vmlinuz"
    del vmlinux
    report("collect kernel modules", 0.12)
    mods = _kernel.resolve_modules(tree / "lib" / "modules" / release)
    (out / "modules").mkdir()
    for name, data in mods.modules:
        (out / "modules" / f"{name}.ko").write_bytes(data)
    (out / "modules" / "load-order").write_text(
        "".join(n + "\n" for n, _ in mods.modules))
    shutil.copyfile(busybox, out / "busybox")
    return _Kernel(package, release, kernel_name, [n for n, _ in mods.modules])


def _build_rootfs(out: Path, scratch: Path, recipe: Recipe, report: Progress) -> int:
    """Build ``recipe``'s root filesystem into ``out/rootfs.img``; its size in bytes."""
    # The in-machine client's dependencies come with every image (docs/images.md).
    pip = tuple(dict.fromkeys((*_rootfs.CLIENT_PIP, *recipe.pip)))
    report("download pip wheels on the host", 0.14)
    wheels = scratch / "wheels"
    _rootfs.download_wheels(pip, wheels)
    report(f"mmdebstrap {recipe.suite} (about a minute)", 0.2)
    rootdir = scratch / "rootfs"
    rootdir.mkdir()
    _rootfs.mmdebstrap(recipe.suite, rootdir, recipe.apt, pip, wheels)
    report("configure rootfs (CA bundle, pip.conf)", 0.85)
    _rootfs.customize(rootdir, _rootfs.host_pip_config())
    report("pack rootfs into ext4", 0.9)
    size = _rootfs.make_ext4(rootdir, out / "rootfs.img")
    shutil.rmtree(rootdir)
    return size


def _read_info(image_dir: Path) -> dict[str, object]:
    try:
        data = json.loads((image_dir / RECIPE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise HostSetupError(f"image {image_dir} is unreadable: {exc}",
                             hint="rebuild it with force=True (boxd image build --force)") from exc
    if not isinstance(data, dict):
        raise HostSetupError(f"image {image_dir} has a malformed {RECIPE_FILE}",
                             hint="rebuild it with force=True")
    return data


def _recipe_of(info: dict[str, object]) -> Recipe:
    r = info.get("recipe")
    if not isinstance(r, dict):
        raise HostSetupError("recipe.json lacks the recipe", hint="rebuild the image")
    return Recipe(suite=str(r["suite"]), apt=tuple(r.get("apt", ())),
                  pip=tuple(r.get("pip", ())))


def _image(image_dir: Path, info: dict[str, object], initrd: Path, ikey: str) -> GuestImage:
    recipe = _recipe_of(info)
    key = hashlib.sha256(f"{recipe.key()}:{ikey}".encode()).hexdigest()[:16]
    return GuestImage(
        key=key,
        dir=image_dir,
        kernel=image_dir / str(info.get("kernel", "vmlinux")),
        initrd=initrd,
        rootfs=image_dir / "rootfs.img",
        recipe=recipe,
        kernel_version=str(info["kernel_version"]),
        # Computed now, not at build time: it depends on the host that boots the image.
        cmdline_hint=cmdline_hint_for(host_tsc_khz()),
    )


def _modules_of(image_dir: Path) -> list[tuple[str, bytes]]:
    order = (image_dir / "modules" / "load-order").read_text().split()
    return [(n, (image_dir / "modules" / f"{n}.ko").read_bytes()) for n in order]


def _with_initrd(image_dir: Path, guest_dir: Path, report: Progress) -> GuestImage:
    info = _read_info(image_dir)
    busybox = (image_dir / "busybox").read_bytes()
    agent = _initramfs.guest_files(guest_dir)
    ikey = _initramfs.initramfs_key(str(info["kernel_version"]), busybox, agent)
    initrd = image_dir / f"initrd-{ikey}.img"
    if not initrd.exists():
        report("build initramfs", 0.99)
        files = _initramfs.with_init_binary(agent)
        data = _initramfs.build_initramfs(busybox, _modules_of(image_dir), files)
        write_atomic(initrd, data)
    report("image ready", 1.0)
    return _image(image_dir, info, initrd, ikey)


def list_images(paths: Paths, *, guest_dir: Path | None = None) -> list[GuestImage]:
    """Every complete image in the cache, newest first.

    Each image is given the initramfs for the current agent files when one exists,
    else its most recently built one; images without any initramfs are skipped.

    Raises:
        HostSetupError: an image's recipe.json is unreadable.
    """
    root = cache_dir(paths)
    if not root.is_dir():
        return []
    agent = _initramfs.guest_files(guest_dir or GUEST_DIR)
    found: list[tuple[float, GuestImage]] = []
    for d in root.iterdir():
        if not d.is_dir() or "." in d.name or not (d / RECIPE_FILE).exists():
            continue
        info = _read_info(d)
        busybox = d / "busybox"
        if not busybox.exists():
            continue
        ikey = _initramfs.initramfs_key(str(info["kernel_version"]), busybox.read_bytes(),
                                        agent)
        initrd = d / f"initrd-{ikey}.img"
        if not initrd.exists():
            candidates = sorted(d.glob("initrd-*.img"), key=lambda p: p.stat().st_mtime)
            if not candidates:
                continue
            initrd = candidates[-1]
            ikey = initrd.name[len("initrd-"):-len(".img")]
        found.append(((d / RECIPE_FILE).stat().st_mtime, _image(d, info, initrd, ikey)))
    return [img for _, img in sorted(found, key=lambda t: -t[0])]
