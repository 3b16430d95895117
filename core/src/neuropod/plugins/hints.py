"""What to install: the plugin of each platform, the framework of each plugin, ``pip install`` lines
that name a source checkout's folders, and a framework's import that says what installs it."""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import importlib_metadata

from neuropod.errors import PluginNotInstalledError
from neuropod.plugins.registry import installed_backends, plugin_info

#: The wheel that provides each platform we know of, for "pip install" hints.
KNOWN_PLATFORMS = {
    "onnx": "neuropod-onnx",
    "torchscript": "neuropod-torchscript",
    "tensorflow": "neuropod-tensorflow",
    "keras": "neuropod-tensorflow",
    "tensorrt": "neuropod-tensorrt",
    "python": "neuropod-python",
    "torch_export": "neuropod-torch",
    "aoti": "neuropod-torch",
    "jax": "neuropod-jax",
}
#: Platforms a package can name ("keras" above is a packager's name; its packages say "tensorflow").
_RUNNABLE_PLATFORMS = sorted(set(KNOWN_PLATFORMS) - {"keras"})
#: What to install when a platform's plugin is there but its framework is not.
KNOWN_FRAMEWORKS = {
    "onnx": "'neuropod-onnx[cpu]' (or 'neuropod-onnx[gpu]' for NVIDIA GPUs; or install onnxruntime or "
            "onnxruntime-gpu yourself)",
    "torchscript": "torch",
    "tensorflow": "'neuropod-tensorflow[cpu]' (or 'neuropod-tensorflow[gpu]', or any tensorflow distribution)",
    "keras": "'neuropod-tensorflow[cpu]' (or 'neuropod-tensorflow[gpu]', or any tensorflow distribution)",
    "tensorrt": "'neuropod-tensorrt[tensorrt]' (TensorRT needs an NVIDIA GPU)",
    "torch_export": "torch",
    "aoti": "torch (the release the package was compiled with)",
    "jax": "jax ('jax[cuda12]' or 'jax[cuda13]' for NVIDIA GPUs)",
}


@functools.cache
def source_checkout() -> Path | None:
    """The Neuropod checkout the core was installed from (``pip install ./core``), or None."""
    import urllib.parse
    import urllib.request

    try:
        text = importlib_metadata.distribution("neuropod").read_text("direct_url.json")
        url = json.loads(text or "{}").get("url", "")
    except Exception:  # noqa: BLE001 - no record, or not one we understand: no checkout
        return None
    if not isinstance(url, str) or not url.startswith("file:"):
        return None
    core = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
    root = core.parent
    return root if (core / "pyproject.toml").is_file() and (root / "plugins").is_dir() else None


_OUR_REQUIREMENT = re.compile(r"'?\b(neuropod-[a-z]+)(\[[a-z0-9,]+\])?'?(?=[\s,;)]|$)")


def pip_install(requirements: str) -> str:
    """``pip install REQUIREMENTS``, for an error's hint.

    Our wheels are named as on a package index, except when the core was
    installed from a checkout of the Neuropod repository: then each of ours
    is that checkout's folder (``pip install '/src/neuropod/plugins/neuropod-onnx[cpu]'``),
    which works as written where a bare name would not.
    """
    root = source_checkout()
    if root is not None:

        def local(match: re.Match[str]) -> str:
            name, extras = match.group(1), match.group(2) or ""
            folder = root / ("serving" if name == "neuropod-serving" else f"plugins/{name}")
            return f"'{folder}{extras}'" if (folder / "pyproject.toml").is_file() else match.group(0)

        requirements = _OUR_REQUIREMENT.sub(local, requirements)
    return f"pip install {requirements}"


def install_hint(platform: str) -> str:
    """What to install to run a platform."""
    dist = KNOWN_PLATFORMS.get(platform)
    plugin = plugin_info(platform)  # plugins are named for the platform they run
    idle = plugin is not None and not any(b.plugin == platform for b in installed_backends())
    if plugin is not None and idle and platform in KNOWN_FRAMEWORKS:
        return f"{plugin.distribution} is installed, but its framework is not: {pip_install(KNOWN_FRAMEWORKS[platform])}"
    if dist:
        return pip_install(dist)
    return (
        f"no known Neuropod plugin runs platform {platform!r} (known: {', '.join(sorted(_RUNNABLE_PLATFORMS))}); "
        "install the plugin that provides it"
    )


def import_framework(
    module: str, platform: str, needed_by: str, importer: Callable[[], Any] | None = None
) -> Any:
    """Import a backend's framework for a packager or demo, or say what installs it.

    Plugins import their framework only when a function needs it; this is
    that import, so a user who installed a plugin without its framework (e.g.
    ``neuropod-onnx`` without its ``[cpu]`` extra) reads what to install
    instead of a ``ModuleNotFoundError``. Call it first and then import as
    usual (``import torch``) where the framework's types matter to a checker.

    :param module: the module to import, e.g. ``"onnxruntime"`` or ``"jax.export"``.
    :param platform: the platform it runs, for the install hint (``"onnx"``).
    :param needed_by: what needs it, for the message (``"create_onnx_neuropod"``).
    :param importer: imports it instead of :func:`importlib.import_module` (e.g. quietly).
    :returns: the imported module.
    :raises PluginNotInstalledError: the module is missing, or is installed and fails to import.
    """
    try:
        return importer() if importer is not None else importlib.import_module(module)
    except ImportError as e:
        hint = KNOWN_FRAMEWORKS.get(platform, module)
        top = module.split(".")[0]
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == top:
            raise PluginNotInstalledError(f"{needed_by} needs {top}, which is not installed: {pip_install(hint)}") from e
        raise PluginNotInstalledError(
            f"{needed_by} needs {top}, which is installed but failed to import ({type(e).__name__}: "
            f"{' '.join(str(e).split())}); reinstall it: {pip_install(hint)}"
        ) from e
