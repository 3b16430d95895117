"""The JAX backend end to end: package real JAX functions, discover, resolve, load, infer."""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import sys
import weakref
import zipfile
from pathlib import Path
from typing import Any

import importlib_metadata
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jax_export

import neuropod
from neuropod import cli, plugins
from neuropod.errors import NoBackendError, PackageError, SpecError
from neuropod.package import read_package
from neuropod.packagers import create_jax_neuropod
from neuropod.testdata import run_test_data
from neuropod.testing import run_in_threads
from neuropod.versions import satisfies
from neuropod_jax import CUDA_PLUGINS
from neuropod_jax.packager import compatible_range

import models
from conftest import jax_sees_a_gpu, spec

JAX_VERSION = importlib_metadata.version("jax")
X_SPEC = spec(("x", "float32", ["batch", 3]))
MLP_OUT = spec(("y", "float32", ["batch", 2]), ("norm", "float32", ["batch"]))


def xs(batch: int, width: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, width)).astype(np.float32)


def mlp_package(tmp_path: Path, name: str = "mlp", **kwargs: Any) -> Path:
    path: Path = create_jax_neuropod(
        tmp_path / f"{name}.neuropod", name, X_SPEC, MLP_OUT, fn=models.mlp, params=models.mlp_params(), **kwargs
    )
    return path


# --- discovery ------------------------------------------------------------


def test_found_through_the_entry_point_with_the_installed_version() -> None:
    eps = {ep.name: ep.value for ep in importlib_metadata.entry_points(group="neuropod.backends")}
    assert eps["jax"] == "neuropod_jax"
    (backend,) = [b for b in plugins.installed_backends() if b.platform == "jax"]
    assert (backend.version, backend.framework) == (JAX_VERSION, "jax")
    assert backend.version == jax.__version__


