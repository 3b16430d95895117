"""TensorFlow (and Keras) backend for Neuropod (platform ``tensorflow``).

This module holds the hook implementations. It imports no framework:
``tensorflow`` is imported in :func:`load_model` only.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps, installed_distribution, installed_distributions, shared_module_warning

if TYPE_CHECKING:
    import numpy as np

    from neuropod.package import Package

PLATFORM = "tensorflow"

#: Distributions that provide the ``tensorflow`` module, in the order they are
#: looked for. They install the same module, so one environment has one.
FRAMEWORK_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-gpu",
    "tensorflow-intel",
    "tensorflow-macos",
    "tensorflow-aarch64",
    "tf-nightly",
    "tf-nightly-cpu",
)


@hookimpl
def supported_versions() -> list[Backend]:
    """The installed TensorFlow, whichever distribution provides it, from its ``.dist-info`` folder."""
    found = installed_distribution(*FRAMEWORK_DISTRIBUTIONS)
    return [Backend(platform=PLATFORM, version=found[1], framework=found[0])] if found else []


def build_info() -> dict[str, Any]:
    """TensorFlow's build facts (CUDA or not, CUDA version, compute capabilities), without importing it.

    Every TensorFlow wheel carries ``tensorflow/python/platform/build_info.py``,
    a generated file holding one ``OrderedDict([...])`` literal; it is read
    as Python source, never executed. Empty when it cannot be read.
    """
    spec = importlib.util.find_spec("tensorflow")  # finds, does not import, a top-level package
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "python" / "platform" / "build_info.py"
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], (ast.List, ast.Dict)):
                try:
                    return dict(ast.literal_eval(node.args[0]))
                except (ValueError, TypeError):
                    continue
    return {}


@hookimpl
def device_caps(backend: Backend) -> DeviceCaps | None:
    """CPU always; CUDA when the installed TensorFlow is a CUDA build.

    Read from ``build_info.py`` (see :func:`build_info`): ``is_cuda_build``,
    ``cuda_version`` and ``cuda_compute_capabilities`` (``sm_XY`` entries
    become ``"X.Y"``; when the build also ships PTX (``compute_XY``), newer
    GPUs can run it too, so no list is given). Any of the distributions that
    provide the ``tensorflow`` module will do (``tensorflow``,
    ``tensorflow-cpu``...); two of them installed together get a warning.
    """
    if backend.platform != PLATFORM:
        return None
    # tensorflow and tensorflow-cpu (or tf-nightly...) installed together share one module.
    warning = shared_module_warning(installed_distributions(*FRAMEWORK_DISTRIBUTIONS), "tensorflow")
    info = build_info()
    if not info.get("is_cuda_build"):
        note = "" if info else "TensorFlow's build_info.py was not readable; assuming a CPU build"
        return DeviceCaps(cpu=True, note=note, warning=warning)
    cuda = str(info.get("cuda_version") or "unknown")
    archs = [str(a) for a in info.get("cuda_compute_capabilities") or []]
    caps: tuple[str, ...] = ()
    if archs and not any(a.startswith("compute_") for a in archs):
        caps = tuple(f"{a[3:-1]}.{a[-1]}" for a in archs if a.startswith("sm_") and a[3:].isdigit())
    return DeviceCaps(cpu=True, cuda=cuda, compute_capabilities=caps, warning=warning)


@hookimpl
def load_model(package: Package, backend: Backend, device: str, options: Mapping[str, Any]) -> Any:
    """Load the package's frozen graph or SavedModel onto ``device``."""
    if backend.platform != PLATFORM:
        return None
    # lazy: numpy, kept out of `import neuropod_tensorflow` (plugin discovery)
    from neuropod_tensorflow._runtime import load

    return load(package, device, options)


@hookimpl
def infer(model: Any, inputs: Mapping[str, np.ndarray], requested_outputs: Sequence[str] | None) -> Any:
    """Run the graph or signature on the inputs."""
    return model.run(inputs, requested_outputs)


__all__ = ["PLATFORM", "build_info", "device_caps", "infer", "load_model", "supported_versions"]
