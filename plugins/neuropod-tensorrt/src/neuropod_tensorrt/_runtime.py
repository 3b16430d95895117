"""A deserialized TensorRT engine on a GPU (imports tensorrt and cuda-python).

TensorRT 10's named-tensor API: one runtime and engine per model, one
execution context, ``set_input_shape`` per input, a device buffer per
tensor (kept and grown across calls), ``set_tensor_address``,
``execute_async_v3`` on a CUDA stream, outputs copied back to numpy.

Nothing here can run without an NVIDIA GPU and TensorRT: the tests for it
are marked ``gpu`` and skip elsewhere. Everything that can be decided
without a GPU lives in :mod:`neuropod_tensorrt._engine` and in the core's
resolution.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from neuropod.errors import BackendError, NeuropodError, PackageError, SpecError
from neuropod.package import Package
from neuropod_tensorrt._engine import ENGINE_PATH, check_io

_plugins_lock = threading.Lock()
_loaded_plugins: set[str] = set()


def cuda_runtime() -> Any:
    """cuda-python's CUDA runtime module (imported on first call)."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        from cuda import cudart  # older cuda-python
    return cudart


def cuda_call(result: Any, what: str) -> Any:
    """Unpack a cuda-python result ``(err, *values)``, raising on an error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise NeuropodError(f"CUDA call {what} failed: {err}")
    return values[0] if len(values) == 1 else tuple(values)


def load_plugins(trt: Any, logger: Any, paths: Sequence[Path], where: str) -> None:
    """Load custom TensorRT plugin libraries once per process, before any engine is deserialized."""
    for path in paths:
        if not path.is_file():
            raise PackageError(f"{where}: plugin library {path} is listed in config.json but missing")
        key = str(path.resolve())
        with _plugins_lock:
            if key in _loaded_plugins:
                continue
            try:
                registry = trt.get_plugin_registry()
                if hasattr(registry, "load_library"):
                    registry.load_library(key)
                else:
                    ctypes.CDLL(key, mode=ctypes.RTLD_GLOBAL)
            except Exception as e:
                raise PackageError(f"{where}: TensorRT plugin library {path.name} failed to load: {e}") from e
            _loaded_plugins.add(key)
    trt.init_libnvinfer_plugins(logger, "")


def engine_io(trt: Any, engine: Any) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Tensor name -> (``"input"``/``"output"``, numpy dtype name, shape) of an engine."""
    io = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        mode = "input" if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else "output"
        dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name))).name
        io[name] = (mode, dtype, tuple(engine.get_tensor_shape(name)))
    return io


class ErrorLogger:
    """A TensorRT logger that keeps errors so they can go into our exceptions."""

    def __init__(self, trt: Any) -> None:
        outer = self
        self.errors: list[str] = []

        class Logger(trt.ILogger):  # type: ignore[misc]
            def __init__(self) -> None:
                trt.ILogger.__init__(self)

            def log(self, severity: Any, msg: str) -> None:
                if severity <= trt.ILogger.Severity.ERROR:
                    outer.errors.append(msg)

        self.trt_logger = Logger()


