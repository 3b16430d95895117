"""The models a server serves: found on disk, loaded once at start, named by package name.

Pure Python: importing this module imports no server library, so the CLI can
load (and report on) models before it imports Starlette and uvicorn.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuropod.errors import NeuropodError, PackageError
from neuropod.model import NeuropodModel
from neuropod.spec import TensorSpec
from neuropod_serving.protocol import model_metadata

#: The one version every served model has: a package carries no version of
#: its own, and OIP clients that name a version expect one to exist.
MODEL_VERSION = "1"

_CONFIG = "config.json"


class UnknownModelError(NeuropodError):
    """A request named a model (or version) the server does not serve; HTTP 404."""


class ModelBusyError(NeuropodError):
    """A model's queue is full: the request is refused at once (HTTP 429, gRPC RESOURCE_EXHAUSTED)
    rather than left to time out; the client may retry later."""


@dataclass(frozen=True)
class ModelSettings:
    """How one model is served: its batching and its OPE workers.

    Every model has one, kept on its :class:`ServedModel`: the server's options
    (``--max-batch-size``, ``--max-queue-delay-us``, ``--workers``) unless the
    repository load that loaded it carried a ``config`` that set some of them
    (:mod:`neuropod_serving.server.config_override`). Read by the engine when it
    starts the model, and by anything that reports how a model is served.
    """

    #: Rows of one batched run; 1: requests are not batched (Triton's ``max_batch_size`` 0 or 1).
    max_batch_size: int = 1
    #: How long the oldest waiting request waits for more to join its batch, in microseconds.
    max_queue_delay_us: int = 0
    #: Batch sizes run as soon as that many rows wait, without waiting out the delay.
    preferred_batch_sizes: tuple[int, ...] = ()
    #: OPE worker processes running the model; 1: in the server's process.
    workers: int = 1
    #: The device it is loaded onto ("cpu", "cuda:N"); None: neuropod's choice (or the server's).
    device: str | None = None
    #: The fields of a load's ``config`` that set these, sorted ("()": the server's options).
    overridden: tuple[str, ...] = ()
    #: (input name, Triton's ``ModelInput.Format``) a load's config declared: the layout of an
    #: image input, which a package does not say; reported in the model configuration only.
    input_formats: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, not {self.max_batch_size}")
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us must be 0 or more, not {self.max_queue_delay_us}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")


@dataclass
class ServedModel:
    """One loaded model and what the server answers about it without running it."""

    model: NeuropodModel
    path: Path
    #: How it is served; None until the engine starts it with the server's options.
    settings: ModelSettings | None = None
    #: The body of ``GET /v2/models/{name}``, built once.
    metadata: dict[str, Any] = field(init=False)
    #: The model's name, and its input spec by name (what every request is decoded against).
    name: str = field(init=False)
    input_specs: dict[str, TensorSpec] = field(init=False)

    def __post_init__(self) -> None:
        self.metadata = model_metadata(
            self.model.name, self.model.inputs, self.model.outputs, platform=self.model.platform, versions=[MODEL_VERSION]
        )
        # Which backend and device run it, for remote clients (`neuropod explain URL`).
        # MLServer's metadata has model-level parameters too; other clients ignore them.
        self.metadata["parameters"] = {"neuropod_backend": self.model.backend.id, "neuropod_device": self.model.device}
        if getattr(getattr(self.model, "package", None), "original_format", False):
            # A package the original Neuropod wrote: its spec symbols hold within the inputs and
            # within the outputs separately, and a remote client must check its answers that way.
            self.metadata["parameters"]["neuropod_symbols"] = "separate"
        self.name = self.model.name
        self.input_specs = {s.name: s for s in self.model.inputs}


def is_package(path: Path) -> bool:
    """Whether ``path`` is a package: a directory with a config.json, or a zip with one at
    its top level (or under its single top-level folder, as some tools zip it)."""
    if path.is_dir():
        return (path / _CONFIG).is_file()
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (OSError, zipfile.BadZipFile):
        return False
    if _CONFIG in names:
        return True
    tops = {n.split("/", 1)[0] for n in names}
    return len(tops) == 1 and f"{tops.pop()}/{_CONFIG}" in names


def find_packages(path: str | os.PathLike[str]) -> list[Path]:
    """The packages a command-line PATH names: itself when it is a package, else the
    packages directly inside it (sorted, so start-up order does not depend on the file system).

    :raises PackageError: PATH does not exist, or is neither a package nor a folder holding one.
    """
    p = Path(path)
    if not p.exists():
        raise PackageError(f"{p}: no such file or directory")
    if is_package(p):
        return [p]
    if not p.is_dir():
        raise PackageError(f"{p} is not a Neuropod package: it is neither a directory nor a zip with a {_CONFIG}")
    found = sorted(child for child in p.iterdir() if is_package(child))
    if not found:
        raise PackageError(
            f"{p} holds no Neuropod package: no {_CONFIG} in it, nor in any directory or zip directly inside it"
        )
    return found


@dataclass(frozen=True)
class RepositoryEntry:
    """One package of the repository (the PATHs given at start), loaded or not."""

    name: str
    path: Path | None
    #: "READY" (loaded) or "UNAVAILABLE" (found, not loaded: see ``reason``),
    #: states of the repository extension.
    state: str
    #: Why it is not loaded; for a READY model, why its last reload failed (it serves what was loaded before).
    reason: str = ""
    #: False when the package could not even be read (its name is then the file's).
    readable: bool = True

    def to_json(self) -> dict[str, Any]:
        # "reason" on every entry, "" when there is none: MLServer's types (and KServe's) require it.
        return {"name": self.name, "version": MODEL_VERSION, "state": self.state, "reason": self.reason}


class ModelRegistry:
    """The served models by name, and the repository (PATHs) they were found in.

    Lookups take no lock (a dict read is atomic); loading and unloading are
    serialized by the :class:`~neuropod_serving.server.engine.Engine` that owns it.
    """

    def __init__(
        self,
        models: Iterable[ServedModel] = (),
        *,
        paths: Iterable[str | os.PathLike[str]] = (),
        loader: Callable[..., NeuropodModel] | None = None,
        load_options: dict[str, Any] | None = None,
    ) -> None:
        self._models: dict[str, ServedModel] = {}
        #: Why the last load of a model failed, by name, until it loads or is unloaded.
        self._failures: dict[str, str] = {}
        self.paths = [Path(p) for p in paths]
        self._loader = loader
        #: The keyword arguments every model is loaded with (``workers`` among them).
        self.load_options: dict[str, Any] = dict(load_options or {})
        for served in models:
            self.add(served)

    @classmethod
    def load(
        cls,
        paths: Iterable[str | os.PathLike[str]],
        *,
        workers: int = 1,
        loader: Callable[..., NeuropodModel] | None = None,
        **load_options: Any,
    ) -> ModelRegistry:
        """Find and load every package under ``paths``.

        :param workers: above 1, each model runs in that many out-of-process
            workers (``use_ope=True``), so CPU-bound models are not held to one GIL.
        :param loader: ``neuropod.load_neuropod`` unless given (tests).
        :raises PackageError: two packages share a name, or a PATH holds none.
            Models already loaded are closed before it is raised.
        """
        if workers > 1:
            load_options = {**load_options, "use_ope": True, "workers": workers}
        paths = list(paths)
        registry = cls(paths=paths, loader=loader, load_options=load_options)
        try:
            packages = [pkg for path in paths for pkg in find_packages(path)]
            for pkg in packages:
                registry._load_path(pkg)
        except BaseException:
            registry.close()
            raise
        return registry

    def _load_path(self, pkg: Path) -> ServedModel:
        served = self._open(pkg, self.load_options)
        try:
            self.add(served)
        except BaseException:
            served.model.close()
            raise
        return served

    def options_for(self, settings: ModelSettings) -> dict[str, Any]:
        """The load options of a model served with ``settings``: their OPE workers (1: in
        process) and device, the rest as the server's."""
        options = {k: v for k, v in self.load_options.items() if k not in ("use_ope", "workers")}
        if settings.workers > 1:
            options.update(use_ope=True, workers=settings.workers)
        if settings.device is not None:
            options["device"] = settings.device
        return options

    def _open(self, pkg: Path, options: dict[str, Any]) -> ServedModel:
        """Load the package at ``pkg`` with ``options`` without serving it yet."""
        loader = self._loader
        if loader is None:
            from neuropod import load_neuropod

            loader = load_neuropod
        model = loader(pkg, **options)
        try:
            return ServedModel(model, pkg)
        except BaseException:
            model.close()
            raise

    def index(self) -> list[RepositoryEntry]:
        """Every package under the repository PATHs now (rescanned), and every loaded model."""
        from neuropod.package import read_package

        entries: list[RepositoryEntry] = []
        for path in self.paths:
            try:
                found = find_packages(path)
            except PackageError:
                continue  # a PATH removed since start: nothing to list there
            for pkg in found:
                served = next((s for s in self._models.values() if s.path == pkg), None)
                if served is not None:
                    entries.append(RepositoryEntry(served.name, pkg, "READY", self._failures.get(served.name, "")))
                    continue
                try:
                    name = read_package(pkg).name
                except NeuropodError as e:
                    entries.append(RepositoryEntry(pkg.name, pkg, "UNAVAILABLE", f"cannot read the package: {e}", False))
                    continue
                loaded = self._models.get(name)
                if loaded is not None:
                    reason = f"another package named {name!r} is loaded ({loaded.path})"
                else:
                    reason = self._failures.get(name, "not loaded")
                entries.append(RepositoryEntry(name, pkg, "UNAVAILABLE", reason))
        listed = {e.path for e in entries}
        entries += [
            RepositoryEntry(s.name, s.path, "READY", self._failures.get(s.name, ""))
            for s in self._models.values()
            if s.path not in listed
        ]
        return sorted(entries, key=lambda e: (e.name, str(e.path)))

    def load_model(self, name: str, settings: ModelSettings | None = None) -> tuple[ServedModel, ServedModel | None]:
        """Load model ``name`` from the repository, replacing the loaded one of that name (a reload).

        With ``settings`` (a load's config override), the model is loaded with their OPE
        workers and keeps them; without, with the server's options.

        The new model is loaded before the old one is replaced: when the load fails, the
        model loaded before keeps serving (as Triton does), and the failure is kept as the
        ``reason`` of its repository index entry until a load succeeds or it is unloaded.

        :returns: the model now served, and the one it replaced (None on a first load);
            the caller closes the replaced one once nothing runs on it.
        :raises UnknownModelError: no package under the repository PATHs has that name.
        :raises PackageError: several do, or the package fails to load.
        """
        try:
            path = self._package_of(name)
            options = self.load_options if settings is None else self.options_for(settings)
            served = self._open(path, options)
            served.settings = settings
            if served.name != name:
                served.model.close()
                raise PackageError(f"the package at {path} is now named {served.name!r}, not {name!r}")
        except NeuropodError as e:
            if name in self._models or not isinstance(e, UnknownModelError):
                loaded = self._models.get(name)
                kept = f"; still serving the model loaded before from {loaded.path}" if loaded is not None else ""
                self._failures[name] = f"the last load failed: {e}{kept}"
            raise
        old = self._models.get(name)
        self._models[name] = served
        self._failures.pop(name, None)
        return served, old

    def package_path(self, name: str) -> Path:
        """The one package under the repository PATHs named ``name``.

        :raises UnknownModelError: none is.
        :raises PackageError: several are, or the only ones are unreadable.
        """
        return self._package_of(name)

    def _package_of(self, name: str) -> Path:
        """The one package under the repository PATHs named ``name``."""
        candidates = [e for e in self.index() if e.name == name and e.path is not None]
        broken = [e for e in candidates if not e.readable]
        if broken and len(candidates) == len(broken):
            raise PackageError(broken[0].reason)
        candidates = [e for e in candidates if e.readable]
        if not candidates:
            where = ", ".join(str(p) for p in self.paths) or "(no repository paths)"
            raise UnknownModelError(f"no package named {name!r} under the repository paths: {where}")
        paths = {e.path for e in candidates}
        if len(paths) > 1:
            raise PackageError(
                f"several packages are named {name!r}: {', '.join(sorted(map(str, paths)))}; remove or rename all but one"
            )
        path = paths.pop()
        assert path is not None
        return path

    def unload_model(self, name: str) -> None:
        """Stop serving ``name`` and close it. :raises UnknownModelError: it is not loaded."""
        served = self.get(name)
        del self._models[name]
        self._failures.pop(name, None)
        served.model.close()

    def add(self, served: ServedModel) -> None:
        """Serve one more model. :raises PackageError: its name is taken."""
        other = self._models.get(served.name)
        if other is not None:
            raise PackageError(
                f"two packages are both named {served.name!r}: {other.path} and {served.path}; "
                "a server answers to one model per name, so serve only one of them "
                "(or rename one when packaging it)"
            )
        self._models[served.name] = served

    def get(self, name: str, version: str | None = None) -> ServedModel:
        """:raises UnknownModelError: no such model, or it has no such version."""
        served = self._models.get(name)
        if served is None:
            known = ", ".join(sorted(self._models)) or "(none)"
            # Triton's words first: Triton's clients and examples look for them.
            raise UnknownModelError(
                f"Request for unknown model: {name!r} is not found; loaded models: {known}"
            )
        if version is not None and version != MODEL_VERSION:
            raise UnknownModelError(
                f"Request for unknown model: {name!r} version {version!r} is not found; "
                f"model {name!r} has only version {MODEL_VERSION!r}"
            )
        return served

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    def close(self) -> None:
        """Close every model (frees framework resources and stops OPE workers)."""
        for served in list(self._models.values()):
            served.model.close()
        self._models.clear()
