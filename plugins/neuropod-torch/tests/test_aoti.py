"""The aoti backend: a real module compiled once per session, loaded, run, and refused where it cannot run."""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path
from typing import Any

import importlib_metadata
import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

import neuropod
from neuropod import cli
from neuropod.create import packager_config
from neuropod.errors import NeuropodError, NoBackendError, PackageError, SpecError
from neuropod.package import read_package, write_package
from neuropod.packagers import create_aoti_neuropod
from neuropod.spec import parse_spec
from neuropod.testing import run_in_threads
from neuropod_torch._runtime import _check_compiled_for, isa_problem, output_picks

import models
from conftest import TWO_LAYER_OUT, XY_SPEC, spec, xy
from conftest import two_layer_direct as direct

TORCH_VERSION = importlib_metadata.version("torch")
RELEASE = TORCH_VERSION.split("+")[0]
OUT_SPEC = TWO_LAYER_OUT


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(list(argv), out)
    return code, out.getvalue()


def test_compiled_package_records_torch_and_device(two_layer_aoti: Path) -> None:
    config = json.loads((two_layer_aoti / "config.json").read_text())
    assert config["platform"] == "aoti"
    assert config["platform_version_semver"] == f"=={RELEASE}", "the exact release that compiled it"
    assert config["exported_with"]["torch"] == torch.__version__
    assert config["exported_with"]["aoti"]["AOTI_DEVICE_KEY"] == "cpu"
    req = config["device_requirements"]
    assert req["device"] == "cpu" and req["machine"] and req["cpu_isa"] == config["exported_with"]["aoti"]["AOTI_CPU_ISA"]
    assert set(config["input_tensor_device"].values()) == {"CPU"}, "a CPU package does not ask for a GPU"
    assert json.loads((two_layer_aoti / "0" / "config.json").read_text()) == {"args": ["x", "y"]}
    assert read_package(two_layer_aoti).has_test_data


