"""``create_tensorrt_neuropod``: package a TensorRT engine (or build one from ONNX)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod.backend import installed_distribution
from neuropod.create import create_package, package_options
from neuropod.errors import BackendError, NeuropodError, PackageError
from neuropod.plugins import import_framework
from neuropod.spec import TensorSpec, parse_spec
from neuropod.strings import refuse_dtypes
from neuropod_tensorrt import FRAMEWORK_DISTRIBUTIONS, PLATFORM
from neuropod_tensorrt._engine import ENGINE_PATH, EngineInfo, check_io
from neuropod_tensorrt._runtime import ErrorLogger, cuda_call, cuda_runtime, engine_io, load_plugins

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from neuropod.create import PackageOptions

Profile = Mapping[str, tuple[Any, Any, Any]]

# An engine's numerics (fused kernels, TF32) are looser than a framework's.
_DEFAULTS = {"test_rtol": 1e-3, "test_atol": 1e-4}


def create_tensorrt_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    engine_path: str | os.PathLike[str] | None = None,
    onnx_path: str | os.PathLike[str] | None = None,
    compute_capability: str | None = None,
    tensorrt_version: str | None = None,
    hardware_compatibility: str = "none",
    min_free_memory: int | None = None,
    optimization_profile: Profile | None = None,
    fp16: bool = False,
    **options: Unpack[PackageOptions],
) -> Path:
    """Package a TensorRT engine as a Neuropod.

    :param engine_path: a serialized engine. TensorRT cannot say which
        compute capability an engine was built for, so give
        ``compute_capability`` (``"8.0"`` for an A100); give
        ``tensorrt_version`` when TensorRT is not installed here (otherwise
        the installed version is recorded, and checked by deserializing the
        engine when a GPU is present).
    :param onnx_path: or an ONNX model to build the engine from here, with
        TensorRT's builder on this machine's first GPU.
        ``optimization_profile`` gives (min, opt, max) for each symbol of the
        spec (``{"batch_size": (1, 8, 64)}``) and a full (min, opt, max) shape
        for inputs with ``null`` dims (``{"image": ((1, 3, 224, 224), ...)}``).
    :param platform_version_semver: defaults to the engine's TensorRT
        major.minor (``~10.3``): what the engine can actually run on.
    :param hardware_compatibility: ``"none"`` (the engine runs only on GPUs of
        its compute capability) or ``"ampere_plus"`` (built with
        ``HardwareCompatibilityLevel.AMPERE_PLUS``: any GPU of cc 8.0 or newer).
    :param min_free_memory: bytes of free GPU memory the model needs; hosts
        whose GPUs have less are rejected by resolution.
    :param options: the common keywords (:class:`neuropod.package.PackageOptions`);
        ``custom_ops`` are TensorRT plugin libraries, loaded before the engine
        is deserialized; test outputs are compared with ``test_rtol=1e-3``
        and ``test_atol=1e-4`` unless given.
    :returns: the path written.
    """
    if (engine_path is None) == (onnx_path is None):
        raise NeuropodError("create_tensorrt_neuropod needs exactly one of engine_path= or onnx_path=")
    opts = package_options("create_tensorrt_neuropod", options, _DEFAULTS)
    custom_ops = opts["custom_ops"]
    inputs = parse_spec(input_spec, "input_spec")
    outputs = parse_spec(output_spec, "output_spec")
    refuse_dtypes(model_name, inputs, outputs, {"bytes"}, PLATFORM)
    installed = installed_distribution(*FRAMEWORK_DISTRIBUTIONS)
    if onnx_path is not None:
        engine, info = _build_from_onnx(
            Path(onnx_path), inputs, outputs, optimization_profile or {}, hardware_compatibility, fp16,
            min_free_memory, [Path(p) for p in custom_ops],
        )  # fmt: skip
    else:
        path = Path(engine_path)  # type: ignore[arg-type]
        if not path.is_file():
            raise PackageError(f"engine_path {path} does not exist")
        if compute_capability is None:
            raise NeuropodError(
                "compute_capability= is needed with engine_path=: an engine runs only on GPUs of the compute "
                "capability it was built on (e.g. '8.0' for an A100, '9.0' for an H100), and the engine file "
                "does not say which"
            )
        version = tensorrt_version or (installed[1] if installed else None)
        if version is None:
            raise NeuropodError("tensorrt_version= is needed: TensorRT is not installed here to say which built the engine")
        engine = path.read_bytes()
        info = EngineInfo(version, compute_capability, hardware_compatibility, min_free_memory)
        # An engine for another TensorRT than the installed one cannot be opened here, only packaged.
        if not (installed and tensorrt_version and tensorrt_version != installed[1]):
            _check_engine_if_possible(engine, inputs, outputs, info, [Path(p) for p in custom_ops], model_name)
    return create_package(
        "create_tensorrt_neuropod", neuropod_path, model_name, PLATFORM, inputs, outputs, {ENGINE_PATH: engine},
        options, framework_distributions=FRAMEWORK_DISTRIBUTIONS,
        # The engine's TensorRT, which need not be the one installed here.
        exported_with={"platform_version": info.tensorrt_version, "hardware_compatibility": info.hardware_compatibility},
        device_requirements=info.device_requirements(), default_version_range=info.default_range(), defaults=_DEFAULTS,
    )  # fmt: skip


def _gpu_here() -> str | None:
    """This machine's first GPU's compute capability, or None without a usable GPU."""
    try:
        cudart = cuda_runtime()
        props = cuda_call(cudart.cudaGetDeviceProperties(0), "cudaGetDeviceProperties")
    except Exception:  # noqa: BLE001 - no driver, no GPU, no binding: all mean "no GPU here"
        return None
    return f"{props.major}.{props.minor}"


def _check_engine_if_possible(
    engine: bytes, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], info: EngineInfo,
    plugins: Sequence[Path], name: str,
) -> None:  # fmt: skip
    """Open the engine and compare its I/O with the spec, when TensorRT and a GPU are here."""
    if _gpu_here() is None:
        return
    try:
        import tensorrt as trt
    except ImportError:
        return
    logger = ErrorLogger(trt)
    load_plugins(trt, logger.trt_logger, plugins, f"Model {name!r}")
    deserialized = trt.Runtime(logger.trt_logger).deserialize_cuda_engine(engine)
    if deserialized is None:
        raise BackendError(
            f"Model {name!r}: TensorRT {trt.__version__} cannot open this engine (recorded as built with "
            f"{info.tensorrt_version}): {' '.join(logger.errors) or 'no reason given'}"
        )
    check_io(engine_io(trt, deserialized), inputs, outputs, f"Model {name!r}")


def profile_shapes(spec: TensorSpec, profile: Profile) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(min, opt, max) shapes of one input from the spec's dims and the user's profile.

    Fixed dims are used as they are; a symbol takes the (min, opt, max) given
    for it; an input with any ``null`` dim needs its own entry of three
    shapes. None when the input has only fixed dims.
    """
    if spec.name in profile:
        lo, mid, hi = (tuple(int(d) for d in s) for s in profile[spec.name])
        return lo, mid, hi
    if all(isinstance(d, int) for d in spec.shape):
        return None
    shapes: list[list[int]] = [[], [], []]
    for axis, dim in enumerate(spec.shape):
        if isinstance(dim, int):
            triple = (dim, dim, dim)
        elif isinstance(dim, str) and dim in profile:
            triple = tuple(int(v) for v in profile[dim])  # type: ignore[assignment]
        else:
            what = f"symbol {dim!r}" if isinstance(dim, str) else f"dim {axis} (null)"
            raise NeuropodError(
                f"Input {spec.name!r} has {what}: give optimization_profile[{dim if isinstance(dim, str) else spec.name!r}] "
                "= (min, opt, max) so TensorRT knows the sizes to build for"
            )
        for i in range(3):
            shapes[i].append(triple[i])
    return tuple(shapes[0]), tuple(shapes[1]), tuple(shapes[2])


