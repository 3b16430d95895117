"""neuropod._json: the depth and size bound checked before untrusted JSON is parsed.

The check scans brackets outside strings without parsing. Its verdicts are
compared with the depth of what ``json.loads`` builds, on generated documents
whose strings hold brackets, quotes, backslashes and non-ASCII text (the
cases where a scan could mistake string content for structure), and on
broken documents, where passing the check must never let ``json.loads``
recurse past the bound.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuropod import _json

# Strings a bracket scan could take for structure: loose brackets, quotes and
# escapes, and balanced runs that would look deeper than the document is.
_TRICKY = st.text(alphabet='[]{}"\\ab,:é\u2028', max_size=8) | st.builds(
    lambda n, opening, closing, inner: opening * n + inner + closing * n,
    st.integers(1, 14), st.sampled_from(["[", "{", "[{"]), st.sampled_from(["]", "}", "}]"]), st.sampled_from(["", '"', "\\"]),
)  # fmt: skip
_LEAVES = st.none() | st.booleans() | st.integers(-5, 5) | _TRICKY
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
    max_leaves=40,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


def _nest(value: Any, levels: int) -> Any:
    for i in range(levels):
        value = [value] if i % 2 else {"k[{": value}
    return value


@settings(max_examples=400, deadline=None)
@given(value=_VALUES, extra=st.integers(0, 12), max_depth=st.integers(1, 12), ascii_only=st.booleans())
def test_the_verdict_is_the_depth_of_what_json_loads_builds(
    value: Any, extra: int, max_depth: int, ascii_only: bool
) -> None:
    value = _nest(value, extra)
    text = json.dumps(value, ensure_ascii=ascii_only)
    if _depth(value) > max_depth:
        with pytest.raises(ValueError, match=f"nests more than {max_depth} levels deep"):
            _json.check_bounds(text, max_depth=max_depth)
    else:
        _json.check_bounds(text, max_depth=max_depth)


@settings(max_examples=400, deadline=None)
@given(value=_VALUES, extra=st.integers(0, 12), cut=st.integers(0, 10_000), junk=st.sampled_from(['"', "\\", "é", "[", "}"]))
def test_a_broken_document_that_passes_never_parses_deeper_than_the_bound(
    value: Any, extra: int, cut: int, junk: str
) -> None:
    text = json.dumps(_nest(value, extra), ensure_ascii=False)
    at = cut % (len(text) + 1)
    broken = text[:at] + junk + text[at:]
    try:
        _json.check_bounds(broken, max_depth=6)
    except ValueError:
        return
    try:
        parsed = json.loads(broken)
    except ValueError:
        return
    assert _depth(parsed) <= 6


def test_deep_documents_are_refused_quickly_and_shallow_ones_pass() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match="nests more than 64 levels deep"):
        _json.loads(deep)
    # Brackets inside strings, with and without escapes, are not structure.
    assert _json.loads(json.dumps(["[" * 1000, '\\"{' * 500])) == ["[" * 1000, '\\"{' * 500]
    with pytest.raises(ValueError, match="characters long"):
        _json.check_bounds("[]" * 10, max_bytes=10)


def test_depth_is_one_linear_scan_across_slices() -> None:
    """Megabytes deep costs one scan, not a pass per level; the depth carries across the scan's slices."""
    import time

    started = time.process_time()
    with pytest.raises(ValueError, match="nests more than 64 levels deep"):
        _json.check_bounds("[" * 2**23 + "]" * 2**23)
    assert time.process_time() - started < 2.0
    wide = "[" + "[]," * (_json._SLICE // 3 + 5)  # the deep part starts in the second slice
    _json.check_bounds(wide + "[" * 62 + "]" * 62 + "[]]")
    with pytest.raises(ValueError, match="nests more than 64 levels deep"):
        _json.check_bounds(wide + "[" * 64 + "]" * 64 + "[]]")


@settings(max_examples=300, deadline=None)
@given(value=_VALUES, extra=st.integers(0, 12), max_depth=st.integers(1, 12), pad=st.sampled_from(["x", "[", "}", '"']))
def test_long_ascii_documents_get_the_same_verdict(value: Any, extra: int, max_depth: int, pad: str) -> None:
    """ASCII documents of _LONG characters or more are scanned as bytes: the verdict is still the depth."""
    doc = [_nest(value, extra), pad * _json._LONG]  # brackets and quotes inside a string are not structure
    text = json.dumps(doc, ensure_ascii=True)
    assert len(text) >= _json._LONG and text.isascii()
    if _depth(doc) > max_depth:
        with pytest.raises(ValueError, match=f"nests more than {max_depth} levels deep"):
            _json.check_bounds(text, max_depth=max_depth)
    else:
        _json.check_bounds(text, max_depth=max_depth)
