"""Tensors that are not numpy arrays: what the core reads from them, and where it takes or refuses them.

No GPU here and no framework in tests_core: the GPU objects below are the
two standard protocols themselves (the CUDA array interface and DLPack's
device query) over no memory, which is all the core reads; a backend plugin
registered in the test says it takes device tensors, as TorchScript and
ONNX Runtime do. The real thing, torch and onnxruntime tensors on a real GPU,
is in tests/gpu and the plugins' GPU tests (``nox -s tests_gpu``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neuropod
from neuropod import hookimpl, plugins
from neuropod.backend import DeviceCaps
from neuropod.devices import load_host
from neuropod.errors import NeuropodError, SpecError
from neuropod.spec import SpecValidator, parse_spec
from neuropod.tensors import DeviceInputs, TensorFacts, describe
from neuropod.testing import HostTensor

from _ope_toy import OUT, XY, install_toy, package
from _toy_backend import PLATFORM, ToyPlugin, write_toy

HOSTS = Path(__file__).parent / "hosts"
SPEC = parse_spec(XY, "in")
OUT_SPEC = parse_spec(OUT, "out")


class CudaArray:
    """What a CuPy or Numba array on GPU ``device`` says about itself (no memory behind it)."""

    def __init__(self, shape: tuple[int, ...], typestr: str = "<f4", device: int | None = 0):
        self.shape, self.typestr, self.device = shape, typestr, device

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "typestr": self.typestr, "data": (0, False), "strides": None, "version": 3}

    def __getattr__(self, name: str) -> Any:
        if name == "__dlpack_device__" and self.device is not None:
            return lambda: (2, self.device)  # kDLCUDA
        raise AttributeError(name)


class RocmTensor:
    shape, dtype = (2, 2), np.dtype(np.float32)

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise AssertionError("never exported: the core reads metadata only")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (10, 1)  # kDLROCM


# --- what the core reads -------------------------------------------------------------------------------


def test_describe_reads_metadata_only() -> None:
    here = __name__.split(".")[0]
    assert describe(CudaArray((2, 3))) == TensorFacts(np.dtype(np.float32), (2, 3), "cuda:0", here)
    assert describe(CudaArray((4,), "<i8", device=None)) == TensorFacts(np.dtype(np.int64), (4,), "cuda", here)
    assert describe(CudaArray((1,), "<f4", device=3)).device == "cuda:3"  # type: ignore[union-attr]
    assert describe(RocmTensor()) == TensorFacts(np.dtype(np.float32), (2, 2), "ROCm:1", here)
    host = describe(HostTensor(np.zeros((3, 1), np.uint8)))  # no shape/dtype attributes: numpy reads the capsule
    assert host == TensorFacts(np.dtype(np.uint8), (3, 1), "cpu", "neuropod")  # the framework: the class's top module
    for other in ([1.0, 2.0], 3, "x", None, {"a": 1}):
        assert describe(other) is None


def test_host_tensors_become_numpy_arrays_sharing_memory() -> None:
    v = SpecValidator("m", SPEC, OUT_SPEC)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    y = np.ones((3, 2), np.float32)
    checked, bindings = v.check_inputs({"x": HostTensor(x), "y": HostTensor(y)})
    assert type(checked["x"]) is np.ndarray and np.shares_memory(checked["x"], x)
    assert bindings == {"batch": (3, "x")}
    with pytest.raises(SpecError, match="'y' in the input spec is expected to be of type float32, but was of type float64"):
        v.check_inputs({"x": HostTensor(x), "y": HostTensor(y.astype(np.float64))})


def test_gpu_tensors_are_checked_from_their_metadata() -> None:
    v = SpecValidator("m", SPEC, OUT_SPEC)
    v.device_policy = lambda name, facts: None  # a model that takes them
    x = CudaArray((4, 2))
    checked, bindings = v.check_inputs({"x": x, "y": np.zeros((4, 2), np.float32)})
    assert checked["x"] is x and bindings == {"batch": (4, "x")}
    # Backends tell a call with device tensors by its dict's type, without looking at every input.
    assert type(checked) is DeviceInputs
    plain = {"x": np.zeros((4, 2), np.float32)}
    assert type(v.check_inputs(plain)[0]) is dict
    with pytest.raises(SpecError, match=r"'x' .* type float32, but was of type float64 \(a test_device_tensors tensor on cuda:0\)"):
        v.check_inputs({"x": CudaArray((4, 2), "<f8")})
    with pytest.raises(SpecError, match="'x' in the input spec is expected to have 2 dimensions, but had 3"):
        v.check_inputs({"x": CudaArray((4, 2, 1))})
    with pytest.raises(SpecError, match=r"symbol 'batch' .* size 4 \(from tensor 'x'\), but was of size 5"):
        v.check_inputs({"x": CudaArray((4, 2)), "y": CudaArray((5, 2))})
    strings = SpecValidator("m", parse_spec([{"name": "s", "dtype": "string", "shape": [None]}], "in"), ())
    strings.device_policy = v.device_policy
    with pytest.raises(SpecError, match="expected to be of type string, but was a test_device_tensors tensor on cuda:0"):
        strings.check_inputs({"s": CudaArray((3,), "<f4")})
    # Outputs left on the device (output_device) are checked the same way.
    _, bound = v.check_inputs({"x": x, "y": x})
    v.check_outputs({"out": CudaArray((4, 2))}, bound, on_device=True)
    with pytest.raises(SpecError, match="Dim 0 of tensor 'out' in the output spec .* size 4"):
        v.check_outputs({"out": CudaArray((3, 2))}, dict(bound), on_device=True)
    # Unasked, a backend's tensor is not a numpy array: an error, not a surprise for the caller.
    with pytest.raises(SpecError, match="'out' in the output spec is expected to be a numpy array of float32, but was CudaArray"):
        v.check_outputs({"out": CudaArray((4, 2))}, dict(bound))


def test_gpu_tensors_are_refused_by_default_and_other_devices_always() -> None:
    v = SpecValidator("m", SPEC, OUT_SPEC)
    with pytest.raises(NeuropodError, match=r"Input 'x' of model 'm' is a test_device_tensors tensor on cuda:0, which this call "
                                            r"cannot take: this model takes numpy arrays \(or CPU tensors\) only"):  # fmt: skip
        v.check_inputs({"x": CudaArray((1, 2))})
    v.device_policy = lambda name, facts: None
    with pytest.raises(NeuropodError, match="on ROCm:1, which this call cannot take: no backend takes tensors on that device"):
        v.check_inputs({"x": RocmTensor()})


# --- where a loaded model takes them -------------------------------------------------------------------


class DeviceToyPlugin(ToyPlugin):
    """The toy backend with a GPU build that takes device tensors, recording what infer got."""

    def __init__(self) -> None:
        super().__init__(gpu=True)
        self.calls: list[tuple[dict[str, Any], str | None]] = []

    @hookimpl
    def device_caps(self, backend: Any) -> DeviceCaps | None:
        caps = super().device_caps(backend)
        return DeviceCaps(cpu=True, cuda=caps.cuda, device_tensors=True) if caps is not None else None

    @hookimpl
    def infer(self, model: Any, inputs: dict[str, Any], requested_outputs: list[str] | None, output_device: str | None) -> Any:  # type: ignore[override]
        self.calls.append((dict(inputs), output_device))
        if output_device is not None:
            batch = describe(inputs["x"]).shape[0] if describe(inputs["x"]) else inputs["x"].shape[0]  # type: ignore[union-attr]
            return {"out": CudaArray((batch, 2), device=int(output_device.split(":")[1]))}
        if any(type(a) is not np.ndarray for a in inputs.values()):
            return {"out": np.zeros((describe(inputs["x"]).shape[0], 2), np.float32)}  # type: ignore[union-attr]
        return model.run(inputs, requested_outputs)


@pytest.fixture
def device_toy(monkeypatch: pytest.MonkeyPatch) -> Iterator[DeviceToyPlugin]:
    import neuropod.loader

    # A host with two GPUs: resolution places GPU packages there (nothing runs on them: the toy is numpy).
    monkeypatch.setattr(neuropod.loader, "local_host", lambda: load_host(HOSTS / "two-a100.json"))
    plugin = DeviceToyPlugin()
    assert plugins.register(plugin, "toy")
    try:
        yield plugin
    finally:
        plugins.unregister("toy")


def test_a_gpu_model_gets_device_tensors_as_they_are(tmp_path: Path, device_toy: DeviceToyPlugin) -> None:
    path = write_toy(tmp_path / "m", input_tensor_device={"x": "GPU", "y": "GPU"})
    with neuropod.load_neuropod(path, backend=f"{PLATFORM}==2.0.0", device="cuda:1") as model:
        assert model.device == "cuda:1"
        x, y = CudaArray((3, 2), device=1), CudaArray((3, 2), device=None)
        model.infer({"x": x, "y": y})
        got, output_device = device_toy.calls[-1]
        assert got["x"] is x and got["y"] is y and output_device is None
        # Outputs stay on the model's GPU when asked: "cuda", "gpu" or the model's own device.
        for asked in ("cuda", "GPU", "cuda:1"):
            out = model.infer({"x": x, "y": y}, output_device=asked)
            assert device_toy.calls[-1][1] == "cuda:1" and describe(out["out"]).device == "cuda:1"  # type: ignore[union-attr]
        # numpy inputs and outputs as ever; "cpu" is numpy outputs.
        xy = {"x": np.ones((2, 2), np.float32), "y": np.ones((2, 2), np.float32)}
        np.testing.assert_array_equal(model.infer(xy, output_device="cpu")["out"], np.full((2, 2), 2, np.float32))
        with pytest.raises(NeuropodError, match=r"on cuda:0, which this call cannot take: the model runs on cuda:1; move"):
            model.infer({"x": CudaArray((3, 2), device=0), "y": y})
        with pytest.raises(NeuropodError, match=r"output_device='cuda:0': model 'toy_adder' runs on cuda:1"):
            model.infer({"x": x, "y": y}, output_device="cuda:0")
        with pytest.raises(NeuropodError, match="Unknown device 'tpu'"):
            model.infer({"x": x, "y": y}, output_device="tpu")
        with pytest.raises(TypeError, match="output_device must be None, 'cpu' or 'cuda"):
            model.infer({"x": x, "y": y}, output_device=1)  # type: ignore[arg-type]


def test_a_cpu_model_refuses_device_tensors_and_device_outputs(tmp_path: Path, device_toy: DeviceToyPlugin) -> None:
    path = write_toy(tmp_path / "m")
    with neuropod.load_neuropod(path, backend=f"{PLATFORM}==2.0.0", device="cpu") as model:
        with pytest.raises(NeuropodError, match=r"cannot take: the model runs on the cpu\. Pass a numpy array"):
            model.infer({"x": CudaArray((1, 2)), "y": CudaArray((1, 2))})
        with pytest.raises(NeuropodError, match="output_device='cuda': model 'toy_adder' runs on the cpu"):
            model.infer({"x": np.ones((1, 2), np.float32), "y": np.ones((1, 2), np.float32)}, output_device="cuda")
        # Host tensors of any framework are fine.
        x = np.ones((1, 2), np.float32)
        out = model.infer({"x": HostTensor(x), "y": HostTensor(x)})
        np.testing.assert_array_equal(out["out"], x + x)
    assert device_toy.calls and all(o is None for _, o in device_toy.calls)


def test_a_backend_without_device_tensors_says_so(tmp_path: Path) -> None:
    from _toy_backend import toy_plugin

    with toy_plugin(), neuropod.load_neuropod(write_toy(tmp_path / "m")) as model:
        with pytest.raises(NeuropodError, match=r"backend toy==1\.0\.0 takes numpy arrays \(or CPU tensors\) only"):
            model.infer({"x": CudaArray((1, 2)), "y": CudaArray((1, 2))})
        with pytest.raises(NeuropodError, match=r"output_device='cuda'.* backend toy==1\.0\.0 takes numpy arrays"):
            model.infer({"x": np.ones((1, 2), np.float32), "y": np.ones((1, 2), np.float32)}, output_device="cuda")


@pytest.fixture
def toy_ope(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    yield from install_toy(tmp_path, monkeypatch)


def test_a_worker_model_says_why(toy_ope: Path) -> None:
    path = package(toy_ope, "add", XY, OUT)
    with neuropod.load_neuropod(path, use_ope=True) as model:
        with pytest.raises(NeuropodError, match="the model runs in a worker process .* through shared host memory"):
            model.infer({"x": CudaArray((1, 2)), "y": CudaArray((1, 2))})
        with pytest.raises(NeuropodError, match="output_device='cuda'.* runs in a worker process"):
            model.infer({"x": np.ones((1, 2), np.float32), "y": np.ones((1, 2), np.float32)}, output_device="cuda")
        x = np.arange(4, dtype=np.float32).reshape(2, 2)
        np.testing.assert_array_equal(model.infer({"x": HostTensor(x), "y": x})["out"], x + x)


def test_a_dropped_model_is_freed_at_once(tmp_path: Path) -> None:
    # The validator's device policy must not point back at the model: a cycle would leave a dropped
    # model (and an OPE model's workers) to the cyclic GC instead of freeing it when the last reference goes.
    import gc
    import weakref

    from _toy_backend import toy_plugin

    with toy_plugin():
        model = neuropod.load_neuropod(write_toy(tmp_path / "m"))
        ref = weakref.ref(model)
        gc.disable()
        try:
            del model
            assert ref() is None
        finally:
            gc.enable()
