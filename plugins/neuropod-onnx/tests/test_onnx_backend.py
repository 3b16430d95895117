"""The ONNX Runtime backend end to end: package, discover, resolve, load, infer."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import importlib_metadata
import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import neuropod
from neuropod import plugins
from neuropod.devices import load_host
from neuropod.errors import BackendError, NeuropodError, NoBackendError, PackageError, SpecError
from neuropod.packagers import create_onnx_neuropod
from neuropod.testing import run_in_threads
from neuropod_onnx import _installed

from conftest import ADDER_INPUT_SPEC, ADDER_OUTPUT_SPEC, make_model, spec, xy

# Whichever build provides onnxruntime here: onnxruntime, or onnxruntime-gpu on a GPU host.
ORT_DIST, ORT_VERSION = _installed()[0]


# --- discovery ------------------------------------------------------------


def test_plugin_found_through_its_entry_point() -> None:
    eps = {ep.name: ep.value for ep in importlib_metadata.entry_points(group="neuropod.backends")}
    assert eps["onnx"] == "neuropod_onnx"
    backends = [b for b in plugins.installed_backends() if b.platform == "onnx"]
    assert [(b.version, b.framework, b.plugin) for b in backends] == [(ORT_VERSION, ORT_DIST, "onnx")]
    assert backends[0].plugin_distribution.startswith("neuropod-onnx ")


def test_discovery_does_not_import_onnxruntime() -> None:
    code = (
        "import sys, neuropod.plugins as p\n"
        "bs = p.installed_backends(); caps = [p.backend_caps(b) for b in bs]\n"
        "assert any(b.platform == 'onnx' for b in bs), bs\n"
        "bad = [m for m in ('onnxruntime', 'onnx', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tests_write_nothing_to_the_home_directory(make_adder, tmp_path: Path) -> None:
    # onnxruntime writes under $XDG_CACHE_HOME (else ~/.cache) at import; conftest points it
    # at a temporary directory, and the package cache is the test's own (NEUROPOD_CACHE_DIR).
    home = tmp_path / "home"
    home.mkdir()
    path = make_adder(package_as_zip=True)
    code = (
        "import sys, numpy as np, neuropod\n"
        "with neuropod.load_neuropod(sys.argv[1]) as m:\n"
        "    m.infer({'x': np.ones((1, 2), np.float32), 'y': np.ones((1, 2), np.float32)})\n"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, env={**os.environ, "HOME": str(home)})
    assert sorted(p.relative_to(home).as_posix() for p in home.rglob("*")) == []


def test_device_caps_of_the_cpu_build() -> None:
    (backend,) = [b for b in plugins.installed_backends() if b.platform == "onnx"]
    caps = plugins.backend_caps(backend)
    assert caps.cpu is True
    # The PyPI `onnxruntime` wheel has no CUDA provider: check against the runtime itself.
    assert caps.gpu == ("CUDAExecutionProvider" in ort.get_available_providers())


def test_packager_found_lazily() -> None:
    from neuropod_onnx.packager import create_onnx_neuropod as direct

    assert create_onnx_neuropod is direct


# --- packaging and inference ----------------------------------------------


def test_package_load_infer_with_shared_symbol(make_adder) -> None:
    inputs = xy(3)
    path = make_adder(test_input_data=inputs, test_expected_out={"out": inputs["x"] + inputs["y"]})
    config = json.loads((path / "config.json").read_text())
    assert config["platform"] == "onnx"
    assert config["exported_with"]["platform_version"] == ORT_VERSION
    with neuropod.load_neuropod(path) as model:
        assert (model.name, model.platform, model.device) == ("adder", "onnx", "cpu")
        assert model.backend.id == f"onnx=={ORT_VERSION}"
        assert [s.name for s in model.inputs] == ["x", "y"]
        assert [s.name for s in model.outputs] == ["out", "doubled"]
        out = model.infer(inputs)
        np.testing.assert_allclose(out["out"], inputs["x"] + inputs["y"], rtol=1e-6)
        np.testing.assert_allclose(out["doubled"], (inputs["x"] + inputs["y"]) * 2, rtol=1e-6)
        with pytest.raises(SpecError, match=r"symbol 'batch_size' .* Dim 0 of tensor 'y' .* size 3 \(from tensor 'x'\), but was of size 4"):
            model.infer({"x": inputs["x"], "y": np.zeros((4, 2), np.float32)})


def test_requested_outputs(make_adder) -> None:
    with neuropod.load_neuropod(make_adder()) as model:
        out = model.infer(xy(), requested_outputs=["doubled"])
        assert list(out) == ["doubled"]
        with pytest.raises(SpecError, match="'nope'.*not in its output spec.*'out', 'doubled'"):
            model.infer(xy(), requested_outputs=["nope"])


def test_zip_package_and_non_contiguous_inputs(make_adder) -> None:
    path = make_adder(package_as_zip=True)
    assert path.is_file()
    big = np.arange(16, dtype=np.float32).reshape(4, 4)
    x, y = big[:, ::2], big.T[:, 1::2]  # strided and transposed views
    assert not x.flags.c_contiguous and not y.flags.c_contiguous
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_array_equal(model.infer({"x": x, "y": y})["out"], x + y)


def test_bad_inputs_are_spec_errors(make_adder) -> None:
    with neuropod.load_neuropod(make_adder()) as model:
        good = xy()
        cases = [
            ({**good, "x": good["x"].astype(np.float64)}, "expected to be of type float32, but was of type float64"),
            ({**good, "x": good["x"][None]}, "expected to have 2 dimensions, but had 3"),
            ({**good, "x": np.zeros((2, 3), np.float32)}, "Dim 1 of tensor 'x' in the input spec is expected to be of size 2, but was of size 3"),
            ({**good, "z": good["x"]}, "no input named 'z'"),
            ({"x": good["x"]}, "needs input\\(s\\) 'y'"),
        ]
        for inputs, message in cases:
            with pytest.raises(SpecError, match=message):
                model.infer(inputs)


def test_all_numeric_dtypes_round_trip(tmp_path: Path) -> None:
    dtypes = ["float16", "float32", "float64", "int8", "int16", "int32", "int64",
              "uint8", "uint16", "uint32", "uint64", "bool"]  # fmt: skip
    nodes = [helper.make_node("Identity", [f"in_{t}"], [f"out_{t}"]) for t in dtypes]
    model = make_model(nodes, [(f"in_{t}", t, [None]) for t in dtypes], [(f"out_{t}", t, [None]) for t in dtypes])
    path = create_onnx_neuropod(
        tmp_path / "identity", "identity",
        spec(*[(f"in_{t}", t, [None]) for t in dtypes]), spec(*[(f"out_{t}", t, [None]) for t in dtypes]),
        onnx_model=model,
    )
    rng = np.random.default_rng(0)
    inputs = {f"in_{t}": (rng.integers(0, 2, 5) if t == "bool" else rng.integers(0, 100, 5)).astype(t) for t in dtypes}
    with neuropod.load_neuropod(path) as m:
        out = m.infer(inputs)
    for t in dtypes:
        assert out[f"out_{t}"].dtype == np.dtype(t)
        np.testing.assert_array_equal(out[f"out_{t}"], inputs[f"in_{t}"])


def test_string_tensors_in_and_out(tmp_path: Path) -> None:
    # en_US.UTF-8, the default locale, is often not installed; C.UTF-8 is.
    node = helper.make_node("StringNormalizer", ["text"], ["upper"], case_change_action="UPPER", locale="C.UTF-8")
    model = make_model([node], [("text", "string", [None])], [("upper", "string", [None])])
    words = ["apple", "Banana", "carrot cake"]
    path = create_onnx_neuropod(
        tmp_path / "upper", "upper", spec(("text", "string", [None])), spec(("upper", "string", [None])),
        onnx_model=model,
        test_input_data={"text": np.array(words)},
        test_expected_out={"upper": np.array([w.upper() for w in words])},
    )
    with neuropod.load_neuropod(path) as m:
        for given in (np.array(words), np.array(words, dtype=object)):
            assert m.infer({"text": given})["upper"].tolist() == [w.upper() for w in words]
        # UTF-8 bytes are text, as the original Neuropod took them; other bytes are refused.
        assert m.infer({"text": np.array([w.encode() for w in words])})["upper"].tolist() == [w.upper() for w in words]
        with pytest.raises(SpecError, match="not UTF-8 text"):
            m.infer({"text": np.array([b"\xff"])})


@pytest.mark.parametrize("use_ope", [False, True], ids=["in-process", "ope"])
def test_strings_with_nul_characters_round_trip(tmp_path: Path, use_ope: bool) -> None:
    # onnxruntime reads numpy unicode arrays as C strings: "a\x00b" used to come back as "a".
    model = make_model([helper.make_node("Identity", ["text"], ["same"])],
                       [("text", "string", [None])], [("same", "string", [None])])  # fmt: skip
    words = ["a\x00b", "\x00lead", "mid\x00dle\x00", "plain", ""]
    path = create_onnx_neuropod(
        tmp_path / "identity", "identity", spec(("text", "string", [None])), spec(("same", "string", [None])),
        onnx_model=model,
    )
    with neuropod.load_neuropod(path, use_ope=use_ope) as m:
        for given in (np.array(words[:1] + words[3:]), np.array(words, dtype=object)):
            assert m.infer({"text": given})["same"].tolist() == given.tolist()


def test_custom_op_library_registered_before_session(tmp_path: Path) -> None:
    ortx = pytest.importorskip("onnxruntime_extensions")
    node = helper.make_node("StringUpper", ["text"], ["upper"], domain="ai.onnx.contrib")
    model = make_model(
        [node], [("text", "string", [None])], [("upper", "string", [None])], extra_opsets=[("ai.onnx.contrib", 1)]
    )
    in_spec, out_spec = spec(("text", "string", [None])), spec(("upper", "string", [None]))
    with pytest.raises(BackendError, match="StringUpper"):  # without the library the op is unknown
        create_onnx_neuropod(tmp_path / "no_ops", "upper", in_spec, out_spec, onnx_model=model)
    assert not (tmp_path / "no_ops").exists()
    lib = Path(ortx.get_library_path())
    path = create_onnx_neuropod(
        tmp_path / "ops", "upper", in_spec, out_spec, onnx_model=model, custom_ops=[lib],
        test_input_data={"text": np.array(["neuropod"])}, test_expected_out={"upper": np.array(["NEUROPOD"])},
    )
    config = json.loads((path / "config.json").read_text())
    assert config["custom_ops"] == [lib.name]
    assert (path / "0" / "ops" / lib.name).read_bytes() == lib.read_bytes()
    with neuropod.load_neuropod(path) as m:
        assert m.infer({"text": np.array(["a", "Bc"])})["upper"].tolist() == ["A", "BC"]


def test_custom_op_that_fails_to_load(tmp_path: Path, adder_model) -> None:
    bogus = tmp_path / "libbogus.so"
    bogus.write_bytes(b"not a shared library")
    with pytest.raises(PackageError, match="custom op library libbogus.so failed to load"):
        create_onnx_neuropod(
            tmp_path / "p", "adder", ADDER_INPUT_SPEC, ADDER_OUTPUT_SPEC, onnx_model=adder_model, custom_ops=[bogus]
        )


# --- resolution and devices ---------------------------------------------------


def test_range_that_excludes_the_installed_version(make_adder) -> None:
    with pytest.warns(UserWarning, match="not checked by loading it.*Install a onnx version in '<1.0'"):
        path = make_adder(platform_version_semver="<1.0")
    with pytest.raises(NoBackendError) as info:
        neuropod.load_neuropod(path)
    text = str(info.value)
    assert f"version {ORT_VERSION} is not in '<1.0'" in text
    assert "Install a onnx version in '<1.0'" in text


def test_backend_pin(make_adder) -> None:
    path = make_adder()
    with neuropod.load_neuropod(path, backend=f"onnx=={ORT_VERSION}") as m:
        assert m.backend.version == ORT_VERSION
    with pytest.raises(NoBackendError, match="not the requested backend 'onnx==0.1'"):
        neuropod.load_neuropod(path, backend="onnx==0.1")


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this build has CUDA")
def test_gpu_requested_on_a_cpu_build_is_an_error(make_adder) -> None:
    with pytest.raises(NeuropodError, match="cuda:0"):
        neuropod.load_neuropod(make_adder(), device="cuda:0")


def test_gpu_requested_through_the_provider_check(make_adder) -> None:
    """Below resolution: the session itself refuses a GPU the build cannot use."""
    from neuropod_onnx._runtime import providers_for

    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert providers_for("cuda:1", "m")[0] == ("CUDAExecutionProvider", {"device_id": 1})
    else:
        with pytest.raises(NeuropodError, match="no CUDA provider.*Install onnxruntime-gpu"):
            providers_for("cuda:0", "m")


# --- load options, lifecycle, threads -------------------------------------------


def test_load_options(make_adder) -> None:
    path = make_adder()
    with neuropod.load_neuropod(path, intra_op_num_threads=1, graph_optimization_level="basic") as m:
        assert m._handle.session.get_session_options().intra_op_num_threads == 1
    with pytest.raises(NeuropodError, match="Unknown ONNX Runtime load option.*'threads'.*intra_op_num_threads"):
        neuropod.load_neuropod(path, threads=2)
    with pytest.raises(NeuropodError, match="graph_optimization_level must be one of"):
        neuropod.load_neuropod(path, graph_optimization_level="max")


def test_close_and_reload(make_adder) -> None:
    path = make_adder()
    model = neuropod.load_neuropod(path)
    model.close()
    model.close()  # idempotent
    with pytest.raises(NeuropodError, match="closed"):
        model.infer(xy())
    with neuropod.load_neuropod(path) as again:
        assert again.infer(xy())["out"].shape == (2, 2)


def test_concurrent_infer(make_adder) -> None:
    with neuropod.load_neuropod(make_adder()) as model:

        def work(batch: int) -> None:
            for _ in range(50):
                inputs = xy(batch)
                out = model.infer(inputs)
                np.testing.assert_allclose(out["out"], inputs["x"] + inputs["y"], rtol=1e-6)

        run_in_threads(lambda i: work(i + 1), 4)


# --- packaging errors -------------------------------------------------------------


def test_spec_that_does_not_match_the_graph(tmp_path: Path, adder_model) -> None:
    cases = [
        (spec(("x", "float32", ["b", 2]), ("w", "float32", ["b", 2])), ADDER_OUTPUT_SPEC, "input spec names 'w'"),
        (spec(("x", "float32", ["b", 2])), ADDER_OUTPUT_SPEC, "needs input\\(s\\) 'y'"),
        (spec(("x", "int32", ["b", 2]), ("y", "float32", ["b", 2])), ADDER_OUTPUT_SPEC, "int32 in the spec"),
        (spec(("x", "float32", ["b"]), ("y", "float32", ["b", 2])), ADDER_OUTPUT_SPEC, "1 dims"),
        (ADDER_INPUT_SPEC, spec(("sum", "float32", [None, 2])), "output spec names 'sum'"),
    ]
    for i, (ins, outs, message) in enumerate(cases):
        with pytest.raises(SpecError, match=message):
            create_onnx_neuropod(tmp_path / f"p{i}", "adder", ins, outs, onnx_model=adder_model)
        assert not (tmp_path / f"p{i}").exists()


def test_packager_argument_errors(tmp_path: Path, adder_model) -> None:
    args = (ADDER_INPUT_SPEC, ADDER_OUTPUT_SPEC)
    with pytest.raises(NeuropodError, match="exactly one of onnx_model= or onnx_path="):
        create_onnx_neuropod(tmp_path / "a", "adder", *args)
    with pytest.raises(NeuropodError, match="exactly one"):
        create_onnx_neuropod(tmp_path / "a", "adder", *args, onnx_model=adder_model, onnx_path="x.onnx")
    with pytest.raises(PackageError, match="does not exist"):
        create_onnx_neuropod(tmp_path / "a", "adder", *args, onnx_path=tmp_path / "missing.onnx")
    with pytest.raises(PackageError, match="platform_version_semver.*'>>1'"):
        create_onnx_neuropod(tmp_path / "a", "adder", *args, onnx_model=adder_model, platform_version_semver=">>1")
    (tmp_path / "taken").mkdir()
    with pytest.raises(PackageError, match="already exists"):
        create_onnx_neuropod(tmp_path / "taken", "adder", *args, onnx_model=adder_model)


def test_packaging_from_a_file_path(tmp_path: Path, adder_model) -> None:
    onnx_file = tmp_path / "adder.onnx"
    onnx_file.write_bytes(adder_model.SerializeToString())
    path = create_onnx_neuropod(tmp_path / "p", "adder", ADDER_INPUT_SPEC, ADDER_OUTPUT_SPEC, onnx_path=onnx_file)
    assert (path / "0" / "data" / "model.onnx").read_bytes() == onnx_file.read_bytes()


def test_wrong_expected_output_removes_the_package(make_adder, tmp_path: Path) -> None:
    inputs = xy()
    with pytest.raises(PackageError, match="does not reproduce its expected test output.*'out'.*not kept"):
        make_adder(test_input_data=inputs, test_expected_out={"out": inputs["x"] - inputs["y"]})
    assert not any(p.name.startswith("adder") for p in tmp_path.iterdir())


def test_deterministic_zip(make_adder) -> None:
    a = make_adder(package_as_zip=True)
    b = make_adder(package_as_zip=True)
    assert a.read_bytes() == b.read_bytes()


def test_tampered_model_is_refused(make_adder) -> None:
    path = make_adder()
    model_file = path / "0" / "data" / "model.onnx"
    model_file.write_bytes(model_file.read_bytes() + b"\0")
    with pytest.raises(PackageError, match="changed: 0/data/model.onnx"):
        neuropod.load_neuropod(path)


def test_framework_error_during_infer_is_wrapped(tmp_path: Path) -> None:
    # Reshape to a fixed element count: a valid spec, but the wrong size fails inside onnxruntime.
    from onnx import TensorProto

    node = helper.make_node("Reshape", ["x", "shape"], ["y"])
    model = make_model(
        [node], [("x", "float32", [None])], [("y", "float32", [2, 2])],
        [helper.make_tensor("shape", TensorProto.INT64, [2], [2, 2])],
    )
    path = create_onnx_neuropod(
        tmp_path / "r", "reshape", spec(("x", "float32", [None])), spec(("y", "float32", [2, 2])), onnx_model=model
    )
    with neuropod.load_neuropod(path) as m:
        np.testing.assert_array_equal(m.infer({"x": np.arange(4, dtype=np.float32)})["y"], [[0, 1], [2, 3]])
        with pytest.raises(BackendError, match=r"Backend onnx==.* failed to run model 'reshape'") as info:
            m.infer({"x": np.arange(5, dtype=np.float32)})
        assert info.value.__cause__ is not None


def test_demo_model_matches_onnx_helper(tmp_path: Path) -> None:
    """The demo's hand-encoded model is the same graph onnx.helper builds."""
    import onnx

    from neuropod_onnx.demo import build_demo, demo_model_bytes

    model = onnx.load_from_string(demo_model_bytes())
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node] == ["Add", "Mul"]
    assert onnx.numpy_helper.to_array(model.graph.initializer[0]) == np.float32(2.0)
    path, inputs, bad = build_demo(tmp_path)
    with neuropod.load_neuropod(path) as m:
        np.testing.assert_array_equal(m.infer(inputs)["out"], (inputs["x"] + inputs["y"]) * 2)
        with pytest.raises(SpecError, match="batch_size"):
            m.infer(bad)


