"""What a backend plugin tells the core about itself.

These small value types cross the hook contract (see :mod:`neuropod.hookspecs`).
They hold no framework objects, so building them never imports a framework.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Backend:
    """One framework version that a plugin can run.

    Plugins fill in ``platform``, ``version`` and ``framework``; the core
    fills in where the backend came from.
    """

    #: The package platform it runs, e.g. ``"onnx"``.
    platform: str
    #: The installed framework version, PEP 440, e.g. ``"1.31.1"`` or ``"2.13.0+cpu"``.
    version: str
    #: The distribution that provides the framework, e.g. ``"onnxruntime-gpu"``.
    framework: str
    #: Entry-point name of the plugin that offers it (set by the core).
    plugin: str = ""
    #: ``"<distribution> <version>"`` of that plugin (set by the core).
    plugin_distribution: str = ""
    #: Where it runs: ``"in-process"`` for this Python environment.
    location: str = "in-process"

    @property
    def id(self) -> str:
        """``platform==version``, the form ``load_neuropod(backend=...)`` accepts."""
        return f"{self.platform}=={self.version}"

    def with_origin(self, plugin: str, plugin_distribution: str) -> Backend:
        return replace(self, plugin=plugin, plugin_distribution=plugin_distribution)


@dataclass(frozen=True)
class DeviceCaps:
    """What a backend build can run on."""

    #: Runs on the CPU.
    cpu: bool = True
    #: The CUDA version the build targets (``"12.4"``), or None when it cannot use a GPU.
    cuda: str | None = None
    #: Compute capabilities it has kernels for (``("8.0", "9.0")``); empty means
    #: every GPU its CUDA version supports.
    compute_capabilities: tuple[str, ...] = field(default=())
    #: Anything the user should know, shown by ``neuropod backends``.
    note: str = ""

    @property
    def gpu(self) -> bool:
        return self.cuda is not None

    def describe(self) -> str:
        parts = []
        if self.cpu:
            parts.append("cpu")
        if self.cuda is not None:
            cc = f", cc {'/'.join(self.compute_capabilities)}" if self.compute_capabilities else ""
            parts.append(f"cuda {self.cuda}{cc}")
        text = " + ".join(parts) or "no device"
        return f"{text} ({self.note})" if self.note else text


_DIST_INFO = re.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)\.dist-info")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _dist_infos(directory: str) -> dict[str, str]:
    """Normalized distribution name -> version, from the ``.dist-info`` folder names in one directory."""
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return {}
    found: dict[str, str] = {}
    for entry in entries:
        m = _DIST_INFO.fullmatch(entry)
        if m:
            found.setdefault(_normalize(m["name"]), m["version"])
    return found


def installed_distribution(*names: str) -> tuple[str, str] | None:
    """The first of ``names`` that is installed, as ``(name, version)``, or None.

    For plugins' ``supported_versions``: it reads the ``{name}-{version}.dist-info``
    folder names that installers write (PEP 427/376), so listing backends
    needs neither the framework nor a metadata parse; a distribution found
    no other way (an egg, a zip) falls back to importlib-metadata.
    Directories are searched in ``sys.path`` order, as imports are.
    """
    wanted = [_normalize(n) for n in names]
    listings = [_dist_infos(d) for d in sys.path if isinstance(d, str)]
    for name, norm in zip(names, wanted):
        for found in listings:
            if norm in found:
                return name, found[norm]
    import importlib_metadata

    for name in names:
        try:
            return name, importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return None


__all__ = ["Backend", "DeviceCaps", "installed_distribution"]
