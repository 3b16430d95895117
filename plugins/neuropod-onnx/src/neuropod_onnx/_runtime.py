"""The ONNX Runtime session behind a loaded model (imports onnxruntime)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from neuropod.errors import BackendError, NeuropodError, PackageError, SpecError
from neuropod.package import Package
from neuropod.spec import TensorSpec
from neuropod.tensors import DeviceInputs

MODEL_FILE = "model.onnx"

# ONNX type strings as ONNX Runtime reports them, for each spec dtype.
ORT_TYPES = {
    "float16": "tensor(float16)",
    "float32": "tensor(float)",
    "float64": "tensor(double)",
    "int8": "tensor(int8)",
    "int16": "tensor(int16)",
    "int32": "tensor(int32)",
    "int64": "tensor(int64)",
    "uint8": "tensor(uint8)",
    "uint16": "tensor(uint16)",
    "uint32": "tensor(uint32)",
    "uint64": "tensor(uint64)",
    "bool": "tensor(bool)",
    "string": "tensor(string)",
}

#: Load options this backend accepts, with what they do.
LOAD_OPTIONS = {
    "intra_op_num_threads": "threads used inside one operator (0 = ONNX Runtime's default)",
    "inter_op_num_threads": "threads used across operators (0 = ONNX Runtime's default)",
    "graph_optimization_level": "'disable', 'basic', 'extended' or 'all' (default 'all')",
    "execution_mode": "'sequential' (default) or 'parallel'",
}

_OPT_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def session_options(options: Mapping[str, Any], custom_ops: Sequence[Path], where: str) -> ort.SessionOptions:
    """SessionOptions from the user's load options, with custom ops registered.

    Custom-op libraries must be registered before the session is created,
    or the model's nodes from their domains are unknown.
    """
    unknown = sorted(set(options) - set(LOAD_OPTIONS))
    if unknown:
        known = "; ".join(f"{k}: {v}" for k, v in LOAD_OPTIONS.items())
        raise NeuropodError(f"Unknown ONNX Runtime load option(s) {', '.join(map(repr, unknown))}. Known: {known}")
    so = ort.SessionOptions()
    for key in ("intra_op_num_threads", "inter_op_num_threads"):
        if key in options:
            value = options[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise NeuropodError(f"Load option {key} must be an int >= 0, not {value!r}")
            setattr(so, key, value)
    if "graph_optimization_level" in options:
        level = _OPT_LEVELS.get(str(options["graph_optimization_level"]).lower())
        if level is None:
            raise NeuropodError(
                f"graph_optimization_level must be one of {', '.join(_OPT_LEVELS)}, "
                f"not {options['graph_optimization_level']!r}"
            )
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    if "execution_mode" in options:
        mode = str(options["execution_mode"]).lower()
        if mode not in ("sequential", "parallel"):
            raise NeuropodError(f"execution_mode must be 'sequential' or 'parallel', not {options['execution_mode']!r}")
        so.execution_mode = getattr(ort.ExecutionMode, f"ORT_{mode.upper()}")
    for lib in custom_ops:
        if not lib.is_file():
            raise PackageError(f"{where}: custom op library {lib} is listed in config.json but missing")
        try:
            so.register_custom_ops_library(str(lib))
        except Exception as e:
            raise PackageError(
                f"{where}: custom op library {lib.name} failed to load in onnxruntime {ort.__version__}: {e}"
            ) from e
    return so


def providers_for(device: str, where: str) -> list[Any]:
    """Execution providers for a device; a GPU that cannot be used is an error, not a fallback."""
    if device == "cpu":
        return ["CPUExecutionProvider"]
    index = int(device.split(":", 1)[1])
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise NeuropodError(
            f"{where}: device {device!r} was asked for, but this onnxruntime build has no CUDA provider "
            f"(available: {', '.join(available)}). Install onnxruntime-gpu or load with device='cpu'."
        )
    # CPU stays in the list only for the nodes CUDA has no kernel for; the
    # session is checked after creation to really have CUDA.
    return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]


def check_io(sess: ort.InferenceSession, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], where: str) -> None:
    """The spec and the ONNX graph must agree on names and element types."""
    for kind, specs, nodes in (("input", inputs, sess.get_inputs()), ("output", outputs, sess.get_outputs())):
        graph = {n.name: n for n in nodes}
        spec_names = {s.name for s in specs}
        missing = sorted(spec_names - set(graph))
        if missing:
            raise SpecError(
                f"{where}: {kind} spec names {', '.join(map(repr, missing))}, but the ONNX graph's {kind}s are "
                f"{', '.join(map(repr, graph)) or 'none'}"
            )
        if kind == "input":
            unspecified = sorted(set(graph) - spec_names)
            if unspecified:
                raise SpecError(
                    f"{where}: the ONNX graph needs input(s) {', '.join(map(repr, unspecified))} that the input spec "
                    "does not describe"
                )
        for spec in specs:
            node = graph[spec.name]
            want = ORT_TYPES[spec.dtype]
            if node.type != want:
                raise SpecError(
                    f"{where}: {kind} {spec.name!r} is {spec.dtype} in the spec, but {node.type} in the ONNX graph"
                )
            shape = node.shape
            if isinstance(shape, list) and len(shape) != len(spec.shape):
                raise SpecError(
                    f"{where}: {kind} {spec.name!r} has {len(spec.shape)} dims {spec.describe_shape()} in the spec, "
                    f"but {len(shape)} dims {shape} in the ONNX graph"
                )


def create_session(
    model: bytes | str, device: str, options: Mapping[str, Any], custom_ops: Sequence[Path], where: str
) -> ort.InferenceSession:
    so = session_options(options, custom_ops, where)
    providers = providers_for(device, where)
    try:
        sess = ort.InferenceSession(model, so, providers=providers)
    except Exception as e:
        raise BackendError(f"{where}: onnxruntime {ort.__version__} could not load the model: {e}") from e
    if device != "cpu" and "CUDAExecutionProvider" not in sess.get_providers():
        raise NeuropodError(
            f"{where}: device {device!r} was asked for, but onnxruntime could not start its CUDA provider "
            "(see onnxruntime's log above for the missing CUDA/cuDNN library); load with device='cpu' to use the CPU"
        )
    return sess


class OnnxModel:
    """A session plus what ``infer`` needs to call it quickly."""

    def __init__(self, sess: ort.InferenceSession, name: str, device: str = "cpu"):
        self.session = sess
        self.name = name
        self.device = device
        self._device_id = int(device.split(":", 1)[1]) if device != "cpu" else 0
        self._run = sess.run
        # The common call goes straight to the session's C++ object, past InferenceSession.run's Python
        # checks, which re-check what the spec check has already made sure of (every graph input is in
        # the feed: a scan of the feed's names for each graph input, about 60 us with 100 inputs and 1 us
        # with two; OrtValue ownership, which numpy feeds do not have). On a GPU the wrapper stays: it
        # also handles CUDA graph capture and its execution providers' fallback.
        inner = getattr(sess, "_sess", None) if device == "cpu" else None
        self._run_plain: Callable[[list[str], dict[str, Any], Any], list[Any]] = getattr(inner, "run", None) or sess.run
        self._output_names = [o.name for o in sess.get_outputs()]
        self._input_names = [i.name for i in sess.get_inputs()]
        self._n_inputs = len(self._input_names)
        # onnxruntime reads numpy unicode arrays as C strings, so "a\x00b" arrives as "a";
        # object arrays of str keep every character.
        self._string_inputs = frozenset(i.name for i in sess.get_inputs() if i.type == "tensor(string)")
        self._string_outputs = frozenset(o.name for o in sess.get_outputs() if o.type == "tensor(string)")
        # The common call (a dict of every input, numpy arrays, no string inputs, all outputs in
        # host memory) needs none of run's choices: just the session and the outputs' dict.
        self._plain = not self._string_inputs
        self._one_output = self._output_names[0] if len(self._output_names) == 1 else None

    @classmethod
    def load(cls, package: Package, device: str, options: Mapping[str, Any]) -> OnnxModel:
        path = package.data_dir / MODEL_FILE
        where = f"Model {package.name!r} ({package.source})"
        if not path.is_file():
            raise PackageError(f"{where}: the ONNX model file 0/data/{MODEL_FILE} is missing")
        sess = create_session(str(path), device, options, package.custom_op_paths, where)
        check_io(sess, package.config.input_spec, package.config.output_spec, where)
        return cls(sess, package.name, device)

    def run(
        self, inputs: Mapping[str, Any], requested: Sequence[str] | None, output_device: str | None = None
    ) -> dict[str, Any]:
        if requested is None and output_device is None and self._plain and type(inputs) is dict \
                and len(inputs) == self._n_inputs:  # fmt: skip
            values = self._run_plain(self._output_names, inputs, None)
            one = self._one_output  # the usual model: a dict literal, no zip
            return {one: values[0]} if one is not None else dict(zip(self._output_names, values))
        if len(inputs) != self._n_inputs:
            missing = [n for n in self._input_names if n not in inputs]
            raise SpecError(f"Model {self.name!r} needs input(s) {', '.join(map(repr, missing))}: ONNX has no optional inputs")
        names = self._output_names if requested is None else requested
        bound = output_device is not None or type(inputs) is DeviceInputs  # device tensors in or out: IO binding
        if self._string_inputs:
            inputs = {k: v.astype(object) if k in self._string_inputs and v.dtype.kind == "U" else v
                      for k, v in inputs.items()}  # fmt: skip
        if not bound:
            return dict(zip(names, self._run(names, inputs)))
        return self.run_bound(inputs, names, output_device is not None)

    def run_bound(self, inputs: Mapping[str, Any], names: Sequence[str], outputs_on_device: bool) -> dict[str, Any]:
        """Run through IO binding: device inputs are bound where they are (no host copy) and,
        with ``outputs_on_device``, numeric outputs are left on the model's device as OrtValues
        (DLPack-capable: ``torch.from_dlpack(value)``)."""
        binding = self.session.io_binding()
        keep = []
        for name, value in inputs.items():
            if type(value) is np.ndarray:
                binding.bind_cpu_input(name, value)
            else:
                keep.append(_bind_device_input(binding, name, value, self._device_id, self.name))
        device_type = "cpu" if self.device == "cpu" else "cuda"
        string_outputs = self._string_outputs
        for name in names:
            if outputs_on_device and name not in string_outputs:
                binding.bind_output(name, device_type, self._device_id)
            else:
                binding.bind_output(name)  # host memory
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        values = binding.get_outputs()
        del keep
        out: dict[str, Any] = {}
        for name, value in zip(names, values):
            out[name] = value if outputs_on_device and name not in string_outputs else value.numpy()
        return out

    def close(self) -> None:
        # Dropping the last references frees the session's memory.
        self.__dict__.pop("session", None)
        self.__dict__.pop("_run", None)


def _bind_device_input(binding: Any, name: str, value: Any, device_id: int, model: str) -> Any:
    """Bind a tensor that lives on the GPU (or an OrtValue) as it is, without a host copy.

    Its producer's pending work must be finished first: onnxruntime runs on a
    stream of its own and does not wait for another framework's. torch and
    CuPy tensors get their current stream synchronized (the framework is
    already imported when such an object exists); other producers must hand
    over finished tensors, as DLPack without a stream means.

    :returns: what must stay alive until the run ends.
    """
    framework = type(value).__module__.split(".")[0]
    if isinstance(value, ort.OrtValue):
        binding.bind_ortvalue_input(name, value)
        return value
    if framework == "torch":
        torch = sys.modules["torch"]
        value = value.contiguous()
        if value.is_cuda:
            torch.cuda.current_stream(value.device).synchronize()
    elif framework == "cupy":
        sys.modules["cupy"].cuda.get_current_stream().synchronize()
    from_dlpack = getattr(ort.OrtValue, "from_dlpack", None)
    if from_dlpack is not None and hasattr(value, "__dlpack__"):
        try:
            ortvalue = from_dlpack(value)
        except Exception as e:
            raise NeuropodError(
                f"Input {name!r} of model {model!r}: onnxruntime {ort.__version__} could not take the {framework} "
                f"tensor without a copy ({e}); pass a C-contiguous tensor"
            ) from e
        binding.bind_ortvalue_input(name, ortvalue)
        return (value, ortvalue)
    cai = getattr(value, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        shape = [int(d) for d in cai["shape"]]
        dtype = np.dtype(cai["typestr"])
        strides = cai.get("strides")
        if strides is not None and 0 not in shape and tuple(strides) != _c_strides(shape, dtype.itemsize):
            raise NeuropodError(f"Input {name!r} of model {model!r} is not C-contiguous on the GPU; pass a contiguous tensor")
        binding.bind_input(name, "cuda", device_id, dtype.type, shape, int(cai["data"][0]))
        return value
    raise NeuropodError(
        f"Input {name!r} of model {model!r}: onnxruntime {ort.__version__} cannot take a {framework} tensor on the GPU "
        "(this onnxruntime has no OrtValue.from_dlpack, and the tensor has no __cuda_array_interface__)"
    )


def _c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """The byte strides of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))
