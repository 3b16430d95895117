"""Everything up to the TensorRT call boundary: discovery, engine metadata, the range
default, resolution against described hosts, and the errors a CPU machine gives.

The engine bytes in these packages are a stand-in file: packaging and
resolution read only the metadata the package records, never the engine.
Running real engines is in test_tensorrt_gpu.py.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import importlib_metadata
import pytest

import neuropod
from neuropod import plugins
from neuropod.backend import Backend
from neuropod.cli import main
from neuropod.errors import NeuropodError, NoBackendError, SpecError
from neuropod.packagers import create_tensorrt_neuropod
from neuropod.versions import satisfies
from neuropod_tensorrt import FRAMEWORK_DISTRIBUTIONS, device_caps
from neuropod_tensorrt._engine import EngineInfo, check_io
from neuropod_tensorrt.packager import _gpu_here, profile_shapes

from conftest import HOSTS, spec

IN = spec(("images", "float32", ["batch_size", 3, 224, 224]))
OUT = spec(("logits", "float32", ["batch_size", 1000]))


def _installed_trt() -> str | None:
    for dist in FRAMEWORK_DISTRIBUTIONS:
        try:
            return importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            continue
    return None


def package(tmp_path: Path, name: str = "resnet", **kwargs) -> Path:  # type: ignore[no-untyped-def]
    engine = tmp_path / f"{name}.engine"
    engine.write_bytes(b"stand-in engine bytes: resolution reads only the package's metadata")
    kwargs.setdefault("compute_capability", "8.0")
    kwargs.setdefault("tensorrt_version", "10.3.0")
    with pytest.warns(UserWarning, match="not checked by loading it"):
        return create_tensorrt_neuropod(tmp_path / f"{name}.neuropod", name, IN, OUT, engine_path=engine, **kwargs)


def explain(path: Path, host: str, *extra: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["explain", str(path), "--host", str(HOSTS / host), "--quiet-spec", *extra], out)
    return code, out.getvalue()


# --- discovery ----------------------------------------------------------------------


def test_discovery_matches_what_is_installed() -> None:
    found = [b for b in plugins.installed_backends() if b.platform == "tensorrt"]
    version = _installed_trt()
    assert [b.version for b in found] == ([version] if version else [])
    assert "tensorrt" in {i.name for i in plugins.plugin_infos()}, "the plugin loads even without TensorRT"


def test_device_caps_are_gpu_only_with_cuda_from_the_bindings_name() -> None:
    caps = device_caps(Backend("tensorrt", "10.3.0", "tensorrt-cu12-bindings"))
    assert caps is not None and caps.cpu is False and caps.cuda == "12"
    assert device_caps(Backend("tensorrt", "11.0.0", "tensorrt-cu13-bindings")).cuda == "13"  # type: ignore[union-attr]
    assert device_caps(Backend("onnx", "1.0", "onnxruntime")) is None


# --- engine metadata and the range default --------------------------------------------


def test_range_defaults_to_the_engines_major_minor(tmp_path: Path) -> None:
    path = package(tmp_path, tensorrt_version="10.3.0")
    config = json.loads((path / "config.json").read_text())
    assert config["platform_version_semver"] == "~10.3"
    assert config["exported_with"]["platform_version"] == "10.3.0"
    assert config["device_requirements"] == {"device": "gpu", "compute_capability": "8.0"}
    assert satisfies("10.3.0.26", "~10.3") and satisfies("10.3.1", "~10.3")
    assert not satisfies("10.4.0", "~10.3") and not satisfies("8.6.1", "~10.3")
    explicit = package(tmp_path, name="pinned", platform_version_semver="==10.3.0.26")
    assert json.loads((explicit / "config.json").read_text())["platform_version_semver"] == "==10.3.0.26"


def test_engine_info_validation() -> None:
    info = EngineInfo("10.3.0.26", "8.6", "ampere_plus", 2**30)
    assert info.default_range() == "~10.3"
    assert info.device_requirements() == {
        "device": "gpu", "compute_capability": "8.6", "hardware_compatible": "ampere_plus",
        "min_compute_capability": "8.0", "min_free_memory": 2**30,
    }  # fmt: skip
    for kwargs, message in [
        ({"tensorrt_version": "ten"}, "is not a version"),
        ({"compute_capability": "eight"}, "must look like '8.0'"),
        ({"hardware_compatibility": "any"}, "must be one of"),
        ({"min_free_memory": -1}, "min_free_memory must be"),
    ]:
        args = {"tensorrt_version": "10.3.0", "compute_capability": "8.0", **kwargs}
        with pytest.raises(NeuropodError, match=message):
            EngineInfo(**args)  # type: ignore[arg-type]


def test_packaging_arguments(tmp_path: Path) -> None:
    engine = tmp_path / "e.engine"
    engine.write_bytes(b"x")
    with pytest.raises(NeuropodError, match="exactly one of engine_path= or onnx_path="):
        create_tensorrt_neuropod(tmp_path / "p", "m", IN, OUT)
    with pytest.raises(NeuropodError, match="compute_capability= is needed with engine_path="):
        create_tensorrt_neuropod(tmp_path / "p", "m", IN, OUT, engine_path=engine, tensorrt_version="10.3.0")
    if _installed_trt() is None:
        with pytest.raises(NeuropodError, match="tensorrt_version= is needed"):
            create_tensorrt_neuropod(tmp_path / "p", "m", IN, OUT, engine_path=engine, compute_capability="8.0")
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"x")
    with pytest.raises(NeuropodError, match="optimization_profile\\['batch_size'\\]"):
        create_tensorrt_neuropod(tmp_path / "p", "m", IN, OUT, onnx_path=onnx)
    if _installed_trt() is None:
        # Without a GPU the builder says so first; with a GPU but no TensorRT, that TensorRT is missing.
        missing = "needs an NVIDIA GPU" if _gpu_here() is None else re.escape("needs tensorrt, which is not installed: " + plugins.pip_install("'neuropod-tensorrt[tensorrt]'"))
        with pytest.raises(NeuropodError, match=missing):
            create_tensorrt_neuropod(tmp_path / "p", "m", IN, OUT, onnx_path=onnx,
                                     optimization_profile={"batch_size": (1, 8, 32)})  # fmt: skip
    assert not (tmp_path / "p").exists()


def test_profile_shapes_from_the_spec() -> None:
    from neuropod.spec import parse_spec

    (images,) = parse_spec(IN, "in")
    assert profile_shapes(images, {"batch_size": (1, 8, 32)}) == ((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))
    (fixed,) = parse_spec(spec(("x", "float32", [2, 3])), "in")
    assert profile_shapes(fixed, {}) is None
    (free,) = parse_spec(spec(("x", "float32", [None, 3])), "in")
    with pytest.raises(NeuropodError, match="dim 0 \\(null\\).*optimization_profile\\['x'\\]"):
        profile_shapes(free, {})
    assert profile_shapes(free, {"x": ((1, 3), (4, 3), (9, 3))}) == ((1, 3), (4, 3), (9, 3))


def test_spec_against_engine_io() -> None:
    from neuropod.spec import parse_spec

    inputs, outputs = parse_spec(IN, "in"), parse_spec(OUT, "out")
    good = {"images": ("input", "float32", (-1, 3, 224, 224)), "logits": ("output", "float32", (-1, 1000))}
    check_io(good, inputs, outputs, "m")
    cases = [
        ({**good, "images": ("input", "float16", (-1, 3, 224, 224))}, "input 'images' is float32 in the spec, float16 in the engine"),
        ({**good, "images": ("input", "float32", (-1, 224, 224))}, "4 dims .* in the spec, 3 dims"),
        ({**good, "images": ("input", "float32", (-1, 1, 224, 224))}, "dim 1 is 3 in the spec, 1 in the engine"),
        ({"input_0": good["images"], "logits": good["logits"]}, "the input spec has 'images', the engine's input tensors are 'input_0'"),
    ]  # fmt: skip
    for io_, message in cases:
        with pytest.raises(SpecError, match=message):
            check_io(io_, inputs, outputs, "m")


# --- resolution against described hosts ----------------------------------------------


def test_two_a100s_choose_the_one_with_most_free_memory(tmp_path: Path) -> None:
    path = package(tmp_path)
    code, out = explain(path, "two-a100.json")
    assert code == 0 and "Chosen: tensorrt==10.3.0 on cuda:1." in out, out
    assert "described in two-a100.json" in out
    code, out = explain(path, "two-a100.json", "--device", "cuda:0")
    assert "Chosen: tensorrt==10.3.0 on cuda:0." in out


def test_other_hosts_are_rejected_with_their_reasons(tmp_path: Path) -> None:
    path = package(tmp_path)
    code, out = explain(path, "one-h100.json")
    assert code == 1 and "cuda:0 is compute capability 9.0, the model was built for 8.0" in out
    code, out = explain(path, "laptop.json")
    assert code == 1 and "needs a GPU: host has no GPU" in out
    code, out = explain(path, "t4.json")
    assert code == 1 and "cuda:0 is compute capability 7.5, the model was built for 8.0" in out
    code, out = explain(path, "a100-trt8.json")
    assert code == 1 and "version 8.6.1 is not in '~10.3' (>=10.3.0, <10.4.0)" in out
    code, out = explain(path, "two-a100.json", "--device", "cpu")
    assert code == 1 and "device='cpu' was requested, but the model needs a GPU" in out


def test_free_memory_requirement(tmp_path: Path) -> None:
    path = package(tmp_path, name="big", min_free_memory=50 * 2**30)
    code, out = explain(path, "two-a100.json")
    assert "Chosen: tensorrt==10.3.0 on cuda:1." in out
    code, out = explain(path, "two-a100.json", "--device", "cuda:0")
    assert code == 1 and "cuda:0 has 40.0 GiB free, the model needs 50.0 GiB" in out
    huge = package(tmp_path, name="huge", compute_capability="9.0", min_free_memory=100 * 2**30)
    code, out = explain(huge, "one-h100.json")
    assert code == 1 and "cuda:0 has 79.0 GiB free, the model needs 100.0 GiB" in out


def test_hardware_compatible_engine_runs_on_newer_gpus(tmp_path: Path) -> None:
    path = package(tmp_path, name="hc", hardware_compatibility="ampere_plus")
    code, out = explain(path, "one-h100.json")
    assert code == 0 and "Chosen: tensorrt==10.3.0 on cuda:0." in out
    code, out = explain(path, "t4.json")
    assert code == 1 and "built hardware-compatible for 8.0 and newer" in out


def test_loading_on_this_machine_says_what_is_missing(tmp_path: Path) -> None:
    if _installed_trt() is not None:
        pytest.skip("TensorRT is installed here")
    path = package(tmp_path)
    with pytest.raises(NoBackendError) as info:
        neuropod.load_neuropod(path)
    framework = plugins.pip_install("'neuropod-tensorrt[tensorrt]'")
    assert f"neuropod-tensorrt 0.4.0 is installed, but its framework is not: {framework}" in str(info.value)


# --- tensor names with '/', ':' and '.' (TensorRT names tensors as the ONNX graph did) ------------


def test_tensor_names_with_slashes_colons_and_dots_up_to_the_engine(tmp_path: Path) -> None:
    names_in = spec(("input/x:0", "float32", ["batch_size", 4]))
    names_out = spec(
        ("InceptionV3/Predictions/Softmax:0", "float32", ["batch_size", 4]), ("out.1", "float32", ["batch_size"])
    )
    engine = tmp_path / "named.engine"
    engine.write_bytes(b"stand-in engine bytes: resolution reads only the package's metadata")
    with pytest.warns(UserWarning, match="not checked by loading it"):
        path = create_tensorrt_neuropod(tmp_path / "named.neuropod", "named", names_in, names_out, engine_path=engine,
                                        compute_capability="8.0", tensorrt_version="10.3.0")  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    assert [s["name"] for s in config["output_spec"]] == ["InceptionV3/Predictions/Softmax:0", "out.1"]
    # What an engine built from such an ONNX graph reports; the spec check matches it by name.
    engine_io = {
        "input/x:0": ("input", "float32", (-1, 4)),
        "InceptionV3/Predictions/Softmax:0": ("output", "float32", (-1, 4)),
        "out.1": ("output", "float32", (-1,)),
    }
    from neuropod.spec import parse_spec

    check_io(engine_io, parse_spec(names_in, "in"), parse_spec(names_out, "out"), "Model 'named'")
