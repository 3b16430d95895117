"""The TorchScript backend end to end: package, discover, resolve, load, infer."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import importlib_metadata
import numpy as np
import pytest
import torch

import neuropod
from neuropod import plugins
from neuropod.errors import BackendError, NeuropodError, NoBackendError, PackageError, SpecError
from neuropod.packagers import create_torchscript_neuropod
from neuropod.testing import run_in_threads

import models
from conftest import FIXTURES, needs_fixtures, spec

TORCH_VERSION = importlib_metadata.version("torch")
XY_SPEC = spec(("x", "float32", ["batch", 2]), ("y", "float32", ["batch", 2]))
ADDER_OUT = spec(("out", "float32", ["batch", 2]), ("doubled", "float32", ["batch", 2]))


def xy(batch: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    return {n: rng.standard_normal((batch, 2)).astype(np.float32) for n in ("x", "y")}


def package(tmp_path: Path, module: torch.nn.Module, in_spec, out_spec, name: str = "m", **kwargs) -> Path:  # type: ignore[no-untyped-def]
    return create_torchscript_neuropod(
        tmp_path / f"{name}.neuropod", name, in_spec, out_spec, module=torch.jit.script(module), **kwargs
    )


# --- discovery ------------------------------------------------------------


def test_found_through_the_entry_point_with_the_installed_version() -> None:
    eps = {ep.name: ep.value for ep in importlib_metadata.entry_points(group="neuropod.backends")}
    assert eps["torchscript"] == "neuropod_torchscript"
    (backend,) = [b for b in plugins.installed_backends() if b.platform == "torchscript"]
    assert (backend.version, backend.framework) == (TORCH_VERSION, "torch")
    # torch.__version__ may carry a local label the wheel's metadata lacks (2.14.1 vs 2.14.1+cu130).
    assert backend.version.split("+")[0] == torch.__version__.split("+")[0]


def test_discovery_does_not_import_torch() -> None:
    code = (
        "import sys, neuropod.plugins as p\n"
        "bs = [b for b in p.installed_backends() if b.platform == 'torchscript']\n"
        "caps = p.backend_caps(bs[0])\n"
        "print(caps.cuda)\n"
        "assert 'torch' not in sys.modules, 'discovery imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == str(torch.version.cuda), "the CUDA version read from torch/version.py is torch's own"


def test_device_caps_match_the_build() -> None:
    (backend,) = [b for b in plugins.installed_backends() if b.platform == "torchscript"]
    caps = plugins.backend_caps(backend)
    assert caps.cpu and caps.cuda == torch.version.cuda


def test_neuropod_backends_says_which_torch_build_is_installed() -> None:
    """A CPU build cannot use a GPU: `neuropod backends` says which build pip installed."""
    out = subprocess.run([sys.executable, "-m", "neuropod", "backends"], check=True, capture_output=True,
                         text=True).stdout  # fmt: skip
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    assert f"  torch {TORCH_VERSION}: {build}" in out, out
    data = json.loads(subprocess.run([sys.executable, "-m", "neuropod", "backends", "--json"], check=True,
                                     capture_output=True, text=True).stdout)  # fmt: skip
    assert data["framework_builds"]["torch"]["build"].startswith(build)


# --- calling conventions --------------------------------------------------


def test_one_argument_per_input_with_shared_symbol(tmp_path: Path) -> None:
    inputs = xy(3)
    total = inputs["x"] + inputs["y"]
    path = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT, test_input_data=inputs,
                   test_expected_out={"out": total, "doubled": total * 2})  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    assert config["platform"] == "torchscript" and config["exported_with"]["platform_version"] == TORCH_VERSION
    # device="cpu": on a GPU host with a CUDA torch, resolution rightly picks cuda:0 (tests_gpu covers that).
    with neuropod.load_neuropod(path, device="cpu") as model:
        assert model.backend.id == f"torchscript=={TORCH_VERSION}" and model.device == "cpu"
        out = model.infer(inputs)
        np.testing.assert_allclose(out["out"], total, rtol=1e-6)
        np.testing.assert_allclose(out["doubled"], total * 2, rtol=1e-6)
        assert list(model.infer(inputs, requested_outputs=["doubled"])) == ["doubled"]
        with pytest.raises(SpecError, match=r"Dim 0 of tensor 'y' .* size 3 \(from tensor 'x'\), but was of size 1"):
            model.infer({"x": inputs["x"], "y": np.zeros((1, 2), np.float32)})


def test_dict_of_tensors(tmp_path: Path) -> None:
    path = package(tmp_path, models.DictAdder(), XY_SPEC, spec(("out", "float32", ["batch", 2])))
    inputs = xy()
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_allclose(model.infer(inputs)["out"], inputs["x"] + inputs["y"], rtol=1e-6)


def test_no_custom_ops_no_probe(tmp_path: Path, neuropod_cache: Path) -> None:
    """A package without custom ops never starts the op probe (a subprocess importing torch)."""
    path = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT)
    with neuropod.load_neuropod(path) as model:
        assert model.infer(xy())["out"].shape == (2, 2)
    assert not (neuropod_cache / "probes").exists()


def test_dict_of_string_lists(tmp_path: Path) -> None:
    words = ["apple", "Banana", "carrot cake"]
    path = package(tmp_path, models.Upper(), spec(("text", "string", [None])), spec(("upper", "string", [None])),
                   test_input_data={"text": np.array(words)},
                   test_expected_out={"upper": np.array([w.upper() for w in words])})  # fmt: skip
    with neuropod.load_neuropod(path) as model:
        for given in (np.array(words), np.array(words, dtype=object)):
            out = model.infer({"text": given})["upper"]
            assert out.dtype.kind == "U" and out.tolist() == [w.upper() for w in words]
        assert model.infer({"text": np.array([], dtype=str)})["upper"].shape == (0,)


@needs_fixtures
def test_original_neuropod_union_dict_package() -> None:
    """Uber's own package: forward(Dict[str, Union[Tensor, List[str]]])."""
    with neuropod.load_neuropod(FIXTURES / "torchscript_dict_with_union_value_type_model") as model:
        out = model.infer({"a": np.array(["x", "y"]), "b": np.array([[1], [2]], dtype=np.float32)})
    np.testing.assert_array_equal(out["c"], np.array([[0, 1], [0, 2]], dtype=np.float32))


