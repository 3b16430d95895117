"""Tests for neuropod.spec: parsing specs and checking tensors against them."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from neuropod.errors import PackageError, SpecError
from neuropod.spec import DTYPES, SpecValidator, TensorSpec, parse_spec, to_string_array

ALL_DTYPES = list(DTYPES)
NUMERIC_DTYPES = [d for d in ALL_DTYPES if d not in ("string", "bytes")]
WHERE = "config.json: input_spec"


def _entry(name: str = "x", dtype: str = "float32", shape: Any = (None,)) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape}


def _validator(inputs: list[tuple[str, str, tuple]], outputs: list[tuple[str, str, tuple]] = ()) -> SpecValidator:
    return SpecValidator(
        "m",
        [TensorSpec(n, d, tuple(s)) for n, d, s in inputs],
        [TensorSpec(n, d, tuple(s)) for n, d, s in outputs],
    )


def _array(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """An array of a spec dtype; strings as a numpy unicode array, bytes as an object array of bytes."""
    if dtype == "string":
        return np.full(shape, "s")
    if dtype == "bytes":
        return np.full(shape, b"s", dtype=object)
    return np.zeros(shape, dtype=DTYPES[dtype])


def _message(excinfo: pytest.ExceptionInfo) -> str:
    return str(excinfo.value)


# --- parse_spec: valid entries ---------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        [],
        [0],
        [3, 4],
        [None],
        [None, None, None],
        ["batch_size"],
        ["batch_size", None, 4],
        ["_x1", "batch_size", "_x1"],
        [10**12],
    ],
)
def test_parse_spec_accepts_valid_shapes(shape: list) -> None:
    (spec,) = parse_spec([_entry(shape=shape)], WHERE)
    assert spec == TensorSpec("x", "float32", tuple(shape))
    assert isinstance(spec.shape, tuple)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_parse_spec_accepts_every_dtype(dtype: str) -> None:
    assert parse_spec([_entry(dtype=dtype, shape=[2])], WHERE) == (TensorSpec("x", dtype, (2,)),)


def test_parse_spec_keeps_order_and_accepts_tuples() -> None:
    entries = (_entry("b", "int64", [1]), _entry("a", "string", ["n"]), _entry("c", "bool", []))
    specs = parse_spec(entries, WHERE)
    assert [s.name for s in specs] == ["b", "a", "c"]
    assert specs[1] == TensorSpec("a", "string", ("n",))
    assert parse_spec([], WHERE) == ()
    # A shape given as a tuple (packager call) is fine too.
    assert parse_spec([{"name": "x", "dtype": "int8", "shape": (1, None)}], WHERE)[0].shape == (1, None)


def test_parse_spec_passes_tensor_specs_through() -> None:
    ts = TensorSpec("x", "float32", ("batch", 3))
    specs = parse_spec([ts, _entry("y", "int32", [2])], WHERE)
    assert specs[0] is ts
    assert specs[1] == TensorSpec("y", "int32", (2,))


def test_parse_spec_catches_duplicates_across_tensor_specs_and_dicts() -> None:
    with pytest.raises(PackageError, match=r"^config\.json: input_spec\[1\]: tensor name 'x' appears twice"):
        parse_spec([TensorSpec("x", "float32", ()), _entry("x")], WHERE)


def test_tensor_spec_round_trip_and_str() -> None:
    ts = TensorSpec("x", "float32", ("batch_size", None, 4))
    assert ts.to_dict() == {"name": "x", "dtype": "float32", "shape": ["batch_size", None, 4]}
    assert parse_spec([ts.to_dict()], WHERE) == (ts,)
    assert ts.describe_shape() == "[batch_size, None, 4]"
    assert str(ts) == "x: float32 [batch_size, None, 4]"
    assert TensorSpec("s", "string", ()).describe_shape() == "[]"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ts.name = "y"  # type: ignore[misc]


# --- parse_spec: errors ----------------------------------------------------

_W = re.escape(WHERE)

PARSE_ERRORS = [
    # not a list
    pytest.param({"name": "x"}, rf"^{_W} must be a list of \{{name, dtype, shape\}} objects, not dict$", id="dict"),
    pytest.param(None, rf"^{_W} must be a list .*, not null$", id="null"),
    pytest.param("x", rf"^{_W} must be a list .*, not str$", id="str"),
    pytest.param(3, rf"^{_W} must be a list .*, not int$", id="int"),
    # entry not an object
    pytest.param([_entry(), 3], rf"^{_W}\[1\] must be an object with name, dtype and shape, not int$", id="entry-int"),
    pytest.param([None], rf"^{_W}\[0\] must be an object .*, not null$", id="entry-null"),
    pytest.param([["x", "float32", []]], rf"^{_W}\[0\] must be an object .*, not list$", id="entry-list"),
    # missing / unknown fields
    pytest.param([{"dtype": "float32", "shape": []}], rf"^{_W}\[0\] is missing 'name'$", id="missing-name"),
    pytest.param([{"name": "x", "shape": []}], rf"^{_W}\[0\] is missing 'dtype'$", id="missing-dtype"),
    pytest.param([_entry(), {"name": "y", "dtype": "int8"}], rf"^{_W}\[1\] is missing 'shape'$", id="missing-shape"),
    pytest.param(
        [{**_entry(), "device": "gpu", "doc": ""}],
        rf"^{_W}\[0\] has unknown field\(s\) 'device', 'doc'; allowed: name, dtype, shape$",
        id="unknown-fields",
    ),
    pytest.param([{**_entry(), 1: 2}], rf"^{_W}\[0\] has unknown field\(s\) 1;", id="unknown-non-str-key"),
    # name
    pytest.param([_entry(name="")], rf"^{_W}\[0\]\.name must be a non-empty string, not ''$", id="empty-name"),
    pytest.param([_entry(name=3)], rf"^{_W}\[0\]\.name must be a non-empty string, not 3$", id="int-name"),
    pytest.param([_entry(name=None)], rf"^{_W}\[0\]\.name must be a non-empty string, not None$", id="null-name"),
    # dtype
    pytest.param(
        [_entry(dtype="float8")],
        rf"^{_W}\[0\] \('x'\): dtype 'float8' is not one of float16, float32, float64, int8, int16, int32, "
        r"int64, uint8, uint16, uint32, uint64, bool, string, bytes$",
        id="unknown-dtype",
    ),
    pytest.param([_entry(dtype="Float32")], rf"^{_W}\[0\] \('x'\): dtype 'Float32' is not one of", id="dtype-case"),
    pytest.param([_entry(dtype=None)], rf"^{_W}\[0\] \('x'\): dtype None is not one of", id="null-dtype"),
    pytest.param([_entry(dtype=["float32"])], rf"^{_W}\[0\] \('x'\): dtype \['float32'\] is not", id="list-dtype"),
    # shape not a list
    pytest.param([_entry(shape="3")], rf"^{_W}\[0\] \('x'\): shape must be a list, not str$", id="shape-str"),
    pytest.param([_entry(shape=3)], rf"^{_W}\[0\] \('x'\): shape must be a list, not int$", id="shape-int"),
    pytest.param([_entry(shape=None)], rf"^{_W}\[0\] \('x'\): shape must be a list, not null$", id="shape-null"),
    pytest.param([_entry(shape={"0": 1})], rf"^{_W}\[0\] \('x'\): shape must be a list, not dict$", id="shape-dict"),
    # bad dims
    pytest.param([_entry(shape=[-1])], rf"^{_W}\[0\] \('x'\): shape\[0\] is -1; a dim is a size >= 0", id="negative"),
    pytest.param([_entry(shape=[2, True])], rf"^{_W}\[0\] \('x'\): shape\[1\] is True;", id="bool-true"),
    pytest.param([_entry(shape=[False])], rf"^{_W}\[0\] \('x'\): shape\[0\] is False;", id="bool-false"),
    pytest.param([_entry(shape=[2.0])], rf"^{_W}\[0\] \('x'\): shape\[0\] is 2\.0;", id="float"),
    pytest.param([_entry(shape=[1, 2, 2.5])], rf"^{_W}\[0\] \('x'\): shape\[2\] is 2\.5;", id="float-frac"),
    pytest.param([_entry(shape=[[2]])], rf"^{_W}\[0\] \('x'\): shape\[0\] is \[2\];", id="nested-list"),
    pytest.param([_entry(shape=["batch size"])], rf"^{_W}\[0\] \('x'\): shape\[0\] is 'batch size';", id="space"),
    pytest.param([_entry(shape=["1x"])], rf"^{_W}\[0\] \('x'\): shape\[0\] is '1x';", id="leading-digit"),
    pytest.param([_entry(shape=[None, "a-b"])], rf"^{_W}\[0\] \('x'\): shape\[1\] is 'a-b';", id="dash"),
    pytest.param([_entry(shape=[""])], rf"^{_W}\[0\] \('x'\): shape\[0\] is '';", id="empty-symbol"),
    # duplicate names
    pytest.param(
        [_entry("x"), _entry("y"), _entry("x", "int8", [])],
        rf"^{_W}\[2\]: tensor name 'x' appears twice; names must be unique$",
        id="duplicate",
    ),
]


@pytest.mark.parametrize(("entries", "pattern"), PARSE_ERRORS)
def test_parse_spec_errors(entries: Any, pattern: str) -> None:
    with pytest.raises(PackageError, match=pattern):
        parse_spec(entries, WHERE)


def test_parse_spec_dim_error_explains_what_a_dim_is() -> None:
    with pytest.raises(PackageError) as excinfo:
        parse_spec([_entry(shape=[-2])], "spec")
    assert _message(excinfo) == (
        "spec[0] ('x'): shape[0] is -2; a dim is a size >= 0, null for any size, "
        'or a symbol name such as "batch_size"'
    )


# --- check_inputs: dtypes ----------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_check_inputs_accepts_every_matching_dtype(dtype: str) -> None:
    v = _validator([("x", dtype, (2, 3))])
    arr = _array(dtype, (2, 3))
    out, bindings = v.check_inputs({"x": arr})
    assert out["x"] is arr
    assert bindings == {}


@pytest.mark.parametrize(
    ("spec_dtype", "actual"),
    [(s, a) for s in ALL_DTYPES for a in ALL_DTYPES if s != a],
)
def test_check_inputs_rejects_every_other_dtype(spec_dtype: str, actual: str) -> None:
    v = _validator([("x", spec_dtype, (2,))])
    arr = _array(actual, (2,))
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs({"x": arr})
    msg = _message(excinfo)
    if spec_dtype == "string" and actual == "bytes":
        assert msg.startswith("Tensor 'x' in the input spec is expected to hold str (a string tensor), but an element is bytes")
    elif spec_dtype in ("string", "bytes"):
        assert msg.startswith(f"Tensor 'x' in the input spec is expected to be of type {spec_dtype}, but was of type {arr.dtype}")
    else:
        assert msg == (
            f"Tensor 'x' in the input spec is expected to be of type {spec_dtype}, but was of type {arr.dtype} (model 'm')"
        )


@pytest.mark.parametrize("dtype", [np.complex64, np.float32().dtype.newbyteorder(">"), "datetime64[s]", object])
def test_check_inputs_rejects_foreign_dtypes(dtype: Any) -> None:
    v = _validator([("x", "float32", (1,))])
    arr = np.zeros(1, dtype=dtype)
    with pytest.raises(SpecError, match=rf"of type float32, but was of type {re.escape(str(arr.dtype))} \(model 'm'\)$"):
        v.check_inputs({"x": arr})


# --- check_inputs: shapes ----------------------------------------------------


def test_check_inputs_wrong_rank_shows_both() -> None:
    v = _validator([("x", "float32", ("batch_size", 3))])
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs({"x": np.zeros((2, 3, 1), np.float32)})
    assert _message(excinfo) == (
        "Tensor 'x' in the input spec is expected to have 2 dimensions, but had 3 "
        "(model 'm': spec [batch_size, 3], shape (2, 3, 1))"
    )


@pytest.mark.parametrize(
    ("spec_shape", "arr_shape", "expected"),
    [
        ((), (1,), "expected to have 0 dimensions, but had 1 (model 'm': spec [], shape (1,))"),
        ((None,), (), "expected to have 1 dimensions, but had 0 (model 'm': spec [None], shape ())"),
        ((None, None), (4,), "expected to have 2 dimensions, but had 1 (model 'm': spec [None, None], shape (4,))"),
    ],
)
def test_check_inputs_wrong_rank_table(spec_shape: tuple, arr_shape: tuple, expected: str) -> None:
    v = _validator([("x", "int32", spec_shape)])
    with pytest.raises(SpecError, match=re.escape(expected) + "$"):
        v.check_inputs({"x": np.zeros(arr_shape, np.int32)})


@pytest.mark.parametrize(
    ("spec_shape", "arr_shape", "axis", "want", "got"),
    [
        ((3,), (4,), 0, 3, 4),
        ((None, 3), (5, 4), 1, 3, 4),
        (("n", 2, 7), (1, 2, 6), 2, 7, 6),
        ((0,), (1,), 0, 0, 1),
        ((2,), (0,), 0, 2, 0),
    ],
)
def test_check_inputs_fixed_dim_mismatch(spec_shape: tuple, arr_shape: tuple, axis: int, want: int, got: int) -> None:
    v = _validator([("x", "float64", spec_shape)])
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs({"x": np.zeros(arr_shape)})
    assert _message(excinfo) == (
        f"Dim {axis} of tensor 'x' in the input spec is expected to be of size {want}, but was of size {got} "
        f"(model 'm': shape {arr_shape})"
    )


def test_check_inputs_symbol_shared_across_inputs_exact_message() -> None:
    v = _validator([("x", "float32", ("batch_size",)), ("y", "float32", ("batch_size",))])
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs({"y": np.zeros(4, np.float32), "x": np.zeros(3, np.float32)})
    assert _message(excinfo) == (
        "All dims with symbol 'batch_size' should be the same size. Dim 0 of tensor 'x' in the input spec was "
        "expected to be of size 4 (from tensor 'y'), but was of size 3 (model 'm')"
    )


def test_check_inputs_symbol_shared_across_inputs_accepts_equal_sizes() -> None:
    v = _validator([("x", "float32", ("batch_size", 2)), ("y", "int64", (None, "batch_size"))])
    out, bindings = v.check_inputs({"x": np.zeros((5, 2), np.float32), "y": np.zeros((9, 5), np.int64)})
    assert set(out) == {"x", "y"}
    assert bindings == {"batch_size": (5, "x")}


def test_check_inputs_same_symbol_twice_in_one_tensor() -> None:
    v = _validator([("x", "float32", ("n", "n"))])
    _, bindings = v.check_inputs({"x": np.zeros((3, 3), np.float32)})
    assert bindings == {"n": (3, "x")}
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs({"x": np.zeros((2, 3), np.float32)})
    assert _message(excinfo) == (
        "All dims with symbol 'n' should be the same size. Dim 1 of tensor 'x' in the input spec was "
        "expected to be of size 2 (from this tensor), but was of size 3 (model 'm')"
    )


def test_check_inputs_bindings_are_per_call() -> None:
    v = _validator([("x", "float32", ("n",))])
    assert v.check_inputs({"x": np.zeros(2, np.float32)})[1] == {"n": (2, "x")}
    assert v.check_inputs({"x": np.zeros(7, np.float32)})[1] == {"n": (7, "x")}


@pytest.mark.parametrize("size", [0, 1, 7, 1000])
def test_check_inputs_none_dims_accept_any_size(size: int) -> None:
    v = _validator([("x", "uint8", (None, 2, None))])
    arr = np.zeros((size, 2, size + 1), np.uint8)
    out, bindings = v.check_inputs({"x": arr})
    assert out["x"] is arr
    assert bindings == {}


def test_check_inputs_zero_size_dims() -> None:
    v = _validator([("x", "float32", ("batch", 3)), ("y", "string", ("batch",)), ("z", "int8", (0, None))])
    x = np.zeros((0, 3), np.float32)
    y = np.array([], dtype=str)
    z = np.zeros((0, 0), np.int8)
    out, bindings = v.check_inputs({"x": x, "y": y, "z": z})
    assert out["x"] is x and out["y"] is y and out["z"] is z
    assert bindings == {"batch": (0, "x")}
    with pytest.raises(SpecError, match=r"Dim 0 of tensor 'y' .* size 0 \(from tensor 'x'\), but was of size 2 \(model 'm'\)$"):
        v.check_inputs({"x": x, "y": np.array(["a", "b"])})


# --- check_inputs: the dict and its values -------------------------------------


def test_check_inputs_unknown_name_lists_inputs() -> None:
    v = _validator([("x", "float32", ("batch_size", 3)), ("y", "int64", (None,))])
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs({"x": np.zeros((1, 3), np.float32), "z": np.zeros(1)})
    assert _message(excinfo) == (
        "Tensor name(s) 'z' are not found in the input spec; model 'm' has no input named 'z'; "
        "its inputs are: x: float32 [batch_size, 3], y: int64 [None]"
    )


@pytest.mark.parametrize(
    ("value", "kind"),
    [([np.zeros(1)], "list"), (None, "null"), (np.zeros(1), "ndarray"), ("x", "str"), ((("x", 1),), "tuple")],
)
def test_check_inputs_not_a_dict(value: Any, kind: str) -> None:
    v = _validator([("x", "float64", (1,))])
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs(value)
    assert _message(excinfo) == f"Inputs of model 'm' must be a dict of name -> numpy array, not {kind}"


@pytest.mark.parametrize(
    ("dtype", "value", "kind"),
    [
        ("float32", [1.0, 2.0], "list"),
        ("float32", (1.0, 2.0), "tuple"),
        ("float32", 1.0, "float"),
        ("int64", 3, "int"),
        ("float32", None, "null"),
        ("string", "abc", "str"),
        ("string", ["a", "b"], "list"),
    ],
)
def test_check_inputs_rejects_non_arrays(dtype: str, value: Any, kind: str) -> None:
    v = _validator([("x", dtype, (None,))])
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs({"x": value})
    assert _message(excinfo) == (
        f"Tensor 'x' in the input spec is expected to be a numpy array of {dtype}, but was {kind} (model 'm')"
    )


def test_check_inputs_missing_inputs_are_left_to_backends() -> None:
    v = _validator([("x", "float32", ("n",)), ("y", "float32", ("n",))])
    assert v.check_inputs({}) == ({}, {})
    y = np.zeros(2, np.float32)
    out, bindings = v.check_inputs({"y": y})
    assert out == {"y": y} and out["y"] is y
    assert bindings == {"n": (2, "y")}


def test_check_inputs_accepts_any_mapping_and_returns_a_new_dict() -> None:
    from types import MappingProxyType

    arr = np.zeros(1, np.float32)
    inputs = MappingProxyType({"x": arr})
    out, _ = _validator([("x", "float32", (1,))]).check_inputs(inputs)
    assert type(out) is dict
    assert out == {"x": arr} and out["x"] is arr


# --- check_inputs: strings ---------------------------------------------------


@pytest.mark.parametrize(
    "arr",
    [
        np.array(["a", "bc"]),
        np.array(["é", "日本"], dtype="<U5"),
        np.array(["a", "bc"], dtype=object),
        np.array([np.str_("a"), np.str_("b")], dtype=object),
        np.array(["", ""], dtype=object),
    ],
    ids=["unicode", "unicode-wide", "object", "object-np-str", "object-empty-strings"],
)
def test_check_inputs_string_tensors_ok(arr: np.ndarray) -> None:
    v = _validator([("s", "string", ("n",))])
    out, bindings = v.check_inputs({"s": arr})
    assert out["s"] is arr
    assert bindings == {"n": (2, "s")}


@pytest.mark.parametrize(
    ("item", "shown"),
    [(3, "int (3)"), (b"ab", "bytes (b'ab')"), (None, "null (None)"), (1.5, "float (1.5)"), (["a"], "list (['a'])")],
)
def test_check_inputs_object_array_with_non_str_element(item: Any, shown: str) -> None:
    v = _validator([("s", "string", (None,))])
    arr = np.empty(3, dtype=object)
    arr[:] = ["a", "b", "c"]
    arr[1] = item
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs({"s": arr})
    assert _message(excinfo) == (
        f"Tensor 's' in the input spec is expected to hold str (a string tensor), but an element is {shown} (model 'm')"
    )


def test_check_inputs_object_element_repr_is_truncated() -> None:
    v = _validator([("s", "string", (None,))])
    arr = np.empty(1, dtype=object)
    arr[0] = b"x" * 100
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs({"s": arr})
    assert _message(excinfo).endswith("an element is bytes (" + repr(b"x" * 100)[:40] + ") (model 'm')")


def test_check_inputs_bytes_array_is_decoded_as_utf8() -> None:
    # As the original Neuropod took string inputs: bytes, UTF-8 encoded.
    v = _validator([("s", "string", ("n",))])
    arr = np.array(["é".encode(), b"bc"])
    out, bindings = v.check_inputs({"s": arr})
    assert out["s"].dtype.kind == "U" and out["s"].tolist() == ["é", "bc"] and bindings == {"n": (2, "s")}
    with pytest.raises(SpecError) as excinfo:
        v.check_inputs({"s": np.array([b"a", b"\xff"])})
    assert _message(excinfo) == (
        "Tensor 's' in the input spec is expected to be of type string, but holds bytes that are not UTF-8 text "
        "(invalid start byte at byte 0) (model 'm')"
    )


def test_check_outputs_bytes_array_hints_to_decode() -> None:
    v = _validator([], [("s", "string", (None,))])
    with pytest.raises(SpecError) as excinfo:
        v.check_outputs({"s": np.array([b"a", b"bc"])}, {})
    assert _message(excinfo) == (
        "Tensor 's' in the output spec is expected to be of type string, but was of type |S2 "
        "(model 'm': a numpy unicode array or an object array of str; decode bytes to str first)"
    )


def test_check_inputs_numeric_array_for_string_spec_has_no_bytes_hint() -> None:
    v = _validator([("s", "string", (None,))])
    with pytest.raises(SpecError, match=r"of type string, but was of type int64 \(model 'm': .*str\)$") as excinfo:
        v.check_inputs({"s": np.zeros(2, np.int64)})
    assert "decode" not in _message(excinfo)


# --- check_inputs: contiguity ------------------------------------------------

_BASE = np.arange(24, dtype=np.float32).reshape(4, 6)

NON_CONTIGUOUS = [
    pytest.param(lambda: _BASE.T, id="transposed"),
    pytest.param(lambda: _BASE[:, ::2], id="strided-columns"),
    pytest.param(lambda: _BASE[::-1], id="reversed-rows"),
    pytest.param(lambda: np.asfortranarray(_BASE), id="fortran"),
    pytest.param(lambda: np.broadcast_to(_BASE[:1], (4, 6)), id="broadcast"),
]


@pytest.mark.parametrize("make", NON_CONTIGUOUS)
def test_check_inputs_non_contiguous_returned_c_contiguous(make: Any) -> None:
    arr = make()
    assert not arr.flags.c_contiguous
    v = _validator([("x", "float32", (None, None))])
    out, _ = v.check_inputs({"x": arr})
    got = out["x"]
    assert got is not arr
    assert got.flags.c_contiguous
    assert got.dtype == arr.dtype and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)


@pytest.mark.parametrize(
    "arr",
    [
        np.array([["a", "b", "c"], ["d", "e", "f"]]).T,
        np.array([["a", "b", "c"], ["d", "e", "f"]], dtype=object)[:, ::2],
    ],
    ids=["unicode-transposed", "object-strided"],
)
def test_check_inputs_non_contiguous_strings(arr: np.ndarray) -> None:
    assert not arr.flags.c_contiguous
    out, _ = _validator([("s", "string", (None, None))]).check_inputs({"s": arr})
    assert out["s"].flags.c_contiguous
    assert out["s"].dtype == arr.dtype
    assert out["s"].tolist() == arr.tolist()


@pytest.mark.parametrize(
    "arr",
    [_BASE, _BASE[1:3], _BASE[:, :0], np.zeros((), np.float32).reshape(1, 1), _BASE.T.T],
    ids=["plain", "row-slice", "empty", "reshaped", "double-transpose"],
)
def test_check_inputs_contiguous_returned_as_same_object(arr: np.ndarray) -> None:
    assert arr.flags.c_contiguous
    out, _ = _validator([("x", "float32", (None, None))]).check_inputs({"x": arr})
    assert out["x"] is arr


def test_check_inputs_does_not_modify_the_callers_dict() -> None:
    inputs = {"x": _BASE.T}
    out, _ = _validator([("x", "float32", (None, None))]).check_inputs(inputs)
    assert inputs["x"].base is not None and not inputs["x"].flags.c_contiguous
    assert out is not inputs


# --- check_outputs -----------------------------------------------------------


def _io_validator() -> SpecValidator:
    return _validator(
        [("x", "float32", ("batch", 3))],
        [("a", "float32", ("batch",)), ("b", "int64", ("batch", "k"))],
    )


def test_check_outputs_accepts_fitting_outputs() -> None:
    v = _io_validator()
    _, bindings = v.check_inputs({"x": np.zeros((4, 3), np.float32)})
    assert v.check_outputs({"a": np.zeros(4, np.float32), "b": np.zeros((4, 2), np.int64)}, bindings) is None
    # Outputs can bind new symbols, in the same dict.
    assert bindings == {"batch": (4, "x"), "k": (2, "b")}


def test_check_outputs_symbol_disagrees_with_input() -> None:
    v = _io_validator()
    _, bindings = v.check_inputs({"x": np.zeros((4, 3), np.float32)})
    with pytest.raises(SpecError) as excinfo:
        v.check_outputs({"a": np.zeros(3, np.float32), "b": np.zeros((4, 2), np.int64)}, bindings)
    assert _message(excinfo) == (
        "All dims with symbol 'batch' should be the same size. Dim 0 of tensor 'a' in the output spec was "
        "expected to be of size 4 (from tensor 'x'), but was of size 3 (model 'm')"
    )


def test_check_outputs_symbol_disagrees_between_outputs() -> None:
    v = _validator([], [("a", "float32", ("k",)), ("b", "float32", ("k",))])
    with pytest.raises(SpecError, match=r"^All dims with symbol 'k' .* tensor 'b' in the output spec .* size 2 \(from tensor 'a'\), but was of size 5"):
        v.check_outputs({"a": np.zeros(2, np.float32), "b": np.zeros(5, np.float32)}, {})


@pytest.mark.parametrize(
    ("outputs", "pattern"),
    [
        ({"a": np.zeros(4, np.float64)}, r"'a' in the output spec is expected to be of type float32, but was of type float64 \(model 'm'\)$"),
        ({"a": [0.0] * 4}, r"'a' in the output spec is expected to be a numpy array of float32, but was list \(model 'm'\)$"),
        ({"a": np.zeros((4, 1), np.float32)}, r"'a' in the output spec is expected to have 1 dimensions, but had 2 \(model 'm': spec \[batch\]"),
        ({"b": np.zeros((4, 2, 1), np.int64)}, r"'b' in the output spec is expected to have 2 dimensions, .*spec \[batch, k\]"),
    ],
)
def test_check_outputs_misfitting_output(outputs: dict, pattern: str) -> None:
    v = _io_validator()
    _, bindings = v.check_inputs({"x": np.zeros((4, 3), np.float32)})
    with pytest.raises(SpecError, match=pattern):
        v.check_outputs(outputs, bindings, requested=list(outputs))


def test_check_outputs_unexpected_output() -> None:
    v = _io_validator()
    with pytest.raises(SpecError) as excinfo:
        v.check_outputs({"a": np.zeros(1, np.float32), "zz": np.zeros(1)}, {})
    assert _message(excinfo) == (
        "Tensor name(s) 'zz' are not found in the output spec: model 'm' returned a tensor 'zz' that is not in its "
        "output spec (a, b)"
    )


def test_check_outputs_missing_output_when_all_requested() -> None:
    v = _io_validator()
    with pytest.raises(SpecError) as excinfo:
        v.check_outputs({"a": np.zeros(1, np.float32)}, {})
    assert _message(excinfo) == "Model 'm' did not return output(s) 'b' (returned: 'a')"
    with pytest.raises(SpecError, match=r"^Model 'm' did not return output\(s\) 'a', 'b' \(returned: nothing\)$"):
        v.check_outputs({}, {})


def test_check_outputs_only_requested_are_required() -> None:
    v = _io_validator()
    a = np.zeros(2, np.float32)
    assert v.check_outputs({"a": a}, {}, requested=["a"]) is None
    # Returning more than was requested is fine when it fits the spec.
    assert v.check_outputs({"a": a, "b": np.zeros((2, 1), np.int64)}, {}, requested=["a"]) is None
    assert v.check_outputs({}, {}, requested=[]) is None
    with pytest.raises(SpecError, match=r"^Model 'm' did not return output\(s\) 'b' \(returned: 'a'\)$"):
        v.check_outputs({"a": a}, {}, requested=["b"])
    with pytest.raises(SpecError, match=r"did not return output\(s\) 'b' \(returned: 'a'\)$"):
        v.check_outputs({"a": a}, {}, requested=iter(["a", "b"]))


def test_check_outputs_with_strings() -> None:
    v = _validator([], [("s", "string", ("n",))])
    assert v.check_outputs({"s": np.array(["a"], dtype=object)}, {"n": (1, "x")}) is None
    with pytest.raises(SpecError, match=r"^Tensor 's' in the output spec .*an element is bytes \(b'a'\) \(model 'm'\)$"):
        v.check_outputs({"s": np.array([b"a"], dtype=object)}, {})


def test_check_requested() -> None:
    v = _io_validator()
    assert v.check_requested(["b", "a"]) == ["b", "a"]
    assert v.check_requested(("a",)) == ["a"]
    assert v.check_requested(n for n in ["b"]) == ["b"]
    assert v.check_requested([]) == []


def test_check_requested_single_string_is_one_name() -> None:
    v = _validator([], [("a", "float32", ()), ("ab", "float32", ())])
    assert v.check_requested("ab") == ["ab"]
    assert v.check_requested("a") == ["a"]
    # Not split into characters: "ba" is one unknown name.
    with pytest.raises(SpecError, match=r"^Requested output\(s\) 'ba' of model 'm'"):
        v.check_requested("ba")


def test_check_requested_unknown_names_list_outputs() -> None:
    v = _io_validator()
    with pytest.raises(SpecError) as excinfo:
        v.check_requested(["a", "c", "d"])
    assert _message(excinfo) == (
        "Requested output(s) 'c', 'd' of model 'm' are not in its output spec; its outputs are: 'a', 'b'"
    )


# --- to_string_array ---------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected", "shape"),
    [
        (["a", "bc"], ["a", "bc"], (2,)),
        ([["a", "b"], ["c", "d"]], [["a", "b"], ["c", "d"]], (2, 2)),
        ([b"a", "b"], ["a", "b"], (2,)),
        (["é".encode(), "日本".encode()], ["é", "日本"], (2,)),
        ([[b"x"], [b"y"]], [["x"], ["y"]], (2, 1)),
        (np.array([b"ab", b"c"]), ["ab", "c"], (2,)),
        (np.array(["a", "b"], dtype=object).reshape(2, 1), [["a"], ["b"]], (2, 1)),
        (("t", "u"), ["t", "u"], (2,)),
    ],
)
def test_to_string_array(values: Any, expected: list, shape: tuple) -> None:
    arr = to_string_array(values)
    assert arr.dtype.kind == "U"
    assert arr.shape == shape
    assert arr.tolist() == expected
    assert all(type(s) is str for s in arr.ravel().tolist())


@pytest.mark.parametrize(("values", "shape"), [([], (0,)), ([[], []], (2, 0)), (np.empty((0, 3), dtype=object), (0, 3))])
def test_to_string_array_empty_keeps_shape(values: Any, shape: tuple) -> None:
    arr = to_string_array(values)
    assert arr.dtype.kind == "U"
    assert arr.shape == shape


def test_to_string_array_rejects_invalid_utf8() -> None:
    with pytest.raises(UnicodeDecodeError):
        to_string_array([b"\xff"])


@pytest.mark.parametrize("values", [[b"c\x00", b"d"], ["\x00"], np.array([["a\x00b", "e\x00\x00"]], dtype=object)])
def test_to_string_array_keeps_trailing_nul_characters(values: Any) -> None:
    # A numpy unicode array would drop them ("c\x00" -> "c"): such strings come back as object arrays of str.
    arr = to_string_array(values)
    expected = [v.decode() if isinstance(v, bytes) else v for v in np.asarray(values, dtype=object).flat]
    assert arr.ravel().tolist() == expected
    assert arr.shape == np.asarray(values, dtype=object).shape
    out, _ = _validator([("s", "string", (None,) * arr.ndim)]).check_inputs({"s": arr})
    assert out["s"] is arr


def test_to_string_array_result_fits_a_string_spec() -> None:
    arr = to_string_array([[b"a", b"b"]])
    out, _ = _validator([("s", "string", (1, 2))]).check_inputs({"s": arr})
    assert out["s"] is arr


# --- properties --------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)

# Entries that are often nearly valid, so the deeper checks get exercised too.
near_dims = st.one_of(
    st.integers(-2, 5), st.none(), st.booleans(), st.floats(allow_nan=False), st.sampled_from(["a", "b", "1x", ""]),
)
near_entries = st.dictionaries(
    st.sampled_from(["name", "dtype", "shape", "extra"]),
    st.one_of(
        st.sampled_from(["x", "y", ""]),
        st.sampled_from([*ALL_DTYPES, "float8"]),
        st.lists(near_dims, max_size=3),
        json_values,
    ),
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(json_values, st.lists(near_entries, max_size=3)))
def test_property_parse_spec_returns_or_raises_package_error(value: Any) -> None:
    try:
        specs = parse_spec(value, WHERE)
    except PackageError as e:
        assert str(e).startswith(WHERE)
        return
    assert isinstance(specs, tuple)
    assert len({s.name for s in specs}) == len(specs)
    for s in specs:
        assert isinstance(s.name, str) and s.name
        assert s.dtype in DTYPES
        for d in s.shape:
            assert d is None or (type(d) is int and d >= 0) or (isinstance(d, str) and d.isidentifier())
        assert parse_spec([s.to_dict()], WHERE) == (s,)


SYMBOLS = ["a", "b"]
spec_dims = st.one_of(st.integers(0, 3), st.none(), st.sampled_from(SYMBOLS))
spec_shapes = st.lists(spec_dims, max_size=3).map(tuple)
specs_strategy = st.lists(
    st.tuples(st.sampled_from(ALL_DTYPES), spec_shapes), min_size=1, max_size=3
).map(lambda entries: [TensorSpec(f"t{i}", d, s) for i, (d, s) in enumerate(entries)])

_shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)
_plain_arrays = st.one_of(
    hnp.arrays(
        hnp.scalar_dtypes() | hnp.unicode_string_dtypes(max_len=3) | hnp.byte_string_dtypes(max_len=3), _shapes
    ),
    hnp.arrays(
        np.dtype(object), _shapes, elements=st.one_of(st.text(max_size=3), st.integers(), st.none(), st.binary())
    ),
    st.sampled_from([*NUMERIC_DTYPES]).flatmap(lambda d: hnp.arrays(DTYPES[d], _shapes)),
)
any_arrays = st.one_of(
    _plain_arrays,
    _plain_arrays.map(lambda a: a.T),
    _plain_arrays.map(lambda a: a[..., ::2] if a.ndim else a),
)
any_values = st.one_of(
    any_arrays, st.none(), st.integers(), st.floats(), st.text(max_size=3), st.lists(st.floats(), max_size=3)
)


@settings(max_examples=200, deadline=None)
@given(specs_strategy, st.data())
def test_property_check_inputs_returns_or_raises_spec_error(specs: list[TensorSpec], data: st.DataObject) -> None:
    v = SpecValidator("m", specs, specs)
    names = st.sampled_from([s.name for s in specs] + ["unknown"])
    tensors = data.draw(st.dictionaries(names, any_values, max_size=4))
    try:
        out, bindings = v.check_inputs(tensors)
    except SpecError as e:
        assert "'m'" in str(e)
    else:
        assert set(out) == set(tensors)
        for name, arr in out.items():
            assert isinstance(arr, np.ndarray) and arr.flags.c_contiguous
            # the same array, unless it had to change: made contiguous, or bytes decoded for a string input
            assert arr is tensors[name] or not tensors[name].flags.c_contiguous or tensors[name].dtype.kind == "S"
        for symbol, (size, source) in bindings.items():
            assert symbol in SYMBOLS and source in tensors and size >= 0
    try:
        v.check_outputs(tensors, {})
    except SpecError as e:
        assert "'m'" in str(e)


def _fitting_array(spec: TensorSpec, sizes: dict[str, int], data: st.DataObject, dtype: str | None = None) -> np.ndarray:
    dtype = spec.dtype if dtype is None else dtype
    shape = tuple(
        sizes[d] if isinstance(d, str) else d if isinstance(d, int) else data.draw(st.integers(0, 3))
        for d in spec.shape
    )
    if dtype == "string" and data.draw(st.booleans()):
        arr = np.empty(shape, dtype=object)
        arr[...] = "s"
        return arr
    return _array(dtype, shape)


@settings(max_examples=200, deadline=None)
@given(specs_strategy, st.fixed_dictionaries({s: st.integers(0, 3) for s in SYMBOLS}), st.data())
def test_property_fitting_inputs_pass_and_perturbed_fail(
    specs: list[TensorSpec], sizes: dict[str, int], data: st.DataObject
) -> None:
    v = SpecValidator("m", specs, specs)
    tensors = {s.name: _fitting_array(s, sizes, data) for s in specs}
    out, bindings = v.check_inputs(tensors)
    assert all(out[n] is tensors[n] for n in tensors)
    used = {d for s in specs for d in s.shape if isinstance(d, str)}
    assert {k: size for k, (size, _) in bindings.items()} == {k: sizes[k] for k in used}
    # Outputs made to the same sizes fit too, with the inputs' bindings.
    assert v.check_outputs(tensors, bindings) is None

    victim = data.draw(st.sampled_from(specs))

    # A different dtype fails.
    # (An empty object array fits both string and bytes, and bytes in a string tensor fail with their own message.)
    text = ("string", "bytes")
    other = data.draw(st.sampled_from([d for d in ALL_DTYPES if d != victim.dtype and not (d in text and victim.dtype in text)]))
    wrong = dict(tensors, **{victim.name: _fitting_array(victim, sizes, data, dtype=other)})
    with pytest.raises(SpecError, match=rf"^Tensor '{victim.name}' .* is expected to be of type {victim.dtype}"):
        v.check_inputs(wrong)

    # A different size in one fixed dim fails.
    fixed = [(i, d) for i, d in enumerate(victim.shape) if isinstance(d, int)]
    if fixed:
        axis, size = data.draw(st.sampled_from(fixed))
        arr = tensors[victim.name]
        shape = list(arr.shape)
        shape[axis] = size + 1
        bad = np.zeros(shape, dtype=arr.dtype)
        if arr.dtype == object:
            bad[...] = b"s" if victim.dtype == "bytes" else "s"
        with pytest.raises(SpecError, match=rf"^Dim {axis} of tensor '{victim.name}' .* expected to be of size {size}, but was"):
            v.check_inputs(dict(tensors, **{victim.name: bad}))
