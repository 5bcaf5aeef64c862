"""Apt source parsing and suite selection, pip config for the guest (no I/O)."""

from __future__ import annotations

from boxd.images import _apt, _rootfs
from boxd.images._apt import AptSource

DEB822 = """\
Types: deb
URIs: http://mirror.invalid/debian
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.invalid/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://mirror.invalid/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://mirror.invalid/disabled
Suites: bookworm
Components: main
Enabled: no
"""

ONE_LINE = """\
# comment
deb [arch=amd64 signed-by=/k.gpg] http://mirror.invalid/debian bookworm main
deb http://mirror.invalid/debian bookworm-backports main  # trailing
deb https://third.invalid/apt cloud-sdk-bookworm main
deb-src http://mirror.invalid/debian bookworm main
"""


def test_parse_deb822() -> None:
    got = _apt._parse_deb822(DEB822)
    assert got == [
        AptSource("http://mirror.invalid/debian", ("bookworm", "bookworm-updates"),
                  ("main", "contrib")),
        AptSource("http://mirror.invalid/debian-security", ("bookworm-security",), ("main",)),
    ]


def test_parse_one_line() -> None:
    got = _apt._parse_one_line(ONE_LINE)
    assert [s.uri for s in got] == [
        "http://mirror.invalid/debian",
        "http://mirror.invalid/debian",
        "https://third.invalid/apt",
    ]
    assert got[0].suites == ("bookworm",)
    assert got[0].components == ("main",)


def test_select_suite_sources_drops_backports_and_third_party() -> None:
    sources = _apt._parse_deb822(DEB822) + _apt._parse_one_line(ONE_LINE) + [
        AptSource("http://mirror.invalid/debian", ("bookworm-backports",), ("main",)),
        AptSource("https://nodesource.invalid", ("nodistro",), ("main",)),
    ]
    picked = _apt.select_suite_sources(sources, "bookworm")
    suites = {s for src in picked for s in src.suites}
    assert suites == {"bookworm", "bookworm-updates", "bookworm-security"}
    assert all("third" not in s.uri and "nodesource" not in s.uri for s in picked)


def test_select_suite_sources_other_suite_is_empty() -> None:
    assert _apt.select_suite_sources(_apt._parse_deb822(DEB822), "trixie") == []


def test_one_line_entries() -> None:
    picked = _apt.select_suite_sources(_apt._parse_deb822(DEB822), "bookworm")
    assert _apt.one_line_entries(picked) == [
        "deb http://mirror.invalid/debian bookworm main contrib",
        "deb http://mirror.invalid/debian bookworm-updates main contrib",
        "deb http://mirror.invalid/debian-security bookworm-security main",
    ]


def test_parse_pip_config_and_guest_conf_drops_file_urls() -> None:
    out = (
        ":env:.cert='/etc/ssl/certs/ca-certificates.crt'\n"
        "global.extra-index-url='file:///opt/pypi/simple https://extra.invalid/simple'\n"
        "global.index-url='https://index.invalid/simple'\n"
        "global.find-links='/opt/wheels'\n"
    )
    cfg = _rootfs.parse_pip_config(out)
    assert cfg == {
        "extra-index-url": ["file:///opt/pypi/simple", "https://extra.invalid/simple"],
        "index-url": ["https://index.invalid/simple"],
    }
    conf = _rootfs.guest_pip_conf(cfg)
    assert "cert = /etc/ssl/certs/ca-certificates.crt" in conf
    assert "break-system-packages = true" in conf
    assert "index-url = https://index.invalid/simple" in conf
    assert "extra-index-url = https://extra.invalid/simple" in conf
    assert "file://" not in conf
    assert "find-links" not in conf


def test_guest_pip_conf_without_host_indexes() -> None:
    conf = _rootfs.guest_pip_conf({"index-url": ["file:///x"]})
    assert "index-url" not in conf
