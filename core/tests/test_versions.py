"""Tests for neuropod.versions: npm-style and PEP 440 ranges over PEP 440 versions."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version

from neuropod.errors import VersionRangeError
from neuropod.versions import VersionRange, normalize_version, parse_range, satisfies


def _cases(range_: str, inside: str, outside: str) -> list[tuple[str, str, bool]]:
    """(version, range, expected) rows from space-separated version lists."""
    return [(v, range_, True) for v in inside.split()] + [
        (v, range_, False) for v in outside.split()
    ]


# Each row: range, versions inside, versions outside.
NPM_TABLE = [
    # Caret: node-semver README, including 0.x and partial versions.
    ("^1.2.3", "1.2.3 1.2.4 1.9.9 1.99.0", "1.2.2 2.0.0 2.0.0rc1 1.3.0rc1 0.9"),
    ("^0.2.3", "0.2.3 0.2.9", "0.2.2 0.3.0 1.0.0"),
    ("^0.0.3", "0.0.3", "0.0.2 0.0.4 0.1.0"),
    ("^0.0.1", "0.0.1", "0.0.2"),
    ("^1.2.x", "1.2.0 1.9.0", "1.1.9 2.0.0"),
    ("^0.0.x", "0.0.0 0.0.9", "0.1.0"),
    ("^0.0", "0.0.0 0.0.9", "0.1.0"),
    ("^0.1.x", "0.1.0 0.1.9", "0.2.0"),
    ("^1.x", "1.0.0 1.99.99", "0.9.9 2.0.0"),
    ("^0.x", "0.0.0 0.9.9", "1.0.0"),
    ("^2.13.0", "2.13.0 2.15.1", "2.12.9 3.0.0"),
    ("^*", "0.0.0 9.9.9", ""),
    ("^1.2.3-beta.2", "1.2.3b2 1.2.3b4 1.2.3rc1 1.2.3 1.9.0", "1.2.3b1 1.2.4b2 2.0.0"),
    ("^0.0.3-beta", "0.0.3b0 0.0.3b1 0.0.3", "0.0.4 0.0.4b1"),
    ("^ 1.2", "1.2.0 1.9.0", "2.0.0"),
    # Tilde.
    ("~1.2.3", "1.2.3 1.2.9", "1.2.2 1.3.0"),
    ("~1.2", "1.2.0 1.2.99", "1.1.9 1.3.0"),
    ("~1", "1.0.0 1.9.9", "0.9.9 2.0.0"),
    ("~0.2.3", "0.2.3 0.2.5", "0.2.2 0.3.0"),
    ("~0.2", "0.2.0 0.2.9", "0.3.0"),
    ("~0", "0.0.0 0.9.9", "1.0.0"),
    ("~1.4", "1.4.0 1.4.7", "1.5.0"),
    ("~1.2.3-beta.2", "1.2.3b2 1.2.3b3 1.2.4", "1.2.3b1 1.2.4b1 1.3.0"),
    ("~>1.2", "1.2.5", "1.3.0"),
    ("~> 1.2.3", "1.2.3 1.2.4", "1.3.0"),
    ("~ 1.2.3", "1.2.3", "1.3.0"),
    # X-ranges and partial versions.
    ("*", "0.0.0 1.0.0 99.0", "1.0.0a1 2.0.0.dev0"),
    ("", "0.0.0 1.0.0", "1.0.0rc1"),
    ("x", "1.0.0", "1.0.0rc1"),
    ("X", "1.0.0", ""),
    ("x.x.x", "1.2.3", ""),
    ("1.x", "1.0.0 1.9.9", "0.9.9 2.0.0 2.0.0rc1"),
    ("1.X", "1.5.0", "2.0.0"),
    ("1.2.x", "1.2.0 1.2.9", "1.1.9 1.3.0"),
    ("1.2.*", "1.2.0 1.2.9", "1.3.0"),
    ("1", "1.0.0 1.5.0", "0.9.0 2.0.0"),
    ("1.2", "1.2.0 1.2.9", "1.1.0 1.3.0"),
    ("^1.x.3", "1.0.0 1.9.0", "2.0.0"),  # node ignores numbers after a wildcard
    ("x.1", "0.0.0 5.0.0", ""),
    # Primitive comparators with X-ranges: README's "<=2 means below 3" family.
    ("<=2", "2.9.9 0.0.1", "3.0.0 3.0.0rc1"),
    ("<2", "1.9.9", "2.0.0 2.0.0a1"),
    (">2", "3.0.0 3.5.0", "2.9.9 2.0.0"),
    (">2.1", "2.2.0 3.0.0", "2.1.9"),
    (">=2.1", "2.1.0 2.5.0", "2.0.9"),
    ("=1.2", "1.2.0 1.2.5", "1.1.9 1.3.0"),
    ("<1.2", "1.1.9", "1.2.0"),
    ("<=1.2", "1.2.9", "1.3.0"),
    (">=*", "0.0.0 5.0.0", ""),
    ("<=x", "0.0.0", ""),
    ("<*", "", "0.0.0 1.0.0"),
    (">x", "", "0.0.0 1.0.0"),
    ("=*", "1.0.0", ""),
    # Primitive comparators with full versions.
    (">1.2.3", "1.2.4", "1.2.3 1.2.2"),
    ("<1.2.3", "1.2.2", "1.2.3"),
    (">=1.2.3", "1.2.3 2.0.0", "1.2.2"),
    ("<=1.2.3", "1.2.3 1.0.0", "1.2.4"),
    ("=1.2.3", "1.2.3 1.2.3.0", "1.2.4"),
    ("1.2.3", "1.2.3", "1.2.4 1.2.2"),
    ("v1.2.3", "1.2.3", "1.2.4"),
    (">=v1.2.3", "1.2.3", "1.2.2"),
    ("1.2.3+build.5", "1.2.3", "1.2.4"),  # build metadata is ignored
    ("1.31.1", "1.31.1", "1.31.0"),
    # Spaces after operators and between comparators.
    ("> 1.13.1", "1.13.2", "1.13.1"),
    (">= 2.13", "2.13.0 2.14.0", "2.12.9"),
    (">=2.13 <2.15", "2.13.0 2.14.9", "2.12.0 2.15.0"),
    (">=2.13   <2.15", "2.14.0", "2.15.0"),
    (">= 2.13 < 2.15", "2.14.0", "2.15.0"),
    ("  ^2.13.0  ", "2.14.0", "3.0.0"),
    ("\t>=1.0.0\t<2\n", "1.5.0", "2.0.0"),
    # Hyphen ranges, with partial versions on either side.
    ("1.2.3 - 2.3.4", "1.2.3 2.0.0 2.3.4", "1.2.2 2.3.5"),
    ("1.2 - 2.3.4", "1.2.0 2.3.4", "1.1.9 2.3.5"),
    ("1.2.3 - 2.3", "1.2.3 2.3.9", "1.2.2 2.4.0 2.4.0rc1"),
    ("1.2.3 - 2", "2.0.0 2.9.9", "3.0.0"),
    ("1.4.0 - 1.6.0", "1.4.0 1.6.0", "1.6.1"),
    ("1.2.x - 2.x", "1.2.0 2.9.0", "1.1.0 3.0.0"),
    ("x - 2", "0.0.0 2.5.0", "3.0.0"),
    ("1.2.3 - *", "1.2.3 99.0.0", "1.2.2"),
    ("1.2.3-rc.1 - 2.0.0-beta", "1.2.3rc1 1.2.3 2.0.0b0", "1.2.3rc0 2.0.0 2.0.0b1"),
    # OR.
    ("1.x || >=2.5.0 || 5.0.0 - 7.2.3", "1.5.0 2.5.0 7.2.3 8.0.0", "0.1.0 2.4.0"),
    ("1.2.7 || >=1.2.9 <2.0.0", "1.2.7 1.2.9 1.4.6", "1.2.8 2.0.0"),
    ("<1.0.0 || >=2.0.0", "0.5.0 2.0.0", "1.5.0"),
    ("||", "1.0.0", "1.0.0rc1"),  # node-semver: empty alternatives mean "*"
    ("1.0.0 ||", "1.0.0 9.9.9", ""),
    ("|| 1.0.0", "0.1.0", ""),
]

PRERELEASE_TABLE = [
    # npm rule: a prerelease needs a comparator naming the same release.
    (">=2.16.0rc0", "2.16.0rc0 2.16.0rc1 2.16.0 2.17.0", "2.16.0b1 2.17.0rc1"),
    (">=2.16.0-rc.0", "2.16.0rc1", "2.17.0rc1"),
    (">=2.16.0-rc0", "2.16.0rc1", ""),
    (">=2.16.0-0", "2.16.0.dev0 2.16.0a1 2.16.0rc1 2.16.0", "2.17.0a1"),
    (">=2.15", "2.16.0", "2.16.0rc1 2.16.0.dev1"),
    (">=2.15.0-rc.0", "2.16.0", "2.16.0rc1"),
    (">1.2.3-alpha.3", "1.2.3a7 1.2.3 3.4.5", "1.2.3a3 3.4.5a9"),
    (">=1.0.0-alpha", "1.0.0a0 1.0.0a1 1.0.0", "0.9.0"),
    ("1.2.3-beta.2", "1.2.3b2", "1.2.3b3 1.2.3"),
    ("=1.2.3-rc.1", "1.2.3rc1", "1.2.3"),
    ("2.16.0rc1", "2.16.0rc1 2.16.0-rc.1", "2.16.0"),
    (">=2.16.0-dev", "2.16.0.dev0 2.16.0.dev3 2.16.0rc1", "2.17.0.dev0"),
    (">=2.16.0.dev1", "2.16.0.dev1", "2.16.0.dev0"),
    (">=2.0.0-1", "2.0.0.dev1", "2.0.0.dev0"),
    (">=1.0.0-a.1 <1.0.0-b.1", "1.0.0a1 1.0.0a5", "1.0.0b1 1.0.0"),
    (">=1.0.0-pre.1", "1.0.0rc1", "1.0.0b9"),
    (">=1.0.0-preview.2", "1.0.0rc2", "1.0.0rc1"),
    (">=1.0.0-c.1", "1.0.0rc1", ""),
    (">=1.0.0-RC.1", "1.0.0rc1", ""),
    (">=2.0.0-rc.0 <2.0.0", "2.0.0rc1", "2.0.0"),  # node keeps the rc here
    ("^1.2.3", "", "2.0.0rc1 1.5.0rc1"),
    ("<2.0.0", "1.0.0", "2.0.0rc1"),
    ("*", "", "1.0.0a1 1.0.0.dev0 1.0.0rc1"),
    ("^2.15.0", "", "2.15.0.post1.dev0"),  # packaging counts this as a prerelease
    (">=2.16.0-rc.0", "2.16rc1 2.16.0.0rc1", ""),  # trailing zeros do not matter
    ("2.16.0-rc.1 || >=3", "2.16.0rc1 3.0.0", "3.0.0rc1"),
]

LOCAL_TABLE = [
    # Local labels never exclude a match.
    ("^2.13.0", "2.13.0+cpu 2.14.0+cu118", ""),
    ("2.13.0", "2.13.0+cpu", "2.13.1+cpu"),
    ("=2.13.0", "2.13.0+cpu", ""),
    ("<=2.13.0", "2.13.0+cpu", ""),
    (">=2.13.0", "2.13.0+cpu", ""),
    ("2.13.0 - 2.13.0", "2.13.0+cpu", ""),
    (">2.13.0", "", "2.13.0+cpu"),
    ("<2.13.0", "", "2.13.0+cpu"),
    ("==2.13.0", "2.13.0+cpu", ""),
    (">=2.13,<2.15", "2.13.0+cpu", ""),
    ("<=2.13.0,>=1", "2.13.0+cpu", ""),
    ("~=2.13.0", "2.13.0+cpu", ""),
    ("===2.13.0", "2.13.0+cpu 2.13.0", ""),
    ("!=2.13.0", "", "2.13.0+cpu"),
    # A PEP 440 set that names a local label compares it.
    ("==2.13.0+cpu", "2.13.0+cpu", "2.13.0+cu118 2.13.0"),
    ("===2.13.0+cpu", "2.13.0+cpu", "2.13.0"),
    ("2.16.0-rc.1", "2.16.0rc1+cpu", ""),
]

POST_TABLE = [
    # Post releases sort just after their base release (PEP 440).
    ("^2.15.0", "2.15.0.post1", ""),
    (">=2.15.0", "2.15.0.post1", ""),
    ("~2.15", "2.15.0.post1", ""),
    ("~2.15.0", "2.15.0.post1", ""),
    ("2.15.x", "2.15.0.post1", ""),
    ("<2.16", "2.15.0.post1", ""),
    ("<=2.15.0", "", "2.15.0.post1"),
    ("2.15.0", "", "2.15.0.post1"),
    (">2.15.0", "2.15.0.post1", ""),  # npm: plain ordering
    (">2.15.0,", "", "2.15.0.post1"),  # PEP 440: '>V' excludes V's post releases
    ("==2.15.0", "", "2.15.0.post1"),
    ("~=2.15.0", "2.15.0.post1", ""),
    (">=2.15,<2.16", "2.15.0.post1", ""),
    ("1.2.3 - 1.2.3", "", "1.2.3.post1"),
    # More than three release parts compare by PEP 440.
    ("^1.2.3", "1.2.3.4", ""),
    ("1.2.x", "1.2.3.4", ""),
    ("1.2.3", "1.2.3.0", "1.2.3.4"),
    ("<=1.2.3", "", "1.2.3.4"),
    ("<1.2.4", "1.2.3.4", ""),
    (">=1.2.3.4,<2", "1.2.3.4", "1.2.3.3"),
]

PEP440_TABLE = [
    (">=2.13,<2.15", "2.13 2.13.0 2.14.9", "2.12.9 2.15.0"),
    (">=2.13, <2.15", "2.14.0", "2.15.0"),
    (" >= 2.13 , < 2.15 ", "2.14.0", "2.15.0"),
    ("~=2.13.0", "2.13.0 2.13.5", "2.12.0 2.14.0"),
    ("~=2.13", "2.13.0 2.99", "3.0.0"),
    ("==2.13.*", "2.13.0 2.13.9", "2.14.0 2.12.0"),
    ("!=2.14.0", "2.14.1 2.13.0", "2.14.0"),
    ("!=2.14.*,>=2", "2.15.0", "2.14.3"),
    ("===1.31.1", "1.31.1", "1.31.1.0 1.31.2"),
    (">=2.13,", "2.13.0", "2.12.0"),
    # PEP 440 prereleases: allowed only when a specifier names one.
    (">=2.16.0rc0,<3", "2.16.0rc1 2.17.0rc1 2.16.0", "3.0.0"),
    (">=2.13,<3", "2.15.0", "2.16.0rc1 2.16.0.dev0"),
    ("==2.*", "2.1.0", "2.1.0rc1"),
    ("!=2.0rc1", "2.5.0", "2.5rc1"),  # excluding one prerelease allows none
    ("==2.16.0rc1", "2.16.0rc1", "2.16.0"),
    (",", "1.0.0", "1.0.0rc1"),  # an empty set is like "*"
    # Families mix per OR-alternative.
    (">=2.13,<2.15 || ^3.0.0", "2.14.0 3.1.0", "2.15.0 4.0.0"),
    ("1.x || ==2.13.*", "1.5.0 2.13.4", "2.14.0"),
]


def _rows(*tables: list[tuple[str, str, str]]) -> list[tuple[str, str, bool]]:
    return [row for table in tables for args in table for row in _cases(*args)]


@pytest.mark.parametrize(
    ("version", "range_", "expected"),
    _rows(NPM_TABLE, PRERELEASE_TABLE, LOCAL_TABLE, POST_TABLE, PEP440_TABLE),
)
def test_satisfies(version: str, range_: str, expected: bool) -> None:
    assert satisfies(version, range_) is expected
    assert (Version(version) in parse_range(range_)) is expected


@pytest.mark.parametrize(
    ("range_", "description"),
    [
        (">=2.13 <2.15", ">=2.13.0, <2.15.0"),
        (">=2.13,<2.15", ">=2.13, <2.15"),
        ("<2.15,>=2.13", "<2.15, >=2.13"),  # order as written
        ("^1.2.3", ">=1.2.3, <2.0.0"),
        ("^0.2.3", ">=0.2.3, <0.3.0"),
        ("^0.0.3", ">=0.0.3, <0.0.4"),
        ("^0.0.x", ">=0.0.0, <0.1.0"),
        ("^0.x", ">=0.0.0, <1.0.0"),
        ("~1.2", ">=1.2.0, <1.3.0"),
        ("~1", ">=1.0.0, <2.0.0"),
        ("1.2 - 2.3.4", ">=1.2.0, <=2.3.4"),
        ("1.2.3 - 2.3", ">=1.2.3, <2.4.0"),
        ("1.2.3 - 2", ">=1.2.3, <3.0.0"),
        ("<=2", "<3.0.0"),
        ("<2", "<2.0.0"),
        (">2", ">=3.0.0"),
        (">2.1", ">=2.2.0"),
        (">=2.1", ">=2.1.0"),
        ("=1.2", ">=1.2.0, <1.3.0"),
        ("1.2.3", "==1.2.3"),
        ("*", "*"),
        ("", "*"),
        ("||", "* || *"),
        ("<*", "<0.0.0"),
        ("1.x || >=2.5.0", ">=1.0.0, <2.0.0 || >=2.5.0"),
        ("^1.2.3-beta.2", ">=1.2.3b2, <2.0.0"),
        (">=2.16.0-0", ">=2.16.0.dev0"),
        ("~=2.13.0", "~=2.13.0"),
    ],
)
def test_describe(range_: str, description: str) -> None:
    assert parse_range(range_).describe() == description


INVALID_RANGES = [
    ">=>1",
    ">=>1.0",
    "1.2.3.x.y",
    "1.2.3.4",
    "^",
    "~",
    "~>",
    "abc",
    "1.2.3 -",
    "- 1.2",
    "1.2.3 - 2.3.4 - 5",
    "^1.2 - 2",
    "1.2.3 - >=2",
    ">= ",
    "<",
    "< = 1",
    ">=1.2<2",
    "1 | 2",
    "1.2.3-foo",
    "1.2.3-alpha.beta",
    "1.2.3-r1",
    "1.2.3.post1",
    "1.2.3-",
    "1.2.3+",
    "1.2a1",
    "v",
    "(1.2",
    "1.2.3)",
    "[1.0,2.0)",
    "~=2",
    "~=2.x",
    ">=2.13,<",
    "==2.13.0 <2.15",
    "===",
    "!=",
    ">=1 || >=>2",
    "1.0 ||| 2.0",
    "=" + "9" * 5000,  # beyond int()'s digit limit
    "==" + "9" * 5000,
]


@pytest.mark.parametrize("range_", INVALID_RANGES)
def test_invalid_range(range_: str) -> None:
    with pytest.raises(VersionRangeError) as info:
        parse_range(range_)
    message = str(info.value)
    assert message.startswith(f"Invalid version range '{range_}': ")
    assert "'^2.13.0'" in message and "'>=2.13,<2.15'" in message
    with pytest.raises(VersionRangeError):
        satisfies("1.0.0", range_)


def test_invalid_range_messages_say_what_is_wrong() -> None:
    def message(range_: str) -> str:
        with pytest.raises(VersionRangeError) as info:
            parse_range(range_)
        return str(info.value)

    assert "'>=>1.0' is not a valid comparator" in message(">=>1.0")
    assert "operator '>=' is not followed by a version" in message(">= ")
    assert "hyphen range" in message("1.2.3 -")
    assert "alpha/a, beta/b, rc/c/pre/preview, dev" in message("1.2.3-foo")
    assert "'-foo'" in message("1.2.3-foo")
    assert "'<' is not a valid PEP 440 specifier" in message(">=2.13,<")


@pytest.mark.parametrize("range_", [None, 2.13, b">=1"])
def test_non_string_range(range_: object) -> None:
    with pytest.raises(VersionRangeError):
        parse_range(range_)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "version", ["abc", "", "1.2.x", "2.13.0+", "1.0-foo", ">=1", "1.0 2.0", "9" * 5000]
)
def test_invalid_version(version: str) -> None:
    with pytest.raises(VersionRangeError) as info:
        normalize_version(version)
    assert f"'{version}'" in str(info.value)
    with pytest.raises(VersionRangeError):
        satisfies(version, "*")
    with pytest.raises(VersionRangeError):
        satisfies(version, ">=1,<2")


@pytest.mark.parametrize(
    ("version", "normal"),
    [
        ("2.13.0+cpu", "2.13.0+cpu"),
        ("2.15.0.post1", "2.15.0.post1"),
        ("2.16.0-rc.1", "2.16.0rc1"),
        ("v1.31.1", "1.31.1"),
        (" 1.0 ", "1.0"),
    ],
)
def test_normalize_version(version: str, normal: str) -> None:
    assert normalize_version(version) == Version(normal)
    assert str(normalize_version(version)) == normal


def test_version_range_object() -> None:
    parsed = parse_range(" ^2.13.0 ")
    assert isinstance(parsed, VersionRange)
    assert parsed.text == " ^2.13.0 "
    assert str(parsed) == " ^2.13.0 "
    assert "2.14.0" in parsed and Version("2.14.0") in parsed
    assert "3.0.0" not in parsed
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.text = "*"  # type: ignore[misc]
    assert parse_range(" ^2.13.0 ") is parsed  # cached
    assert parsed == parse_range(" ^2.13.0 ") and hash(parsed) == hash(
        parse_range(" ^2.13.0 ")
    )
    assert parsed != parse_range("^2.13.0")
    with pytest.raises(VersionRangeError):
        _ = "not a version" in parsed


# --- properties ---------------------------------------------------------------

_num = st.integers(0, 3).map(str)
_wild = st.sampled_from(["x", "X", "*"])
_npm_pre = st.sampled_from(["-rc.1", "-beta.2", "-alpha", "-0", "rc1", "-dev.3", "b2"])


@st.composite
def _npm_version(draw: st.DrawFn, prerelease: bool = True) -> str:
    parts = draw(st.lists(_num | _wild, min_size=1, max_size=3))
    text = ".".join(parts)
    if len(parts) == 3 and prerelease and draw(st.booleans()):
        text += draw(_npm_pre)
    return draw(st.sampled_from(["", "v"])) + text


@st.composite
def _npm_range(draw: st.DrawFn, prerelease: bool = True) -> str:
    alternatives = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            low, high = draw(_npm_version(prerelease)), draw(_npm_version(prerelease))
            alternatives.append(f"{low} - {high}")
            continue
        comparators = []
        for _ in range(draw(st.integers(1, 3))):
            op = draw(st.sampled_from(["", "=", "<", "<=", ">", ">=", "~", "~>", "^"]))
            space = draw(st.sampled_from(["", " "])) if op else ""
            comparators.append(op + space + draw(_npm_version(prerelease)))
        alternatives.append(" ".join(comparators))
    return " || ".join(alternatives)


@st.composite
def _pep440_range(draw: st.DrawFn) -> str:
    specifiers = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from([">=", "<=", "<", ">", "==", "!=", "~=", "==="]))
        parts = draw(st.lists(_num, min_size=2 if op == "~=" else 1, max_size=3))
        version = ".".join(parts)
        if op in ("==", "!=") and draw(st.booleans()):
            version += ".*"
        elif op not in ("===",) and draw(st.booleans()):
            version += draw(st.sampled_from(["rc1", "a0", ".dev2", ".post1"]))
        specifiers.append(op + version)
    # A lone ">=1" would be npm-style; the comma makes it a PEP 440 set.
    return ",".join(specifiers) + ("," if len(specifiers) == 1 else "")


@st.composite
def _installed_version(draw: st.DrawFn) -> str:
    text = ".".join(draw(st.lists(_num, min_size=1, max_size=4)))
    text += draw(st.sampled_from(["", "", "a1", "b2", "rc1"]))
    text += draw(st.sampled_from(["", "", ".post1"]))
    text += draw(st.sampled_from(["", "", ".dev0"]))
    return text + draw(st.sampled_from(["", "", "+cpu", "+cu118"]))


_triple = st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3))


def _dotted(triple: tuple[int, int, int]) -> str:
    return ".".join(map(str, triple))


@settings(max_examples=300, deadline=None)
@given(st.text() | st.text(alphabet="0123456789.xX*^~<>=!|-, vabrcdev+"))
def test_parse_range_raises_only_version_range_error(text: str) -> None:
    try:
        parsed = parse_range(text)
    except VersionRangeError as exc:
        assert f"'{text}'" in str(exc)
        return
    assert isinstance(parsed.describe(), str)
    assert isinstance("1.0.0" in parsed, bool)
    assert isinstance("1.0.0rc1+cpu" in parsed, bool)


@settings(max_examples=200, deadline=None)
@given(_installed_version(), _npm_range() | _pep440_range())
def test_satisfies_never_raises_on_valid_input(version: str, range_: str) -> None:
    assert isinstance(satisfies(version, range_), bool)


@settings(max_examples=200, deadline=None)
@given(_triple, _npm_range(prerelease=False))
def test_describe_is_an_equivalent_range(
    triple: tuple[int, int, int], range_: str
) -> None:
    version = _dotted(triple)
    description = parse_range(range_).describe()
    assert satisfies(version, description) == satisfies(version, range_)


@given(_triple, _triple)
def test_caret_agrees_with_reference(
    version: tuple[int, int, int], base: tuple[int, int, int]
) -> None:
    major, minor, patch = base
    if major:
        same_scope = version[0] == major
    elif minor:
        same_scope = version[:2] == (0, minor)
    else:
        same_scope = version == (0, 0, patch)
    expected = version >= base and same_scope
    assert satisfies(_dotted(version), "^" + _dotted(base)) == expected


@given(_triple, _triple)
def test_tilde_agrees_with_reference(
    version: tuple[int, int, int], base: tuple[int, int, int]
) -> None:
    expected = version >= base and version[:2] == base[:2]
    assert satisfies(_dotted(version), "~" + _dotted(base)) == expected


@given(_triple, _triple, _triple)
def test_hyphen_agrees_with_reference(
    version: tuple[int, int, int],
    low: tuple[int, int, int],
    high: tuple[int, int, int],
) -> None:
    expected = low <= version <= high
    range_ = f"{_dotted(low)} - {_dotted(high)}"
    assert satisfies(_dotted(version), range_) == expected
    # Dropping the high patch widens the top to the whole minor release.
    expected = low <= version and version[:2] <= high[:2]
    range_ = f"{_dotted(low)} - {high[0]}.{high[1]}"
    assert satisfies(_dotted(version), range_) == expected


@given(_triple, st.integers(0, 3), st.integers(0, 3))
def test_partial_comparators_agree_with_reference(
    version: tuple[int, int, int], major: int, minor: int
) -> None:
    v, partial = _dotted(version), f"{major}.{minor}"
    assert satisfies(v, "<=" + partial) == (version[:2] <= (major, minor))
    assert satisfies(v, "<" + partial) == (version[:2] < (major, minor))
    assert satisfies(v, ">" + partial) == (version[:2] > (major, minor))
    assert satisfies(v, ">=" + partial) == (version[:2] >= (major, minor))
    assert satisfies(v, partial) == (version[:2] == (major, minor))
    assert satisfies(v, f"<={major}") == (version[0] <= major)
    assert satisfies(v, f">{major}") == (version[0] > major)