def test_runs_like_the_module_for_any_batch(two_layer_aoti: Path) -> None:
    with neuropod.load_neuropod(two_layer_aoti) as model:
        assert (model.backend.platform, model.device) == ("aoti", "cpu")
        for batch in (1, 5, 64):
            inputs = xy(batch, seed=batch)
            out, want = model.infer(inputs), direct(**inputs)
            assert set(out) == {"out", "norm"}
            np.testing.assert_allclose(out["out"], want["out"], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(out["norm"], want["norm"], rtol=1e-4, atol=1e-5)
        assert set(model.infer(xy(2), requested_outputs=["norm"])) == {"norm"}
        with pytest.raises(SpecError, match="batch"):
            model.infer({"x": xy(2)["x"], "y": xy(3)["y"]})


@pytest.mark.parametrize("runners", [1, 2])
def test_threads_share_the_runners(two_layer_aoti: Path, runners: int) -> None:
    with neuropod.load_neuropod(two_layer_aoti, num_runners=runners) as model:

        def work(seed: int) -> None:
            for i in range(20):
                inputs = xy(1 + (seed + i) % 6, seed=seed * 100 + i)
                np.testing.assert_allclose(model.infer(inputs)["out"], direct(**inputs)["out"], rtol=1e-4, atol=1e-5)

        run_in_threads(work, 4)
    with pytest.raises(NeuropodError, match=r"Unknown aoti load option\(s\) 'runners'.*num_runners"):
        neuropod.load_neuropod(two_layer_aoti, runners=2)


def test_worker_process_and_zip(two_layer_aoti: Path, tmp_path: Path) -> None:
    pt2 = two_layer_aoti / "0" / "data" / "model.pt2"
    ex = xy(3)
    path = create_aoti_neuropod(tmp_path / "m.zip", "m", XY_SPEC, OUT_SPEC, compiled_package=pt2, package_as_zip=True,
                                test_input_data=ex, test_expected_out=direct(**ex))  # fmt: skip
    inputs = xy(6, seed=6)
    with neuropod.load_neuropod(path, use_ope=True) as model:
        assert type(model).__name__ == "WorkerModel"
        np.testing.assert_allclose(model.infer(inputs)["out"], direct(**inputs)["out"], rtol=1e-4, atol=1e-5)


def test_compiled_package_checks(two_layer_aoti: Path, tmp_path: Path) -> None:
    pt2 = two_layer_aoti / "0" / "data" / "model.pt2"
    with pytest.raises(PackageError, match="was compiled for cpu, but device='cuda' was given"):
        create_aoti_neuropod(tmp_path / "a", "a", XY_SPEC, OUT_SPEC, compiled_package=pt2, device="cuda")
    with pytest.raises(PackageError, match="exactly one of module=, exported_program= or compiled_package="):
        create_aoti_neuropod(tmp_path / "b", "b", XY_SPEC, OUT_SPEC, module=models.TwoLayer(), compiled_package=pt2)
    with pytest.raises(PackageError, match="device must be 'cpu' or 'cuda'"):
        create_aoti_neuropod(tmp_path / "c", "c", XY_SPEC, OUT_SPEC, compiled_package=pt2, device="tpu")
    with pytest.raises(SpecError, match=r"the program takes 2 positional input\(s\), but the input spec describes 1 \(x\)"):
        create_aoti_neuropod(tmp_path / "d", "d", spec(("x", "float32", ["batch", 4])), OUT_SPEC, compiled_package=pt2)
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_compiling_for_cuda_without_a_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this torch has a GPU")
    with pytest.raises(PackageError, match=r"compiling 'm' for CUDA needs a CUDA build of torch and a GPU.*device='cpu'"):
        create_aoti_neuropod(tmp_path / "m", "m", XY_SPEC, OUT_SPEC, module=models.TwoLayer(), device="cuda",
                             example_inputs=xy(2))  # fmt: skip


def _repackage(source: Path, dest: Path, **config: Any) -> Path:
    """The same compiled model in a package whose config says other things (what another machine's packager wrote)."""
    original = read_package(source).config
    new = packager_config(
        original.name, "aoti", [s.to_dict() for s in original.input_spec], [s.to_dict() for s in original.output_spec],
        platform_version_semver=config.get("platform_version_semver", original.platform_version_semver),
        default_input_tensor_device=config.get("default_input_tensor_device", "CPU"),
        device_requirements=config.get("device_requirements", original.device_requirements),
        exported_with=config.get("exported_with", original.exported_with),
    )  # fmt: skip
    return write_package(dest, new, {"0/data/model.pt2": source / "0" / "data" / "model.pt2"},
                         backend_config={"args": ["x", "y"]})  # fmt: skip


def test_cuda_package_on_a_cpu_host_is_refused_by_resolution(two_layer_aoti: Path, tmp_path: Path) -> None:
    from neuropod.devices import local_host

    if local_host().has_gpu:
        pytest.skip("this host has a GPU")
    path = _repackage(two_layer_aoti, tmp_path / "cuda", default_input_tensor_device="GPU",
                      device_requirements={"device": "cuda", "compute_capability": "9.0"})  # fmt: skip
    code, text = run_cli("explain", str(path), "--quiet-spec")
    assert code == 1 and "No backend can run it" in text
    row = next(line for line in text.splitlines() if f"aoti=={TORCH_VERSION}" in line)
    assert re.search("needs a GPU: (host has no GPU|backend build has no GPU support)", row), row
    with pytest.raises(NoBackendError, match="needs a GPU"):
        neuropod.load_neuropod(path)
    with pytest.raises(NoBackendError, match="device='cpu' was requested, but the model needs a GPU"):
        neuropod.load_neuropod(path, device="cpu")


def test_package_for_another_torch_with_no_environment(two_layer_aoti: Path, tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = create_aoti_neuropod(tmp_path / "old", "old", XY_SPEC, OUT_SPEC,
                                    compiled_package=two_layer_aoti / "0" / "data" / "model.pt2",
                                    platform_version_semver="==2.12.0")  # fmt: skip
    assert any("not checked by loading it" in str(w.message) for w in caught), [str(w.message) for w in caught]
    code, text = run_cli("explain", str(path), "--quiet-spec")
    assert code == 1 and "needs platform 'aoti', versions '==2.12.0'" in text
    row = next(line for line in text.splitlines() if f"aoti=={TORCH_VERSION}" in line)
    assert f"version {TORCH_VERSION} is not in '==2.12.0'" in row
    assert "create a backend environment with one: neuropod env create aoti==" in text
    with pytest.raises(NoBackendError, match="neuropod env create aoti=="):
        neuropod.load_neuropod(path)


def test_the_backend_refuses_a_device_the_package_was_not_compiled_for(two_layer_aoti: Path) -> None:
    package = read_package(two_layer_aoti)
    where = "Model 'two_layer'"
    with pytest.raises(NeuropodError, match="compiled for cpu, so it cannot run on cuda:0; load it with device='cpu'"):
        _check_compiled_for(package, "cpu", {}, "cuda:0", where)
    with pytest.raises(NeuropodError, match="compiled for cuda, so it cannot run on cpu; load it on a machine with an NVIDIA GPU"):
        _check_compiled_for(package, "cuda", {}, "cpu", where)


def test_cpu_instruction_set_check() -> None:
    avx512 = {"AOTI_PLATFORM": "linux", "AOTI_MACHINE": "x86_64", "AOTI_CPU_ISA": "AVX512 AVX512_VNNI AMX_TILE"}
    assert isa_problem(avx512, "linux", "x86_64", "avx512 avx512_vnni amx_tile") is None
    problem = isa_problem(avx512, "linux", "x86_64", "avx2")
    assert problem and "this CPU lacks AMX_TILE AVX512 AVX512_VNNI" in problem
    assert isa_problem({**avx512, "AOTI_CPU_ISA": "AVX2"}, "linux", "x86_64", "avx512") is None, "AVX-512 runs AVX2 code"
    assert "compiled for linux aarch64" in str(isa_problem({**avx512, "AOTI_MACHINE": "aarch64"}, "linux", "x86_64", "avx2"))
    # This machine runs what it compiled.
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    here = {"AOTI_CPU_ISA": str(pick_vec_isa()).upper()}
    assert isa_problem(here, "linux", "x86_64", str(pick_vec_isa())) is None


@pytest.mark.parametrize(
    ("structure", "names", "picks"),
    [
        ({"b": 0, "a": 1}, ["a", "b"], [("b", (0,)), ("a", (1,))]),
        (0, ["only"], [("only", (0,))]),
        ((0, 1), ["first", "second"], [("first", (0,)), ("second", (1,))]),
        (({"p": 0}, {"q": 1, "r": 2}), ["p", "q", "r"], [("p", (0,)), ("q", (1,)), ("r", (2,))]),
    ],
    ids=["dict", "single", "tuple", "tuple_of_dicts"],
)
def test_flat_outputs_map_to_names(structure: Any, names: list[str], picks: list[tuple[str, tuple[int, ...]]]) -> None:
    """An AOTInductor runner returns a flat list; the names come from its output structure."""
    _, out_spec = pytree.tree_flatten(structure)
    output_spec = parse_spec([{"name": n, "dtype": "float32", "shape": [None]} for n in names], "output_spec")
    assert output_picks(out_spec, output_spec, "m", flat=True) == picks
    more = parse_spec([*[s.to_dict() for s in output_spec], {"name": "zzz", "dtype": "float32", "shape": [None]}], "o")
    with pytest.raises(SpecError, match="output spec has 'zzz' that forward does not return|but the output spec has"):
        output_picks(out_spec, more, "m")
