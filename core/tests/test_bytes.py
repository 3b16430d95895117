"""The ``bytes`` spec dtype: binary tensors as object arrays of bytes, checked, built and stored as test data."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from neuropod.cli.output import fmt_array
from neuropod.errors import NeuropodError, PackageError, SpecError
from neuropod.package import read_package
from neuropod.package.config import TEST_INPUTS, ModelConfig
from neuropod.package.write import write_package
from neuropod.spec import DTYPES, SpecValidator, parse_spec, to_bytes_array, to_string_array
from neuropod.statespec import initial_state, parse_sequence_controls, parse_state_spec
from neuropod.strings import refuse_dtypes

JPEG_HEAD = b"\xff\xd8\xff"  # not UTF-8


def validator(dtype: str = "bytes") -> SpecValidator:
    specs = parse_spec([{"name": "blob", "dtype": dtype, "shape": ["batch"]}], "input_spec")
    return SpecValidator("m", specs, parse_spec([{"name": "out", "dtype": dtype, "shape": ["batch"]}], "output_spec"))


def objects(*items: object) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = list(items)
    return arr


def test_bytes_is_a_spec_dtype() -> None:
    assert "bytes" in DTYPES
    (spec,) = parse_spec([{"name": "x", "dtype": "bytes", "shape": [None]}], "input_spec")
    assert spec.dtype == "bytes"


def test_an_object_array_of_bytes_passes_unchanged() -> None:
    v = validator()
    blob = objects(JPEG_HEAD, b"", b"a\x00\x00")
    inputs = {"blob": blob}
    checked, bindings = v.check_inputs(inputs)
    assert checked["blob"] is blob
    assert bindings == {"batch": (3, "blob")}
    v.check_outputs({"out": objects(b"\x00")}, {})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            objects(b"ok", "text"),
            r"Tensor 'blob' in the input spec is expected to hold bytes .* element is str .*encode text first",
        ),
        (objects(b"ok", 3), r"Tensor 'blob' in the input spec is expected to hold bytes .* element is int"),
        (objects(bytearray(b"x")), r"element is bytearray"),
        (np.array([b"ab", b"c"]), r"expected to be of type bytes, but was of type \|S2 .*drops trailing NUL bytes"),
        (np.array(["ab"]), r"expected to be of type bytes, but was of type <U2"),
        (np.array([1, 2], np.uint8), r"expected to be of type bytes, but was of type uint8"),
    ],
)
def test_what_is_not_a_bytes_tensor_is_refused(value: np.ndarray, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        validator().check_inputs({"blob": value})


def test_a_bytes_output_is_checked_too() -> None:
    with pytest.raises(SpecError, match=r"Tensor 'out' in the output spec is expected to hold bytes.*element is str"):
        validator().check_outputs({"out": objects("text")}, {})


def test_a_string_tensor_keeps_its_rules() -> None:
    v = validator("string")
    checked, _ = v.check_inputs({"blob": np.array([b"caf\xc3\xa9"])})  # UTF-8 bytes: decoded, as before
    assert checked["blob"].tolist() == ["café"]
    with pytest.raises(SpecError, match="not UTF-8 text"):
        v.check_inputs({"blob": np.array([JPEG_HEAD])})
    with pytest.raises(SpecError, match=r"expected to hold str \(a string tensor\), but an element is bytes"):
        v.check_inputs({"blob": objects(b"abc")})


def test_to_bytes_array() -> None:
    arr = to_bytes_array([[JPEG_HEAD, bytearray(b"b\x00")], [memoryview(b"c"), b""]])
    assert arr.dtype == object and arr.shape == (2, 2)
    assert arr.tolist() == [[JPEG_HEAD, b"b\x00"], [b"c", b""]]
    assert all(type(b) is bytes for b in arr.flat)
    assert to_bytes_array(b"one").shape == ()
    assert to_bytes_array(b"one").item() == b"one"
    assert to_bytes_array([]).shape == (0,)
    assert to_bytes_array(np.array([b"s", b"t\x00"])).tolist() == [b"s", b"t"]  # numpy had dropped the NUL
    with pytest.raises(TypeError, match=r"element is str .*encode text first"):
        to_bytes_array(["text"])
    # Strings stay text.
    assert to_string_array([b"caf\xc3\xa9"]).tolist() == ["café"]


def _config() -> ModelConfig:
    spec_in = parse_spec(
        [{"name": "blob", "dtype": "bytes", "shape": [2, None]}, {"name": "s", "dtype": "string", "shape": [1]}], "i"
    )
    spec_out = parse_spec([{"name": "out", "dtype": "bytes", "shape": [None]}], "o")
    return ModelConfig(
        name="bytes_model", platform="python", platform_version_semver="*", input_spec=spec_in, output_spec=spec_out
    )


def test_bytes_test_data_round_trips_exactly(tmp_path: Path) -> None:
    blob = to_bytes_array([[JPEG_HEAD, b"\x00"], [b"", b"tail\x00\x00"]])
    out = to_bytes_array([b"a\x00b\x00", b"\xff" * 40])
    path = write_package(
        tmp_path / "p.neuropod", _config(), {"0/data/x.bin": b"x"},
        test_input_data={"blob": blob, "s": np.array(["text"])}, test_expected_out={"out": out},
    )  # fmt: skip
    inputs, expected = read_package(path).test_data()
    assert inputs["blob"].dtype == object and inputs["blob"].shape == (2, 2)
    assert inputs["blob"].tolist() == blob.tolist()  # trailing NULs and all
    assert all(type(b) is bytes for b in inputs["blob"].flat)
    assert inputs["s"].tolist() == ["text"]
    assert expected is not None and expected["out"].tolist() == out.tolist()
    # Stored without pickle: numpy reads the file alone, as fixed-width bytes and lengths.
    with np.load(path / TEST_INPUTS, allow_pickle=False) as raw:
        stored = raw["blob"]
    assert stored.dtype.names == ("bytes", "length")
    assert stored["length"].tolist() == [[3, 1], [0, 6]]
    with zipfile.ZipFile(path / TEST_INPUTS) as zf:
        assert sorted(zf.namelist()) == ["blob.npy", "s.npy"]


def test_text_as_bytes_test_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match=r"Test tensor 'blob' .* is a bytes tensor: .*element is str"):
        write_package(
            tmp_path / "p.neuropod", _config(), {"0/data/x.bin": b"x"},
            test_input_data={"blob": np.array([["a", "b"]], dtype=object), "s": np.array(["t"])},
        )  # fmt: skip


def test_refuse_dtypes_names_the_tensors_and_what_to_use() -> None:
    config = _config()
    with pytest.raises(NeuropodError, match=r"Model 'bytes_model': backend onnx cannot take bytes tensors "
                       r"\(input 'blob' \(bytes\), output 'out' \(bytes\)\); use the python"):  # fmt: skip
        refuse_dtypes(config.name, config.input_spec, config.output_spec, {"bytes"}, "onnx")
    refuse_dtypes(config.name, config.input_spec, config.output_spec, {"float16"}, "onnx")  # nothing to refuse


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("CONTROL_SEQUENCE_CORRID", r"the sequence id input 'c' is bytes; it must be an integer type"),
        ("CONTROL_SEQUENCE_START", r"CONTROL_SEQUENCE_START input 'c' is a bytes tensor; it must be a number or bool"),
    ],
)
def test_a_bytes_tensor_is_no_sequence_control(kind: str, message: str) -> None:
    inputs = parse_spec([{"name": "c", "dtype": "bytes", "shape": [1]}], "input_spec")
    with pytest.raises(PackageError, match=message):
        parse_sequence_controls([{"name": "c", "kind": kind}], inputs, "sequence_controls")


def test_a_bytes_state_starts_as_empty_bytes() -> None:
    inputs = parse_spec([{"name": "memo", "dtype": "bytes", "shape": [2]}], "input_spec")
    outputs = parse_spec([{"name": "memo_out", "dtype": "bytes", "shape": [2]}], "output_spec")
    (pair,) = parse_state_spec([{"input_name": "memo", "output_name": "memo_out"}], inputs, outputs, "state_spec")
    start = initial_state(pair, None, "m")
    assert start.dtype == object and start.tolist() == [b"", b""]


def test_the_cli_shows_a_bytes_tensor_as_bytes() -> None:
    assert fmt_array(to_bytes_array([JPEG_HEAD, b""])) == r"bytes [2] [b'\xff\xd8\xff', b'']"
    assert fmt_array(np.array(["a"])) == "string [1] ['a']"
