"""What the torch backends share when they load and run a model: TorchScript, torch.export and AOTInductor.

Two plugins run torch models (``neuropod-torchscript`` and ``neuropod-torch``)
and neither may depend on the other, so the torch code they would otherwise
each carry lives here: load options that set torch's thread pools, the check
that a GPU can run this torch build, how an input reaches a model on a GPU,
and handing GPU memory back on close. (Their custom-op check is in
:mod:`neuropod.probe`.)

The core never imports this module, and this module imports torch only inside
its functions: importing it costs nothing until a torch model loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from neuropod.errors import NeuropodError

if TYPE_CHECKING:
    import torch

#: The load options every torch backend takes; torch makes both thread counts process-wide.
THREAD_OPTIONS = {
    "intra_op_num_threads": "threads inside one operator (torch.set_num_threads; process-wide)",
    "inter_op_num_threads": "threads across operators (torch.set_num_interop_threads; process-wide, settable once)",
}


def check_load_options(options: Mapping[str, Any], known: Mapping[str, str], platform: str) -> dict[str, int]:
    """Check a torch model's load options (each an int >= 1) and apply the thread counts among them.

    :param known: option name to what it does (for the error); it includes :data:`THREAD_OPTIONS`.
    :param platform: the backend's name, for the error.
    :returns: the options, checked.
    :raises NeuropodError: an unknown option, a value that is not an int >= 1, or a thread count
        torch no longer lets this process change.
    """
    import torch

    unknown = sorted(set(options) - set(known))
    if unknown:
        listed = "; ".join(f"{k}: {v}" for k, v in known.items())
        raise NeuropodError(f"Unknown {platform} load option(s) {', '.join(map(repr, unknown))}. Known: {listed}")
    out = {}
    for key, value in options.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise NeuropodError(f"Load option {key} must be an int >= 1, not {value!r}")
        out[key] = value
    for key, getter, setter in (
        ("intra_op_num_threads", torch.get_num_threads, torch.set_num_threads),
        ("inter_op_num_threads", torch.get_num_interop_threads, torch.set_num_interop_threads),
    ):
        if key not in out or getter() == out[key]:
            continue
        try:
            setter(out[key])
        except RuntimeError as e:
            raise NeuropodError(
                f"Cannot set {key}={out[key]}: PyTorch allows it only once per process, before any parallel work "
                f"(it is {getter()} now). Set it on the first model loaded, or use torch's environment variables. ({e})"
            ) from e
    return out


def check_device(device: str, where: str) -> torch.device:
    """``device`` (``"cpu"`` or ``"cuda:N"``) as a torch device, once this torch build can run on it.

    :raises NeuropodError: torch has no CUDA support or sees no GPU, or the GPU's compute capability
        has neither kernels nor PTX old enough to compile for it in this build.
    """
    import torch

    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise NeuropodError(
            f"{where}: device {device!r} was asked for, but torch {torch.__version__} "
            f"{'has no CUDA support' if torch.version.cuda is None else 'sees no usable GPU'}; load with device='cpu'"
        )
    dev = torch.device(device)
    major, minor = torch.cuda.get_device_capability(dev)
    arch = torch.cuda.get_arch_list()
    # PTX for an older architecture can be JIT-compiled for a newer GPU.
    ptx_ok = any(a.startswith("compute_") and int(a[8:]) <= major * 10 + minor for a in arch)
    if arch and f"sm_{major}{minor}" not in arch and not ptx_ok:
        raise NeuropodError(
            f"{where}: {device} is compute capability {major}.{minor}, but torch {torch.__version__} has kernels only "
            f"for {', '.join(arch)}"
        )
    return dev


def gpu_model_input(target: torch.device) -> Callable[[Any], Any]:
    """How an input reaches a model on a GPU, for an input the package puts on ``target``.

    numpy arrays by ``torch.from_numpy`` (then to ``target``); tensors already
    on a GPU as they are (torch's) or through DLPack / the CUDA array interface
    (CuPy...), with no trip through host memory. ``target`` is the model's GPU,
    or the CPU for an input the package keeps there (``input_tensor_device``).
    A model on the CPU needs none of this: the core hands it numpy arrays only.
    """
    import torch

    from_numpy = torch.from_numpy
    if target.type == "cpu":

        def convert(arr: Any) -> Any:
            return from_numpy(arr) if type(arr) is np.ndarray else device_tensor(arr).cpu()

    else:

        def convert(arr: Any) -> Any:
            if type(arr) is np.ndarray:
                return from_numpy(arr).to(target)
            return device_tensor(arr).to(target)  # free for a tensor already there

    return convert


def device_tensor(arr: Any) -> torch.Tensor:
    """A tensor on a GPU (torch's, or any DLPack or CUDA-array-interface producer) as a torch tensor sharing its memory."""
    import torch

    if isinstance(arr, torch.Tensor):
        return arr
    if hasattr(arr, "__dlpack__"):
        return torch.utils.dlpack.from_dlpack(arr)  # hands the producer torch's stream, so its pending work is ordered first
    return torch.as_tensor(arr, device="cuda")  # __cuda_array_interface__ only (Numba...)


def release_gpu_memory(device: torch.device) -> None:
    """After a model on ``device`` dropped its last references: hand torch's cached blocks back to the driver.

    torch's caching allocator keeps freed GPU memory for itself; without this,
    NVML (and every other process) sees a closed model's memory still taken.
    """
    import gc

    import torch

    if device.type != "cuda":
        return
    gc.collect()  # the parameters may sit in a reference cycle
    with torch.cuda.device(device):
        torch.cuda.empty_cache()


__all__ = [
    "THREAD_OPTIONS",
    "check_device",
    "check_load_options",
    "device_tensor",
    "gpu_model_input",
    "release_gpu_memory",
]
