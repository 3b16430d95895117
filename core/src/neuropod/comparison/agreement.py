"""How a candidate's outputs compare with the baseline's, output by output, over every input set."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from neuropod.comparison.inputs import InputSet
from neuropod.comparison.results import OutputAgreement, Worst
from neuropod.spec import TensorSpec

#: How many of the worst elements each output keeps.
WORST_KEPT = 5


def compare_sets(spec: Sequence[TensorSpec], baseline: Sequence[InputSet], candidate: Sequence[InputSet], *,
                 rtol: float, atol: float) -> list[OutputAgreement]:  # fmt: skip
    """One :class:`OutputAgreement` per output of ``spec`` (the baseline's), in spec order."""
    return [_one(t, baseline, candidate, rtol=rtol, atol=atol) for t in spec]


def _one(t: TensorSpec, baseline: Sequence[InputSet], candidate: Sequence[InputSet], *, rtol: float,
         atol: float) -> OutputAgreement:  # fmt: skip
    exact = t.dtype in ("string", "bytes", "bool") or t.dtype.startswith(("int", "uint"))
    result = OutputAgreement(name=t.name, dtype=t.dtype, exact=exact)
    worst: list[tuple[bool, float, Worst]] = []
    for i, (want_set, got_set) in enumerate(zip(baseline, candidate)):
        if t.name not in got_set or t.name not in want_set:
            who = "the candidate" if t.name not in got_set else "the baseline"
            result.problem = f"{who} returned no {t.name!r} for input set {i + 1}"
            return result
        want, got = np.asarray(want_set[t.name]), np.asarray(got_set[t.name])
        if want.shape != got.shape:
            result.problem = f"shape {list(got.shape)} where the baseline's is {list(want.shape)} (input set {i + 1})"
            return result
        result.elements += int(want.size)
        if exact:
            bad = _exact_mismatch(want, got)
            result.outside += int(bad.sum())
            for where in np.argwhere(bad)[:WORST_KEPT]:  # argwhere: a 0-d output too (nonzero refuses one)
                at = tuple(int(x) for x in where)
                worst.append((True, math.inf, Worst(i, list(at), _show(got[at]), _show(want[at]))))
            continue
        w, g = want.astype(np.float64), got.astype(np.float64)
        same = (np.isnan(w) & np.isnan(g)) | (w == g)  # NaN against NaN, and an infinity against itself
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            abs_err = np.where(same, 0.0, np.abs(g - w))
            abs_err = np.where(np.isnan(abs_err), np.inf, abs_err)  # NaN against a number
            rel_err = np.where(abs_err == 0, 0.0, abs_err / np.abs(w))
            rel_err = np.where(np.isnan(rel_err), np.inf, rel_err)  # an infinite baseline
        bad = ~np.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        result.outside += int(bad.sum())
        if abs_err.size:
            result.max_abs_error = _max(result.max_abs_error, float(abs_err.max()))
            result.max_rel_error = _max(result.max_rel_error, float(rel_err.max()))
            # elements outside the tolerance first (a large error may be within it where the baseline is large)
            order = np.lexsort((-np.arange(abs_err.size), abs_err.ravel(), bad.ravel()))[::-1][:WORST_KEPT]
            for flat in order:
                index = np.unravel_index(int(flat), abs_err.shape)
                if not bad[index] and abs_err[index] == 0:
                    break
                worst.append((bool(bad[index]), float(abs_err[index]), Worst(
                    i, [int(x) for x in index], _show(got[index]), _show(want[index]),
                    _finite(float(abs_err[index])), _finite(float(rel_err[index])),
                )))  # fmt: skip
    worst.sort(key=lambda p: (not p[0], -p[1]))
    result.worst = [w for _, _, w in worst[:WORST_KEPT]]
    result.max_abs_error = _finite(result.max_abs_error)
    result.max_rel_error = _finite(result.max_rel_error)
    return result


def _exact_mismatch(want: np.ndarray, got: np.ndarray) -> np.ndarray:
    if want.dtype.kind in "OSU" or got.dtype.kind in "OSU":
        flat = [a != b for a, b in zip(want.ravel().tolist(), got.ravel().tolist())]
        return np.array(flat, dtype=bool).reshape(want.shape)
    return np.asarray(want != got)


def _max(a: float | None, b: float) -> float:
    return b if a is None else max(a, b)


def _finite(value: float | None) -> float | None:
    """JSON has no infinity or NaN: such an error is given as None (and the element is listed)."""
    return value if value is None or math.isfinite(value) else None


def _show(value: object) -> object:
    """An element as JSON can hold it (bytes as their repr, numpy scalars as Python's)."""
    if isinstance(value, bytes):
        return repr(value)
    item = getattr(value, "item", None)
    value = item() if callable(item) else value
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value
