"""TorchScript (PyTorch) backend for Neuropod (platform ``torchscript``).

This module holds the hook implementations. It imports no framework:
``torch`` is imported in :func:`load_model` only.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps, installed_distribution

if TYPE_CHECKING:
    import numpy as np

    from neuropod.package import Package

PLATFORM = "torchscript"
FRAMEWORK_DISTRIBUTIONS = ("torch",)

_CUDA_LINE = re.compile(r"^cuda\s*(?::[^=]*)?=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", re.MULTILINE)


@hookimpl
def supported_versions() -> list[Backend]:
    """The installed torch, read from its ``.dist-info`` folder."""
    found = installed_distribution(*FRAMEWORK_DISTRIBUTIONS)
    return [Backend(platform=PLATFORM, version=found[1], framework=found[0])] if found else []


def torch_cuda_version() -> tuple[str | None, str]:
    """The CUDA version torch was built for, without importing torch.

    Every torch wheel carries ``torch/version.py`` with a line
    ``cuda: Optional[str] = '12.4'`` (or ``None`` for CPU builds); reading it
    as text keeps ``neuropod backends`` from paying torch's import (seconds).

    :returns: (CUDA version or None, how it was found).
    """
    spec = importlib.util.find_spec("torch")  # finds, does not import, a top-level package
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        version_file = Path(location) / "version.py"
        try:
            text = version_file.read_text(encoding="utf-8")
        except OSError:
            continue
        m = _CUDA_LINE.search(text)
        if m:
            return (m.group(1) or m.group(2) or None), f"from {version_file}"
    return None, "torch/version.py not readable; assuming a CPU build"


@hookimpl
def device_caps(backend: Backend) -> DeviceCaps | None:
    """CPU always; CUDA when torch is a CUDA build.

    Which compute capabilities the build has kernels for is only known from
    torch itself (``torch.cuda.get_arch_list()``), so discovery leaves the
    list empty and loading checks the chosen GPU against it.
    """
    if backend.platform != PLATFORM:
        return None
    cuda, _ = torch_cuda_version()
    if cuda:
        return DeviceCaps(cpu=True, cuda=cuda, note="compute capabilities are checked when a model loads", device_tensors=True)
    return DeviceCaps(cpu=True, device_tensors=True)


@hookimpl
def load_model(package: Package, backend: Backend, device: str, options: Mapping[str, Any]) -> Any:
    """Load the package's TorchScript module onto ``device``."""
    if backend.platform != PLATFORM:
        return None
    from neuropod.strings import refuse_dtypes  # lazy: numpy, kept out of plugin discovery

    refuse_dtypes(package.name, package.config.input_spec, package.config.output_spec, {"bytes"}, PLATFORM)
    # lazy: torch and numpy, kept out of `import neuropod_torchscript` (plugin discovery)
    from neuropod_torchscript._runtime import TorchScriptModel

    return TorchScriptModel.load(package, device, options)


@hookimpl
def infer(
    model: Any, inputs: Mapping[str, np.ndarray], requested_outputs: Sequence[str] | None, output_device: str | None
) -> Any:
    """Run the module on the inputs (numpy arrays, or tensors on the model's GPU)."""
    return model.run(inputs, requested_outputs, output_device)


__all__ = ["PLATFORM", "device_caps", "infer", "load_model", "supported_versions", "torch_cuda_version"]