def test_discovery_and_packager_import_do_not_import_jax() -> None:
    code = (
        "import sys, neuropod.plugins as p\n"
        "import neuropod_jax, neuropod_jax.packager, neuropod_jax.demo\n"
        "bs = [b for b in p.installed_backends() if b.platform == 'jax']\n"
        "caps = p.backend_caps(bs[0])\n"
        "print(bs[0].version, caps.cpu, caps.cuda)\n"
        "bad = [m for m in ('jax', 'jaxlib') if m in sys.modules]\n"
        "assert not bad, f'discovery imported {bad}'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    cuda = next((major for dist, major in CUDA_PLUGINS if _installed(dist)), "None")
    assert out == [JAX_VERSION, "True", cuda]


def _installed(dist: str) -> bool:
    try:
        importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return False
    return True


def _site_without_jax(tmp_path: Path) -> Path:
    """A site directory holding everything this environment has installed except JAX (links to it)."""
    site = Path(np.__file__).resolve().parents[1]
    target = tmp_path / "site-without-jax"
    target.mkdir()
    for entry in site.iterdir():
        lowered = entry.name.lower()
        if (lowered.startswith(("jax", "jaxlib")) and not lowered.startswith("jax_plugins")) or lowered.startswith("jax_cuda"):
            continue
        (target / entry.name).symlink_to(entry)
    return target


def test_without_jax_installed(tmp_path: Path) -> None:
    """With no jax at all, the plugin still imports, offers no backend, and says what to install."""
    path = mlp_package(tmp_path)
    site_dir = _site_without_jax(tmp_path)
    code = (
        "import site, sys\n"
        f"site.addsitedir({str(site_dir)!r})\n"
        "import neuropod, neuropod_jax\n"
        "from neuropod import plugins\n"
        "from neuropod.errors import NoBackendError, PluginNotInstalledError\n"
        "assert neuropod_jax.supported_versions() == [], neuropod_jax.supported_versions()\n"
        "assert 'jax' in plugins.plugin_distributions(), plugins.plugin_failures()\n"
        "try:\n"
        f"    neuropod.load_neuropod({str(path)!r})\n"
        "except NoBackendError as e:\n"
        "    print('LOAD:', str(e).replace(chr(10), ' '))\n"
        "from neuropod_jax.packager import create_jax_neuropod\n"
        "try:\n"
        "    create_jax_neuropod('/nonexistent/x', 'x', [], [], fn=lambda: 0)\n"
        "except PluginNotInstalledError as e:\n"
        "    print('PACKAGE:', e)\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('jax') is None\n"
    )
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert "Model 'mlp' needs platform 'jax'" in lines["LOAD"] and "jax" in lines["LOAD"].split("was not found.")[1]
    assert "create_jax_neuropod needs jax" in lines["PACKAGE"] and "pip install jax" in lines["PACKAGE"]


def test_device_caps_follow_the_installed_cuda_plugin() -> None:
    (backend,) = [b for b in plugins.installed_backends() if b.platform == "jax"]
    caps = plugins.backend_caps(backend)
    cuda = next((major for dist, major in CUDA_PLUGINS if _installed(dist)), None)
    assert caps.cpu and caps.cuda == cuda and not caps.device_tensors


# --- packaging round trips ----------------------------------------------------


def test_mlp_with_a_params_pytree_matches_jax_and_numpy(tmp_path: Path) -> None:
    params = models.mlp_params()
    x = xs(4)
    direct = {k: np.asarray(v) for k, v in jax.jit(models.mlp)(params, x).items()}
    path = mlp_package(tmp_path, test_input_data={"x": x}, test_expected_out=direct)
    with neuropod.load_neuropod(path) as model:
        assert model.backend.id == f"jax=={JAX_VERSION}" and model.device == "cpu"
        for batch in (1, 3, 17):  # one program for every batch size: the symbol is a JAX symbolic dim
            xb = xs(batch, seed=batch)
            out = model.infer({"x": xb})
            assert list(out) == ["y", "norm"]  # spec order
            want = {k: np.asarray(v) for k, v in jax.jit(models.mlp)(params, xb).items()}
            ref = models.mlp_numpy(params, xb)
            for name in ("y", "norm"):
                assert out[name].dtype == np.float32 and out[name].shape == ref[name].shape
                np.testing.assert_allclose(out[name], want[name], rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(out[name], ref[name], rtol=1e-4, atol=1e-5)
            out["y"] += 1  # the caller's own arrays
        assert model.infer({"x": x}, requested_outputs=["norm"]).keys() == {"norm"}


def test_weights_are_stored_beside_the_program_not_in_it(tmp_path: Path) -> None:
    params = models.mlp_params(sizes=(3, 256, 256, 2))
    path = create_jax_neuropod(tmp_path / "big", "big", X_SPEC, MLP_OUT, fn=models.mlp, params=params)
    pkg = read_package(path)
    program = (pkg.data_dir / "model.jaxexport").read_bytes()
    big = params["layers"][1]["w"]  # 256 KiB of float32
    assert len(program) < big.nbytes / 4 and big.tobytes()[:4096] not in program
    entries = pkg.backend_config["params"]
    assert [e["path"] for e in entries] == [
        "['layers'][0]['b']", "['layers'][0]['w']", "['layers'][1]['b']", "['layers'][1]['w']",
        "['layers'][2]['b']", "['layers'][2]['w']", "['scale']",
    ]  # fmt: skip
    stored = np.load(pkg.data_dir / entries[3]["file"], allow_pickle=False)
    np.testing.assert_array_equal(stored, big)
    assert pkg.backend_config["format"] == 1 and pkg.backend_config["export"] == "model.jaxexport"
    # New weights of the same shapes: the same program (but for source locations), other results.
    other = models.mlp_params(sizes=(3, 256, 256, 2), seed=1)
    path2 = create_jax_neuropod(tmp_path / "big2", "big", X_SPEC, MLP_OUT, fn=models.mlp, params=other)
    program2 = (read_package(path2).data_dir / "model.jaxexport").read_bytes()
    assert _module_text(program2) == _module_text(program)
    x = xs(5)
    with neuropod.load_neuropod(path2) as model:
        np.testing.assert_allclose(model.infer({"x": x})["y"], models.mlp_numpy(other, x)["y"], rtol=1e-4, atol=1e-5)


def _module_text(program: bytes) -> list[str]:
    """The StableHLO of a serialized program without its source locations."""
    text = jax_export.deserialize(bytearray(program)).mlir_module()
    return [line for line in text.splitlines() if not line.startswith("#loc")]


def test_what_the_package_records(tmp_path: Path) -> None:
    path = mlp_package(tmp_path)
    config = read_package(path).config
    made = dict(config.exported_with or {})
    assert made["framework"] == "jax" and made["platform_version"] == JAX_VERSION
    assert made["jaxlib"] == importlib_metadata.version("jaxlib")
    assert made["lowering_platforms"] == ["cpu"] and made["exported_function"] == "mlp"
    assert jax_export.minimum_supported_calling_convention_version <= made["calling_convention_version"]
    assert made["calling_convention_version"] <= jax_export.maximum_supported_calling_convention_version
    assert config.platform_version_semver == compatible_range(JAX_VERSION)
    major, minor = (int(p) for p in JAX_VERSION.split(".")[:2])
    assert config.platform_version_semver == f">={JAX_VERSION},<{major}.{minor + 2}"
    # A CPU-only program says so, and its inputs default to the CPU so resolution never sends it to a GPU.
    assert config.device_requirements == {"device": "cpu", "jax_platforms": ["cpu"]}
    assert dict(config.input_tensor_device) == {"x": "CPU"}


def test_compatible_range() -> None:
    assert compatible_range("0.10.2") == ">=0.10.2,<0.12"
    assert compatible_range("0.8.3") == ">=0.8.3,<0.10"
    assert compatible_range("1.0.0") == ">=1.0.0,<1.2"
    assert compatible_range("0.9.0.1") == ">=0.9.0.1,<0.11"
    assert compatible_range("0.10.2+local") == ">=0.10.2,<0.12"
    assert compatible_range("not a version") == "*"
    # A nightly can load what it wrote (a range that names a prerelease admits it).
    nightly = "0.11.0.dev20260601"
    assert compatible_range(nightly) == f">={nightly},<0.13" and satisfies(nightly, compatible_range(nightly))


def test_cpu_and_cuda_export_prefers_nothing_but_asks_for_no_gpu(tmp_path: Path) -> None:
    path = mlp_package(tmp_path, platforms=("cpu", "cuda"))
    config = read_package(path).config
    assert config.exported_with and config.exported_with["lowering_platforms"] == ["cpu", "cuda"]
    assert config.device_requirements is None and dict(config.input_tensor_device) == {"x": "GPU"}
    x = xs(2)
    gpu = jax_sees_a_gpu()
    with neuropod.load_neuropod(path) as model:  # the CUDA lowering where JAX sees a GPU, else the CPU one
        assert model.device == ("cuda:0" if gpu else "cpu")
        tolerance = {"rtol": 1e-3, "atol": 1e-4} if gpu else {"rtol": 1e-4, "atol": 1e-5}  # TF32 matmuls on a GPU
        np.testing.assert_allclose(model.infer({"x": x})["y"], models.mlp_numpy(models.mlp_params(), x)["y"], **tolerance)


def test_zip_package_and_test_data(tmp_path: Path) -> None:
    params = models.mlp_params()
    x = xs(3)
    expected = {k: np.asarray(v) for k, v in jax.jit(models.mlp)(params, x).items()}
    path = mlp_package(tmp_path, package_as_zip=True, test_input_data={"x": x}, test_expected_out=expected)
    assert zipfile.is_zipfile(path)
    report = run_test_data(path)
    assert report.passed and report.backend == f"jax=={JAX_VERSION}"


def test_a_wrong_expected_output_removes_the_package(tmp_path: Path) -> None:
    x = xs(3)
    wrong = {k: np.asarray(v) + 1 for k, v in jax.jit(models.mlp)(models.mlp_params(), x).items()}
    with pytest.raises(PackageError, match="does not reproduce its expected test output"):
        mlp_package(tmp_path, test_input_data={"x": x}, test_expected_out=wrong)
    assert not (tmp_path / "mlp.neuropod").exists()


# --- symbols -------------------------------------------------------------------


def test_shared_symbols_become_one_jax_dimension(tmp_path: Path) -> None:
    in_spec = spec(("x", "float32", ["batch", "n"]), ("y", "float32", ["batch", "m"]), ("z", "float32", [None, "n"]))
    out_spec = spec(("xy", "float32", ["batch", None]), ("zx", "float32", [None, "n"]))

    def fn(x: Any, y: Any, z: Any) -> tuple[Any, Any]:
        return jnp.concatenate([x, y], axis=1), jnp.concatenate([z, x], axis=0)

    path = create_jax_neuropod(tmp_path / "sym", "sym", in_spec, out_spec, fn=fn)
    exported = jax_export.deserialize(bytearray((read_package(path).data_dir / "model.jaxexport").read_bytes()))
    (x_batch, x_n), (y_batch, y_m), (z_free, z_n) = (a.shape for a in exported.in_avals)
    assert str(x_batch) == str(y_batch) == "batch" and str(x_n) == str(z_n) == "n" and str(y_m) == "m"
    assert not isinstance(z_free, int) and str(z_free) not in ("batch", "n", "m")
    assert [str(d) for d in exported.out_avals[0].shape] in (["batch", "m + n"], ["batch", "n + m"])
    rng = np.random.default_rng(0)
    x, y, z = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3), (2, 5), (4, 3)))
    with neuropod.load_neuropod(path) as model:
        out = model.infer({"x": x, "y": y, "z": z})
        np.testing.assert_array_equal(out["xy"], np.concatenate([x, y], axis=1))
        np.testing.assert_array_equal(out["zx"], np.concatenate([z, x], axis=0))
        with pytest.raises(SpecError, match="symbol 'batch'"):
            model.infer({"x": x, "y": y[:1], "z": z})
        with pytest.raises(SpecError, match="symbol 'n'"):
            model.infer({"x": x, "y": y, "z": z[:, :2]})