# --- onnxruntime builds: which one, what CUDA, two at once ------------------

# The Requires-Dist lines of the real onnxruntime-gpu wheels (read from PyPI's files): 1.31.1 links
# CUDA 13, 1.24.4 CUDA 12; older releases name no CUDA runtime at all.
_GPU_REQUIRES = {
    "1.31.1": ['nvidia-cuda-nvrtc~=13.0; extra == "cuda"', 'nvidia-cuda-runtime~=13.0; extra == "cuda"',
               'nvidia-cudnn-cu13~=9.0; extra == "cudnn"'],
    "1.24.4": ['nvidia-cuda-nvrtc-cu12~=12.0; extra == "cuda"', 'nvidia-cuda-runtime-cu12~=12.0; extra == "cuda"'],
    "1.18.1": [],
}


def _fake_gpu_build(site: Path, version: str) -> Path:
    """The dist-info of an onnxruntime-gpu wheel (metadata only: the module stays this environment's)."""
    info = site / f"onnxruntime_gpu-{version}.dist-info"
    info.mkdir(parents=True)
    requires = "".join(f"Requires-Dist: {line}\n" for line in ["numpy>=1.21.6", *_GPU_REQUIRES[version]])
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: onnxruntime-gpu\nVersion: {version}\n{requires}")
    return info


