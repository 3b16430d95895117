"""JAX backend for Neuropod (platform ``jax``): programs serialized with ``jax.export``.

This module holds the hook implementations. It imports no framework:
``jax`` is imported in :func:`load_model` (and by the packager) only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps, installed_distribution

if TYPE_CHECKING:
    import numpy as np

    from neuropod.package import Package

PLATFORM = "jax"
FRAMEWORK_DISTRIBUTIONS = ("jax",)

#: JAX's CUDA support comes as a PJRT plugin distribution per CUDA major version
#: (``pip install jax[cuda12]`` installs ``jax-cuda12-plugin``), newest first.
CUDA_PLUGINS = (("jax-cuda13-plugin", "13"), ("jax-cuda12-plugin", "12"))


@hookimpl
def supported_versions() -> list[Backend]:
    """The installed jax, read from its ``.dist-info`` folder."""
    found = installed_distribution(*FRAMEWORK_DISTRIBUTIONS)
    return [Backend(platform=PLATFORM, version=found[1], framework=found[0])] if found else []


def cuda_plugin() -> tuple[str, str, str] | None:
    """The installed JAX CUDA plugin as (distribution, version, CUDA major), without importing jax."""
    for dist, cuda in CUDA_PLUGINS:
        found = installed_distribution(dist)
        if found:
            return found[0], found[1], cuda
    return None


@hookimpl
def device_caps(backend: Backend) -> DeviceCaps | None:
    """CPU always; CUDA when a JAX CUDA plugin (``jax-cuda12-plugin``, ``jax-cuda13-plugin``) is installed.

    Whether a package runs on a device also depends on the platforms its
    program was lowered for: the packager records them as the package's
    ``device_requirements``, and loading checks them again.
    """
    if backend.platform != PLATFORM:
        return None
    plugin = cuda_plugin()
    if plugin is None:
        return DeviceCaps(cpu=True)
    dist, version, cuda = plugin
    warning = ""
    if version.split("+")[0] != backend.version.split("+")[0]:
        warning = (
            f"{dist} {version} is installed beside jax {backend.version}; JAX loads a CUDA plugin only of its own "
            f"version. Install jax[cuda{cuda}]=={backend.version}"
        )
    return DeviceCaps(cpu=True, cuda=cuda, note=f"{dist} {version}", warning=warning)


@hookimpl
def load_model(package: Package, backend: Backend, device: str, options: Mapping[str, Any]) -> Any:
    """Deserialize the package's exported program and put its parameters on ``device``."""
    if backend.platform != PLATFORM:
        return None
    from neuropod.strings import refuse_dtypes  # lazy: numpy, kept out of plugin discovery

    refuse_dtypes(package.name, package.config.input_spec, package.config.output_spec, {"bytes"}, PLATFORM)
    # lazy: jax and numpy, kept out of `import neuropod_jax` (plugin discovery)
    from neuropod_jax._runtime import JaxModel

    return JaxModel.load(package, device, options)


@hookimpl
def infer(model: Any, inputs: Mapping[str, np.ndarray], requested_outputs: Sequence[str] | None) -> Any:
    """Run the exported program on the inputs (numpy arrays)."""
    return model.run(inputs, requested_outputs)


__all__ = ["CUDA_PLUGINS", "FRAMEWORK_DISTRIBUTIONS", "PLATFORM", "cuda_plugin", "device_caps", "infer", "load_model", "supported_versions"]