def test_symbols_jax_cannot_parse_as_names(tmp_path: Path) -> None:
    """Spec symbols are any Python identifier; JAX's parser takes ASCII names, reads 'max' as an operator,
    and the plugin names null dims '_free<N>' (a spec symbol of that name must not clash)."""
    dims = ["größe", "max", "_free0"]
    in_spec = spec(("a", "int32", [*dims, None]), ("b", "int32", [*dims, 1]))
    out_spec = spec(("sum", "int32", [*dims, None]))
    path = create_jax_neuropod(tmp_path / "names", "names", in_spec, out_spec, fn=lambda a, b: {"sum": a + b})
    a = np.arange(24, dtype=np.int32).reshape(2, 3, 4, 1)
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_array_equal(model.infer({"a": a, "b": a * 10})["sum"], a * 11)
        with pytest.raises(SpecError, match="symbol 'größe'"):
            model.infer({"a": a, "b": a[:1]})


def test_fixed_sizes_stay_static(tmp_path: Path) -> None:
    path = create_jax_neuropod(
        tmp_path / "fixed", "fixed", spec(("x", "float32", [2, 3])), spec(("t", "float32", [3, 2])),
        fn=lambda x: {"t": x.T},
    )  # fmt: skip
    exported = jax_export.deserialize(bytearray((read_package(path).data_dir / "model.jaxexport").read_bytes()))
    assert exported.in_avals[0].shape == (2, 3)
    x = xs(2)
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_array_equal(model.infer({"x": x})["t"], x.T)