@needs_fixtures
@pytest.mark.parametrize(
    "name", ["torchscript_addition_model", "torchscript_addition_model_single_output", "torchscript_strings_model"]
)
def test_original_legacy_format_packages_fail_clearly(name: str) -> None:
    with pytest.raises(PackageError) as info:
        neuropod.load_neuropod(FIXTURES / name)
    message = str(info.value)
    assert "legacy format from before torch 1.4" in message and f"torch {torch.__version__} cannot read it" in message
    assert info.value.__cause__ is None, "no torch traceback behind it"


def test_single_tensor_named_tuple_and_tuple_of_dicts(tmp_path: Path) -> None:
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    single = package(tmp_path, models.SingleTensor(), spec(("x", "float32", [None, 2])),
                     spec(("y", "float32", [None, 2])), name="single")  # fmt: skip
    with neuropod.load_neuropod(single) as m:
        np.testing.assert_array_equal(m.infer({"x": x})["y"], x * 3)
    named = package(tmp_path, models.ReturnsNamedTuple(), spec(("x", "float32", [3, 2]), ("y", "float32", [3, 2])),
                    spec(("total", "float32", [3, 2]), ("diff", "float32", [3, 2])), name="named")  # fmt: skip
    with neuropod.load_neuropod(named) as m:
        out = m.infer({"x": x, "y": x * 2})
        np.testing.assert_array_equal(out["total"], x * 3)
        np.testing.assert_array_equal(out["diff"], -x)
    tuples = package(tmp_path, models.ReturnsTupleOfDicts(), spec(("x", "float32", ["n", 2])),
                     spec(("twice", "float32", ["n", 2]), ("label", "string", ["n"])), name="tuples")  # fmt: skip
    with neuropod.load_neuropod(tuples) as m:
        out = m.infer({"x": x})
        np.testing.assert_array_equal(out["twice"], x * 2)
        assert out["label"].tolist() == ["a", "a", "a"]


