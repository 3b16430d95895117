"""Tensors that are not numpy arrays: framework tensors and device memory.

``model.infer`` takes numpy arrays, and also any object of another framework
that describes itself through one of the standard protocols:

* a torch tensor (CPU or CUDA);
* an object with ``__dlpack__`` / ``__dlpack_device__`` (CuPy, JAX, an
  onnxruntime ``OrtValue``, numpy itself);
* an object with ``__cuda_array_interface__`` (CuPy, Numba, PyCUDA...).

:func:`describe` reads such an object's dtype, shape and device from its
metadata: nothing is copied and no framework is imported (an object of a
framework means that framework is already imported). The spec checks use it,
so a tensor on a GPU is checked exactly as a numpy array is.

What happens next depends on where the tensor lives. A tensor in host memory
becomes a numpy array sharing its memory (:func:`host_array`), so every
backend takes CPU tensors of every framework. A tensor on a GPU goes to the
backend as it is, when the backend says it takes device tensors
(``DeviceCaps.device_tensors``) and the model runs in this process on that
GPU; otherwise the call is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from neuropod.errors import NeuropodError

# DLPack device types (dlpack.h): the ones we can name.
_DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cpu", 13: "cuda"}  # kDLCPU, kDLCUDA, kDLCUDAHost (pinned), kDLCUDAManaged
_DLPACK_NAMES = {4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm", 11: "ROCm host", 12: "ext_dev", 14: "oneAPI",
                 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}  # fmt: skip
# ONNX element types as onnxruntime's OrtValue.data_type() names them.
_ONNX_TYPES = {
    "tensor(float16)": "float16", "tensor(float)": "float32", "tensor(double)": "float64",
    "tensor(int8)": "int8", "tensor(int16)": "int16", "tensor(int32)": "int32", "tensor(int64)": "int64",
    "tensor(uint8)": "uint8", "tensor(uint16)": "uint16", "tensor(uint32)": "uint32", "tensor(uint64)": "uint64",
    "tensor(bool)": "bool", "tensor(string)": "object",
}  # fmt: skip


class DeviceInputs(dict[str, Any]):
    """The checked inputs of a call that holds tensors on a GPU.

    What a backend's ``infer`` gets instead of a plain dict when (and only
    when) some input is a device tensor, so the common all-numpy call pays
    one ``type(inputs) is DeviceInputs`` test rather than a look at every input.
    """

    __slots__ = ()


class TensorFacts(NamedTuple):
    """What a non-numpy tensor says about itself."""

    #: numpy's name for its element type, or the framework's (``"bfloat16"``) when numpy has none.
    dtype: np.dtype[Any] | str
    shape: tuple[int, ...]
    #: ``"cpu"``, ``"cuda:N"``, ``"cuda"`` (a GPU whose index the object does not say) or another
    #: device's name (``"ROCm:0"``), which no backend takes.
    device: str
    #: The framework it came from, for messages: ``"torch"``, ``"cupy"``, ``"onnxruntime"``...
    framework: str

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


def describe(obj: Any) -> TensorFacts | None:
    """The dtype, shape and device of a framework tensor, from its metadata; None for anything else.

    Never copies data and never imports a framework.
    """
    framework = type(obj).__module__.split(".")[0]
    if framework == "torch" and hasattr(obj, "is_cuda") and hasattr(obj, "device"):
        dev = obj.device
        device = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index if dev.index is not None else 0}"
        return TensorFacts(_dtype(obj.dtype), tuple(obj.shape), device, framework)
    data_type = getattr(obj, "data_type", None)
    if framework == "onnxruntime" and callable(data_type) and callable(getattr(obj, "shape", None)):
        name = getattr(obj, "device_name", lambda: "cpu")().lower()
        placed = _dlpack_device(obj)
        device = "cpu" if name == "cpu" else f"{name}:{placed[1] if placed else 0}"
        onnx_type = data_type()
        return TensorFacts(_dtype(_ONNX_TYPES.get(onnx_type, onnx_type)), tuple(obj.shape()), device, framework)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(cai, dict) and "shape" in cai and "typestr" in cai:
        placed = _dlpack_device(obj)
        device = f"cuda:{placed[1]}" if placed is not None and placed[0] in (2, 13) else "cuda"
        return TensorFacts(_dtype(cai["typestr"]), tuple(int(d) for d in cai["shape"]), device, framework)
    found = _dlpack_device(obj) if hasattr(obj, "__dlpack__") else None
    if found is not None:
        kind, ordinal = found
        name = _DLPACK_DEVICES.get(kind) or _DLPACK_NAMES.get(kind, f"DLPack device type {kind}")
        device = "cpu" if name == "cpu" else f"{name}:{ordinal}"
        shape = getattr(obj, "shape", None)
        dtype = getattr(obj, "dtype", None)
        if shape is None or dtype is None:
            if device != "cpu":
                return TensorFacts("unknown", (), device, framework)
            arr = np.from_dlpack(obj)  # host memory: numpy reads the capsule itself, without a copy
            return TensorFacts(arr.dtype, arr.shape, "cpu", framework)
        return TensorFacts(_dtype(dtype), tuple(int(d) for d in shape), device, framework)
    return None


def host_array(obj: Any, facts: TensorFacts) -> np.ndarray:
    """A tensor in host memory as a numpy array sharing its memory (a copy only where sharing is refused).

    :raises NeuropodError: numpy cannot read it (an element type numpy lacks, such as bfloat16).
    """
    detach = getattr(obj, "detach", None)  # a torch tensor that requires grad refuses DLPack export until detached
    numpy = getattr(obj, "numpy", None)  # an OrtValue of an onnxruntime without DLPack
    attempts: list[Callable[[], np.ndarray]] = [lambda: np.from_dlpack(obj)]
    if callable(detach):
        attempts.append(lambda: np.from_dlpack(detach()))
    if callable(numpy):
        attempts.append(lambda: np.asarray(numpy()))
    errors = []
    for attempt in attempts:
        try:
            return attempt()
        except Exception as e:  # noqa: BLE001  # each producer refuses in its own way; the next one may work
            errors.append(f"{type(e).__name__}: {e}")
    raise NeuropodError(
        f"A {facts.framework} tensor of {facts.dtype} {list(facts.shape)} on the cpu cannot be read as a numpy array "
        f"({'; '.join(errors)})"
    )


def _dlpack_device(obj: Any) -> tuple[int, int] | None:
    get = getattr(obj, "__dlpack_device__", None)
    if not callable(get):
        return None
    try:
        kind, index = get()
        return int(kind), int(index)
    except Exception:  # noqa: BLE001  # an object that cannot say is one we cannot place
        return None


def _dtype(dtype: Any) -> np.dtype[Any] | str:
    """numpy's dtype for a framework's dtype object or name; the bare name when numpy has none (bfloat16)."""
    as_numpy = getattr(dtype, "as_numpy_dtype", None)  # TensorFlow's DType
    if as_numpy is not None:
        dtype = as_numpy
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch."):]
    try:
        return np.dtype(text if isinstance(dtype, str) or text.isidentifier() else dtype)
    except TypeError:
        return text


__all__ = ["DeviceInputs", "TensorFacts", "describe", "host_array"]