class TensorRTModel:
    """An engine, its execution context, a stream and reusable device buffers."""

    def __init__(self, trt: Any, package: Package, device: str, where: str):
        self.name = package.name
        self.where = where
        self._trt = trt
        self._cudart = cudart = cuda_runtime()
        self._device_index = int(device.split(":", 1)[1])
        cuda_call(cudart.cudaSetDevice(self._device_index), "cudaSetDevice")
        props = cuda_call(cudart.cudaGetDeviceProperties(self._device_index), "cudaGetDeviceProperties")
        here = f"{props.major}.{props.minor}"
        need = (package.config.device_requirements or {}).get("compute_capability")
        if need and need != here and not (package.config.device_requirements or {}).get("hardware_compatible"):
            raise NeuropodError(
                f"{where}: the engine was built for compute capability {need}, but {device} is {here}; rebuild the "
                "engine on this GPU (or build it hardware-compatible)"
            )
        self._logger = ErrorLogger(trt)
        load_plugins(trt, self._logger.trt_logger, package.custom_op_paths, where)
        runtime = trt.Runtime(self._logger.trt_logger)
        engine = runtime.deserialize_cuda_engine((package.root / ENGINE_PATH).read_bytes())
        if engine is None:
            built = (package.config.exported_with or {}).get("platform_version", "unknown")
            raise BackendError(
                f"{where}: TensorRT {trt.__version__} could not deserialize the engine, which was built with TensorRT "
                f"{built}: {' '.join(self._logger.errors) or 'no reason given'}"
            )
        self._runtime, self.engine = runtime, engine
        self._io = engine_io(trt, engine)
        check_io(self._io, package.config.input_spec, package.config.output_spec, where)
        self.context = engine.create_execution_context()
        self.stream = cuda_call(cudart.cudaStreamCreate(), "cudaStreamCreate")
        self._buffers: dict[str, tuple[int, int]] = {}  # name -> (pointer, capacity in bytes)
        self._lock = threading.Lock()  # one execution context: one call at a time

    @classmethod
    def load(cls, package: Package, device: str, options: Mapping[str, Any]) -> TensorRTModel:
        where = f"Model {package.name!r} ({package.source})"
        if options:
            raise NeuropodError(f"The TensorRT backend takes no load options, got {sorted(options)}")
        if device == "cpu":
            raise NeuropodError(f"{where}: TensorRT engines run only on NVIDIA GPUs, not on the CPU")
        if not (package.root / ENGINE_PATH).is_file():
            raise PackageError(f"{where}: the engine file {ENGINE_PATH} is missing")
        try:
            import tensorrt as trt
        except ImportError as e:
            raise NeuropodError(f"{where}: tensorrt is not importable: {e}") from e
        return cls(trt, package, device, where)

    def _buffer(self, name: str, nbytes: int) -> int:
        ptr, capacity = self._buffers.get(name, (0, 0))
        if capacity < nbytes:
            if ptr:
                cuda_call(self._cudart.cudaFree(ptr), "cudaFree")
            ptr = int(cuda_call(self._cudart.cudaMalloc(max(nbytes, 1)), f"cudaMalloc({nbytes})"))
            self._buffers[name] = (ptr, max(nbytes, 1))
        return ptr

    def run(self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] | None) -> dict[str, np.ndarray]:
        cudart = self._cudart
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        d2h = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        with self._lock:
            cuda_call(cudart.cudaSetDevice(self._device_index), "cudaSetDevice")
            for name, (mode, _, _) in self._io.items():
                if mode == "input" and name not in inputs:
                    raise SpecError(f"Model {self.name!r} needs input {name!r}: TensorRT engines have no optional inputs")
            for name, arr in inputs.items():
                if not self.context.set_input_shape(name, arr.shape):
                    raise SpecError(
                        f"Model {self.name!r}: input {name!r} of shape {arr.shape} is outside the engine's "
                        "optimization profile"
                    )
                ptr = self._buffer(name, arr.nbytes)
                cuda_call(cudart.cudaMemcpyAsync(ptr, arr.ctypes.data, arr.nbytes, h2d, self.stream), "cudaMemcpyAsync")
                self.context.set_tensor_address(name, ptr)
            outputs: dict[str, np.ndarray] = {}
            for name, (mode, dtype, _) in self._io.items():
                if mode != "output":
                    continue
                shape = tuple(self.context.get_tensor_shape(name))
                host = np.empty(shape, dtype=dtype)
                self.context.set_tensor_address(name, self._buffer(name, host.nbytes))
                outputs[name] = host
            if not self.context.execute_async_v3(self.stream):
                raise BackendError(f"Model {self.name!r}: TensorRT execution failed: {' '.join(self._logger.errors)}")
            wanted = outputs if requested is None else {k: outputs[k] for k in requested}
            for name, host in wanted.items():
                ptr = self._buffers[name][0]
                cuda_call(cudart.cudaMemcpyAsync(host.ctypes.data, ptr, host.nbytes, d2h, self.stream), "cudaMemcpyAsync")
            cuda_call(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
            return dict(wanted)

    def close(self) -> None:
        with self._lock:
            for ptr, _ in self._buffers.values():
                self._cudart.cudaFree(ptr)
            self._buffers.clear()
            if getattr(self, "stream", None) is not None:
                self._cudart.cudaStreamDestroy(self.stream)
                self.stream = None
            self.__dict__.pop("context", None)
            self.__dict__.pop("engine", None)