def test_optional_argument_left_out(tmp_path: Path) -> None:
    path = package(tmp_path, models.OptionalBias(), spec(("x", "float32", [2]), ("bias", "float32", [2])),
                   spec(("out", "float32", [2])))  # fmt: skip
    x, b = np.array([1, 2], np.float32), np.array([10, 20], np.float32)
    with neuropod.load_neuropod(path) as m:
        np.testing.assert_array_equal(m.infer({"x": x})["out"], x)
        np.testing.assert_array_equal(m.infer({"x": x, "bias": b})["out"], x + b)
        with pytest.raises(SpecError, match="needs input\\(s\\) 'x'"):
            m.infer({"bias": b})


def test_bare_string_list_is_the_single_output(tmp_path: Path) -> None:
    """forward may return a bare List[str] when the output spec has one entry (the original's string models)."""
    x, y = np.array(["apple", "big"]), np.array(["sauce", "top"])
    in_spec = spec(("x", "string", ["n"]), ("y", "string", ["n"]))
    path = package(tmp_path, models.ConcatStrings(), in_spec, spec(("out", "string", ["n"])),
                   test_input_data={"x": x, "y": y}, test_expected_out={"out": np.array(["apple sauce", "big top"])})  # fmt: skip
    with neuropod.load_neuropod(path) as m:
        out = m.infer({"x": x, "y": y.astype(object)})["out"]
        assert out.dtype.kind == "U" and out.tolist() == ["apple sauce", "big top"]
        assert m.infer({"x": x[:0], "y": y[:0]})["out"].shape == (0,)
    two = package(tmp_path, models.ConcatStrings(), in_spec, spec(("a", "string", ["n"]), ("b", "string", ["n"])),
                  name="two")  # fmt: skip
    with neuropod.load_neuropod(two) as m, pytest.raises(BackendError) as info:
        m.infer({"x": x, "y": y})
    assert "returned a list of str, but its output spec has 2 outputs (a, b)" in str(info.value)
    assert "Model did not return dict and output spec is not size 1" in str(info.value)
    numeric = package(tmp_path, models.ConcatStrings(), in_spec, spec(("out", "float32", ["n"])), name="numeric")
    with neuropod.load_neuropod(numeric) as m, pytest.raises(SpecError, match="'out'.*float32"):
        m.infer({"x": x, "y": y})


def test_output_returned_twice_is_an_error(tmp_path: Path) -> None:
    path = package(tmp_path, models.ReturnsDuplicate(), spec(("x", "float32", [2])),
                   spec(("out", "float32", [2]), ("a", "float32", [2])))  # fmt: skip
    with neuropod.load_neuropod(path) as m:
        for requested in (None, ["a"]):  # even when 'out' is not asked for: the model is wrong
            with pytest.raises(BackendError) as info:
                m.infer({"x": np.ones(2, np.float32)}, requested_outputs=requested)
            message = str(info.value)
            assert isinstance(info.value, RuntimeError)
            assert "returned output 'out' twice" in message
            assert "An item with name `out` was already returned by this model" in message