def test_a_zero_size_dynamic_dimension_is_a_spec_error(tmp_path: Path) -> None:
    path = mlp_package(tmp_path)
    with neuropod.load_neuropod(path) as model, pytest.raises(SpecError, match="at least 1.*dimension variable 'batch'"):
        model.infer({"x": np.zeros((0, 3), np.float32)})


# --- calling conventions and outputs --------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: {"sum": x + y, "diff": x - y},
        lambda x, y: (x + y, x - y),
        lambda x, y: [x + y, x - y],
    ],
    ids=["dict", "tuple", "list"],
)
def test_output_conventions(tmp_path: Path, fn: Any) -> None:
    in_spec = spec(("x", "float32", ["n"]), ("y", "float32", ["n"]))
    path = create_jax_neuropod(tmp_path / "o", "o", in_spec, spec(("sum", "float32", ["n"]), ("diff", "float32", ["n"])), fn=fn)
    x, y = np.arange(3, dtype=np.float32), np.ones(3, np.float32)
    with neuropod.load_neuropod(path) as model:
        out = model.infer({"x": x, "y": y})
        np.testing.assert_array_equal(out["sum"], x + y)
        np.testing.assert_array_equal(out["diff"], x - y)


def test_a_single_array_is_the_only_output(tmp_path: Path) -> None:
    path = create_jax_neuropod(
        tmp_path / "one", "one", spec(("x", "int32", ["n"])), spec(("sq", "int32", ["n"])), fn=lambda x: x * x
    )
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_array_equal(model.infer({"x": np.arange(4, dtype=np.int32)})["sq"], [0, 1, 4, 9])


