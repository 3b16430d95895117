"""What a backend plugin tells the core about itself.

These small value types cross the hook contract (see :mod:`neuropod.hookspecs`).
They hold no framework objects, so building them never imports a framework.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


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


def backend_record(backend: Backend, caps: DeviceCaps) -> dict[str, Any]:
    """A backend and what it runs on as one JSON object: ``neuropod backends --json`` and environments' records."""
    return {
        "platform": backend.platform,
        "version": backend.version,
        "framework": backend.framework,
        "plugin": backend.plugin,
        "plugin_distribution": backend.plugin_distribution,
        "location": backend.location,
        "cpu": caps.cpu,
        "cuda": caps.cuda,
        "compute_capabilities": list(caps.compute_capabilities),
    }


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


_libraries_lock = threading.Lock()
_loaded_libraries: dict[tuple[str, str], str] = {}


def load_libraries_once(
    paths: Iterable[Path], load: Callable[[str], object], framework: str, where: str
) -> None:
    """Load custom-op libraries into a framework once per process per file content.

    For backends' ``load_model``: the same library shipped in several
    packages (or one package extracted twice) is loaded once, since
    frameworks refuse to register an op a second time.

    :param load: the framework's loader, e.g. ``torch.ops.load_library``.
    :param framework: names the framework in errors and keys the record
        (``"torch 2.13.0"``).
    :raises PackageError: a listed library is missing or fails to load.
    """
    from neuropod.errors import PackageError

    for path in paths:
        if not path.is_file():
            raise PackageError(f"{where}: custom op library {path} is listed in config.json but missing")
        key = (framework.split()[0], hashlib.sha256(path.read_bytes()).hexdigest())
        with _libraries_lock:
            if key in _loaded_libraries:
                continue
            try:
                load(str(path))
            except Exception as e:
                raise PackageError(f"{where}: custom op library {path.name} failed to load in {framework}: {e}") from e
            _loaded_libraries[key] = str(path)


__all__ = ["Backend", "DeviceCaps", "backend_record", "installed_distribution", "load_libraries_once"]