def _build_from_onnx(
    onnx_path: Path, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], profile: Profile,
    hardware_compatibility: str, fp16: bool, min_free_memory: int | None, plugins: Sequence[Path],
) -> tuple[bytes, EngineInfo]:  # fmt: skip
    """Build an engine with TensorRT's builder on this machine's first GPU."""
    if not onnx_path.is_file():
        raise PackageError(f"onnx_path {onnx_path} does not exist")
    shapes = {s.name: profile_shapes(s, profile) for s in inputs}  # checks the profile before needing a GPU
    cc = _gpu_here()
    if cc is None:
        raise NeuropodError("Building a TensorRT engine from ONNX needs an NVIDIA GPU and its driver; none is usable here")
    trt = import_framework("tensorrt", PLATFORM, "Building a TensorRT engine")
    logger = ErrorLogger(trt)
    load_plugins(trt, logger.trt_logger, plugins, f"ONNX model {onnx_path}")
    builder = trt.Builder(logger.trt_logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger.trt_logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise NeuropodError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if hardware_compatibility == "ampere_plus":
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    opt = builder.create_optimization_profile()
    for name, triple in shapes.items():
        if triple is not None:
            opt.set_shape(name, *triple)
    config.add_optimization_profile(opt)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BackendError(f"TensorRT could not build an engine from {onnx_path}: {' '.join(logger.errors)}")
    engine = bytes(serialized)
    deserialized = trt.Runtime(logger.trt_logger).deserialize_cuda_engine(engine)
    check_io(engine_io(trt, deserialized), inputs, outputs, f"ONNX model {onnx_path}")
    return engine, EngineInfo(trt.__version__, cc, hardware_compatibility, min_free_memory)


__all__ = ["create_tensorrt_neuropod", "profile_shapes"]