def test_scalars_in_and_out(tmp_path: Path) -> None:
    path = create_jax_neuropod(
        tmp_path / "s", "s", spec(("x", "float32", []), ("v", "float32", ["n"])),
        spec(("dot", "float32", []), ("scaled", "float32", ["n"])),
        fn=lambda x, v: {"dot": jnp.sum(v * v), "scaled": x * v},
    )  # fmt: skip
    v = np.arange(3, dtype=np.float32)
    with neuropod.load_neuropod(path) as model:
        out = model.infer({"x": np.float32(2.0), "v": v})
        assert out["dot"].shape == () and float(out["dot"]) == 5.0
        np.testing.assert_array_equal(out["scaled"], 2 * v)


def test_64_bit_dtypes_leave_jax_global_setting_alone(tmp_path: Path) -> None:
    in_spec = spec(("ids", "int64", ["n"]), ("w", "float64", ["n"]))
    out_spec = spec(("big", "int64", ["n"]), ("half", "float64", ["n"]))
    path = create_jax_neuropod(tmp_path / "x64", "x64", in_spec, out_spec, fn=lambda ids, w: {"big": ids * 2**33, "half": w / 3})
    ids, w = np.arange(3, dtype=np.int64), np.array([1.0, 2.0, 1e-300])
    with neuropod.load_neuropod(path) as model:
        out = model.infer({"ids": ids, "w": w})
    assert out["big"].dtype == np.int64 and list(out["big"]) == [0, 2**33, 2**34]  # beyond int32
    np.testing.assert_array_equal(out["half"], w / 3)  # float64 precision (1e-300 / 3 underflows in float32)
    assert jax.config.jax_enable_x64 is False and jnp.asarray(np.int64(1)).dtype == jnp.int32

    # JAX's 64-bit switch is per thread: calls from many threads at once all get int64 back.
    with neuropod.load_neuropod(path) as model:

        def work(seed: int) -> None:
            for i in range(20):
                n = 1 + (seed + i) % 4
                got = model.infer({"ids": np.arange(n, dtype=np.int64) + seed, "w": np.ones(n)})
                assert got["big"].dtype == np.int64 and int(got["big"][-1]) == (n - 1 + seed) * 2**33

        run_in_threads(work, 8)


def test_float64_weights_become_float32_as_jax_reads_them(tmp_path: Path) -> None:
    params = {"w": np.random.default_rng(0).standard_normal((3, 2))}  # float64, numpy's default
    x = xs(4)
    path = create_jax_neuropod(tmp_path / "f64", "f64", X_SPEC, spec(("y", "float32", ["batch", 2])), fn=lambda p, x: x @ p["w"], params=params)
    pkg = read_package(path)
    assert np.load(pkg.data_dir / "params" / "00000.npy", allow_pickle=False).dtype == np.float32
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_allclose(model.infer({"x": x})["y"], np.asarray(jax.jit(lambda p, x: x @ p["w"])(params, x)), rtol=1e-6)


def test_an_exported_program_with_and_without_params(tmp_path: Path) -> None:
    params = models.mlp_params()
    (b,) = jax_export.symbolic_shape("b")
    struct = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), params)
    # For the CPU, where the reference call below runs (on a GPU machine the default would be the GPU alone).
    exported = jax_export.export(jax.jit(models.mlp), platforms=("cpu",))(struct, jax.ShapeDtypeStruct((b, 3), np.float32))
    path = create_jax_neuropod(tmp_path / "e", "e", X_SPEC, MLP_OUT, exported=exported, params=params)
    x = xs(6)
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_allclose(model.infer({"x": x})["y"], np.asarray(exported.call(params, x)["y"]), rtol=1e-6)
    # A deserialized one, without parameters.
    plain = jax_export.deserialize(jax_export.export(jax.jit(lambda x: {"y": x[:, :2] * 2, "norm": x[:, 0]}))(
        jax.ShapeDtypeStruct((b, 3), np.float32)).serialize())  # fmt: skip
    path = create_jax_neuropod(tmp_path / "p", "p", X_SPEC, MLP_OUT, exported=plain)
    with neuropod.load_neuropod(path) as model:
        np.testing.assert_array_equal(model.infer({"x": x})["y"], x[:, :2] * 2)


