"""The models a server serves, by name and version, and the repository they come from.

The repository is the PATHs ``neuropod serve`` was given (folders, packages, URLs of object
store prefixes; see :mod:`~neuropod_serving.server.served_versions` for what they may hold). Each
model's versions that the version policy serves are loaded at start; the engine loads and
unloads them later (repository requests, polls) through :meth:`ModelRegistry.scan`,
:meth:`ModelRegistry.plan`, :meth:`ModelRegistry.open`, :meth:`ModelRegistry.put` and
:meth:`ModelRegistry.remove`.

Pure Python: importing this module imports no server library, so the CLI can
load (and report on) models before it imports Starlette and uvicorn.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuropod import load_neuropod
from neuropod.errors import NeuropodError, PackageError
from neuropod.model import NeuropodModel
from neuropod.package import read_package
from neuropod.pipespec import PIPELINE_PLATFORM
from neuropod.spec import TensorSpec
from neuropod.storage import as_downloaded, is_package_url
from neuropod_serving.errors import ModelBusyError, UnknownModelError
from neuropod_serving.protocol import model_metadata
from neuropod_serving.server.ensemble_config import ENSEMBLE, EnsembleConfig
from neuropod_serving.server.served_versions import Found, RemoteRepository, VersionPolicy, is_package, scan_local

#: The one version every served model has: a package carries no version of
#: its own, and OIP clients that name a version expect one to exist.
MODEL_VERSION = "1"

_CONFIG = "config.json"


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
    #: A stateful model's state and controls as a load's config declared them (Triton's
    #: ``sequence_batching`` ``state`` and ``control_input``), as JSON for ``load_neuropod``'s
    #: ``sequences``; None: the package's own declaration.
    sequences: str | None = None
    #: Microseconds a sequence may sit idle before its state is freed; None: the server's
    #: ``--max-sequence-idle-us`` (Triton's ``max_sequence_idle_microseconds``).
    max_sequence_idle_us: int | None = None
    #: How many sequences of the model may be live at once; None: the server's option.
    max_sequences: int | None = None

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
    #: Its version: its folder's number in a repository of Triton's layout, else 1.
    version: str = MODEL_VERSION
    #: The name it is served under when not its package's (its model folder's, in Triton's layout).
    alias: str | None = None
    #: Where it was loaded from, as messages show it (a local path, or a URL); "" for ``path``.
    where: str = ""
    #: What its files were when it was loaded (see :class:`~neuropod_serving.server.served_versions.Found`).
    stamp: str = ""
    #: The Triton ensemble configuration it was made from (a pipeline of served models, not a package).
    ensemble: EnsembleConfig | None = None
    #: The body of ``GET /v2/models/{name}``, built once.
    metadata: dict[str, Any] = field(init=False)
    #: The model's name, and its input spec by name (what every request is decoded against).
    name: str = field(init=False)
    input_specs: dict[str, TensorSpec] = field(init=False)
    #: Whether the model is stateful: each request must name a sequence (Triton's sequence extension).
    stateful: bool = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.alias or self.model.name
        # A pipeline is what Triton calls an ensemble (its clients know that platform).
        platform = ENSEMBLE if self.model.platform == PIPELINE_PLATFORM else self.model.platform
        self.metadata = model_metadata(
            self.name, self.model.inputs, self.model.outputs, platform=platform, versions=[self.version]
        )
        if not self.where:
            self.where = str(self.path)
        # Which backend and device run it, for remote clients (`neuropod explain URL`).
        # MLServer's metadata has model-level parameters too; other clients ignore them.
        self.metadata["parameters"] = {"neuropod_backend": self.model.backend.id, "neuropod_device": self.model.device}
        if getattr(getattr(self.model, "package", None), "original_format", False):
            # A package the original Neuropod wrote: its spec symbols hold within the inputs and
            # within the outputs separately, and a remote client must check its answers that way.
            self.metadata["parameters"]["neuropod_symbols"] = "separate"
        if getattr(self.model, "decoupled", False):
            # Any number of responses a request: a remote client runs it with infer_stream.
            self.metadata["parameters"]["neuropod_decoupled"] = True
        self.stateful = bool(getattr(self.model, "stateful", False))
        if self.stateful:
            # Each request is a step of a sequence (request parameter sequence_id): a remote client
            # runs it with model.sequence() or infer(..., sequence_id=...).
            self.metadata["parameters"]["neuropod_stateful"] = True
        self.input_specs = {s.name: s for s in self.model.inputs}


def find_packages(path: str | os.PathLike[str]) -> list[Path]:
    """The packages a command-line PATH names: itself when it is a package, else the
    packages directly inside it (sorted, so start-up order does not depend on the file system).
    Versions of models in Triton's layout are not among them (see :func:`.versions.scan_local`).

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
    """One version of a model of the repository (the PATHs given at start), loaded or not."""

    name: str
    path: Path | None
    #: "READY" (loaded) or "UNAVAILABLE" (found, not loaded: see ``reason``),
    #: states of the repository extension.
    state: str
    #: Why it is not loaded; for a READY model, why its last reload failed (it serves what was loaded before).
    reason: str = ""
    #: False when the package could not even be read (its name is then the file's).
    readable: bool = True
    version: str = MODEL_VERSION
    #: Where it is, as messages show it (a local path or a URL).
    where: str = ""

    def to_json(self) -> dict[str, Any]:
        # "reason" on every entry, "" when there is none: MLServer's types (and KServe's) require it.
        return {"name": self.name, "version": self.version, "state": self.state, "reason": self.reason}


