"""The checks compiled per model (SpecValidator's fast path) agree with the general checks on every call:
they pass exactly what fits, and anything else gets the general checks' answer, error and all."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neuropod.errors import SpecError
from neuropod.spec import SpecValidator, parse_spec

INPUTS = parse_spec(
    [
        {"name": "x", "dtype": "float32", "shape": ["batch", 3]},
        {"name": "ids", "dtype": "int64", "shape": ["batch", None]},
        {"name": "scale", "dtype": "float64", "shape": []},
    ],
    "in",
)
OUTPUTS = parse_spec(
    [{"name": "out", "dtype": "float32", "shape": ["batch", "k"]}, {"name": "n", "dtype": "int64", "shape": ["k"]}], "out"
)


def _general(v: SpecValidator, inputs: dict[str, Any]) -> Any:
    """The general checks alone (the fast paths switched off)."""
    plain = SpecValidator(v.model_name, list(v._inputs[n][5] for n in v._inputs), list(v._outputs[n][5] for n in v._outputs))
    plain._fast_inputs = plain._fast_outputs = None
    try:
        return plain.check_inputs(inputs)
    except SpecError as e:
        return str(e)


def _fast_or_general(v: SpecValidator, inputs: dict[str, Any]) -> Any:
    try:
        return v.check_inputs(inputs)
    except SpecError as e:
        return str(e)


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(0, 4), other_batch=st.integers(0, 4), cols=st.sampled_from([3, 2]), free=st.integers(0, 3),
    x_dtype=st.sampled_from(["float32", "float64"]), drop=st.sampled_from([None, "x", "scale"]),
    extra=st.booleans(), strided=st.booleans(),
)  # fmt: skip
def test_agrees_with_the_general_checks(
    batch: int, other_batch: int, cols: int, free: int, x_dtype: str, drop: str | None, extra: bool, strided: bool
) -> None:
    v = SpecValidator("m", INPUTS, OUTPUTS)
    x = np.zeros((batch, cols * (2 if strided else 1)), x_dtype)
    inputs: dict[str, Any] = {
        "x": x[:, ::2] if strided else x, "ids": np.zeros((other_batch, free), np.int64), "scale": np.array(2.0)
    }
    if drop:
        del inputs[drop]
    if extra:
        inputs["nope"] = np.zeros(1)
    fast, general = _fast_or_general(v, inputs), _general(v, inputs)
    if isinstance(general, str):
        assert fast == general
    else:
        assert fast[1] == general[1]
        assert fast[0].keys() == general[0].keys()
        for name, arr in general[0].items():
            assert fast[0][name].flags.c_contiguous
            np.testing.assert_array_equal(fast[0][name], arr)


FIXED = parse_spec(
    [
        {"name": "m", "dtype": "float32", "shape": [2, 3]},
        {"name": "v", "dtype": "int32", "shape": [3]},
        {"name": "s", "dtype": "float64", "shape": []},
    ],
    "in",
)
SHAPES = [(2, 3), (3, 2), (2, 3, 1), (1, 2, 3), (6,), (3,), (2,), (), (1,), (0, 3), (2, 0)]


@settings(max_examples=300, deadline=None)
@given(
    m_shape=st.sampled_from(SHAPES), v_shape=st.sampled_from(SHAPES), s_shape=st.sampled_from(SHAPES),
    v_dtype=st.sampled_from(["int32", "int64"]), fortran=st.booleans(),
)  # fmt: skip
def test_fixed_shapes_agree_with_the_general_checks(
    m_shape: tuple[int, ...], v_shape: tuple[int, ...], s_shape: tuple[int, ...], v_dtype: str, fortran: bool
) -> None:
    """Fully fixed shapes are checked with one tuple comparison: it passes exactly the right rank and sizes."""
    v = SpecValidator("m", FIXED, FIXED)
    inputs: dict[str, Any] = {
        "m": np.zeros(m_shape, np.float32, order="F" if fortran else "C"),
        "v": np.zeros(v_shape, v_dtype),
        "s": np.zeros(s_shape, np.float64),
    }
    fast, general = _fast_or_general(v, inputs), _general(v, inputs)
    if isinstance(general, str):
        assert fast == general
    else:
        assert fast[1] == general[1] == {}
        for name, arr in general[0].items():
            assert fast[0][name].flags.c_contiguous
            np.testing.assert_array_equal(fast[0][name], arr)


def test_outputs_agree_and_report_the_same_misfit() -> None:
    v = SpecValidator("m", INPUTS, OUTPUTS)
    _, bindings = v.check_inputs({"x": np.zeros((2, 3), np.float32), "ids": np.zeros((2, 1), np.int64), "scale": np.array(1.0)})
    v.check_outputs({"out": np.zeros((2, 5), np.float32), "n": np.zeros(5, np.int64)}, dict(bindings))
    with pytest.raises(SpecError, match=r"symbol 'k'.*expected to be of size 5 \(from tensor 'out'\), but was of size 4"):
        v.check_outputs({"out": np.zeros((2, 5), np.float32), "n": np.zeros(4, np.int64)}, dict(bindings))
    with pytest.raises(SpecError, match=r"symbol 'batch'.*expected to be of size 2 \(from tensor 'x'\), but was of size 3"):
        v.check_outputs({"out": np.zeros((3, 5), np.float32), "n": np.zeros(5, np.int64)}, dict(bindings))
    with pytest.raises(SpecError, match="did not return output"):
        v.check_outputs({"out": np.zeros((2, 5), np.float32)}, dict(bindings))
    # A 0-d output given as a numpy scalar is still turned into an array by the general checks.
    scalar_out = SpecValidator("m", INPUTS, parse_spec([{"name": "s", "dtype": "float32", "shape": []}], "o"))
    outputs = {"s": np.float32(1)}
    scalar_out.check_outputs(outputs, {})
    assert type(outputs["s"]) is np.ndarray


def test_odd_names_and_symbols_are_literals() -> None:
    """Names and symbols reach the generated checks only as literals."""
    name, symbol = "x'); import os  #", "größe"
    spec = parse_spec([{"name": name, "dtype": "float32", "shape": [symbol]}], "in")
    v = SpecValidator("m", spec, spec)
    arr = np.zeros(3, np.float32)
    checked, bindings = v.check_inputs({name: arr})
    assert checked[name] is arr and bindings == {symbol: (3, name)}
    v.check_outputs({name: arr}, bindings)
    with pytest.raises(SpecError, match="expected to be of size 3"):
        v.check_outputs({name: np.zeros(2, np.float32)}, bindings)


def test_string_specs_take_the_general_checks() -> None:
    spec = parse_spec([{"name": "s", "dtype": "string", "shape": [None]}], "in")
    v = SpecValidator("m", spec, spec)
    assert v._fast_inputs is None
    checked, _ = v.check_inputs({"s": np.array([b"caf\xc3\xa9"])})
    assert checked["s"].tolist() == ["café"]