@pytest.mark.parametrize(("version", "cuda"), [("1.31.1", "13"), ("1.24.4", "12"), ("1.18.1", "unknown")])
def test_gpu_build_cuda_version_from_its_own_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, cuda: str
) -> None:
    _fake_gpu_build(tmp_path, version)
    monkeypatch.syspath_prepend(str(tmp_path))
    import neuropod_onnx

    (backend,) = neuropod_onnx.supported_versions()
    assert (backend.framework, backend.version) == ("onnxruntime-gpu", version)
    caps = neuropod_onnx.device_caps(backend)
    assert caps is not None and caps.cpu and caps.cuda == cuda
    if ORT_DIST == "onnxruntime":
        # With onnxruntime installed too (this environment's), both own one module: a warning naming both.
        assert f"onnxruntime-gpu {version}, onnxruntime {ORT_VERSION} are installed together" in caps.warning
        assert "whichever pip installed last" in caps.warning
    # "unknown" is not a version the driver is checked against: a CUDA 12 host may try it.
    from neuropod.resolve import _driver_ok

    host = load_host(Path(__file__).parents[3] / "core/tests/hosts/two-a100.json")
    too_old = "12" if cuda == "13" else None
    assert (_driver_ok(replace(host, cuda_driver_version="12.4"), caps) is not None) == (too_old is not None)