@dataclass
class Catalog:
    """One scan of the repository: every version of every model found, by model name."""

    #: Model name -> version -> what was found for it (several: packages that conflict).
    models: dict[str, dict[str, list[Found]]] = field(default_factory=dict)
    #: Packages standing alone whose name could not be read: (shown name, what was found, why).
    unreadable: list[tuple[str, Found, str]] = field(default_factory=list)
    #: Why repository PATHs could not be scanned (each names its PATH).
    errors: list[str] = field(default_factory=list)

    def add(self, name: str, found: Found) -> None:
        self.models.setdefault(name, {}).setdefault(found.version, []).append(found)


def _by_version(version: str) -> int:
    return int(version) if version.isdigit() else -1


class ModelRegistry:
    """The served models by name and version, and the repository (PATHs) they were found in.

    Lookups take no lock (a dict read is atomic); loading and unloading are
    serialized by the :class:`~neuropod_serving.server.engine.Engine` that owns it.

    :param paths: the repository: local paths and package URLs (``s3://bucket/models/``).
    :param policy: which versions of a model are served (default: the latest).
    :param storage_options: the filesystem options of URL paths (None: their credential chains).
    """

    def __init__(
        self,
        models: Iterable[ServedModel] = (),
        *,
        paths: Iterable[str | os.PathLike[str]] = (),
        loader: Callable[..., NeuropodModel] | None = None,
        load_options: dict[str, Any] | None = None,
        policy: VersionPolicy | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._models: dict[str, dict[str, ServedModel]] = {}
        #: The latest loaded version of each model (what a request naming no version gets): kept
        #: by every change, so that a request's lookup is one dict read while a poll changes them.
        self._latest: dict[str, ServedModel] = {}
        #: Why the last load of a version failed, and the stamp of the files that failed, by
        #: (name, version), until it loads or is unloaded.
        self._failures: dict[tuple[str, str], tuple[str, str]] = {}
        self._sources: list[Path | RemoteRepository] = [
            RemoteRepository(p, storage_options) if isinstance(p, str) and is_package_url(p) else Path(p) for p in paths
        ]
        #: The repository PATHs as messages show them.
        self.paths = [s.where if isinstance(s, RemoteRepository) else str(s) for s in self._sources]
        self.policy = policy if policy is not None else VersionPolicy()
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
        policy: VersionPolicy | None = None,
        storage_options: Mapping[str, Any] | None = None,
        **load_options: Any,
    ) -> ModelRegistry:
        """Find every package under ``paths`` and load the versions ``policy`` serves.

        :param workers: above 1, each model runs in that many out-of-process
            workers (``use_ope=True``), so CPU-bound models are not held to one GIL.
        :param loader: ``neuropod.load_neuropod`` unless given (tests).
        :raises PackageError: two packages share a name and version, a PATH holds none, or a
            package cannot be read or loaded. Models already loaded are closed before it is raised.
        """
        if workers > 1:
            load_options = {**load_options, "use_ope": True, "workers": workers}
        registry = cls(paths=paths, loader=loader, load_options=load_options, policy=policy,
                       storage_options=storage_options)  # fmt: skip
        try:
            catalog = registry.scan(strict=True)
            for _, found, reason in catalog.unreadable:
                raise PackageError(f"{found.where}: {reason}")
            for name in sorted(catalog.models):
                for found in registry.plan(name, catalog).values():
                    if found.problem or found.path is None:
                        raise PackageError(found.problem)
                    registry.put(registry.open(found, name, registry.load_options))
        except BaseException:
            registry.close()
            raise
        return registry

    # -- the repository ------------------------------------------------------------

    def scan(self, *, strict: bool = False, listing: bool = True) -> Catalog:
        """What the repository PATHs hold now.

        :param strict: raise when a PATH holds nothing or cannot be listed; else a PATH that cannot
            be listed is skipped (its error in :attr:`Catalog.errors`) and a folder that holds
            nothing holds no model.
        :param listing: list URL PATHs again (downloading changed packages); False: take what
            their last listing found.
        :raises PackageError: with ``strict``, as :func:`.versions.scan_local` and
            :meth:`.versions.RemoteRepository.scan` do.
        """
        found: list[Found] = []
        errors: list[str] = []
        for source in self._sources:
            try:
                if isinstance(source, RemoteRepository):
                    found += source.scan() if listing else source.last
                else:  # a folder that is there and holds nothing is an empty repository (not strict)
                    found += scan_local(source, empty_ok=not strict)
            except NeuropodError as e:
                if strict:
                    raise
                errors.append(str(e))
        loaded = {(s.where, s.stamp): s for s in self}
        catalog = Catalog(errors=errors)
        for f in found:
            if f.folder is not None:
                catalog.add(f.folder, f)
                continue
            if f.path is None:
                catalog.unreadable.append((Path(f.where.rstrip("/")).name, f, f.problem))
                continue
            served = loaded.get((f.where, f.stamp))
            if served is not None:
                catalog.add(served.name, f)
                continue
            try:
                name = read_package(f.path, verify=False).name
            except NeuropodError as e:
                catalog.unreadable.append((Path(f.where.rstrip("/")).name, f, f"cannot read the package: {e}"))
                continue
            catalog.add(name, f)
        return catalog

    def plan(self, name: str, catalog: Catalog) -> dict[str, Found]:
        """The versions of model ``name`` the version policy serves, by version.

        :raises UnknownModelError: the repository has no model of that name.
        :raises PackageError: several packages are that name's version (every one of them is).
        """
        versions = catalog.models.get(name)
        if not versions:
            broken = [reason for shown, _, reason in catalog.unreadable if shown == name]
            if broken:
                raise PackageError(broken[0])
            where = ", ".join(self.paths) or "(no repository paths)"
            raise UnknownModelError(f"no package named {name!r} under the repository paths: {where}")
        chosen = self.policy.select(versions)
        plan: dict[str, Found] = {}
        for version in chosen:
            founds = versions[version]
            if len(founds) > 1:
                count = "two packages are both" if len(founds) == 2 else f"{len(founds)} packages are all"
                raise PackageError(
                    f"{count} named {name!r}{_of_version(version)}: {' and '.join(sorted(f.where for f in founds))}; "
                    "a server answers to one model per name and version, so serve only one of them "
                    "(or rename one when packaging it)"
                )
            plan[version] = founds[0]
        if not plan:
            present = ", ".join(sorted(versions, key=_by_version))
            raise PackageError(f"model {name!r} has no version that the version policy {self.policy} serves "
                               f"(its versions: {present})")  # fmt: skip
        return plan

    def index(self, catalog: Catalog | None = None) -> list[RepositoryEntry]:
        """Every version of every model under the repository PATHs (local ones rescanned, URL ones
        as last listed), and every loaded model."""
        if catalog is None:
            catalog = self.scan(listing=False)
        entries: list[RepositoryEntry] = []
        listed: set[tuple[str, str]] = set()
        for shown, f, reason in catalog.unreadable:
            entries.append(RepositoryEntry(shown, f.path, "UNAVAILABLE", reason, False, f.version, f.where))
        for name, versions in catalog.models.items():
            for version, founds in versions.items():
                served = self._models.get(name, {}).get(version)
                failure = self._failures.get((name, version), ("", ""))[0]
                for f in founds:
                    if served is not None and served.where == f.where:
                        entries.append(RepositoryEntry(name, f.path, "READY", failure, True, version, f.where))
                        listed.add((name, version))
                    elif f.problem:
                        entries.append(RepositoryEntry(name, f.path, "UNAVAILABLE", f.problem, True, version, f.where))
                    elif served is not None:
                        reason = f"another package named {name!r}{_of_version(version)} is loaded ({served.where})"
                        entries.append(RepositoryEntry(name, f.path, "UNAVAILABLE", reason, True, version, f.where))
                    else:
                        reason = failure or self._not_served(versions, version)
                        entries.append(RepositoryEntry(name, f.path, "UNAVAILABLE", reason, True, version, f.where))
        for s in self:
            if (s.name, s.version) not in listed:
                failure = self._failures.get((s.name, s.version), ("", ""))[0]
                entries.append(RepositoryEntry(s.name, s.path, "READY", failure, True, s.version, s.where))
        return sorted(entries, key=lambda e: (e.name, _by_version(e.version), e.where))

    def _not_served(self, versions: Mapping[str, object], version: str) -> str:
        if version in self.policy.select(versions):
            return "not loaded"
        return f"not loaded: the version policy ({self.policy}) serves other versions"

    def package_path(self, name: str) -> Path:
        """The package of the latest version of ``name`` the version policy serves.

        :raises UnknownModelError: none is named so.
        :raises PackageError: several are, or the only ones cannot be read.
        """
        plan = self.plan(name, self.scan())
        found = plan[max(plan, key=_by_version)]
        if found.problem or found.path is None:
            raise PackageError(found.problem)
        return found.path

    # -- loading ---------------------------------------------------------------------

    def options_for(self, settings: ModelSettings) -> dict[str, Any]:
        """The load options of a model served with ``settings``: their OPE workers (1: in
        process) and device, the rest as the server's."""
        options = {k: v for k, v in self.load_options.items() if k not in ("use_ope", "workers")}
        if settings.workers > 1:
            options.update(use_ope=True, workers=settings.workers)
        if settings.device is not None:
            options["device"] = settings.device
        if settings.sequences is not None:
            # A load's config declared the model's state and controls (sequence_batching).
            options["sequences"] = settings.sequences
        return options

    def open(self, found: Found, name: str, options: dict[str, Any]) -> ServedModel:
        """Load version ``found`` of model ``name`` with ``options`` without serving it yet.

        :raises PackageError: it fails to load, or its package is named otherwise (a package
            standing alone: its name is the model's).
        """
        if found.problem or found.path is None:
            raise PackageError(found.problem)
        loader = self._loader
        if loader is None:
            loader = load_neuropod
        try:
            model = loader(found.path, **options)
        except PackageError as e:
            if found.where != str(found.path):
                raise as_downloaded(e, found.path, found.where) from None
            raise
        try:
            alias = found.folder if found.folder is not None and found.folder != model.name else None
            served = ServedModel(model, found.path, version=found.version, alias=alias, where=found.where,
                                 stamp=found.stamp)  # fmt: skip
            if served.name != name:
                raise PackageError(f"the package at {found.where} is now named {served.name!r}, not {name!r}")
            return served
        except BaseException:
            model.close()
            raise

    def failed(self, name: str, version: str, reason: str, stamp: str) -> None:
        """Keep why version ``version`` of ``name`` failed to load (with the stamp of its files)."""
        self._failures[(name, version)] = (reason, stamp)

    def failure(self, name: str, version: str) -> tuple[str, str] | None:
        """Why the last load of that version failed, and the stamp of its files then; None: it did not."""
        return self._failures.get((name, version))

    def put(self, served: ServedModel) -> ServedModel | None:
        """Serve ``served`` as its version of its model, in place of the one loaded before (returned,
        for the caller to close once nothing runs on it)."""
        versions = self._models.setdefault(served.name, {})
        old = versions.get(served.version)
        versions[served.version] = served
        self._failures.pop((served.name, served.version), None)
        self._update_versions(served.name)
        return old

    def remove(self, name: str, version: str) -> ServedModel:
        """Stop serving that version (the caller closes it). :raises KeyError: it is not loaded."""
        versions = self._models[name]
        served = versions.pop(version)
        self._failures.pop((name, version), None)
        if not versions:
            del self._models[name]
        self._update_versions(name)
        return served

    def _update_versions(self, name: str) -> None:
        """The ``versions`` of every loaded version's metadata: all those loaded."""
        versions = self._models.get(name, {})
        loaded = sorted(versions, key=_by_version)
        for served in versions.values():
            served.metadata = {**served.metadata, "versions": loaded}
        if loaded:
            self._latest[name] = versions[loaded[-1]]
        else:
            self._latest.pop(name, None)

    def versions(self, name: str) -> list[str]:
        """The loaded versions of ``name``, lowest first (none: not loaded)."""
        return sorted(self._models.get(name, {}), key=_by_version)

    def loaded(self, name: str, version: str) -> ServedModel | None:
        """That version of ``name`` if it is loaded, else None."""
        return self._models.get(name, {}).get(version)

    def latest(self, name: str) -> ServedModel | None:
        """The latest loaded version of ``name``; None: none is."""
        return self._latest.get(name)

    def names(self) -> list[str]:
        """The names of the loaded models."""
        return list(self._models)

    def add(self, served: ServedModel) -> None:
        """Serve one more model. :raises PackageError: its name and version are taken."""
        other = self._models.get(served.name, {}).get(served.version)
        if other is not None:
            raise PackageError(
                f"two packages are both named {served.name!r}{_of_version(served.version)}: {other.where} and "
                f"{served.where}; a server answers to one model per name and version, so serve only one of them "
                "(or rename one when packaging it)"
            )
        self.put(served)

    def get(self, name: str, version: str | None = None) -> ServedModel:
        """Version ``version`` of ``name``; None: its latest loaded version.

        :raises UnknownModelError: no such model, or it has no such version loaded.
        """
        if not version:
            latest = self._latest.get(name)
            if latest is not None:
                return latest
        versions = self._models.get(name)
        if versions is None or not version:
            known = ", ".join(sorted(self._models)) or "(none)"
            # Triton's words first: Triton's clients and examples look for them.
            raise UnknownModelError(f"Request for unknown model: {name!r} is not found; loaded models: {known}")
        served = versions.get(version)
        if served is None:
            loaded = ", ".join(repr(v) for v in sorted(list(versions), key=_by_version))
            has = f"only version {loaded}" if len(versions) == 1 else f"versions {loaded}"
            raise UnknownModelError(
                f"Request for unknown model: {name!r} version {version!r} is not found; model {name!r} has {has} loaded"
            )
        return served

    def step_statistics(self) -> dict[str, dict[str, dict[str, int]]]:
        """Each pipeline's steps' counts (``count``, ``failures``, ``ns``: its ``step_statistics()``),
        by model name (every loaded version of it together)."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for served in self:
            read = getattr(served.model, "step_statistics", None)
            if read is None:
                continue
            steps = out.setdefault(served.name, {})
            for step, counts in read().items():
                mine = steps.setdefault(step, {"count": 0, "failures": 0, "ns": 0})
                for key in mine:
                    mine[key] += int(counts.get(key, 0))
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __iter__(self) -> Iterator[ServedModel]:
        """Every loaded version of every model."""
        return iter([s for versions in list(self._models.values()) for s in list(versions.values())])

    def __len__(self) -> int:
        return sum(len(v) for v in list(self._models.values()))

    def close(self) -> None:
        """Close every model (frees framework resources and stops OPE workers)."""
        for served in list(self):
            served.model.close()
        self._models.clear()
        self._latest.clear()


def _of_version(version: str) -> str:
    """The words " version N" for a version other than 1 (the only one of a package standing alone)."""
    return "" if version == MODEL_VERSION else f" version {version}"


__all__ = ["MODEL_VERSION", "Catalog", "ModelBusyError", "ModelRegistry", "ModelSettings", "RepositoryEntry",
           "ServedModel", "UnknownModelError", "find_packages", "is_package"]  # fmt: skip
