"""Bad input to the JAX backend: each a NeuropodError naming the model and what to do, never a raw traceback."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jax_export

import neuropod
from neuropod import cli
from neuropod.errors import NeuropodError, NoBackendError, PackageError
from neuropod.loader import plan
from neuropod.package import read_package
from neuropod.packagers import create_jax_neuropod
from neuropod_jax._runtime import JaxModel

import models
from conftest import skip_on_a_gpu_host, spec

X_SPEC = spec(("x", "float32", ["batch", 3]))
Y_SPEC = spec(("y", "float32", ["batch", 3]))


def package(tmp_path: Path, fn: Any = lambda x: {"y": x * 2}, name: str = "m", **kwargs: Any) -> Path:
    path: Path = create_jax_neuropod(tmp_path / f"{name}.neuropod", name, X_SPEC, Y_SPEC, fn=fn, **kwargs)
    return path


def copy_package(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- the device the program was lowered for ---------------------------------------


def test_cuda_only_export_on_a_cpu_host(tmp_path: Path) -> None:
    skip_on_a_gpu_host()
    with pytest.warns(UserWarning, match="was not checked by loading it.*no device fits"):
        path = package(tmp_path, name="cuda_only", platforms=("cuda",))
    config = read_package(path).config
    assert config.device_requirements == {"device": "cuda", "jax_platforms": ["cuda"]}
    with pytest.raises(NoBackendError, match=r"(?s)Model 'cuda_only'.*needs a GPU: (host has no GPU|backend build has no GPU support)"):
        neuropod.load_neuropod(path)
    with pytest.raises(NoBackendError, match="device='cpu' was requested, but the model needs a GPU"):
        neuropod.load_neuropod(path, device="cpu")
    buf = io.StringIO()
    assert cli.main(["explain", str(path)], buf) == cli.EXIT_TEST_FAILED
    assert "Needs:     {\"device\": \"cuda\"" in buf.getvalue() and "needs a GPU" in buf.getvalue()
    # Past resolution (a stale plan, a host file that lied), loading refuses it too, saying why.
    with pytest.raises(NeuropodError, match=r"Model 'cuda_only' .*exported for cuda only, not for cpu.*NVIDIA GPU"):
        JaxModel.load(read_package(path), "cpu", {})


def test_cpu_only_export_asked_for_a_gpu(tmp_path: Path) -> None:
    path = package(tmp_path)
    with pytest.raises(NeuropodError, match=r"exported for cpu only, not for cuda.*device='cpu'.*platforms=\('cpu', 'cuda'\)"):
        JaxModel.load(read_package(path), "cuda:0", {})


def test_gpu_inputs_for_a_cpu_only_program(tmp_path: Path) -> None:
    for kwargs in ({"input_tensor_device": {"x": "GPU"}}, {"default_input_tensor_device": "GPU"}):
        with pytest.raises(PackageError, match=r"asks for GPU inputs .* exported for the CPU only.*platforms=\('cpu', 'cuda'\)"):
            package(tmp_path, **kwargs)
    path = package(tmp_path, platforms=("cpu", "cuda"), input_tensor_device={"x": "GPU"})
    assert dict(read_package(path).config.input_tensor_device) == {"x": "GPU"}


@pytest.mark.parametrize("platforms", [("tpu",), ("cpu", "rocm"), (), ("cpu", "cpu")])
def test_platforms_neuropod_cannot_run(tmp_path: Path, platforms: tuple[str, ...]) -> None:
    with pytest.raises(PackageError, match=r"model 'm'.*neuropod runs JAX programs on cpu and cuda"):
        package(tmp_path, platforms=platforms)


def test_exported_for_tpu(tmp_path: Path) -> None:
    exported = jax_export.export(jax.jit(lambda x: {"y": x * 2}), platforms=("tpu",))(jax.ShapeDtypeStruct((2, 3), np.float32))
    with pytest.raises(PackageError, match=r"lowered for \('tpu',\); neuropod runs JAX programs on cpu and cuda"):
        create_jax_neuropod(tmp_path / "tpu", "tpu", spec(("x", "float32", [2, 3])), spec(("y", "float32", [2, 3])), exported=exported)


# --- damaged and tampered packages --------------------------------------------------


def test_tampered_program_is_caught_by_the_manifest(tmp_path: Path) -> None:
    path = package(tmp_path)
    program = path / "0" / "data" / "model.jaxexport"
    data = bytearray(program.read_bytes())
    data[len(data) // 2] ^= 0xFF
    program.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="model.jaxexport"):
        neuropod.load_neuropod(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "flipped"])
def test_corrupt_program_is_a_package_error(tmp_path: Path, damage: str) -> None:
    path = package(tmp_path, name="corrupt")
    program = path / "0" / "data" / "model.jaxexport"
    data = program.read_bytes()
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = b"neuropod" * 100
    elif damage == "empty":
        data = b""
    else:
        # The StableHLO bytecode inside the flatbuffer: its header, so the module cannot be parsed.
        exported = jax_export.deserialize(bytearray(data))
        start = data.index(exported.mlir_module_serialized[:64])
        data = data[:start] + bytes(64) + data[start + 64 :]
    program.write_bytes(data)
    # verify=False skips the manifest, as a user may: the program itself must still fail cleanly.
    with pytest.raises(PackageError, match=r"Model 'corrupt' .*0/data/model.jaxexport is not a program jax .* can read"):
        neuropod.load_neuropod(path, verify=False)


def test_missing_program(tmp_path: Path) -> None:
    path = package(tmp_path, name="missing")
    (path / "0" / "data" / "model.jaxexport").unlink()
    with pytest.raises(PackageError, match="model.jaxexport"):
        neuropod.load_neuropod(path)
    with pytest.raises(PackageError, match=r"Model 'missing' .*cannot read the exported program 0/data/model.jaxexport"):
        neuropod.load_neuropod(path, verify=False)


class _Boom:
    """Unpickling this runs code: it would create a file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.marker),))


