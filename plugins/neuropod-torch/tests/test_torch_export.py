"""The torch_export backend end to end: package real modules, discover, load, infer, and the errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import importlib_metadata
import numpy as np
import pytest
import torch

import neuropod
from neuropod import plugins
from neuropod.errors import NeuropodError, PackageError, SpecError
from neuropod.packagers import create_torch_export_neuropod
from neuropod.testing import run_in_threads

import models
from conftest import spec

TORCH_VERSION = importlib_metadata.version("torch")
XY_SPEC = spec(("x", "float32", ["batch", 4]), ("y", "float32", ["batch", 3]))
TWO_LAYER_OUT = spec(("out", "float32", ["batch", 3]), ("norm", "float32", ["batch"]))


def xy(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 4)).astype(np.float32), "y": rng.standard_normal((batch, 3)).astype(np.float32)}


def direct(module: torch.nn.Module, **inputs: np.ndarray) -> Any:
    """What the module itself computes, for comparison."""
    with torch.no_grad():
        out = module(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    if isinstance(out, dict):
        return {k: v.numpy() for k, v in out.items()}
    return out


def package(tmp_path: Path, module: torch.nn.Module, in_spec: Any, out_spec: Any, name: str = "m", **kwargs: Any) -> Path:
    path: Path = create_torch_export_neuropod(tmp_path / name, name, in_spec, out_spec, module=module, **kwargs)
    return path


# --- discovery --------------------------------------------------------------------------------------


def test_both_platforms_found_through_their_entry_points() -> None:
    eps = {ep.name: ep.value for ep in importlib_metadata.entry_points(group="neuropod.backends")}
    assert eps["torch_export"] == "neuropod_torch:torch_export" and eps["aoti"] == "neuropod_torch:aoti"
    found = {b.platform: b for b in plugins.installed_backends() if b.plugin_distribution.startswith("neuropod-torch ")}
    assert set(found) == {"torch_export", "aoti"}
    for platform, b in found.items():
        assert (b.version, b.framework, b.plugin) == (TORCH_VERSION, "torch", platform)
        caps = plugins.backend_caps(b)
        assert caps.cpu and caps.cuda == torch.version.cuda and caps.device_tensors


def test_importing_the_plugin_and_listing_backends_imports_no_torch() -> None:
    code = (
        "import sys, neuropod_torch, neuropod_torch.packager\n"
        "from neuropod import plugins\n"
        "bs = [b for b in plugins.installed_backends() if b.platform in ('torch_export', 'aoti')]\n"
        "assert len(bs) == 2, bs\n"
        "print([plugins.backend_caps(b).cuda for b in bs])\n"
        "assert 'torch' not in sys.modules, 'the plugin imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == repr([torch.version.cuda] * 2), "the CUDA version read from torch/version.py is torch's own"


# --- round trips with real modules ------------------------------------------------------------------


def test_two_layer_network_round_trip(tmp_path: Path) -> None:
    module = models.TwoLayer()
    examples = xy(4)
    path = package(tmp_path, module, XY_SPEC, TWO_LAYER_OUT, test_input_data=examples,
                   test_expected_out=direct(module, **examples))  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    assert config["platform"] == "torch_export"
    assert config["platform_version_semver"] == f"^{TORCH_VERSION.split('+')[0]}"
    assert config["exported_with"]["torch"] == torch.__version__ and config["exported_with"]["export_schema"]
    assert json.loads((path / "0" / "config.json").read_text()) == {"args": ["x", "y"]}
    assert module.training, "the caller's module is left in the mode it was in"
    with neuropod.load_neuropod(path) as model:
        assert model.backend.platform == "torch_export" and model.device == "cpu"
        for batch in (1, 7, 64):  # the symbol is dynamic: any batch, not just the example's
            inputs = xy(batch, seed=batch)
            out = model.infer(inputs)
            want = direct(module, **inputs)
            assert set(out) == {"out", "norm"}
            np.testing.assert_allclose(out["out"], want["out"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(out["norm"], want["norm"], rtol=1e-5, atol=1e-6)
        with pytest.raises(SpecError, match="batch"):
            model.infer({"x": xy(3)["x"], "y": xy(5)["y"]})


def test_shared_symbols_become_one_dim_each(tmp_path: Path) -> None:
    """q and k share 'batch' and 'features'; their sequence lengths are two other symbols."""
    module = models.Attention()
    in_spec = spec(("q", "float32", ["batch", "queries", "features"]), ("k", "float32", ["batch", "keys", "features"]))
    out_spec = spec(("scores", "float32", ["batch", "queries", "keys"]))
    rng = np.random.default_rng(1)
    examples = {"q": rng.standard_normal((2, 5, 8)).astype(np.float32), "k": rng.standard_normal((2, 6, 8)).astype(np.float32)}
    path = package(tmp_path, module, in_spec, out_spec, test_input_data=examples)
    program = torch.export.load(str(path / "0" / "data" / "model.pt2"))
    q, k = (n.meta["val"].shape for n in program.graph.nodes if n.op == "placeholder")
    assert q[0] == k[0] and q[2] == k[2], "one Dim per symbol, shared by both tensors"
    assert len({str(q[0]), str(q[1]), str(k[1]), str(q[2])}) == 4, "four symbols, four Dims"
    with neuropod.load_neuropod(path) as model:
        for b, lq, lk, f in ((3, 1, 9, 4), (1, 7, 2, 16)):
            inputs = {"q": rng.standard_normal((b, lq, f)).astype(np.float32),
                      "k": rng.standard_normal((b, lk, f)).astype(np.float32)}  # fmt: skip
            np.testing.assert_allclose(model.infer(inputs)["scores"], direct(module, **inputs)["scores"], rtol=1e-5)
        with pytest.raises(SpecError, match="features"):
            model.infer({"q": np.zeros((2, 3, 4), np.float32), "k": np.zeros((2, 3, 5), np.float32)})


def test_fixed_sizes_stay_static_and_none_dims_are_free(tmp_path: Path) -> None:
    module = models.Doubles()
    path = package(tmp_path, module, spec(("x", "float32", [None, 3])), spec(("y", "float32", [None, 3])),
                   example_inputs={"x": np.ones((4, 3), np.float32)})  # fmt: skip
    program = torch.export.load(str(path / "0" / "data" / "model.pt2"))
    (shape,) = (n.meta["val"].shape for n in program.graph.nodes if n.op == "placeholder")
    assert not isinstance(shape[0], int) and shape[1] == 3
    with neuropod.load_neuropod(path) as model:
        x = np.arange(15, dtype=np.float32).reshape(5, 3)
        np.testing.assert_array_equal(model.infer({"x": x})["y"], x * 2)


@pytest.mark.parametrize(
    ("module", "in_spec", "out_spec"),
    [
        (models.ReturnsTensor(), spec(("x", "float32", ["n"])), spec(("tripled", "float32", ["n"]))),
        (models.ReturnsTuple(), spec(("x", "float32", ["n"]), ("y", "float32", ["n"])),
         spec(("sum", "float32", ["n"]), ("product", "float32", ["n"]))),
        (models.ReturnsTupleOfDicts(), spec(("x", "float32", ["n"])),
         spec(("twice", "float32", ["n"]), ("half", "float32", ["n"]))),
    ],
    ids=["single_tensor", "tuple_in_spec_order", "tuple_of_dicts"],
)  # fmt: skip
def test_what_forward_returns_maps_to_the_output_spec(tmp_path: Path, module: torch.nn.Module, in_spec: Any,
                                                      out_spec: Any) -> None:  # fmt: skip
    inputs = {s["name"]: np.arange(1, 6, dtype=np.float32) * (i + 1) for i, s in enumerate(in_spec)}
    path = package(tmp_path, module, in_spec, out_spec, test_input_data=inputs)
    with torch.no_grad():
        raw = module(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    leaves = [raw] if isinstance(raw, torch.Tensor) else [v for d in raw for v in d.values()] if isinstance(raw[0], dict) else list(raw)
    with neuropod.load_neuropod(path) as model:
        out = model.infer(inputs)
        assert list(out) == [s["name"] for s in out_spec]
        for s, want in zip(out_spec, leaves):
            np.testing.assert_allclose(out[s["name"]], want.numpy())


def test_named_tuple_output_is_refused_with_advice(tmp_path: Path) -> None:
    """A saved program can rebuild a named tuple only where its class is registered: not portable."""
    with pytest.raises(PackageError, match=r"returns a named tuple \(models.Pair\).*return a dict of name -> tensor"):
        package(tmp_path, models.ReturnsNamedTuple(), spec(("x", "float32", ["n"]), ("y", "float32", ["n"])),
                spec(("total", "float32", ["n"]), ("diff", "float32", ["n"])),
                example_inputs={"x": np.ones(2, np.float32), "y": np.ones(2, np.float32)})  # fmt: skip


def test_output_returned_twice_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="returns output 'out' twice"):
        package(tmp_path, models.ReturnsDuplicate(), spec(("x", "float32", ["n"])), spec(("out", "float32", ["n"])),
                example_inputs={"x": np.ones(3, np.float32)})  # fmt: skip
    assert not (tmp_path / "m").exists()


def test_outputs_that_do_not_match_the_spec(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"output spec has 'z' that forward does not return.*forward returns 'out'"):
        package(tmp_path, models.TwoLayer(), XY_SPEC, spec(("z", "float32", ["batch"]), ("norm", "float32", ["batch"])),
                example_inputs=xy(2))  # fmt: skip
    with pytest.raises(SpecError, match="returns a tuple of 2 tensors, but the output spec has 1"):
        package(tmp_path, models.ReturnsTuple(), spec(("x", "float32", ["n"]), ("y", "float32", ["n"])),
                spec(("sum", "float32", ["n"])), example_inputs={"x": np.ones(2, np.float32), "y": np.ones(2, np.float32)})  # fmt: skip


def test_arguments_with_defaults_and_keyword_only(tmp_path: Path) -> None:
    # 'scale' keeps its default; 'bias' comes after it, so it is passed by keyword.
    module = models.WithDefault()
    in_spec = spec(("x", "float32", ["n"]), ("bias", "float32", ["n"]))
    ones = {"x": np.arange(3, dtype=np.float32), "bias": np.ones(3, np.float32)}
    path = package(tmp_path, module, in_spec, spec(("out", "float32", ["n"])), name="defaults", test_input_data=ones,
                   test_expected_out={"out": ones["x"] * 2 + 1})  # fmt: skip
    assert json.loads((path / "0" / "config.json").read_text()) == {"args": ["x"]}
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_allclose(model.infer({"x": np.full(5, 2, np.float32), "bias": np.ones(5, np.float32)})["out"], 5)
        with pytest.raises(SpecError, match=r"needs input\(s\) 'bias'"):
            model.infer({"x": np.ones(5, np.float32)})
    path = package(tmp_path, models.KeywordOnly(), spec(("x", "float32", ["n"]), ("y", "float32", ["n"])),
                   spec(("out", "float32", ["n"])), name="kwonly", test_input_data={"x": np.ones(2, np.float32) * 3,
                   "y": np.ones(2, np.float32)}, test_expected_out={"out": np.full(2, 2, np.float32)})  # fmt: skip
    assert json.loads((path / "0" / "config.json").read_text()) == {"args": ["x"]}


def test_spec_that_does_not_fit_forward(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"forward\(x, y\) does not match the input spec .*'z' that it does not take.*needs 'y'"):
        package(tmp_path, models.TwoLayer(), spec(("x", "float32", ["batch", 4]), ("z", "float32", ["batch", 3])),
                TWO_LAYER_OUT, example_inputs=xy(2))  # fmt: skip
    with pytest.raises(SpecError, match="string tensors, but torch.export programs take tensors only"):
        package(tmp_path, models.Doubles(), spec(("x", "string", ["n"])), spec(("y", "string", ["n"])))


def test_exported_program_given(tmp_path: Path) -> None:
    module = models.TwoLayer().eval()
    batch = torch.export.Dim("batch")
    ex = xy(3)
    program = torch.export.export(module, (torch.from_numpy(ex["x"]), torch.from_numpy(ex["y"])),
                                  dynamic_shapes={"x": {0: batch}, "y": {0: batch}})  # fmt: skip
    path = create_torch_export_neuropod(tmp_path / "ep", "ep", XY_SPEC, TWO_LAYER_OUT, exported_program=program,
                                        test_input_data=ex, test_expected_out=direct(module, **ex))  # fmt: skip
    with neuropod.load_neuropod(path) as model:
        inputs = xy(9, seed=9)
        np.testing.assert_allclose(model.infer(inputs)["out"], direct(module, **inputs)["out"], rtol=1e-5, atol=1e-6)
    static = torch.export.export(module, (torch.from_numpy(ex["x"]), torch.from_numpy(ex["y"])))
    with pytest.raises(PackageError, match=r"dim 0 of input 'x' is fixed at 3 in the exported program, but the spec says symbol 'batch'"):
        create_torch_export_neuropod(tmp_path / "static", "static", XY_SPEC, TWO_LAYER_OUT, exported_program=static)


def test_packager_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="exactly one of module= or exported_program="):
        create_torch_export_neuropod(tmp_path / "a", "a", XY_SPEC, TWO_LAYER_OUT)
    with pytest.raises(PackageError, match="needs example inputs"):
        package(tmp_path, models.TwoLayer(), XY_SPEC, TWO_LAYER_OUT)
    with pytest.raises(PackageError, match="TorchScript module, which torch.export cannot export"):
        package(tmp_path, torch.jit.script(models.Doubles()), spec(("x", "float32", ["n"])), spec(("y", "float32", ["n"])),
                example_inputs={"x": np.ones(2, np.float32)})  # fmt: skip
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        package(tmp_path, models.TwoLayer(), XY_SPEC, TWO_LAYER_OUT, no_such_option=1)


# --- what torch.export cannot do, said clearly ---------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_module_torch_export_cannot_export(tmp_path: Path, strict: bool, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PackageError) as info:
        package(tmp_path, models.BranchOnValues(), spec(("x", "float32", ["n"])), spec(("y", "float32", ["n"])),
                example_inputs={"x": np.ones(4, np.float32)}, strict=strict)  # fmt: skip
    text = str(info.value)
    assert f"torch.export could not export 'm' (strict={strict})" in text
    assert "models.py" in text and "if x.sum() > 0:" in text, "the failing construct is named"
    assert ("try strict=False" in text) == strict and "create_torchscript_neuropod" in text
    assert not (tmp_path / "m").exists()
    assert "Error while creating guard" not in capfd.readouterr().err, "torch's own log lines are kept quiet"


@pytest.mark.parametrize("strict", [False, True])
def test_symbol_the_model_specializes(tmp_path: Path, strict: bool) -> None:
    with pytest.raises(PackageError) as info:
        package(tmp_path, models.FixedBatch(), spec(("x", "float32", ["batch", 3])), spec(("y", "float32", [4, 3])),
                example_inputs={"x": np.ones((4, 3), np.float32)}, strict=strict)  # fmt: skip
    text = str(info.value)
    assert "specialized the spec symbol(s) 'batch'" in text
    assert "You marked batch as dynamic but your code specialized it to be a constant (4)" in text, "torch's reason"
    assert "works for that size only" in text
    if strict:  # TorchDynamo says where; tracing with Python does not
        assert "models.py" in text and "reshape(4, 3)" in text


def test_example_of_size_one_explains_itself(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match=r"inputs give 'batch' the size 1, and torch specializes sizes 0 and 1: pass example_inputs="):
        package(tmp_path, models.TwoLayer(), XY_SPEC, TWO_LAYER_OUT, test_input_data=xy(1))
    # With examples of batch 2, the same model packages, and the test data of batch 1 runs.
    one = xy(1)
    package(tmp_path, models.TwoLayer(), XY_SPEC, TWO_LAYER_OUT, example_inputs=xy(2), test_input_data=one,
            test_expected_out=direct(models.TwoLayer(), **one))  # fmt: skip


# --- loading --------------------------------------------------------------------------------------------


def test_load_options_threads_and_close(tmp_path: Path) -> None:
    path = package(tmp_path, models.TwoLayer(), XY_SPEC, TWO_LAYER_OUT, example_inputs=xy(2))
    with pytest.raises(NeuropodError, match=r"Unknown torch_export load option\(s\) 'bogus'.*intra_op_num_threads"):
        neuropod.load_neuropod(path, bogus=1)
    with pytest.raises(NeuropodError, match="must be an int >= 1"):
        neuropod.load_neuropod(path, intra_op_num_threads=0)
    threads = torch.get_num_threads()
    model = neuropod.load_neuropod(path, intra_op_num_threads=threads)
    module = models.TwoLayer()  # made here, not in the threads: its weights come from a seeded generator

    def work(seed: int) -> None:
        for i in range(20):
            inputs = xy(1 + (seed + i) % 6, seed=seed * 100 + i)
            np.testing.assert_allclose(model.infer(inputs)["out"], direct(module, **inputs)["out"], rtol=1e-5, atol=1e-6)

    run_in_threads(work, 4)
    model.close()
    with pytest.raises(NeuropodError, match="closed"):
        model.infer(xy(2))


def test_gpu_on_a_cpu_build(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this torch has a usable GPU")
    from neuropod.package import read_package
    from neuropod_torch._runtime import ExportedModel

    path = package(tmp_path, models.TwoLayer(), XY_SPEC, TWO_LAYER_OUT, example_inputs=xy(2))
    # Through the backend directly: resolution already refuses a GPU on this host.
    with pytest.raises(NeuropodError, match="device 'cuda:0' was asked for, but torch .* (has no CUDA support|sees no usable GPU)"):
        ExportedModel.load(read_package(path), "cuda:0", {})


def test_outputs_do_not_track_gradients_and_torch_tensors_go_in(tmp_path: Path) -> None:
    path = package(tmp_path, models.TwoLayer(), XY_SPEC, TWO_LAYER_OUT, example_inputs=xy(2))
    inputs = xy(3)
    with neuropod.load_neuropod(path) as model:
        out = model.infer({k: torch.from_numpy(v) for k, v in inputs.items()})
        assert all(type(v) is np.ndarray for v in out.values())
        np.testing.assert_allclose(out["out"], direct(models.TwoLayer(), **inputs)["out"], rtol=1e-5, atol=1e-6)


def test_zip_package_and_worker_process(tmp_path: Path) -> None:
    module = models.TwoLayer()
    examples = xy(4)
    path = package(tmp_path, module, XY_SPEC, TWO_LAYER_OUT, name="m.zip", package_as_zip=True,
                   test_input_data=examples, test_expected_out=direct(module, **examples))  # fmt: skip
    assert path.is_file()
    inputs = xy(5, seed=5)
    with neuropod.load_neuropod(path, use_ope=True) as model:
        assert type(model).__name__ == "WorkerModel"
        out = model.infer(inputs)
        np.testing.assert_allclose(out["out"], direct(module, **inputs)["out"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["norm"], direct(module, **inputs)["norm"], rtol=1e-5, atol=1e-6)


def test_exception_inside_the_program_is_wrapped(tmp_path: Path) -> None:
    path = package(tmp_path, models.TwoLayer(), XY_SPEC, TWO_LAYER_OUT, example_inputs=xy(2))
    from neuropod.package import read_package
    from neuropod_torch._runtime import ExportedModel

    handle = ExportedModel.load(read_package(path), "cpu", {})
    # Past the core's spec checks (called directly): the program's own guard on the shared symbol fires.
    with pytest.raises(Exception, match=r"y.size\(\)\[0\] == x.size\(\)\[0\]|Guard failed"):
        handle.run({"x": np.zeros((2, 4), np.float32), "y": np.zeros((3, 3), np.float32)}, None)


def test_program_guards_still_hold_when_forward_is_called_directly(tmp_path: Path) -> None:
    """The model calls the module's forward (skipping nn.Module hooks) only where the program's input guards
    run inside its graph; a shape the program was specialized to still fails, as a BackendError."""

    class Flatten(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"out": x.reshape(8) * 2}

    in_spec, out_spec = spec(("x", "float32", [None, None])), spec(("out", "float32", [None]))
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    path = package(tmp_path, Flatten(), in_spec, out_spec, example_inputs={"x": x})
    with neuropod.load_neuropod(path) as model:
        handle = model._handle
        from neuropod_torch._runtime import _guards_in_graph

        in_graph = _guards_in_graph(handle.module)
        if in_graph:
            assert handle._call == handle.module.forward
        else:
            assert handle._call is handle.module
        np.testing.assert_array_equal(model.infer({"x": x})["out"], x.reshape(8) * 2)
        said = r"Guard failed: .*== 8" if in_graph else r"Expected input at .* to be equal to"
        with pytest.raises(NeuropodError, match=rf"failed to run model 'm': .*{said}"):
            model.infer({"x": np.zeros((2, 2), np.float32)})


def test_guards_in_graph_only_for_a_graph_that_calls_them() -> None:
    from neuropod_torch._runtime import _guards_in_graph

    assert not _guards_in_graph(torch.fx.symbolic_trace(models.TwoLayer()))
    assert not _guards_in_graph(torch.nn.Linear(2, 2))