def test_backends_warns_when_two_builds_are_installed(tmp_path: Path) -> None:
    # The build this environment lacks, as a second distribution over the same module.
    if ORT_DIST == "onnxruntime":
        _fake_gpu_build(tmp_path, "1.31.1")
        expected = f"onnx==1.31.1: onnxruntime-gpu 1.31.1, onnxruntime {ORT_VERSION} are installed together"
    else:
        info = tmp_path / "onnxruntime-1.30.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: onnxruntime\nVersion: 1.30.0\n")
        expected = f"onnx=={ORT_VERSION}: {ORT_DIST} {ORT_VERSION}, onnxruntime 1.30.0 are installed together"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "neuropod", "backends"], env=env, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    if ORT_DIST == "onnxruntime":
        assert re.search(r"onnx==1\.31\.1 +onnxruntime-gpu +neuropod-onnx \S+ +cpu \+ cuda 13\n", out), out
    assert f"warning: {expected}" in out
    data = json.loads(subprocess.run([sys.executable, "-m", "neuropod", "backends", "--json"], env=env,
                                     capture_output=True, text=True, check=True).stdout)  # fmt: skip
    assert [w.split(": ")[0] for w in data["warnings"]] == [expected.split(": ")[0]]
    # Alone, the installed build gets no warning.
    plain = subprocess.run([sys.executable, "-m", "neuropod", "backends"], capture_output=True, text=True, check=True)
    assert "warning:" not in plain.stdout