def test_a_model_runs_on_its_device_whatever_the_default_device(tmp_path: Path) -> None:
    """A process may set JAX's default device elsewhere (to its CPU, on a GPU machine): a loaded model
    still runs where it was loaded, with parameters or without. Two host devices stand in for the two
    kinds here: the default is set to the second, the model loads on the first."""
    (b,) = jax_export.symbolic_shape("b")
    plain = jax_export.export(jax.jit(lambda x: {"y": x[:, :2] * 2, "norm": x[:, 0]}), platforms=("cpu",))(
        jax.ShapeDtypeStruct((b, 3), np.float32)
    )
    create_jax_neuropod(tmp_path / "plain", "plain", X_SPEC, MLP_OUT, exported=plain)
    with_params = mlp_package(tmp_path)
    code = (
        "import sys, jax, numpy as np, neuropod\n"
        "jax.config.update('jax_default_device', jax.devices('cpu')[1])\n"
        "for path in sys.argv[1:]:\n"
        "    with neuropod.load_neuropod(path) as model:\n"
        "        out = model.infer({'x': np.ones((2, 3), np.float32)})\n"
        "        handle = model._handle\n"
        "        leaves = handle._call(*handle._take_inputs({'x': np.ones((2, 3), np.float32)}))\n"
        "        print(sorted(d.id for leaf in leaves for d in leaf.devices()), out['y'].shape)\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "plain"), str(with_params)],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[0, 0] (2, 2)"] * 2


def test_ope_worker(tmp_path: Path) -> None:
    params = models.mlp_params()
    path = mlp_package(tmp_path)
    x = xs(5)
    with neuropod.load_neuropod(path, use_ope=True) as model:
        out = model.infer({"x": x})
        np.testing.assert_allclose(out["y"], np.asarray(jax.jit(models.mlp)(params, x)["y"]), rtol=1e-6, atol=1e-6)
        with pytest.raises(SpecError, match="'x'"):
            model.infer({"x": x[:, :2]})


def test_range_that_excludes_the_installed_jax(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="was not checked by loading it"):
        path = mlp_package(tmp_path, platform_version_semver="<0.5")
    with pytest.raises(NoBackendError, match=r"Install a jax version in '<0.5'.*neuropod env create jax==VERSION"):
        neuropod.load_neuropod(path)


def test_demo(tmp_path: Path) -> None:
    from neuropod_jax.demo import build_demo

    path, good, bad = build_demo(tmp_path)
    with neuropod.load_neuropod(path) as model:
        out = model.infer(good)
        assert out["scores"].shape == (2, 3) and out["label"].dtype == np.int32
        np.testing.assert_allclose(out["scores"].sum(-1), 1, rtol=1e-6)
        np.testing.assert_array_equal(out["label"], out["scores"].argmax(-1))
        with pytest.raises(SpecError, match="'x'"):
            model.infer(bad)
    buf = io.StringIO()
    assert cli.main(["demo", "jax", "--dir", str(tmp_path / "cli")], buf) == 0
    text = buf.getvalue()
    assert "Chosen: jax==" in text and "output scores" in text and "SpecError" in text


def test_inspect_shows_what_the_export_holds(tmp_path: Path) -> None:
    path = mlp_package(tmp_path)
    buf = io.StringIO()
    assert cli.main(["inspect", str(path), "--json"], buf) == 0
    data = json.loads(buf.getvalue())
    text = json.dumps(data)
    assert "lowering_platforms" in text and "calling_convention_version" in text


def test_a_dropped_model_frees_its_weights_without_the_garbage_collector(tmp_path: Path) -> None:
    path = mlp_package(tmp_path)
    gc.disable()  # freed by reference counting alone: nothing in the loaded model refers back to it
    try:
        for close in (True, False):
            model = neuropod.load_neuropod(path)
            model.infer({"x": xs(2)})
            handle = weakref.ref(model._handle)
            weights = [weakref.ref(leaf) for leaf in model._handle._params]
            if close:
                model.close()
            del model
            assert handle() is None and all(w() is None for w in weights)
    finally:
        gc.enable()
