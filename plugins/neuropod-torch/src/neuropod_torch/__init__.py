"""PyTorch 2 backends for Neuropod: ``torch.export`` programs and AOTInductor packages.

Two platforms, each a plugin named for it (entry points in
``neuropod.backends``), so ``NEUROPOD_PLUGINS=torch_export,aoti`` and
``neuropod env create aoti==2.13.0`` work as for any other backend:

* ``torch_export``: an ``ExportedProgram`` written by ``torch.export.save``,
  run with its ``.module()``;
* ``aoti``: an AOTInductor package from
  ``torch._inductor.aoti_compile_and_package``: compiled code for one torch
  release and one kind of device, run with ``torch._inductor.aoti_load_package``.

Packagers: :func:`neuropod_torch.packager.create_torch_export_neuropod` and
:func:`neuropod_torch.packager.create_aoti_neuropod` (also
``neuropod.packagers.create_torch_export_neuropod`` and ``...create_aoti_neuropod``).

Importing this package imports no framework: torch is imported when a model
is loaded or packaged.
"""

from __future__ import annotations

from neuropod_torch._hooks import (
    AOTI,
    FRAMEWORK_DISTRIBUTIONS,
    PLATFORMS,
    TORCH_EXPORT,
    TorchPlugin,
    torch_cuda_version,
)

#: The plugin objects the entry points name.
torch_export = TorchPlugin(TORCH_EXPORT)
aoti = TorchPlugin(AOTI)

__all__ = [
    "AOTI", "FRAMEWORK_DISTRIBUTIONS", "PLATFORMS", "TORCH_EXPORT", "TorchPlugin", "aoti", "torch_cuda_version",
    "torch_export",
]  # fmt: skip
