"""What a backend plugin tells the core about itself.

These small value types cross the hook contract (see :mod:`neuropod.hookspecs`).
They hold no framework objects, so building them never imports a framework.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from neuropod.errors import InProcessConflictError, PackageError


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
    #: The CUDA version the build targets (``"12.4"``, or a major version ``"13"``), or None when
    #: it cannot use a GPU; ``"any"`` for a backend that brings no CUDA of its own (the python
    #: backend: the model's code does); ``"unknown"`` for a GPU build whose CUDA version its
    #: metadata does not say (resolution then does not check the driver against it).
    cuda: str | None = None
    #: Compute capabilities it has kernels for (``("8.0", "9.0")``); empty means
    #: every GPU its CUDA version supports.
    compute_capabilities: tuple[str, ...] = field(default=())
    #: Anything the user should know, shown by ``neuropod backends``.
    note: str = ""
    #: Something wrong with the installation that the user should fix (two builds of
    #: the framework installed over one module, say); ``neuropod backends`` prints it as a warning.
    warning: str = ""
    #: ``infer`` takes inputs that live on the model's GPU (torch CUDA tensors, objects with
    #: ``__dlpack__`` or ``__cuda_array_interface__``) and honours ``output_device``.
    device_tensors: bool = False

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


#: A ``.dist-info`` folder name: the distribution (as written in the folder name) and its version.
DIST_INFO = re.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)\.dist-info")


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
        m = DIST_INFO.fullmatch(entry)
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


def installed_distributions(*names: str) -> list[tuple[str, str]]:
    """Every one of ``names`` that is installed, as ``(name, version)``, in the order given.

    Several distributions can provide one module (``onnxruntime`` and
    ``onnxruntime-gpu``, ``tensorflow`` and ``tensorflow-cpu``); with two of
    them installed, whichever pip installed last owns the module's files.
    """
    return [found for name in names if (found := installed_distribution(name)) is not None]


def shared_module_warning(found: Sequence[tuple[str, str]], module: str) -> str:
    """The warning for two or more installed distributions that provide one module, or ``""``."""
    if len(found) < 2:
        return ""
    listed = ", ".join(f"{name} {version}" for name, version in found)
    return (
        f"{listed} are installed together and provide the same '{module}' module: whichever pip installed last "
        f"owns its files, so the build that runs may not be the one reported. Keep one "
        f"(pip uninstall {' '.join(name for name, _ in found)}, then install the one you want)"
    )


_CUDA_RUNTIME = re.compile(r"nvidia[-_.]cuda[-_.]runtime(?:[-_.]cu(?P<suffix>[0-9]{2,3}))?", re.IGNORECASE)


def cuda_from_requirements(distribution: str) -> str | None:
    """The CUDA major version a distribution's own metadata asks for, or None when it names none.

    GPU builds on PyPI (``onnxruntime-gpu``, ``tensorflow[and-cuda]``) declare
    the CUDA runtime they link against in an extra: ``nvidia-cuda-runtime~=13.0;
    extra == "cuda"`` or ``nvidia-cuda-runtime-cu12~=12.0``. The ``-cuNN`` suffix,
    else the specifier's first version, gives the major version. Reading it
    parses the installed METADATA; nothing is imported.
    """
    import importlib_metadata
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requires = importlib_metadata.distribution(distribution).requires or []
    except importlib_metadata.PackageNotFoundError:
        return None
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        m = _CUDA_RUNTIME.fullmatch(req.name)
        if m is None:
            continue
        if m["suffix"]:
            return m["suffix"]
        for spec in req.specifier:
            major = re.match(r"[0-9]+", spec.version)
            if major:
                return major.group(0)
    return None


_libraries_lock = threading.Lock()
_loaded_libraries: dict[tuple[str, str], str] = {}


def load_libraries_once(
    paths: Iterable[Path],
    load: Callable[[str], object],
    framework: str,
    where: str,
    *,
    clash: Callable[[Path], str | None] | None = None,
) -> None:
    """Load custom-op libraries into a framework once per process per file content.

    For backends' ``load_model``. Frameworks abort or fail when one op is
    registered twice (torch aborts the interpreter), so a library is loaded
    only when nothing with its content is in the process yet:

    * one loaded here before (the same library shipped in several packages,
      or one package extracted twice) is skipped;
    * one whose content is already mapped into the process (the caller
      loaded it to build the model, then packaged it; see :func:`mapped_copy`)
      is skipped too: its ops are registered already;
    * for the others, ``clash`` (when given) is asked first, for every
      library before any is loaded, whether loading it here would register
      ops this process already has from another file; if it says why, an
      :class:`~neuropod.errors.InProcessConflictError` is raised and
      ``load_neuropod`` runs the model in a worker process instead.

    :param load: the framework's loader, e.g. ``torch.ops.load_library``.
    :param framework: names the framework in errors and keys the record
        (``"torch 2.13.0"``).
    :param clash: the framework's check, given a library's path: why it
        cannot be loaded into this process, or None.
    :raises PackageError: a listed library is missing or fails to load.
    :raises InProcessConflictError: ``clash`` found a library that cannot be loaded here.
    """
    # lazy: numpy (the cache reads JSON through neuropod._json), kept out of plugin discovery and `neuropod backends`
    from neuropod import cache

    kind = framework.split()[0]
    todo: list[tuple[Path, tuple[str, str]]] = []
    for path in paths:
        if not path.is_file():
            raise PackageError(f"{where}: custom op library {path} is listed in config.json but missing")
        digest = cache.sha256_file(path)
        key = (kind, digest)
        with _libraries_lock:
            if key in _loaded_libraries:
                continue
        mapped = mapped_copy(digest, path.stat().st_size)
        if mapped is not None:
            with _libraries_lock:
                _loaded_libraries.setdefault(key, str(mapped))
            continue
        todo.append((path, key))
    if clash is not None:
        for path, _ in todo:
            reason = clash(path)
            if reason:
                raise InProcessConflictError(
                    f"{where}: custom op library {path.name} cannot be loaded into this process: {reason}"
                )
    for path, key in todo:
        with _libraries_lock:
            if key in _loaded_libraries:
                continue
            try:
                load(str(path))
            except Exception as e:
                raise PackageError(f"{where}: custom op library {path.name} failed to load in {framework}: {e}") from e
            _loaded_libraries[key] = str(path)


# (st_dev, st_ino, st_size, st_mtime_ns) -> sha256, for files mapped into this process.
_mapped_hashes: dict[tuple[int, int, int, int], str] = {}


def mapped_copy(digest: str, size: int) -> Path | None:
    """A shared object mapped into this process whose content has this sha256, or None.

    Reads ``/proc/self/maps`` (Linux; elsewhere there is nothing to read and
    the answer is None). Only files of exactly ``size`` bytes are hashed, and
    each once per (device, inode, size, mtime), so asking costs a read of the
    map and a few ``stat`` calls.
    """
    # lazy: numpy (the cache reads JSON through neuropod._json), kept out of plugin discovery and `neuropod backends`
    from neuropod import cache

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    seen: set[str] = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/") or fields[5].endswith(" (deleted)"):
            continue
        name = fields[5]
        if name in seen:
            continue
        seen.add(name)
        try:
            st = os.stat(name)
        except OSError:
            continue
        if st.st_size != size:
            continue
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        known = _mapped_hashes.get(ident)
        if known is None:
            try:
                known = _mapped_hashes[ident] = cache.sha256_file(Path(name))
            except PackageError:
                continue
        if known == digest:
            return Path(name)
    return None


def cached_probe(kind: str, key: str, compute: Callable[[], Any], valid: Callable[[Any], bool] | None = None) -> Any:
    """``compute()``, remembered on disk under the cache directory by ``kind`` and ``key``.

    For facts about a file that are slow to learn and never change for its
    content, such as the op names a custom-op library registers (learnt by
    loading it in a subprocess): ``key`` must identify the content and the
    framework version (e.g. ``"<sha256>-torch-2.13.0"``). The value must be
    JSON. A cache that cannot be written only costs the next caller a compute.

    :param valid: whether a value read from the cache has the answer's shape;
        an entry that does not (someone else wrote or damaged it) is computed
        again and replaced.
    """
    import json

    # lazy: numpy (the cache reads JSON through neuropod._json), kept out of plugin discovery and `neuropod backends`
    from neuropod import cache

    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", f"{kind}-{key}")
    path = cache.cache_dir() / "probes" / f"{safe}.json"
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
        if valid is None or valid(found):
            return found
    except (OSError, ValueError):
        pass
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(value), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
    return value


__all__ = [
    "Backend",
    "DeviceCaps",
    "backend_record",
    "cached_probe",
    "cuda_from_requirements",
    "installed_distribution",
    "installed_distributions",
    "load_libraries_once",
    "mapped_copy",
    "shared_module_warning",
]
