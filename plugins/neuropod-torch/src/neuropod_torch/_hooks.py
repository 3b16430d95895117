"""What the two plugin modules share; imports no framework."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps, installed_distribution

if TYPE_CHECKING:
    from neuropod.package import Package

TORCH_EXPORT = "torch_export"
AOTI = "aoti"
PLATFORMS = (TORCH_EXPORT, AOTI)
FRAMEWORK_DISTRIBUTIONS = ("torch",)

_CUDA_LINE = re.compile(r"^cuda\s*(?::[^=]*)?=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", re.MULTILINE)


def torch_cuda_version() -> str | None:
    """The CUDA version the installed torch was built for (None for a CPU build), without importing torch.

    Every torch wheel carries ``torch/version.py`` with a line
    ``cuda: Optional[str] = '12.8'`` (``None`` in CPU builds); reading it as
    text keeps ``neuropod backends`` from paying torch's import (seconds).
    """
    spec = importlib.util.find_spec("torch")  # finds, does not import, a top-level package
    for location in list(spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(location) / "version.py").read_text(encoding="utf-8")
        except OSError:
            continue
        m = _CUDA_LINE.search(text)
        if m:
            return m.group(1) or m.group(2) or None
    return None


class TorchPlugin:
    """The hook implementations for one platform; the package holds one instance per platform.

    pluggy registers any object with ``hookimpl``-marked attributes, so one
    class serves both entry points (``neuropod_torch:torch_export`` and
    ``neuropod_torch:aoti``) and each is a plugin named for its platform.
    """

    def __init__(self, platform: str):
        self.platform = platform
        self.__name__ = f"neuropod_torch:{platform}"  # what plugin listings call it

    def __repr__(self) -> str:
        return f"<neuropod-torch plugin {self.platform!r}>"

    @hookimpl
    def supported_versions(self) -> list[Backend]:
        """The installed torch, read from its ``.dist-info`` folder."""
        found = installed_distribution(*FRAMEWORK_DISTRIBUTIONS)
        return [Backend(platform=self.platform, version=found[1], framework=found[0])] if found else []

    @hookimpl
    def device_caps(self, backend: Backend) -> DeviceCaps | None:
        """CPU always, and CUDA when torch is a CUDA build.

        What one AOTInductor package runs on is fixed when it is compiled: its
        ``device_requirements`` in config.json say which, and resolution reads them.
        """
        if backend.platform != self.platform:
            return None
        cuda = torch_cuda_version()
        if self.platform == AOTI:
            note = "each package runs on the device it was compiled for"
        else:
            note = "compute capabilities are checked when a model loads" if cuda else ""
        return DeviceCaps(cpu=True, cuda=cuda, note=note, device_tensors=True)

    @hookimpl
    def load_model(self, package: Package, backend: Backend, device: str, options: Mapping[str, Any]) -> Any:
        """Load the package's program (torch_export) or compiled model (aoti) onto ``device``."""
        if backend.platform != self.platform:
            return None
        from neuropod.strings import refuse_dtypes  # lazy: numpy, kept out of plugin discovery

        refuse_dtypes(package.name, package.config.input_spec, package.config.output_spec, {"bytes"}, self.platform)
        # lazy: torch, kept out of `import neuropod_torch` (plugin discovery)
        from neuropod_torch._runtime import AotiModel, ExportedModel

        loader = AotiModel if self.platform == AOTI else ExportedModel
        return loader.load(package, device, options)

    @hookimpl
    def infer(
        self, model: Any, inputs: Mapping[str, Any], requested_outputs: Sequence[str] | None, output_device: str | None
    ) -> Any:
        """Run the model on the inputs (numpy arrays, or tensors on the model's GPU)."""
        return model.run(inputs, requested_outputs, output_device)
