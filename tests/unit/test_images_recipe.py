"""Recipe keys, kernel command-line hints and initramfs keys (no I/O)."""

from __future__ import annotations

import pytest

from boxd.images import Recipe, _build, _initramfs


def test_key_is_short_hex_and_stable() -> None:
    a = Recipe(suite="bookworm")
    assert a.key() == Recipe(suite="bookworm").key()
    assert len(a.key()) == 16
    int(a.key(), 16)


def test_key_ignores_order_and_duplicates() -> None:
    a = Recipe(suite="bookworm", apt=("git", "curl"), pip=("numpy", "gymnasium"))
    b = Recipe(suite="bookworm", apt=("curl", "git", "curl"), pip=("gymnasium", "numpy"))
    assert a.key() == b.key()


def test_key_changes_with_content() -> None:
    base = Recipe(suite="bookworm")
    keys = {
        base.key(),
        Recipe(suite="trixie").key(),
        Recipe(suite="bookworm", apt=("git",)).key(),
        Recipe(suite="bookworm", pip=("git",)).key(),
    }
    assert len(keys) == 4


def test_key_covers_builder_version(monkeypatch: pytest.MonkeyPatch) -> None:
    before = Recipe(suite="bookworm").key()
    monkeypatch.setattr(_build, "BUILDER_VERSION", "999")
    assert Recipe(suite="bookworm").key() != before


def test_canonical_is_sorted() -> None:
    r = Recipe(suite="bookworm", apt=("b", "a"), pip=("z", "y", "z"))
    assert r.canonical() == {"suite": "bookworm", "apt": ["a", "b"], "pip": ["y", "z"]}


def test_cmdline_hint() -> None:
    assert _build.cmdline_hint_for(2_100_000) == "pci=off tsc_early_khz=2100000 lpj=8400000"
    assert _build.cmdline_hint_for(None) == "pci=off"


def test_initramfs_key_tracks_agent_and_kernel() -> None:
    bb = b"busybox"
    k1 = _initramfs.initramfs_key("6.1.0-1-amd64", bb, {"agent.py": b"print(1)"})
    assert k1 == _initramfs.initramfs_key("6.1.0-1-amd64", bb, {"agent.py": b"print(1)"})
    assert k1 != _initramfs.initramfs_key("6.1.0-1-amd64", bb, {"agent.py": b"print(2)"})
    assert k1 != _initramfs.initramfs_key("6.1.0-2-amd64", bb, {"agent.py": b"print(1)"})
    assert k1 != _initramfs.initramfs_key(
        "6.1.0-1-amd64", bb, {"agent.py": b"print(1)", "protocol.py": b""})


def test_the_daemons_image_takes_its_packages_from_the_environment() -> None:
    from boxd.config import Settings

    s = Settings.from_env({"BOXD_IMAGE_PIP": "gymnasium, numpy  torch", "BOXD_IMAGE_APT": "git"})
    assert s.image_pip == ("gymnasium", "numpy", "torch") and s.image_apt == ("git",)
    recipe = Recipe.for_machines(s)
    assert recipe.pip == ("gymnasium", "numpy", "torch") and recipe.apt == ("git",)
    assert recipe.key() != Recipe().key()
    # unset or blank: the default image, the same key as before the setting existed
    assert Recipe.for_machines(Settings.from_env({"BOXD_IMAGE_PIP": " "})).key() == Recipe().key()