def test_scalars_in_and_out(tmp_path: Path) -> None:
    x = np.array([1, 2, 3.5], np.float32)
    in_spec = spec(("x", "float32", ["n"]), ("scale", "float32", []))
    out_spec = spec(("total", "float32", []), ("count", "int64", []))
    path = package(tmp_path, models.Scalars(), in_spec, out_spec,
                   test_input_data={"x": x, "scale": np.float32(2)},
                   test_expected_out={"total": np.float32(13), "count": np.int64(3)})  # fmt: skip
    with neuropod.load_neuropod(path) as m:
        for scale in (np.float32(2), np.array(2, np.float32)):
            out = m.infer({"x": x, "scale": scale})
            for name, value, dtype in (("total", 13.0, np.float32), ("count", 3, np.int64)):
                assert type(out[name]) is np.ndarray and out[name].shape == () and out[name].dtype == dtype
                assert out[name] == value
        with pytest.raises(SpecError, match="'scale'"):
            m.infer({"x": x, "scale": np.array([2], np.float32)})


# --- outputs the spec cannot describe ------------------------------------------


@pytest.mark.parametrize(
    ("module", "out_spec", "error", "message"),
    [
        (models.ReturnsInt(), spec(("y", "int64", [])), NeuropodError, "returned a int, which its output spec cannot describe"),
        (models.ReturnsListOfTensors(), spec(("y", "float32", [2])), NeuropodError, "returned a list of Tensor"),
        (models.SingleTensor(), spec(("a", "float32", [2]), ("b", "float32", [2])), NeuropodError,
         "returned a single tensor, but its output spec has 2 outputs"),
        (models.MissesAnOutput(), spec(("a", "float32", [2]), ("b", "float32", [2])), SpecError,
         "did not return output\\(s\\) 'b'"),
    ],
)  # fmt: skip
def test_bad_return_types(tmp_path: Path, module: torch.nn.Module, out_spec, error, message) -> None:  # type: ignore[no-untyped-def]
    path = package(tmp_path, module, spec(("x", "float32", [2])), out_spec)
    with neuropod.load_neuropod(path) as m, pytest.raises(error, match=message):
        m.infer({"x": np.ones(2, np.float32)})


# --- packaging errors ------------------------------------------------------------


def test_wrong_calling_convention_is_caught_at_packaging(tmp_path: Path) -> None:
    cases = [
        (spec(("x", "float32", [2]), ("z", "float32", [2])), "the input spec has 'z' that it does not take"),
        (spec(("x", "float32", [2])), "it needs 'y' that the input spec does not describe"),
    ]
    for i, (in_spec, message) in enumerate(cases):
        with pytest.raises(SpecError, match=message):
            package(tmp_path, models.Adder(), in_spec, ADDER_OUT, name=f"p{i}")
        assert not (tmp_path / f"p{i}.neuropod").exists(), "a package that cannot load is not kept"
    with pytest.raises(SpecError, match="input 'text' is string, but forward\\(inputs: Dict\\[str, Tensor\\]\\)"):
        package(tmp_path, models.DictAdder(), spec(("text", "string", [None])), ADDER_OUT, name="strs")
    with pytest.raises(SpecError, match="string input 'text' has shape \\[None, 2\\].*must be 1-D"):
        package(tmp_path, models.Upper(), spec(("text", "string", [None, 2])), spec(("upper", "string", [None])))


def test_packager_argument_errors(tmp_path: Path) -> None:
    # ValueError, as the original raised.
    with pytest.raises(ValueError, match="exactly one of module= or module_path="):
        create_torchscript_neuropod(tmp_path / "a", "a", XY_SPEC, ADDER_OUT)
    with pytest.raises(PackageError, match="must be a torch.jit.ScriptModule, not Adder \\(script or trace it first"):
        create_torchscript_neuropod(tmp_path / "a", "a", XY_SPEC, ADDER_OUT, module=models.Adder())
    with pytest.raises(PackageError, match="does not exist"):
        create_torchscript_neuropod(tmp_path / "a", "a", XY_SPEC, ADDER_OUT, module_path=tmp_path / "none.pt")