def test_the_installed_gpu_build_reports_the_cuda_it_links() -> None:
    if ORT_DIST != "onnxruntime-gpu":
        pytest.skip(f"this environment has {ORT_DIST}, not onnxruntime-gpu")
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("needs readelf (binutils) to read the CUDA provider's NEEDED entries")
    # What the CUDA provider library really links (its ELF NEEDED entries), against what the metadata said.
    lib = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    dynamic = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    linked = set(re.findall(r"NEEDED\).*\[libcudart\.so\.([0-9]+)\]", dynamic))
    (backend,) = [b for b in plugins.installed_backends() if b.platform == "onnx"]
    assert linked == {plugins.backend_caps(backend).cuda}


# --- other frameworks' tensors and IO binding (CPU here; test_onnx_gpu.py has the GPU side) ------------


def test_ortvalues_and_dlpack_tensors_in(make_adder) -> None:
    inputs = xy(3)
    want = inputs["x"] + inputs["y"]
    with neuropod.load_neuropod(make_adder(), device="cpu") as model:
        x = ort.OrtValue.ortvalue_from_numpy(inputs["x"])
        out = model.infer({"x": x, "y": inputs["y"]})
        assert type(out["out"]) is np.ndarray
        np.testing.assert_allclose(out["out"], want, rtol=1e-6)
        with pytest.raises(SpecError, match=r"'y' in the input spec is expected to be of type float32, but was of type float64"):
            model.infer({"x": x, "y": ort.OrtValue.ortvalue_from_numpy(inputs["y"].astype(np.float64))})
        with pytest.raises(NeuropodError, match="output_device='cuda': model 'adder' runs on the cpu"):
            model.infer(inputs, output_device="cuda")
    caps = plugins.backend_caps(next(b for b in plugins.installed_backends() if b.platform == "onnx"))
    assert caps.device_tensors


