"""Tests for neuropod.package: the on-disk format, read and written, as a directory or a zip."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import re
import stat
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import neuropod
from neuropod.errors import PackageError
from neuropod.package import ModelConfig, cache_dir, parse_config, read_package, write_package, write_zip

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared/fixtures/uber-neuropod-0.3"
FIXTURE_NAMES = [
    "dummy_object_detection",
    "dummy_small_input_model",
    "tf_addition_model",
    "tf_strings_model",
    "torchscript_addition_model",
    "torchscript_addition_model_single_output",
    "torchscript_dict_with_union_value_type_model",
    "torchscript_strings_model",
]
TF_FIXTURES = [n for n in FIXTURE_NAMES if json.loads((FIXTURES / n / "config.json").read_text())["platform"]
               == "tensorflow"] if FIXTURES.is_dir() else []

MODEL_BYTES = b"\x08\x07model-bytes\x00\xff" * 8
DELETE = object()  # a table marker: remove the field instead of setting it


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test extracts zips into its own cache under tmp_path."""
    path = tmp_path / "home" / "neuropod-cache"
    path.parent.mkdir()  # the cache itself is created by the code under test
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(path))
    monkeypatch.delenv("NEUROPOD_MAX_PACKAGE_BYTES", raising=False)
    return path


@pytest.fixture
def fixtures() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip(f"the Neuropod 0.3 fixture packages are not checked out at {FIXTURES}")
    return FIXTURES


# --- helpers ----------------------------------------------------------------


def _tree(root: Path, exclude: Path | None = None) -> set[str]:
    """Every file and directory under root (relative), leaving out `exclude` and what is inside it."""
    out = set()
    for p in root.rglob("*"):
        if exclude is not None and (p == exclude or exclude in p.parents):
            continue
        out.add(p.relative_to(root).as_posix())
    return out


def _valid_config_dict() -> dict[str, Any]:
    return {
        "name": "adder",
        "platform": "onnx",
        "platform_version_semver": "^1.16",
        "input_spec": [
            {"name": "x", "dtype": "float32", "shape": ["batch_size", 3]},
            {"name": "words", "dtype": "string", "shape": [None]},
        ],
        "output_spec": [
            {"name": "out", "dtype": "float32", "shape": ["batch_size", 3]},
            {"name": "aux", "dtype": "int64", "shape": []},
        ],
        "custom_ops": [],
        "input_tensor_device": {"x": "GPU"},
    }


def _config(**extra: Any) -> ModelConfig:
    data = _valid_config_dict()
    data["exported_with"] = {"neuropod": "0.4.0", "framework": "onnxruntime", "platform_version": "1.17.0"}
    data.update(extra)
    return parse_config(data, "test config")