def test_original_packager_keywords(tmp_path: Path) -> None:
    """persist_test_data, zip_compression and neuropod_load_args, as the original's packagers took them."""
    inputs = xy(3)
    total = inputs["x"] + inputs["y"]
    expected = {"out": total, "doubled": total * 2}
    kept = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT, name="kept", test_input_data=inputs,
                   test_expected_out=expected, neuropod_load_args={"visible_gpu": None})  # fmt: skip
    assert (kept / "test_data").is_dir()
    unkept = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT, name="unkept", test_input_data=inputs,
                     test_expected_out=expected, persist_test_data=False)  # fmt: skip
    assert not (unkept / "test_data").exists()
    # Not persisted, the test data is still checked: a wrong expectation is refused.
    with pytest.raises(PackageError, match="does not reproduce its expected test output") as info:
        package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT, name="wrong", test_input_data=inputs,
                test_expected_out={"out": total + 1, "doubled": total * 2}, persist_test_data=False)  # fmt: skip
    assert isinstance(info.value, ValueError) and not (tmp_path / "wrong.neuropod").exists()
    for compression in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        zipped = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT, name=f"zip{compression}", package_as_zip=True,
                         zip_compression=compression)  # fmt: skip
        with zipfile.ZipFile(zipped) as zf:
            assert {i.compress_type for i in zf.infolist() if i.file_size} == {compression}
        with neuropod.load_neuropod(zipped) as m:
            np.testing.assert_allclose(m.infer(inputs)["out"], total, rtol=1e-6)
    with pytest.raises(NeuropodError, match="Unknown TorchScript load option.*'threads'"):
        package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT, name="badargs", neuropod_load_args={"threads": 2})
    assert not (tmp_path / "badargs.neuropod").exists()


def test_module_path_zip_and_traced_module(tmp_path: Path) -> None:
    linear = models.Linear()
    traced = torch.jit.trace(linear, torch.zeros(1, 4), strict=False)  # strict=False: it returns a dict
    torch.jit.save(traced, str(tmp_path / "linear.pt"))
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    with torch.no_grad():
        expected = linear(torch.from_numpy(x))["y"].numpy()
    path = create_torchscript_neuropod(
        tmp_path / "linear.zip", "linear", spec(("x", "float32", ["n", 4])), spec(("y", "float32", ["n", 3])),
        module_path=tmp_path / "linear.pt", package_as_zip=True,
        test_input_data={"x": x}, test_expected_out={"y": expected},
    )
    assert path.is_file()
    with neuropod.load_neuropod(path) as m:
        np.testing.assert_allclose(m.infer({"x": x})["y"], expected, rtol=1e-5, atol=1e-6)
        assert not m._handle.module.training


# --- dtypes, layouts, errors ---------------------------------------------------------


def test_numeric_dtypes_round_trip(tmp_path: Path) -> None:
    dtypes = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
    if hasattr(torch, "uint16"):
        dtypes += ["uint16", "uint32", "uint64"]
    path = package(tmp_path, models.Identity(), spec(*[(f"in_{t}", t, [None]) for t in dtypes]),
                   spec(*[(f"out_{t}", t, [None]) for t in dtypes]))  # fmt: skip
    rng = np.random.default_rng(0)
    inputs = {f"in_{t}": rng.integers(0, 2 if t == "bool" else 100, 4).astype(t) for t in dtypes}
    with neuropod.load_neuropod(path) as m:
        out = m.infer(inputs)
    for t in dtypes:
        assert out[f"out_{t}"].dtype == np.dtype(t)
        np.testing.assert_array_equal(out[f"out_{t}"], inputs[f"in_{t}"])


def test_non_contiguous_inputs(tmp_path: Path) -> None:
    path = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT)
    big = np.arange(16, dtype=np.float32).reshape(4, 4)
    x, y = big[:, ::2], big.T[:, 1::2]
    with neuropod.load_neuropod(path) as m:
        np.testing.assert_array_equal(m.infer({"x": x, "y": y})["out"], x + y)