def test_io_binding_path_on_the_cpu(make_adder) -> None:
    # The path device tensors take (bind where they are, outputs left as OrtValues), run on the CPU:
    # the same binding calls with device "cpu" instead of "cuda".
    from neuropod_onnx._runtime import OnnxModel, _bind_device_input

    inputs = xy(4)
    want = inputs["x"] + inputs["y"]
    with neuropod.load_neuropod(make_adder(), device="cpu") as model:
        handle: OnnxModel = model._handle
        x = ort.OrtValue.ortvalue_from_numpy(inputs["x"])
        out = handle.run_bound({"x": x, "y": inputs["y"]}, ["out", "doubled"], outputs_on_device=True)
        assert all(isinstance(v, ort.OrtValue) and v.device_name().lower() == "cpu" for v in out.values())
        np.testing.assert_allclose(out["out"].numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(out["doubled"].numpy(), want * 2, rtol=1e-6)
        if hasattr(ort.OrtValue, "__dlpack__"):  # onnxruntime >= 1.2x: outputs go to other frameworks without a copy
            np.testing.assert_allclose(np.from_dlpack(out["out"]), want, rtol=1e-6)
        host = handle.run_bound({"x": x, "y": inputs["y"]}, ["doubled"], outputs_on_device=False)
        assert type(host["doubled"]) is np.ndarray
        np.testing.assert_allclose(host["doubled"], want * 2, rtol=1e-6)
        if hasattr(ort.OrtValue, "from_dlpack"):  # any DLPack producer, bound without a copy (here host memory)

            class Producer:
                def __init__(self, arr: np.ndarray):
                    self.arr = arr

                def __dlpack__(self, **kwargs: object) -> object:
                    return self.arr.__dlpack__(**kwargs)

                def __dlpack_device__(self) -> object:
                    return self.arr.__dlpack_device__()

            binding = handle.session.io_binding()
            keep = [_bind_device_input(binding, name, Producer(inputs[name]), 0, "m") for name in ("x", "y")]
            binding.bind_output("out")
            handle.session.run_with_iobinding(binding)
            np.testing.assert_allclose(binding.get_outputs()[0].numpy(), want, rtol=1e-6)
            del keep
        # Anything that is neither DLPack nor the CUDA array interface is refused by name.
        binding = handle.session.io_binding()
        with pytest.raises(NeuropodError, match="cannot take a builtins tensor on the GPU"):
            _bind_device_input(binding, "x", object(), 0, "m")