def test_a_pickle_in_a_parameter_file_is_never_unpickled(tmp_path: Path) -> None:
    path = package(tmp_path, fn=lambda p, x: {"y": x * p["s"]}, params={"s": np.float32(2)}, name="pickled")
    marker = tmp_path / "unpickled"
    leaf = path / "0" / "data" / "params" / "00000.npy"
    evil = np.empty((), dtype=object)
    evil[()] = _Boom(str(marker))
    with open(leaf, "wb") as f:
        np.save(f, evil, allow_pickle=True)
    with pytest.raises(PackageError, match="00000.npy"):
        neuropod.load_neuropod(path)  # the manifest
    with pytest.raises(PackageError, match=r"Model 'pickled' .*parameter file 00000.npy is not a readable .npy array.*pickle"):
        neuropod.load_neuropod(path, verify=False)
    assert not marker.exists()


def test_parameter_file_that_does_not_fit_the_program(tmp_path: Path) -> None:
    params = {"w": np.ones((3, 3), np.float32)}
    path = package(tmp_path, fn=lambda p, x: {"y": x @ p["w"]}, params=params, name="resized")
    np.save(path / "0" / "data" / "params" / "00000.npy", np.ones((3, 4), np.float32))
    with pytest.raises(PackageError, match=r"parameter \['w'\] \(0/data/params/00000.npy\) is float32\[3, 4\], but the program takes float32\[3, 3\]"):
        neuropod.load_neuropod(path, verify=False)
    np.save(path / "0" / "data" / "params" / "00000.npy", np.ones((3, 3), np.int32))
    with pytest.raises(PackageError, match=r"parameter \['w'\] .* is int32\[3, 3\], but the program takes float32\[3, 3\]"):
        neuropod.load_neuropod(path, verify=False)


def test_backend_config_tampered(tmp_path: Path) -> None:
    base = package(tmp_path, fn=lambda p, x: {"y": x * p}, params=np.float32(3), name="cfg")
    cases = {
        "format": ({"format": 99}, "format 99; this neuropod-jax reads format 1"),
        "export": ({"export": "../../config.json"}, "'export' must name a file in 0/data/"),
        "params": ({"params": "all of them"}, "'params' must be a list"),
        "escape": ({"params": [{"path": "p", "file": "../../manifest.json"}]}, "must be inside 0/data/"),
        "count": ({"params": []}, r"has 0 parameter array\(s\), but the program takes 1"),
        "none": ({"params": None}, r"argument 0 of the program is a pytree|takes 1 input array\(s\)|program takes"),
    }
    for label, (change, message) in cases.items():
        path = copy_package(base, tmp_path / f"cfg_{label}")
        cfg_path = path / "0" / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(change)
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(PackageError, match=message):
            neuropod.load_neuropod(path, verify=False)


def test_custom_ops_are_refused(tmp_path: Path) -> None:
    lib = tmp_path / "libop.so"
    lib.write_bytes(b"\x7fELF")
    with pytest.raises(PackageError, match="model 'm'.*loads no custom-op libraries"):
        package(tmp_path, custom_ops=[lib])


# --- the spec against the function ----------------------------------------------------


def test_a_symbol_the_function_specializes(tmp_path: Path) -> None:
    """The function only works for one batch size: packaging names the symbol and JAX's reason."""
    with pytest.raises(PackageError) as info:
        package(tmp_path, fn=lambda x: {"y": x.reshape(2, -1)[0].reshape(1, 3)})
    text = str(info.value)
    assert "model 'm'" in text and "symbol 'batch'" in text
    assert "Cannot divide evenly the sizes of shapes (batch, 3) and (2, -1)" in text
    assert "make that dim a fixed size in the spec" in text
    assert not (tmp_path / "m.neuropod").exists()