def _write(dest: Path, **kwargs: Any) -> Path:
    return write_package(
        dest, _config(), {"0/data/model.bin": MODEL_BYTES}, backend_config={"opset": 17}, **kwargs
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _make_zip(path: Path, members: list[tuple[str | zipfile.ZipInfo, bytes]],
              compression: int = zipfile.ZIP_DEFLATED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return path


def _assert_cache_clean(cache: Path) -> None:
    """A failed extraction leaves neither a partial nor a finished directory in the cache."""
    packages = cache / "packages"
    leftovers = sorted(p.name for p in packages.iterdir()) if packages.exists() else []
    assert not [n for n in leftovers if n.startswith(".extract-")], leftovers
    assert leftovers == []


CONFIG_BYTES = json.dumps(_valid_config_dict()).encode()


# --- reading the original Neuropod 0.3 packages -----------------------------


def test_fixture_list_covers_every_package(fixtures: Path) -> None:
    on_disk = sorted(p.name for p in fixtures.iterdir() if (p / "config.json").is_file())
    assert on_disk == sorted(FIXTURE_NAMES)


def _spec_rows(specs: Any) -> list[tuple[str, str, list[Any]]]:
    return [(s.name, s.dtype, list(s.shape)) for s in specs]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_read_original_package(fixtures: Path, name: str, cache: Path) -> None:
    folder = fixtures / name
    raw = json.loads((folder / "config.json").read_text())
    pkg = read_package(folder)

    assert pkg.root == folder and pkg.source == folder
    assert pkg.name == raw["name"]
    assert pkg.platform == raw["platform"]
    assert pkg.version_range == "*"  # absent or "*" in every fixture
    assert _spec_rows(pkg.config.input_spec) == [(e["name"], e["dtype"], e["shape"]) for e in raw["input_spec"]]
    assert _spec_rows(pkg.config.output_spec) == [(e["name"], e["dtype"], e["shape"]) for e in raw["output_spec"]]
    assert pkg.config.custom_ops == tuple(raw.get("custom_ops", []))
    assert dict(pkg.config.input_tensor_device) == raw.get("input_tensor_device", {})
    assert pkg.config.exported_with is None and pkg.config.extra == {}
    assert pkg.manifest is None
    assert pkg.data_dir.is_dir() and pkg.files()
    backend_config_path = folder / "0" / "config.json"
    if backend_config_path.is_file():
        assert pkg.backend_config == json.loads(backend_config_path.read_text())
    else:
        assert pkg.backend_config == {}
    assert not cache.exists()  # reading a directory never touches the cache


@pytest.mark.parametrize("name", TF_FIXTURES or ["tf_addition_model"])
def test_tensorflow_fixture_backend_config_maps_every_tensor(fixtures: Path, name: str) -> None:
    pkg = read_package(fixtures / name)
    mapping = pkg.backend_config["node_name_mapping"]
    spec_names = {s.name for s in pkg.config.input_spec + pkg.config.output_spec}
    assert set(mapping) == spec_names
    assert all(isinstance(v, str) and v.endswith(":0") for v in mapping.values())


def test_fixture_spot_values(fixtures: Path) -> None:
    """Values read by eye from the fixtures' config.json files."""
    det = read_package(fixtures / "dummy_object_detection").config
    assert (det.input_spec[0].name, det.input_spec[0].dtype, det.input_spec[0].shape) == ("image", "uint8",
                                                                                          (1200, 1920, 3))
    assert det.output_spec[1].shape == ("num_detections", "num_classes")
    assert det.input_tensor_device == {"image": "GPU"}
    small = read_package(fixtures / "dummy_small_input_model").config
    assert [s.name for s in small.input_spec] == [f"small_input{i}" for i in range(100)]
    single = read_package(fixtures / "torchscript_addition_model_single_output").config
    assert [(s.name, s.dtype, s.shape) for s in single.input_spec] == [
        ("x", "float32", ("batch_size", None)),
        ("y", "float32", ("batch_size", None)),
        ("optional", "string", ("batch_size",)),
    ]
    strings = read_package(fixtures / "tf_strings_model").config
    assert strings.output_spec[0].dtype == "string" and strings.output_spec[0].shape == (None,)
    addition = read_package(fixtures / "tf_addition_model")
    assert addition.backend_config["node_name_mapping"]["x"] == "some_namespace/in_x:0"


def test_fixture_read_as_zip(fixtures: Path, tmp_path: Path, cache: Path) -> None:
    folder = fixtures / "tf_addition_model"
    zpath = tmp_path / "tf_addition_model.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                zf.write(p, p.relative_to(folder).as_posix())
    pkg = read_package(zpath)
    assert pkg.root.is_relative_to(cache)
    assert pkg.config == read_package(folder).config
    assert (pkg.data_dir / "model.pb").read_bytes() == (folder / "0/data/model.pb").read_bytes()


def test_fixture_pickle_needs_trust(fixtures: Path) -> None:
    pkg = read_package(fixtures / "torchscript_addition_model_single_output")
    assert pkg.has_test_data
    with pytest.raises(PackageError, match=r"test_data\.pkl, a pickle.*trust_pickle=True"):
        pkg.test_data()

    inputs, expected = pkg.test_data(trust_pickle=True)
    spec = {s.name: s for s in pkg.config.input_spec}
    assert set(inputs) == {"x", "y"} and set(inputs) <= set(spec)
    for key, arr in inputs.items():
        assert isinstance(arr, np.ndarray)
        assert arr.dtype == np.dtype(spec[key].dtype)
    assert expected is not None and set(expected) <= {s.name for s in pkg.config.output_spec}
    np.testing.assert_array_equal(expected["out"], inputs["x"] + inputs["y"])  # the model adds x and y


class _TouchOnLoad:
    """Unpickling this creates a file: proof of whether a pickle was loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("trust", [False, True])
def test_legacy_pickle_runs_only_with_trust(tmp_path: Path, trust: bool) -> None:
    pkg_dir = tmp_path / "legacy"
    pkg_dir.mkdir()
    (pkg_dir / "config.json").write_bytes(CONFIG_BYTES)
    marker = tmp_path / "unpickled"
    (pkg_dir / "test_data.pkl").write_bytes(pickle.dumps(_TouchOnLoad(marker)))
    pkg = read_package(pkg_dir)
    if trust:
        with pytest.raises(PackageError, match=r"expected a dict with 'test_input'"):
            pkg.test_data(trust_pickle=True)
        assert marker.exists()
    else:
        with pytest.raises(PackageError, match="trust"):
            pkg.test_data()
        assert not marker.exists()


def test_corrupt_legacy_pickle_is_a_package_error(tmp_path: Path) -> None:
    pkg_dir = tmp_path / "legacy"
    pkg_dir.mkdir()
    (pkg_dir / "config.json").write_bytes(CONFIG_BYTES)
    (pkg_dir / "test_data.pkl").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(PackageError, match=r"Cannot read legacy test data .*test_data\.pkl"):
        read_package(pkg_dir).test_data(trust_pickle=True)


# --- writing ----------------------------------------------------------------


def test_write_directory_round_trip(tmp_path: Path) -> None:
    dest = _write(tmp_path / "out" / "adder")
    assert dest.is_dir()
    pkg = read_package(dest)
    assert pkg.config == _config()
    assert json.loads((dest / "config.json").read_text()) == _config().to_dict()
    assert pkg.backend_config == {"opset": 17}
    assert (pkg.data_dir / "model.bin").read_bytes() == MODEL_BYTES
    assert pkg.config.exported_with == {"neuropod": "0.4.0", "framework": "onnxruntime", "platform_version": "1.17.0"}
    assert not pkg.has_test_data
    with pytest.raises(PackageError, match="no bundled test data"):
        pkg.test_data()


def test_manifest_holds_sha256_of_every_file(tmp_path: Path) -> None:
    dest = _write(tmp_path / "adder", test_input_data={"x": np.ones((2, 3), np.float32)})
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["manifest_version"] == 1
    files = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()} - {"manifest.json"}
    assert files == {"config.json", "0/config.json", "0/data/model.bin", "test_data/inputs.npz"}
    assert manifest["files"] == {f: _sha256(dest / f) for f in files}
    assert read_package(dest).manifest == manifest["files"]


# config.json as the original Neuropod's write_neuropod_config laid it out (json.dump with
# indent=4 and sort_keys=True), written out by hand; exported_with is the one key it lacked.
ORIGINAL_LAYOUT_CONFIG = """{
    "custom_ops": [],
    "exported_with": {
        "framework": "onnxruntime",
        "neuropod": "0.4.0",
        "platform_version": "1.17.0"
    },
    "input_spec": [
        {
            "dtype": "float32",
            "name": "x",
            "shape": [
                "batch_size",
                3
            ]
        },
        {
            "dtype": "string",
            "name": "words",
            "shape": [
                null
            ]
        }
    ],
    "input_tensor_device": {
        "words": "GPU",
        "x": "GPU"
    },
    "name": "adder",
    "output_spec": [
        {
            "dtype": "float32",
            "name": "out",
            "shape": [
                "batch_size",
                3
            ]
        },
        {
            "dtype": "int64",
            "name": "aux",
            "shape": []
        }
    ],
    "platform": "onnx",
    "platform_version_semver": "^1.16"
}"""


def test_config_and_manifest_are_laid_out_as_the_original_wrote_them(tmp_path: Path) -> None:
    config = _config(input_tensor_device={"x": "GPU", "words": "GPU"})
    path = write_package(tmp_path / "p", config, {"0/data/model.bin": MODEL_BYTES})
    assert (path / "config.json").read_text(encoding="ascii") == ORIGINAL_LAYOUT_CONFIG
    files = {"0/data/model.bin": hashlib.sha256(MODEL_BYTES).hexdigest(),
             "config.json": hashlib.sha256(ORIGINAL_LAYOUT_CONFIG.encode()).hexdigest()}  # fmt: skip
    lines = ",\n".join(f'        "{rel}": "{digest}"' for rel, digest in files.items())
    expected = '{\n    "files": {\n' + lines + '\n    },\n    "manifest_version": 1\n}'
    assert (path / "manifest.json").read_text(encoding="ascii") == expected


def test_write_zip_round_trip(tmp_path: Path, cache: Path) -> None:
    zpath = _write(tmp_path / "adder.zip", package_as_zip=True)
    assert zipfile.is_zipfile(zpath)
    pkg = read_package(zpath)
    assert pkg.source == zpath and pkg.root.is_relative_to(cache)
    assert pkg.config == _config()
    assert pkg.backend_config == {"opset": 17}
    with zipfile.ZipFile(zpath) as zf:
        assert pkg.files() == sorted(zf.namelist())
        assert zf.read("0/data/model.bin") == MODEL_BYTES


def test_test_data_stored_as_npz_without_pickle(tmp_path: Path) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    words_obj = np.array(["apple", "bánana", ""], dtype=object)
    words_uni = np.array([["kiwi", "日本"]])
    raw_bytes = np.array([b"abc", b"d"])
    out = np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3))  # not C-contiguous
    dest = _write(
        tmp_path / "adder",
        test_input_data={"x": x, "words": words_obj, "words_uni": words_uni, "raw": raw_bytes},
        test_expected_out={"out": out},
    )
    with np.load(dest / "test_data/inputs.npz", allow_pickle=False) as data:
        assert sorted(data.files) == ["raw", "words", "words_uni", "x"]
        np.testing.assert_array_equal(data["x"], x)
        assert data["x"].dtype == np.float32
        assert data["words"].dtype.kind == "U" and data["words"].tolist() == words_obj.tolist()
        assert data["words_uni"].dtype.kind == "U" and data["words_uni"].tolist() == words_uni.tolist()
        assert data["raw"].tolist() == [b.decode() for b in raw_bytes]
    with np.load(dest / "test_data/expected.npz", allow_pickle=False) as data:
        np.testing.assert_array_equal(data["out"], out)

    pkg = read_package(dest)
    assert pkg.has_test_data
    inputs, expected = pkg.test_data()
    assert inputs["words"].tolist() == ["apple", "bánana", ""]
    np.testing.assert_array_equal(inputs["x"], x)
    assert expected is not None
    np.testing.assert_array_equal(expected["out"], out)


def test_test_inputs_without_expected(tmp_path: Path) -> None:
    dest = _write(tmp_path / "adder", test_input_data={"x": np.zeros((1, 3), np.float32)})
    assert not (dest / "test_data/expected.npz").exists()
    inputs, expected = read_package(dest).test_data()
    assert list(inputs) == ["x"] and expected is None


@pytest.mark.parametrize("as_zip", [False, True])
@pytest.mark.parametrize("existing", ["dir", "file"])
def test_write_refuses_existing_destination(tmp_path: Path, as_zip: bool, existing: str) -> None:
    dest = tmp_path / "taken"
    if existing == "dir":
        dest.mkdir()
        (dest / "keep.txt").write_text("mine")
    else:
        dest.write_text("mine")
    before = _tree(tmp_path)
    with pytest.raises(PackageError, match=rf"{re.escape(str(dest))} already exists"):
        _write(dest, package_as_zip=as_zip)
    assert _tree(tmp_path) == before
    assert (dest / "keep.txt" if existing == "dir" else dest).read_text() == "mine"


def test_custom_ops_copied_into_ops_dir(tmp_path: Path) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    op_a, op_b = libs / "libfirst.so", libs / "libsecond.so"
    op_a.write_bytes(b"\x7fELF first")
    op_b.write_bytes(b"\x7fELF second")
    dest = _write(tmp_path / "adder", custom_ops=[op_b, str(op_a)])
    assert json.loads((dest / "config.json").read_text())["custom_ops"] == ["libsecond.so", "libfirst.so"]
    assert (dest / "0/ops/libfirst.so").read_bytes() == op_a.read_bytes()
    assert (dest / "0/ops/libsecond.so").read_bytes() == op_b.read_bytes()
    pkg = read_package(dest)
    assert pkg.config.custom_ops == ("libsecond.so", "libfirst.so")
    assert pkg.custom_op_paths == [dest / "0/ops/libsecond.so", dest / "0/ops/libfirst.so"]
    assert {"0/ops/libfirst.so", "0/ops/libsecond.so"} <= set(pkg.manifest or {})


def test_directory_sources_are_copied(tmp_path: Path) -> None:
    src = tmp_path / "saved_model"
    (src / "variables").mkdir(parents=True)
    (src / "saved_model.pb").write_bytes(b"graph")
    (src / "variables" / "v.data").write_bytes(b"weights")
    dest = write_package(tmp_path / "pkg", _config(), {"0/data/savedmodel": src})
    assert (dest / "0/data/savedmodel/saved_model.pb").read_bytes() == b"graph"
    assert (dest / "0/data/savedmodel/variables/v.data").read_bytes() == b"weights"
    assert read_package(dest).files() == sorted([
        "0/data/savedmodel/saved_model.pb", "0/data/savedmodel/variables/v.data", "config.json", "manifest.json",
    ])


@pytest.mark.parametrize("as_zip", [False, True])
@pytest.mark.parametrize(
    ("files", "ops", "message"),
    [
        pytest.param({"0/data/m.bin": b"m"}, ["missing.so"], r"Custom op library .*missing\.so does not exist",
                     id="missing-custom-op"),
        pytest.param({"0/data/m.bin": b"m"}, ["a/libop.so", "b/libop.so"], r"named 'libop\.so'", id="duplicate-op"),
        pytest.param({"../escape.bin": b"m"}, [], r"'\.\./escape\.bin' must be relative", id="dotdot-file"),
        pytest.param({"/abs.bin": b"m"}, [], r"'/abs\.bin' must be relative", id="absolute-file"),
        pytest.param({"0/data/m.bin": "no-such-source"}, [], r"Cannot package .*no-such-source", id="missing-source"),
    ],
)
def test_failed_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, Any], ops: list[str], message: str,
    as_zip: bool,
) -> None:
    work = tmp_path / "work"  # relative custom-op and source paths resolve here
    for rel in ("a/libop.so", "b/libop.so"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(b"op")
    out = tmp_path / "out"
    out.mkdir()
    (out / "other").write_text("unrelated")
    monkeypatch.chdir(work)
    before_out, before_work = _tree(out), _tree(work)
    with pytest.raises(PackageError, match=message):
        write_package(out / ("pkg.zip" if as_zip else "pkg"), _config(), files, custom_ops=ops,
                      package_as_zip=as_zip)
    assert _tree(out) == before_out  # no staging dir, no partial zip, no package
    assert _tree(work) == before_work


# --- deterministic zips -----------------------------------------------------


def test_zips_are_deterministic(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "model" / "sub").mkdir(parents=True)
    sources = [src / "model" / "a.bin", src / "model" / "sub" / "b.bin", src / "weights.bin"]
    for i, p in enumerate(sources):
        p.write_bytes(bytes([i]) * (100 + i))

    def write(dest: Path) -> bytes:
        write_package(
            dest, _config(), {"0/data/model": src / "model", "0/data/weights.bin": src / "weights.bin"},
            backend_config={"b": 1, "a": [1, 2]},
            test_input_data={"x": np.ones((2, 3), np.float32), "words": np.array(["a", "b"], dtype=object)},
            test_expected_out={"out": np.zeros((2, 3), np.float32)},
            package_as_zip=True,
        )
        return dest.read_bytes()

    first = write(tmp_path / "one" / "pkg.zip")
    for i, p in enumerate(sources):  # new times and modes on every source file
        os.utime(p, (1_000_000_000 + i, 1_500_000_000 + 7 * i))
        p.chmod(0o600)
    second = write(tmp_path / "two" / "pkg.zip")
    assert first == second

    directory = write_package(
        tmp_path / "dir", _config(), {"0/data/model": src / "model", "0/data/weights.bin": src / "weights.bin"},
        backend_config={"b": 1, "a": [1, 2]},
        test_input_data={"x": np.ones((2, 3), np.float32), "words": np.array(["a", "b"], dtype=object)},
        test_expected_out={"out": np.zeros((2, 3), np.float32)},
    )
    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    with zipfile.ZipFile(tmp_path / "one" / "pkg.zip") as zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        assert names == sorted(names) == files
        assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)}
        assert {i.external_attr >> 16 for i in infos} == {stat.S_IFREG | 0o644}
        for name in files:
            assert zf.read(name) == (directory / name).read_bytes()
    rezipped = tmp_path / "rezipped.zip"
    write_zip(directory, rezipped)
    assert rezipped.read_bytes() == first


# --- manifest checking ------------------------------------------------------


def _change(root: Path) -> None:
    (root / "0/data/model.bin").write_bytes(b"tampered")


def _remove(root: Path) -> None:
    (root / "0/data/model.bin").unlink()


def _add(root: Path) -> None:
    (root / "0/data/extra.bin").write_bytes(b"x")


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        pytest.param(_change, r"changed: 0/data/model\.bin", id="changed"),
        pytest.param(_remove, r"missing: 0/data/model\.bin", id="missing"),
        pytest.param(_add, r"not in the manifest: 0/data/extra\.bin", id="extra"),
    ],
)
def test_manifest_mismatch(tmp_path: Path, tamper: Any, message: str) -> None:
    dest = _write(tmp_path / "adder")
    tamper(dest)
    with pytest.raises(PackageError, match=message) as err:
        read_package(dest)
    assert "manifest.json" in str(err.value) and str(dest) in str(err.value)
    assert read_package(dest, verify=False).config == _config()


def test_tampered_zip_member_is_detected(tmp_path: Path) -> None:
    zpath = _write(tmp_path / "adder.zip", package_as_zip=True)
    with zipfile.ZipFile(zpath) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    tampered = _make_zip(tmp_path / "tampered.zip",
                         [(n, b"evil" if n == "0/data/model.bin" else d) for n, d in members])
    with pytest.raises(PackageError, match=r"changed: 0/data/model\.bin"):
        read_package(tampered)


def test_manifest_required_when_exported_with(tmp_path: Path) -> None:
    dest = _write(tmp_path / "adder")
    (dest / "manifest.json").unlink()
    with pytest.raises(PackageError, match=r"manifest\.json is missing"):
        read_package(dest)


def test_manifest_optional_without_exported_with(tmp_path: Path) -> None:
    # As the original Neuropod's packages are: config.json without exported_with, and no manifest.
    dest = write_package(tmp_path / "plain", parse_config(_valid_config_dict(), "c"), {"0/data/m.bin": b"m"})
    config = json.loads((dest / "config.json").read_text())
    assert config.pop("exported_with") == {"neuropod": neuropod.__version__}  # write_package always stamps ours
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "manifest.json").unlink()
    pkg = read_package(dest)
    assert pkg.manifest is None and pkg.config.exported_with is None and pkg.original_format


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("{not json", id="not-json"),
        pytest.param("[]", id="list"),
        pytest.param('{"manifest_version": 2, "files": {}}', id="wrong-version"),
        pytest.param('{"manifest_version": 1}', id="no-files"),
        pytest.param('{"manifest_version": 1, "files": []}', id="files-list"),
        pytest.param('{"manifest_version": 1, "files": {"config.json": 5}}', id="hash-not-str"),
    ],
)
def test_malformed_manifest(tmp_path: Path, text: str) -> None:
    dest = _write(tmp_path / "adder")
    (dest / "manifest.json").write_text(text)
    with pytest.raises(PackageError, match=r"manifest\.json"):
        read_package(dest)
    with pytest.raises(PackageError, match=r"manifest\.json"):
        read_package(dest, verify=False)  # a malformed manifest is an error even unverified


# --- config errors ----------------------------------------------------------


def _mutated(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    data = _valid_config_dict()
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    if value is DELETE:
        if isinstance(target, dict):
            target.pop(path[-1], None)
        else:
            del target[path[-1]]
    else:
        target[path[-1]] = value
    return data


CONFIG_ERRORS = [
    (("name",), DELETE, r"required field 'name' is missing"),
    (("platform",), DELETE, r"required field 'platform' is missing"),
    (("input_spec",), DELETE, r"required field 'input_spec' is missing"),
    (("output_spec",), DELETE, r"required field 'output_spec' is missing"),
    (("name",), 5, r"'name' must be a non-empty string, not 5"),
    (("name",), "", r"'name' must be a non-empty string"),
    (("platform",), ["onnx"], r"'platform' must be a non-empty string"),
    (("platform_version_semver",), 1.2, r"'platform_version_semver' must be a string"),
    (("platform_version_semver",), "not a range!!", r"platform_version_semver: .*'not a range!!'"),
    (("platform_version_semver",), ">=1.2 <", r"platform_version_semver: .*'>=1\.2 <'"),
    (("input_spec",), "x", r"input_spec must be a list"),
    (("output_spec",), {}, r"output_spec must be a list .*not dict"),
    (("input_spec", 0), "x", r"input_spec\[0\] must be an object"),
    (("input_spec", 0, "dtype"), "float128", r"input_spec\[0\] \('x'\): dtype 'float128' is not one of"),
    (("input_spec", 0, "dtype"), 7, r"input_spec\[0\] \('x'\): dtype 7 is not one of"),
    (("input_spec", 0, "shape"), "batch", r"input_spec\[0\] \('x'\): shape must be a list"),
    (("input_spec", 0, "shape", 1), -1, r"input_spec\[0\] \('x'\): shape\[1\] is -1"),
    (("input_spec", 0, "shape", 1), 1.5, r"input_spec\[0\] \('x'\): shape\[1\] is 1\.5"),
    (("input_spec", 0, "shape", 1), True, r"input_spec\[0\] \('x'\): shape\[1\] is True"),
    (("input_spec", 0, "shape", 0), "not an identifier", r"shape\[0\] is 'not an identifier'"),
    (("output_spec", 0, "shape", 0), [3], r"output_spec\[0\] \('out'\): shape\[0\] is \[3\]"),
    (("input_spec", 0, "name"), "", r"input_spec\[0\]\.name must be a non-empty string"),
    (("input_spec", 0, "shape"), DELETE, r"input_spec\[0\] is missing 'shape'"),
    (("input_spec", 0, "units"), "cm", r"input_spec\[0\] has unknown field\(s\) 'units'"),
    (("output_spec", 1, "name"), "out", r"output_spec\[1\]: tensor name 'out' appears twice"),
    (("custom_ops",), ["../evil.so"], r"'custom_ops' must be a list of file names.*'\.\./evil\.so'"),
    (("custom_ops",), ["ops/evil.so"], r"'custom_ops' must be a list of file names.*'ops/evil\.so'"),
    (("custom_ops",), "libop.so", r"'custom_ops' must be a list of file names"),
    (("input_tensor_device",), ["GPU"], r"'input_tensor_device' must map input names"),
    (("input_tensor_device",), {"x": 1}, r"'input_tensor_device' must map input names"),
    (("exported_with",), "0.4", r"'exported_with' must be an object, not str"),
    (("device_requirements",), [7.5], r"'device_requirements' must be an object, not list"),
]


def _write_config(tmp_path: Path, content: bytes) -> Path:
    pkg = tmp_path / "pkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "config.json").write_bytes(content)
    return pkg


def test_valid_config_dict_reads(tmp_path: Path) -> None:
    """The base that CONFIG_ERRORS mutates is itself valid."""
    pkg = read_package(_write_config(tmp_path, CONFIG_BYTES))
    assert pkg.config.to_dict() == _valid_config_dict()


@pytest.mark.parametrize(("path", "value", "message"), CONFIG_ERRORS,
                         ids=[".".join(map(str, p)) + f"={v if v is not DELETE else 'DELETE'}"
                              for p, v, _ in CONFIG_ERRORS])
def test_config_field_errors(tmp_path: Path, path: tuple[Any, ...], value: Any, message: str) -> None:
    pkg = _write_config(tmp_path, json.dumps(_mutated(path, value)).encode())
    with pytest.raises(PackageError, match=message) as err:
        read_package(pkg)
    assert str(pkg / "config.json") in str(err.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(b'{\n  "name": "x",\n  oops\n}', r"not valid JSON: .* at line 3, column 3", id="invalid-json"),
        pytest.param(b"", r"not valid JSON: .* at line 1, column 1", id="empty"),
        pytest.param(b"[]", r"top level must be a JSON object, not list", id="list"),
        pytest.param(b'"adder"', r"top level must be a JSON object, not str", id="string"),
        pytest.param(b"null", r"top level must be a JSON object, not NoneType", id="null"),
        pytest.param(b'{"name": "\xff\xfe"}', r"Cannot read config", id="not-utf8"),
        pytest.param(b"[" * 100_000, r"not valid JSON", id="too-deep"),
        pytest.param(b"1" * 5000, r"not valid JSON", id="huge-int"),
    ],
)
def test_config_file_errors(tmp_path: Path, content: bytes, message: str) -> None:
    pkg = _write_config(tmp_path, content)
    with pytest.raises(PackageError, match=message) as err:
        read_package(pkg)
    assert str(pkg / "config.json") in str(err.value)


def test_missing_config(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "0" / "data").mkdir(parents=True)
    with pytest.raises(PackageError, match=rf"{re.escape(str(pkg))} is not a Neuropod package: it has no config\.json"):
        read_package(pkg)


def test_missing_package_path(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match=r"No Neuropod package at .*nowhere"):
        read_package(tmp_path / "nowhere")


def test_bad_backend_config(tmp_path: Path) -> None:
    pkg = _write_config(tmp_path, CONFIG_BYTES)
    (pkg / "0").mkdir()
    (pkg / "0" / "config.json").write_text("[1, 2]")
    with pytest.raises(PackageError, match=r"0/config\.json: the top level must be a JSON object"):
        read_package(pkg)


def test_unknown_keys_are_kept(tmp_path: Path) -> None:
    data = _valid_config_dict()
    data["future_field"] = {"a": [1, 2, None]}
    data["another"] = "x"
    config = parse_config(data, "config.json")
    assert config.extra == {"future_field": {"a": [1, 2, None]}, "another": "x"}
    assert config.to_dict() == data
    dest = write_package(tmp_path / "pkg", config, {"0/data/m.bin": b"m"})
    assert read_package(dest).config.extra == config.extra
    assert json.loads((dest / "config.json").read_text())["future_field"] == {"a": [1, 2, None]}


def test_semver_defaults_to_star() -> None:
    data = _valid_config_dict()
    del data["platform_version_semver"]
    assert parse_config(data, "config.json").platform_version_semver == "*"
    data["platform_version_semver"] = None
    assert parse_config(data, "config.json").platform_version_semver == "*"


# --- zip safety -------------------------------------------------------------


def _symlink_member() -> zipfile.ZipInfo:
    info = zipfile.ZipInfo("0/data/link")
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


HOSTILE_ZIPS = [
    pytest.param([("../evil.txt", b"x")], None, r"leaves the package: '\.\./evil\.txt'", id="dotdot"),
    pytest.param([("a/../../evil.txt", b"x")], None, r"leaves the package: 'a/\.\./\.\./evil\.txt'",
                 id="nested-dotdot"),
    pytest.param([("/etc/neuropod-test-evil.txt", b"x")], None, r"absolute .* '/etc/neuropod-test-evil\.txt'",
                 id="absolute"),
    pytest.param([("C:/evil.txt", b"x")], None, r"absolute or non-POSIX path 'C:/evil\.txt'", id="drive"),
    pytest.param([("0\\..\\..\\evil.txt", b"x")], None, r"non-POSIX path", id="backslash"),
    pytest.param([(_symlink_member(), b"../../../../evil.txt")], None, r"holds a link '0/data/link'", id="symlink"),
    pytest.param([("0/data/big.bin", b"\0" * 2000)], 1000, r"unpacks to more than 1000 bytes", id="too-big"),
    pytest.param([(".", b"x")], None, r"Cannot extract zip package", id="dot-member"),
    pytest.param([("0/data", b"x"), ("0/data/m.bin", b"x")], None, r"Cannot extract zip package",
                 id="file-then-child"),
]


def _assert_nothing_escaped(tmp_path: Path, cache: Path, before: set[str]) -> None:
    assert _tree(tmp_path, exclude=cache) == before
    assert not [p for p in tmp_path.rglob("*evil*") if p.name != "hostile.zip"]
    _assert_cache_clean(cache)


@pytest.mark.parametrize(("members", "max_bytes", "message"), HOSTILE_ZIPS)
def test_hostile_zip_refused(tmp_path: Path, cache: Path, members: list[Any], max_bytes: int | None,
                            message: str) -> None:
    assert not Path("/etc/neuropod-test-evil.txt").exists()
    zpath = _make_zip(tmp_path / "hostile.zip", [("config.json", CONFIG_BYTES), *members])
    before = _tree(tmp_path, exclude=cache)
    with pytest.raises(PackageError, match=message) as err:
        read_package(zpath, max_bytes=max_bytes)
    assert str(zpath) in str(err.value)
    _assert_nothing_escaped(tmp_path, cache, before)
    assert not Path("/etc/neuropod-test-evil.txt").exists()


def test_size_bound_from_environment(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zpath = _make_zip(tmp_path / "hostile.zip", [("config.json", CONFIG_BYTES), ("0/data/big.bin", b"\0" * 2000)])
    before = _tree(tmp_path, exclude=cache)
    monkeypatch.setenv("NEUROPOD_MAX_PACKAGE_BYTES", "1000")
    with pytest.raises(PackageError, match=r"more than 1000 bytes"):
        read_package(zpath)
    _assert_nothing_escaped(tmp_path, cache, before)
    monkeypatch.setenv("NEUROPOD_MAX_PACKAGE_BYTES", "100000")
    assert read_package(zpath).root.is_relative_to(cache)


@pytest.mark.parametrize("value", ["lots", "1e9", "10GB"])
def test_bad_max_bytes_environment(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
                                   value: str) -> None:
    zpath = _write(tmp_path / "adder.zip", package_as_zip=True)
    monkeypatch.setenv("NEUROPOD_MAX_PACKAGE_BYTES", value)
    with pytest.raises(PackageError,
                       match=rf"NEUROPOD_MAX_PACKAGE_BYTES must be a whole number of bytes greater than 0 .*'{value}'"):
        read_package(zpath)
    _assert_cache_clean(cache)


def _patch_central_size(data: bytes, member: str, size: int) -> bytes:
    """Rewrite the uncompressed size that the central directory states for one member."""
    out = bytearray(data)
    pos = out.find(b"PK\x01\x02")
    while pos != -1:
        name_len = struct.unpack_from("<H", out, pos + 28)[0]
        if out[pos + 46:pos + 46 + name_len] == member.encode():
            struct.pack_into("<I", out, pos + 24, size)
            return bytes(out)
        pos = out.find(b"PK\x01\x02", pos + 46)
    raise AssertionError(f"{member} not in the central directory")


def test_zip_with_lying_header_refused(tmp_path: Path, cache: Path) -> None:
    honest = _make_zip(tmp_path / "honest.zip", [("config.json", CONFIG_BYTES), ("0/data/big.bin", b"\1" * 2000)],
                       compression=zipfile.ZIP_STORED)
    zpath = tmp_path / "hostile.zip"
    zpath.write_bytes(_patch_central_size(honest.read_bytes(), "0/data/big.bin", 10))
    with zipfile.ZipFile(zpath) as zf:  # the header now claims 10 bytes for 2000
        assert zf.getinfo("0/data/big.bin").file_size == 10
    before = _tree(tmp_path, exclude=cache)
    with pytest.raises(PackageError, match=r"hostile\.zip is damaged: member '0/data/big\.bin' cannot be unpacked"):
        read_package(zpath, max_bytes=1000)
    _assert_nothing_escaped(tmp_path, cache, before)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(b"this is not a zip file", r"not a readable zip package", id="not-zip"),
        pytest.param(b"", r"not a readable zip package", id="empty-file"),
        pytest.param(b"PK\x03\x04" + b"\0" * 40, r"not a readable zip package", id="truncated"),
    ],
)
def test_not_a_zip(tmp_path: Path, cache: Path, content: bytes, message: str) -> None:
    zpath = tmp_path / "package.zip"
    zpath.write_bytes(content)
    before = _tree(tmp_path, exclude=cache)
    with pytest.raises(PackageError, match=message):
        read_package(zpath)
    _assert_nothing_escaped(tmp_path, cache, before)


@pytest.mark.parametrize(
    "members",
    [
        pytest.param([], id="empty-zip"),
        pytest.param([("0/data/model.bin", b"m")], id="no-config"),
        pytest.param([("pkg/0/data/model.bin", b"m")], id="folder-without-config"),
        pytest.param([("a/config.json", CONFIG_BYTES), ("b/config.json", CONFIG_BYTES)], id="two-folders"),
    ],
)
def test_zip_without_config(tmp_path: Path, cache: Path, members: list[tuple[str, bytes]]) -> None:
    zpath = _make_zip(tmp_path / "package.zip", members)
    before = _tree(tmp_path, exclude=cache)
    with pytest.raises(PackageError, match=r"not a Neuropod package: the zip has no config\.json"):
        read_package(zpath)
    assert _tree(tmp_path, exclude=cache) == before
    assert not list((cache / "packages").glob(".extract-*"))


def test_zip_with_one_top_level_folder(tmp_path: Path, cache: Path) -> None:
    dest = _write(tmp_path / "adder")
    zpath = _make_zip(tmp_path / "wrapped.zip", [
        (f"adder/{p.relative_to(dest).as_posix()}", p.read_bytes()) for p in sorted(dest.rglob("*")) if p.is_file()
    ])
    pkg = read_package(zpath)
    assert pkg.root.name == "adder" and pkg.root.is_relative_to(cache / "packages")
    assert pkg.config == _config()
    assert pkg.manifest == read_package(dest).manifest


def test_extraction_writes_only_into_cache_and_is_reused(tmp_path: Path, cache: Path) -> None:
    zpath = _write(tmp_path / "adder.zip", package_as_zip=True)
    before = _tree(tmp_path, exclude=cache)
    first = read_package(zpath)
    assert cache_dir() == cache
    assert first.root.is_relative_to(cache / "packages")
    assert _tree(tmp_path, exclude=cache) == before
    entry = first.root.relative_to(cache / "packages").parts[0]
    assert entry == _sha256(zpath)  # keyed by the zip's content
    assert [p.name for p in (cache / "packages").iterdir()] == [entry]
    config_mtime = (first.root / "config.json").stat().st_mtime_ns

    second = read_package(zpath)
    assert second.root == first.root
    assert (second.root / "config.json").stat().st_mtime_ns == config_mtime
    # Not unpacked again: the size bound, which applies while unpacking, is not even consulted.
    assert read_package(zpath, max_bytes=1).root == first.root
    assert [p.name for p in (cache / "packages").iterdir()] == [entry]

    copy_path = tmp_path / "copy.zip"  # the cache is keyed by content, not by path
    copy_path.write_bytes(zpath.read_bytes())
    assert read_package(copy_path).root == first.root


# --- property tests ---------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=16,
)

MUTATION_PATHS = [
    ("name",), ("platform",), ("platform_version_semver",), ("input_spec",), ("output_spec",), ("custom_ops",),
    ("input_tensor_device",), ("exported_with",), ("device_requirements",), ("unknown_key",),
    ("input_spec", 0), ("input_spec", 0, "name"), ("input_spec", 0, "dtype"), ("input_spec", 0, "shape"),
    ("input_spec", 0, "shape", 0), ("output_spec", 1, "shape"), ("output_spec", 1, "name"),
    ("input_tensor_device", "x"),
]

FUZZ = settings(max_examples=200, deadline=None, database=None)


def _parses_or_package_error(data: Any) -> ModelConfig | None:
    try:
        config = parse_config(data, "config.json")
    except PackageError as e:
        assert "config.json" in str(e)
        return None
    assert isinstance(config, ModelConfig)
    return config


@FUZZ
@given(json_values)
def test_parse_config_on_arbitrary_json(data: Any) -> None:
    _parses_or_package_error(data)


@FUZZ
@given(st.sampled_from(MUTATION_PATHS), json_values | st.sampled_from([DELETE, "", "*", "^1.2", 0, -1, []]))
def test_parse_config_on_mutated_config(path: tuple[Any, ...], value: Any) -> None:
    data = _mutated(path, value)
    original = copy.deepcopy(data)
    config = _parses_or_package_error(data)
    assert data == original  # parsing does not modify its input
    if config is not None:
        assert config.name == data["name"]
        assert parse_config(config.to_dict(), "config.json") == config


@settings(FUZZ, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.binary(max_size=300)
    | st.text(max_size=100).map(str.encode)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.sampled_from(MUTATION_PATHS).flatmap(
        lambda p: json_values.map(lambda v: json.dumps(_mutated(p, v)).encode())
    )
)
def test_read_package_on_arbitrary_config_bytes(tmp_path: Path, content: bytes) -> None:
    pkg_dir = _write_config(tmp_path, content)  # the same file, rewritten for each example
    try:
        pkg = read_package(pkg_dir)
    except PackageError as e:
        assert str(pkg_dir) in str(e)
    else:
        assert isinstance(pkg.config, ModelConfig)
        assert pkg.config == parse_config(json.loads(content.decode("utf-8")), "config.json")
