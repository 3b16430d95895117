"""Matching installed framework versions against a package's version range.

A package names the framework versions it works with as a range string
(``platform_version_semver``); installed frameworks report PEP 440 versions
(``2.13.0+cpu``, ``2.15.0.post1``, ``2.16.0rc1``). :func:`satisfies` answers
whether one is inside the other.

Grammar
-------
A range is one or more alternatives joined by ``||`` (OR); an empty
alternative means "any version", as in node-semver. Each alternative belongs
to one of two families, picked per alternative:

* **PEP 440 specifier set** when it contains a comma or one of the operators
  ``~=``, ``==``, ``!=``, ``===``: ``>=2.13,<2.15``, ``~=2.13.0``,
  ``==2.13.*``, ``!=2.14.0``.
* **npm (node-semver) range** otherwise: space-separated comparators that must
  all hold (AND). A comparator is an optional operator (``<`` ``<=`` ``>``
  ``>=`` ``=`` ``~`` ``~>`` ``^``, spaces after it allowed) and a version of
  up to three parts with optional leading ``v``, where any part may be a
  wildcard ``x``/``X``/``*`` or be left out (``1``, ``1.2``, ``1.2.x``). A
  hyphen range ``A - B`` makes up a whole alternative. Wildcards, tilde, caret
  and hyphen ranges desugar exactly as node-semver documents them, e.g.
  ``^0.2.3`` is ``>=0.2.3 <0.3.0``, ``<=2`` is ``<3.0.0``, ``>2.1`` is
  ``>=2.2.0`` and ``1.2.3 - 2.3`` is ``>=1.2.3 <2.4.0``. Build metadata
  (``+build``) in a range is ignored, as node-semver does.

  npm prerelease tags are translated to PEP 440: ``-alpha``/``-a``,
  ``-beta``/``-b``, ``-rc``/``-c``/``-pre``/``-preview`` and ``-dev``, each
  optionally numbered (``1.2.3-beta.2`` is ``1.2.3b2``); a purely numeric tag
  ``-N`` becomes ``.devN``, so ``-0`` keeps its npm meaning of "the lowest
  prerelease". The PEP 440 spelling (``>=2.16.0rc0``) is accepted too. Any
  other tag is an error, since it has no place in PEP 440 ordering.

  Two small leniencies beyond node-semver: leading zeros are accepted
  (``2024.01``), and numbers after a wildcard are ignored everywhere
  (``1.x.3`` is ``1.x``; node-semver does that only in ``^``/``~``/hyphens).

Matching decisions
------------------
* **Local labels never exclude a match**: ``2.13.0+cpu`` is compared as
  ``2.13.0`` in both families, so it satisfies ``2.13.0``, ``<=2.13.0`` and
  ``==2.13.0``. The one exception is a PEP 440 set that itself names a local
  label (``==2.13.0+cpu``), which is given the full version.
* **Post releases follow PEP 440 ordering**: ``2.15.0.post1`` sorts just after
  ``2.15.0``, so it satisfies ``>=2.15.0``, ``^2.15.0``, ``~2.15.0``,
  ``2.15.x`` and ``<2.16`` but not ``<=2.15.0`` or the exact ``2.15.0``.
  npm ``>2.15.0`` matches it too; PEP 440 ``>2.15.0`` does not, by its spec.
* **Prereleases (including ``.devN``) must be asked for.** In the npm family
  the node-semver rule applies: a prerelease matches an AND-set only if one
  of that set's comparators names a prerelease of the same release
  (``>=2.16.0-rc.0`` admits ``2.16.0rc1``; ``>=2.15`` and ``*`` do not). In
  the PEP 440 family a prerelease matches only if some specifier other than
  ``!=`` names one
  (packaging's classic rule, applied explicitly because packaging 26 changed
  its default). Upper bounds created by desugaring (``^1.2.3`` gives
  ``<2.0.0-0``) sit below every prerelease of that release.
* Versions with more than three release parts (``1.2.3.4``) compare by PEP 440.

:meth:`VersionRange.describe` renders each alternative as PEP 440 style
comparators joined by ", " and alternatives by " || " (``>=2.13 <2.15`` gives
``>=2.13.0, <2.15.0``; ``1.x || ^3.1`` gives ``>=1.0.0, <2.0.0 || >=3.1.0,
<4.0.0``).
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

from packaging.specifiers import InvalidSpecifier, Specifier, SpecifierSet
from packaging.version import Version

from neuropod.errors import VersionRangeError

__all__ = ["VersionRange", "normalize_version", "parse_range", "satisfies"]

_HINT = (
    "accepted forms include '1.x', '^2.13.0', '~1.4', '>=2.13 <2.15', "
    "'1.4.0 - 1.6.0', '>=2.13,<2.15', '~=2.13.0', '==2.13.*'"
)
_PRE_HINT = (
    "only alpha/a, beta/b, rc/c/pre/preview, dev or numeric prerelease tags "
    "(e.g. '-rc.1', '-beta2', 'rc1') can be compared with PEP 440 versions"
)

# ASCII classes on purpose: \d would accept other scripts' digits, which int()
# converts but no version ever contains.
_PART = r"(?:[0-9]+|[xX*])"
_IDENTS = r"[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*"
# PEP 440 spelling glued to the patch ("rc1", ".dev0"); "1.2.3.x" is no tag.
_PEP_TAG = r"(?:[A-Za-z]|\.[A-Za-z]{2})[0-9A-Za-z.]*"
_VERSION = (
    rf"v?(?P<M>{_PART})(?:\.(?P<m>{_PART})(?:\.(?P<p>{_PART})"
    rf"(?:-(?P<npm_pre>{_IDENTS})|(?P<pep_pre>{_PEP_TAG}))?"
    rf"(?:\+{_IDENTS})?)?)?"
)
_OPERATOR = r"~>?|\^|[<>]=?|="
_COMPARATOR_RE = re.compile(rf"(?P<op>{_OPERATOR})?{_VERSION}")
_VERSION_RE = re.compile(_VERSION)
_OPERATOR_RE = re.compile(_OPERATOR)
# node-semver lets an operator and its version be separated by spaces; the
# lookahead keeps "< = 1" from being glued into "<=1".
_OPERATOR_SPACE_RE = re.compile(rf"({_OPERATOR})\s+(?=[0-9vxX*])")
_HYPHEN_RE = re.compile(r"(\S+)\s+-\s+(\S+)")
_PEP440_RE = re.compile(r",|~=|==|!=")


_OPERATORS: dict[str, Callable[[Version, Version], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
}


class _Problem(Exception):
    """What is wrong with one part of a range; reported with the full text."""


def _error(text: str, problem: str) -> VersionRangeError:
    return VersionRangeError(f"Invalid version range '{text}': {problem}; {_HINT}")


def normalize_version(version: str) -> Version:
    """Parse an installed framework version (PEP 440)."""
    try:
        return Version(version)
    except (ValueError, TypeError) as exc:  # ValueError also covers huge ints
        raise VersionRangeError(
            f"Invalid version '{version}': not a PEP 440 version "
            "such as '2.13.0', '2.16.0rc1' or '2.13.0+cpu'"
        ) from exc


def _public(version: Version) -> Version:
    return version if version.local is None else Version(version.public)


def _release_key(version: Version) -> tuple[int, tuple[int, ...]]:
    # 2.16rc1 and 2.16.0rc1 are prereleases of the same release.
    release = list(version.release)
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    return version.epoch, tuple(release)


@dataclass(frozen=True)
class _Comparator:
    op: str  # "<", "<=", ">", ">=" or "=="
    version: Version

    def test(self, version: Version) -> bool:
        return bool(_OPERATORS[self.op](version, self.version))

    def __str__(self) -> str:
        v = self.version
        # "<2.0.0.dev0" is how "<2.0.0-0" is stored; PEP 440 spells that
        # "<2.0.0", which also excludes the prereleases of 2.0.0.
        if self.op == "<" and v.dev == 0 and v.pre is None and v.post is None:
            return f"<{v.base_version}"
        return f"{self.op}{v}"


@dataclass(frozen=True)
class _NpmSet:
    comparators: tuple[_Comparator, ...]  # empty means any version

    def contains(self, version: Version) -> bool:
        version = _public(version)
        if not all(c.test(version) for c in self.comparators):
            return False
        if not version.is_prerelease:
            return True
        key = _release_key(version)
        return any(
            c.version.is_prerelease and _release_key(c.version) == key
            for c in self.comparators
        )

    def describe(self) -> str:
        return ", ".join(map(str, self.comparators)) or "*"


@dataclass(frozen=True)
class _PepSet:
    specifiers: tuple[Specifier, ...]  # in the order written, for describe()
    specifier_set: SpecifierSet
    allows_prereleases: bool
    uses_local: bool

    def contains(self, version: Version) -> bool:
        if not self.uses_local:
            version = _public(version)
        if version.is_prerelease and not self.allows_prereleases:
            return False
        return self.specifier_set.contains(version, prereleases=True)

    def describe(self) -> str:
        return ", ".join(map(str, self.specifiers)) or "*"


_Alternative: TypeAlias = _NpmSet | _PepSet


@dataclass(frozen=True)
class VersionRange:
    """A parsed range; ``version in parsed_range`` tests membership."""

    text: str
    _alternatives: tuple[_Alternative, ...] = field(repr=False, compare=False)

    def __contains__(self, version: str | Version) -> bool:
        if isinstance(version, str):
            version = normalize_version(version)
        elif not isinstance(version, Version):
            raise TypeError(f"a version is a str such as '2.13.0', not {type(version).__name__} {version!r:.60}")
        return any(alt.contains(version) for alt in self._alternatives)

    def __str__(self) -> str:
        return self.text

    def describe(self) -> str:
        """The range in normalized comparator form, e.g. ``>=2.13.0, <2.15.0``."""
        return " || ".join(alt.describe() for alt in self._alternatives)


def _parse_pep440(part: str) -> _PepSet:
    specifiers: list[Specifier] = []
    allows_prereleases = False
    for item in (s.strip() for s in part.split(",")):
        if not item:
            continue
        try:
            spec = Specifier(item)
        except InvalidSpecifier:
            raise _Problem(f"'{item}' is not a valid PEP 440 specifier") from None
        if not spec.version:  # packaging accepts a bare "==="
            raise _Problem(f"'{item}' has no version")
        if spec.operator != "===":
            # Parsed now so a bad number fails here, not later in satisfies().
            bound = Version(spec.version.removesuffix(".*"))
            allows_prereleases |= spec.operator != "!=" and bound.is_prerelease
        specifiers.append(spec)
    uses_local = any("+" in s.version for s in specifiers)
    return _PepSet(
        tuple(specifiers), SpecifierSet(specifiers), allows_prereleases, uses_local
    )


def _prerelease(release: str, npm_tag: str | None, pep_tag: str | None) -> Version:
    if npm_tag is not None and npm_tag.isdigit():
        return Version(f"{release}.dev{int(npm_tag)}")
    tag = f"-{npm_tag}" if npm_tag is not None else str(pep_tag)
    try:
        version = Version(release + tag)
    except ValueError:
        version = None
    if version is None or version.post is not None or not version.is_prerelease:
        raise _Problem(f"prerelease tag '{tag}' is not understood; {_PRE_HINT}")
    return version


def _ints(match: re.Match[str]) -> tuple[int | None, int | None, int | None]:
    """Major, minor, patch; None for a wildcard and for everything after one."""
    parts: list[int | None] = []
    for name in ("M", "m", "p"):
        text = match[name]
        # node-semver ignores numbers after a wildcard ("^1.x.3" is "^1.x").
        wild = text is None or text in ("x", "X", "*") or None in parts
        parts.append(None if wild else int(text))
    return parts[0], parts[1], parts[2]


def _bound(match: re.Match[str]) -> Version:
    major, minor, patch = (int(match[n]) for n in ("M", "m", "p"))
    release = f"{major}.{minor}.{patch}"
    if match["npm_pre"] is None and match["pep_pre"] is None:
        return Version(release)
    return _prerelease(release, match["npm_pre"], match["pep_pre"])


def _ge(*release: int) -> _Comparator:
    return _Comparator(">=", Version(".".join(map(str, release))))


def _below(*release: int) -> _Comparator:
    # node-semver's "<X.Y.Z-0": below every prerelease of X.Y.Z. .dev0 is the
    # lowest PEP 440 version of a release, and as a bound it never admits a
    # prerelease by the same-release rule, because no prerelease is below it.
    return _Comparator("<", Version(".".join(map(str, release)) + ".dev0"))


def _desugar(op: str, match: re.Match[str]) -> list[_Comparator]:
    major, minor, patch = _ints(match)
    if major is None:  # "*", "^x", "~*", ">=x": anything; ">x", "<x": nothing
        return [_below(0, 0, 0)] if op in ("<", ">") else []
    if op in ("~", "~>"):
        if minor is None:
            return [_ge(major, 0, 0), _below(major + 1, 0, 0)]
        low = (
            _ge(major, minor, 0) if patch is None else _Comparator(">=", _bound(match))
        )
        return [low, _below(major, minor + 1, 0)]
    if op == "^":
        if minor is None:
            return [_ge(major, 0, 0), _below(major + 1, 0, 0)]
        if patch is None:
            upper = (0, minor + 1, 0) if major == 0 else (major + 1, 0, 0)
            return [_ge(major, minor, 0), _below(*upper)]
        if major:
            upper = (major + 1, 0, 0)
        elif minor:
            upper = (0, minor + 1, 0)
        else:
            upper = (0, 0, patch + 1)
        return [_Comparator(">=", _bound(match)), _below(*upper)]
    if patch is not None:  # a full version with a primitive operator
        return [_Comparator("==" if op in ("", "=") else op, _bound(match))]
    # X-ranges: the wildcard part widens the bound to the whole major/minor.
    if op in ("", "="):
        if minor is None:
            return [_ge(major, 0, 0), _below(major + 1, 0, 0)]
        return [_ge(major, minor, 0), _below(major, minor + 1, 0)]
    if op == ">":
        return [_ge(major + 1, 0, 0) if minor is None else _ge(major, minor + 1, 0)]
    if op == "<=":
        return [
            _below(major + 1, 0, 0) if minor is None else _below(major, minor + 1, 0)
        ]
    if op == "<":
        return [_below(major, minor or 0, 0)]
    return [_ge(major, minor or 0, 0)]  # ">="


def _hyphen(low_text: str, high_text: str) -> list[_Comparator]:
    low, high = _VERSION_RE.fullmatch(low_text), _VERSION_RE.fullmatch(high_text)
    if low is None or high is None:
        bad = low_text if low is None else high_text
        raise _Problem(f"'{bad}' in a hyphen range is not a version")
    comparators: list[_Comparator] = []
    major, minor, patch = _ints(low)
    if major is not None:
        comparators.append(
            _Comparator(">=", _bound(low))
            if patch is not None
            else _ge(major, minor or 0, 0)
        )
    major, minor, patch = _ints(high)
    if major is None:
        return comparators
    if minor is None:
        comparators.append(_below(major + 1, 0, 0))
    elif patch is None:
        comparators.append(_below(major, minor + 1, 0))
    else:
        comparators.append(_Comparator("<=", _bound(high)))
    return comparators


def _parse_npm(part: str) -> _NpmSet:
    hyphen = _HYPHEN_RE.fullmatch(part)
    if hyphen is not None:
        return _NpmSet(tuple(_hyphen(hyphen[1], hyphen[2])))
    comparators: list[_Comparator] = []
    for token in _OPERATOR_SPACE_RE.sub(r"\1", part).split():
        match = _COMPARATOR_RE.fullmatch(token)
        if match is not None:
            comparators += _desugar(match["op"] or "", match)
        elif _OPERATOR_RE.fullmatch(token):
            raise _Problem(f"operator '{token}' is not followed by a version")
        elif token == "-":
            raise _Problem("a hyphen range needs one version on each side of ' - '")
        else:
            raise _Problem(f"'{token}' is not a valid comparator")
    return _NpmSet(tuple(comparators))


@functools.lru_cache(maxsize=512)
def _parse_cached(text: str) -> VersionRange:
    alternatives: list[_Alternative] = []
    try:
        for part in (p.strip() for p in text.split("||")):
            parse = _parse_pep440 if _PEP440_RE.search(part) else _parse_npm
            alternatives.append(parse(part))
    except _Problem as exc:
        raise _error(text, str(exc)) from None
    except ValueError as exc:  # e.g. a number beyond int()'s digit limit
        raise _error(text, str(exc)) from exc
    return VersionRange(text, tuple(alternatives))


def parse_range(range_: str) -> VersionRange:
    """Parse a version range; raises :class:`VersionRangeError` if invalid."""
    if not isinstance(range_, str):
        raise VersionRangeError(
            f"Invalid version range {range_!r}: expected a string; {_HINT}"
        )
    return _parse_cached(range_)


def satisfies(version: str, range_: str) -> bool:
    """Whether installed ``version`` (PEP 440) lies inside ``range_``.

    :raises TypeError: ``version`` or ``range_`` is not a string.
    :raises VersionRangeError: either is not a valid version or range.
    """
    if not isinstance(version, (str, Version)):
        raise TypeError(
            f"satisfies(): version must be a str such as '2.13.0', not {type(version).__name__} {version!r:.60}"
        )
    if not isinstance(range_, str):
        raise TypeError(f"satisfies(): range_ must be a str such as '^2.13.0', not {type(range_).__name__} {range_!r:.60}")
    return version in parse_range(range_)