def test_a_comparison_on_a_symbol(tmp_path: Path) -> None:
    def fn(x: Any) -> Any:
        return {"y": x[:4] if x.shape[0] > 3 else x}

    with pytest.raises(PackageError, match=r"symbol 'batch'.*comparison 'batch' > '3' is inconclusive"):
        package(tmp_path, fn=fn)


def test_two_symbols_the_function_needs_equal(tmp_path: Path) -> None:
    in_spec = spec(("x", "float32", ["n", 3]), ("z", "float32", ["m", 3]))
    with pytest.raises(PackageError, match=r"symbol 'n', symbol 'm'.*incompatible shapes.*make them one symbol"):
        create_jax_neuropod(tmp_path / "nm", "nm", in_spec, spec(("y", "float32", ["n", 3])), fn=lambda x, z: {"y": x + z})


def test_an_unnamed_symbol_in_the_message_is_described(tmp_path: Path) -> None:
    in_spec = spec(("x", "float32", [None, 3]), ("z", "float32", [None, 3]))
    with pytest.raises(PackageError, match=r"<dim 0 of input 'x' \(null in the spec\)>"):
        create_jax_neuropod(tmp_path / "nn", "nn", in_spec, spec(("y", "float32", [None, 3])), fn=lambda x, z: {"y": x + z})


@pytest.mark.parametrize(
    ("fn", "out_spec", "message"),
    [
        (lambda x: {"y": x.astype(jnp.int32)}, Y_SPEC, r"output 'y' is float32 \[batch, 3\] in the spec, but the program gives int32"),
        (lambda x: {"y": x[:, :2]}, Y_SPEC, r"output 'y' .* dim 1 of the program's is 2, not 3"),
        (lambda x: {"y": jnp.concatenate([x, x])}, Y_SPEC, r"output 'y' .* symbol 'batch', which the program has as 'batch' elsewhere, but as '2\*batch' here"),
        (lambda x: {"y": x[0]}, Y_SPEC, r"output 'y' .* the program's has 1 dims"),
        (lambda x: {"z": x}, Y_SPEC, r"returns a dict with keys 'z', but the output spec names 'y'; missing 'y'; not in the spec 'z'"),
        (lambda x: (x, x), Y_SPEC, r"returns a tuple of 2 items .* output spec has 1 outputs"),
        (lambda x: x, spec(("y", "float32", ["batch", 3]), ("w", "float32", ["batch", 3])), r"returns a single array, but the output spec has 2 outputs"),
        (lambda x: {"y": {"deep": x}}, Y_SPEC, r"output 'y' of the program is a pytree"),
    ],
    ids=["dtype", "size", "symbol", "rank", "keys", "count", "single", "nested"],
)
def test_outputs_that_do_not_fit_the_spec(tmp_path: Path, fn: Any, out_spec: Any, message: str) -> None:
    with pytest.raises(PackageError, match=message):
        create_jax_neuropod(tmp_path / "out", "out", X_SPEC, out_spec, fn=fn)


def test_wrong_dtypes_at_infer(tmp_path: Path) -> None:
    path = package(tmp_path)
    with neuropod.load_neuropod(path) as model:
        from neuropod.errors import SpecError

        with pytest.raises(SpecError, match=r"'x'.*float32.*float64"):
            model.infer({"x": np.ones((2, 3))})
        with pytest.raises(SpecError, match="'x'"):
            model.infer({"x": np.ones((2, 3), np.int32)})


def test_strings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="'s' is a string tensor, and JAX has no strings"):
        create_jax_neuropod(tmp_path / "s", "s", spec(("s", "string", ["n"])), Y_SPEC, fn=lambda s: s)


def test_packager_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="exactly one of fn= .* or exported="):
        create_jax_neuropod(tmp_path / "a", "a", X_SPEC, Y_SPEC)
    exported = jax_export.export(jax.jit(lambda x: {"y": x}))(jax.ShapeDtypeStruct((2, 3), np.float32))
    with pytest.raises(PackageError, match="exactly one of"):
        create_jax_neuropod(tmp_path / "a", "a", X_SPEC, Y_SPEC, fn=lambda x: x, exported=exported)
    with pytest.raises(PackageError, match="exported must be a jax.export.Exported, not bytearray"):
        create_jax_neuropod(tmp_path / "a", "a", X_SPEC, Y_SPEC, exported=exported.serialize())
    with pytest.raises(PackageError, match="fn must be a function, not str"):
        create_jax_neuropod(tmp_path / "a", "a", X_SPEC, Y_SPEC, fn="x * 2")
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        create_jax_neuropod(tmp_path / "a", "a", X_SPEC, Y_SPEC, fn=lambda x: {"y": x}, no_such_option=1)  # type: ignore[call-arg]
    with pytest.raises(PackageError, match=r"platforms=\('cpu',\), but the exported program was lowered for \('tpu',\)"):
        tpu = jax_export.export(jax.jit(lambda x: {"y": x}), platforms=("tpu",))(jax.ShapeDtypeStruct((2, 3), np.float32))
        create_jax_neuropod(tmp_path / "a", "a", X_SPEC, Y_SPEC, exported=tpu, platforms=("cpu",))
    with pytest.raises(PackageError, match="params is not a JAX pytree|parameter .* not a numeric array"):
        create_jax_neuropod(tmp_path / "a", "a", X_SPEC, Y_SPEC, fn=lambda p, x: {"y": x}, params={"w": "weights"})
    assert not (tmp_path / "a").exists()


