"""Whether a plugin's distribution admits this core: the ``neuropod`` range in its ``Requires-Dist``."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from neuropod._version import __version__

# A Requires-Dist header for the core: "neuropod", maybe extras, then a
# specifier (maybe in parentheses), maybe a marker. "neuropod-onnx" does not match.
_REQUIRES_CORE = re.compile(
    r"Requires-Dist:\s*neuropod\s*(?:\[[^\]]*\])?\s*\(?(?P<spec>(?:[<>=!~][^;()]*)?)\)?\s*(?:;(?P<marker>.*))?",
    re.IGNORECASE,
)
_SIMPLE_CLAUSE = re.compile(r"(?P<op>>=|<=|==|!=|>|<)(?P<version>\d+(?:\.\d+)*)")
_COMPARE: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


def core_range(dist: Any) -> str | None:
    """The ``neuropod`` range a distribution requires (``">=0.4,<0.5"``), ``""``
    when it names none, or None when its metadata cannot be read.

    Reads the ``Requires-Dist`` lines of its METADATA directly: parsing the
    whole file with the email package would cost a third of listing backends.
    Requirements under an extra do not count.
    """
    try:
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    except Exception:  # noqa: BLE001 - unreadable metadata is "unknown", not an error
        return None
    for line in text.splitlines():
        if not line.strip():
            break  # the headers end at the first blank line; the description follows
        m = _REQUIRES_CORE.fullmatch(line.strip())
        if m and "extra" not in (m["marker"] or ""):
            return m["spec"].replace(" ", "")
    return ""


def core_satisfies(spec: str | None, version: str = __version__) -> bool:
    """Whether ``version`` of the core is in a plugin's required range (an empty or unknown range admits it)."""
    if not spec:
        return True
    clauses = spec.split(",")
    matches = [_SIMPLE_CLAUSE.fullmatch(c) for c in clauses]
    if re.fullmatch(r"\d+(\.\d+)*", version) and all(matches):
        # The usual ">=0.4,<0.5" without importing packaging.specifiers (15 ms).
        def release(v: str) -> tuple[int, ...]:
            parts = [int(p) for p in v.split(".")]
            return tuple(parts + [0] * (4 - len(parts)))

        return all(_COMPARE[m["op"]](release(version), release(m["version"])) for m in matches if m)
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        return SpecifierSet(spec).contains(version, prereleases=True)
    except InvalidSpecifier:
        return True  # pip would not have installed it; let the import decide