def test_exception_inside_the_model_is_wrapped(tmp_path: Path) -> None:
    path = package(tmp_path, models.Raises(), spec(("x", "float32", [None])), spec(("y", "float32", [None])))
    with neuropod.load_neuropod(path) as m:
        np.testing.assert_array_equal(m.infer({"x": np.ones(2, np.float32)})["y"], np.ones(2))
        with pytest.raises(BackendError, match="failed to run model 'm': builtins.ValueError: negative input\n") as info:
            m.infer({"x": -np.ones(2, np.float32)})
        assert info.value.__cause__ is not None


def test_range_that_excludes_the_installed_torch(tmp_path: Path) -> None:
    """~2.14 is rejected on 2.13 (and ~2.13 on 2.14), with the resolution table."""
    other = "~2.14" if torch.__version__.startswith("2.13") else "~2.13"
    with pytest.warns(UserWarning, match="not checked by loading it: no installed backend"):
        path = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT, platform_version_semver=other)
    with pytest.raises(NoBackendError) as info:
        neuropod.load_neuropod(path)
    text = str(info.value)
    assert f"version {TORCH_VERSION} is not in '{other}'" in text
    assert f"torchscript=={TORCH_VERSION}" in text and "Candidates:" in text


def test_gpu_on_a_cpu_build(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is available here")
    path = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT)
    with pytest.raises(NoBackendError, match="device='cuda:0' was requested"):
        neuropod.load_neuropod(path, device="cuda:0")
    from neuropod.torch_support import check_device

    with pytest.raises(NeuropodError, match="device 'cuda:0' was asked for, but torch .* load with device='cpu'"):
        check_device("cuda:0", "m")


def test_load_options(tmp_path: Path) -> None:
    path = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT)
    before = torch.get_num_threads()
    try:
        with neuropod.load_neuropod(path, intra_op_num_threads=1):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(NeuropodError, match="Unknown TorchScript load option.*'threads'.*intra_op_num_threads"):
        neuropod.load_neuropod(path, threads=2)
    with pytest.raises(NeuropodError, match="intra_op_num_threads must be an int >= 1"):
        neuropod.load_neuropod(path, intra_op_num_threads=0)


def test_close_reload_and_threads(tmp_path: Path) -> None:
    path = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT)
    model = neuropod.load_neuropod(path)
    model.close()
    with pytest.raises(NeuropodError, match="closed"):
        model.infer(xy())
    with neuropod.load_neuropod(path) as model:

        def work(batch: int) -> None:
            for _ in range(50):
                inputs = xy(batch)
                np.testing.assert_allclose(model.infer(inputs)["out"], inputs["x"] + inputs["y"], rtol=1e-6)

        run_in_threads(lambda i: work(i + 1), 4)


def test_outputs_do_not_track_gradients(tmp_path: Path) -> None:
    path = package(tmp_path, models.Linear(), spec(("x", "float32", ["n", 4])), spec(("y", "float32", ["n", 3])))
    with neuropod.load_neuropod(path) as m:
        assert all(not p.requires_grad for p in m._handle.module.parameters())
        assert m.infer({"x": np.ones((2, 4), np.float32)})["y"].shape == (2, 3)


def test_packaging_and_loading_are_quiet(tmp_path: Path) -> None:
    """torch's 'torch.jit is deprecated' notices are not shown to people running packaged models."""
    import warnings

    module = torch.jit.script(models.Adder())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # overrides the test suite's own ignore filters
        path = create_torchscript_neuropod(tmp_path / "m", "m", XY_SPEC, ADDER_OUT, module=module)
        with neuropod.load_neuropod(path) as m:
            assert m.infer(xy())["out"].shape == (2, 2)


# --- other frameworks' tensors (CPU here; tests/test_torchscript_gpu.py has the GPU side) ----------