# --- an exported program and parameters that do not match ----------------------------------


def _exported_mlp(batch: Any = None) -> tuple[Any, dict[str, Any]]:
    params = models.mlp_params()
    (b,) = jax_export.symbolic_shape("b")
    struct = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), params)
    x = jax.ShapeDtypeStruct((b if batch is None else batch, 3), np.float32)
    return jax_export.export(jax.jit(models.mlp))(struct, x), params


MLP_OUT = spec(("y", "float32", ["batch", 2]), ("norm", "float32", ["batch"]))


def test_params_that_do_not_match_an_exported_program(tmp_path: Path) -> None:
    exported, params = _exported_mlp()
    resized = models.mlp_params(sizes=(3, 8, 16, 2))
    with pytest.raises(PackageError, match=r"model 'e'.*parameter \['layers'\]\[0\]\['b'\] has shape \[8\], but the program takes \[16\]"):
        create_jax_neuropod(tmp_path / "e", "e", X_SPEC, MLP_OUT, exported=exported, params=resized)
    fewer = {"layers": params["layers"][:2], "scale": params["scale"]}
    with pytest.raises(PackageError, match=r"params has 5 array\(s\), but the program's first argument takes 7"):
        create_jax_neuropod(tmp_path / "e", "e", X_SPEC, MLP_OUT, exported=exported, params=fewer)
    as_int = jax.tree_util.tree_map(lambda a: np.asarray(a).astype(np.int32), params)
    with pytest.raises(PackageError, match=r"parameter \['layers'\]\[0\]\['b'\] is int32, but the program takes float32"):
        create_jax_neuropod(tmp_path / "e", "e", X_SPEC, MLP_OUT, exported=exported, params=as_int)
    with pytest.raises(PackageError, match=r"argument 0 of the program is a pytree .*needs params="):
        create_jax_neuropod(tmp_path / "e", "e", X_SPEC, MLP_OUT, exported=exported)
    assert not (tmp_path / "e").exists()


def test_an_exported_program_that_does_not_fit_the_spec(tmp_path: Path) -> None:
    fixed, params = _exported_mlp(batch=4)
    with pytest.raises(PackageError, match=r"input 'x' .*dim 0 is symbol 'batch', but the program takes only size 4 there"):
        create_jax_neuropod(tmp_path / "e", "e", X_SPEC, MLP_OUT, exported=fixed, params=params)
    exported, params = _exported_mlp()
    with pytest.raises(PackageError, match=r"takes 1 input array\(s\) after its parameters, but the input spec has 2"):
        create_jax_neuropod(tmp_path / "e", "e", [*X_SPEC, *spec(("z", "float32", [1]))], MLP_OUT, exported=exported, params=params)
    with pytest.raises(PackageError, match=r"input 'x' is float16 \[batch, 3\] in the spec, but the program takes float32"):
        create_jax_neuropod(tmp_path / "e", "e", spec(("x", "float16", ["batch", 3])), MLP_OUT, exported=exported, params=params)
    two = spec(("x", "float32", ["batch", 3]), ("z", "float32", ["other", 3]))
    same = jax_export.export(jax.jit(lambda x, z: {"y": x + z}))(*[jax.ShapeDtypeStruct((jax_export.symbolic_shape("b")[0], 3), np.float32)] * 2)
    with pytest.raises(PackageError, match=r"input 'z' .*symbol 'other', but the program ties it to symbol 'batch'"):
        create_jax_neuropod(tmp_path / "e", "e", two, Y_SPEC, exported=same)


def test_resolution_table_explains_a_cuda_only_package(tmp_path: Path) -> None:
    skip_on_a_gpu_host()
    with pytest.warns(UserWarning):
        path = package(tmp_path, name="gpu_only", platforms=("cuda",))
    resolution = plan(path)
    assert resolution.chosen is None and "needs a GPU" in resolution.table()