def test_torch_tensors_in(tmp_path: Path) -> None:
    path = package(tmp_path, models.Adder(), XY_SPEC, ADDER_OUT)
    inputs = xy(3)
    want = inputs["x"] + inputs["y"]
    with neuropod.load_neuropod(path, device="cpu") as model:
        x = torch.from_numpy(inputs["x"])
        y = torch.from_numpy(inputs["y"].T.copy()).T  # non-contiguous
        graded = x.clone().requires_grad_(True)  # refuses DLPack export until detached
        for given in ({"x": x, "y": y}, {"x": graded, "y": inputs["y"]}):
            out = model.infer(given)
            assert type(out["out"]) is np.ndarray
            np.testing.assert_allclose(out["out"], want, rtol=1e-6)
        with pytest.raises(SpecError, match="'x' in the input spec is expected to be of type float32, but was of type float64"):
            model.infer({"x": x.double(), "y": y})
        with pytest.raises(SpecError, match="expected to be of type float32, but was of type bfloat16"):
            model.infer({"x": x.bfloat16(), "y": y})
        with pytest.raises(SpecError, match=r"Dim 0 of tensor 'y' .* size 3 \(from tensor 'x'\), but was of size 1"):
            model.infer({"x": x, "y": y[:1]})
        with pytest.raises(NeuropodError, match="output_device='cuda': model 'm' runs on the cpu"):
            model.infer({"x": x, "y": y}, output_device="cuda")


def test_device_caps_say_device_tensors() -> None:
    (backend,) = [b for b in plugins.installed_backends() if b.platform == "torchscript"]
    assert plugins.backend_caps(backend).device_tensors


def test_device_input_converters() -> None:
    # How a GPU model takes inputs, with the CPU standing in for the GPU: numpy arrays through
    # from_numpy, torch tensors as they are, other DLPack producers without a copy.
    from neuropod.spec import parse_spec
    from neuropod_torchscript._runtime import _converter

    (x_spec,) = parse_spec(spec(("x", "float32", [None, 2])), "in")
    convert = _converter(x_spec, torch.device("cpu"))
    arr = np.arange(4, dtype=np.float32).reshape(2, 2)
    t = torch.from_numpy(arr)

    class OnlyDLPack:
        def __dlpack__(self, **kwargs: object) -> object:
            return t.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> object:
            return t.__dlpack_device__()

    for given in (arr, t, OnlyDLPack()):
        got = convert(given)
        assert isinstance(got, torch.Tensor) and got.data_ptr() == t.data_ptr()


def test_arguments_go_by_name_whatever_their_order(tmp_path: Path) -> None:
    """forward's arguments are matched to inputs by name, not by the spec's order."""
    path = package(tmp_path, models.Subtract(), spec(("x", "float32", [2]), ("y", "float32", [2])),
                   spec(("diff", "float32", [2])))  # fmt: skip
    x, y = np.array([10, 20], np.float32), np.array([1, 2], np.float32)
    with neuropod.load_neuropod(path) as m:
        np.testing.assert_array_equal(m.infer({"x": x, "y": y})["diff"], x - y)
        np.testing.assert_array_equal(m.infer({"y": y, "x": x})["diff"], x - y)
        with pytest.raises(SpecError, match="not found in the input spec"):
            m.infer({"x": x, "z": y})


def test_a_dict_of_a_tensor_and_a_string_list(tmp_path: Path) -> None:
    path = package(tmp_path, models.CountAndLabel(), spec(("x", "float32", ["n"])),
                   spec(("n", "int64", []), ("label", "string", ["n"])))  # fmt: skip
    with neuropod.load_neuropod(path) as m:
        out = m.infer({"x": np.ones(3, np.float32)})
        assert out["n"].shape == () and out["n"] == 3 and type(out["n"]) is np.ndarray
        assert out["label"].dtype.kind == "U" and out["label"].tolist() == ["item"] * 3
        assert list(m.infer({"x": np.ones(3, np.float32)}, requested_outputs=["label"])) == ["label"]
