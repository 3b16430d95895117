"""The model repository extension for both protocols: index, load (with a ``config`` override) and unload.

A load whose config is Triton's ensemble configuration, under a name that is no package, makes a
pipeline of served models (:mod:`~neuropod_serving.server.ensembles`).

The REST routes (``POST /v2/repository/...``) and the gRPC RPCs
(``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``)
decode their requests into plain values and call these functions, so the two
answer alike: the same entries, the same checks, the same messages. They
block (a load reads and loads a package): call them from a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from neuropod.errors import NeuropodError
from neuropod.package import read_package
from neuropod_serving.errors import UnknownModelError
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.server.config_override import settings_from_config
from neuropod_serving.server.engine import Engine
from neuropod_serving.server.ensemble_config import EnsembleConfig, is_ensemble, load_config, parse_ensemble
from neuropod_serving.server.ensembles import in_repository, load_ensemble, made_here, users
from neuropod_serving.server.registry import ModelSettings, RepositoryEntry

log = logging.getLogger("neuropod_serving.server")

#: The load parameter holding Triton's model configuration (JSON in a string).
CONFIG_PARAMETER = "config"


class LoadFailed(ProtocolError):
    """A package failed to load (400, gRPC INVALID_ARGUMENT): the message says which
    model, why, and whether the model loaded before keeps serving."""


def index(engine: Engine, ready: bool = False) -> list[RepositoryEntry]:
    """Every package of the repository (rescanned) and every loaded model; with
    ``ready``, only the models ready for inference."""
    entries = engine.registry.index()
    return [e for e in entries if e.state == "READY"] if ready else entries


def load(engine: Engine, name: str, parameters: Mapping[str, object]) -> None:
    """Load (or reload) model ``name``, with the serving settings of a ``config`` parameter
    (:mod:`~neuropod_serving.server.config_override`) when there is one; in every process of
    ``neuropod serve --processes`` (:mod:`~neuropod_serving.processes`).

    :raises UnknownModelError: no package of the repository has that name.
    :raises ProtocolError: a parameter this server does not take, or a config it refuses.
    :raises LoadFailed: the package failed to load (the model loaded before, if any, keeps serving).
    """
    _check_explicit(engine, "load", name)
    if engine.group is not None:
        engine.group.repository("load", name, dict(parameters))
        return
    load_here(engine, name, parameters)


def load_here(engine: Engine, name: str, parameters: Mapping[str, object]) -> None:
    """:func:`load` in this process only."""
    files = sorted(k for k in parameters if k.startswith("file:"))
    if files:
        # Triton loads these instead of the repository's files; ignoring them would serve something else.
        raise ProtocolError(
            f"failed to load model {name!r}: this server loads packages from its repository paths only; "
            f"the {', '.join(files)} parameter(s) of a load request are not supported"
        )
    settings: ModelSettings | None = None
    try:
        ensemble = _ensemble(engine, name, parameters)
        if ensemble is not None:
            try:
                load_ensemble(engine, ensemble)
            except ProtocolError as e:
                kept = "; the model loaded before keeps serving" if name in engine.registry else ""
                raise LoadFailed(f"failed to load model {name!r}: {e}{kept}") from None
            log.info("loaded model %r: an ensemble of %s", name, ", ".join(repr(m) for m in ensemble.models))
            return
        if CONFIG_PARAMETER in parameters:
            package = read_package(engine.registry.package_path(name)).config
            try:
                settings = settings_from_config(parameters[CONFIG_PARAMETER], package, engine.default_settings)
            except ProtocolError as e:
                kept = "; the model loaded before keeps serving" if name in engine.registry else ""
                raise LoadFailed(f"failed to load model {name!r}: {e}{kept}") from None
        engine.load(name, settings=settings)
    except UnknownModelError as e:
        # Still a 404 (gRPC NOT_FOUND), in the words every failed load starts with (Triton's too).
        raise UnknownModelError(f"failed to load model {name!r}: {e}") from None
    except ProtocolError:
        raise
    except NeuropodError as e:
        # The package is at fault, not a running model: 400 like Triton, naming the model.
        # A reload that fails leaves the model loaded before serving, as Triton does.
        kept = "; the model loaded before keeps serving" if name in engine.registry else ""
        log.error("loading model %r failed: %s%s", name, e, kept)
        raise LoadFailed(f"failed to load model {name!r}: {e}{kept}") from e
    overrides = f" with its load config's {', '.join(settings.overridden)}" if settings and settings.overridden else ""
    log.info("loaded model %r%s", name, overrides)


def _ensemble(engine: Engine, name: str, parameters: Mapping[str, object]) -> EnsembleConfig | None:
    """The ensemble a load makes of served models: its config's, when that is an ensemble's and
    no package is named ``name``; without a config, the one ``name`` was made from before."""
    if CONFIG_PARAMETER not in parameters:
        return made_here(engine, name)
    try:
        config = load_config(parameters[CONFIG_PARAMETER], f"the load's config for model {name!r}")
    except ProtocolError:
        return None  # not an ensemble's: the config override refuses it in its words
    if not is_ensemble(config) or in_repository(engine, name):
        return None
    try:
        return parse_ensemble(config, name)
    except ProtocolError as e:
        raise LoadFailed(f"failed to load model {name!r}: {e}") from None


def unload(engine: Engine, name: str) -> None:
    """Stop serving model ``name`` and close it (in every process of ``neuropod serve --processes``).

    :raises UnknownModelError: it is not loaded.
    """
    _check_explicit(engine, "unload", name)
    if engine.group is not None:
        engine.group.repository("unload", name)
        return
    unload_here(engine, name)


def _check_explicit(engine: Engine, what: str, name: str) -> None:
    """:raises ProtocolError: the server polls its repository, so loads and unloads follow it."""
    if engine.poll_interval_s is not None:
        # As Triton's poll mode: a model loaded or unloaded by hand would be undone by the next poll.
        raise ProtocolError(
            f"failed to {what} model {name!r}: this server polls its model repository every "
            f"{engine.poll_interval_s:g} s (neuropod serve --poll-interval) and loads and unloads models as "
            "the repository changes; repository load and unload requests are refused"
        )


def unload_here(engine: Engine, name: str) -> None:
    """:func:`unload` in this process only.

    :raises ProtocolError: an ensemble (made by a load's config) uses the model.
    """
    using = users(engine, name)
    if using and name in engine.registry:
        raise ProtocolError(
            f"failed to unload model {name!r}: ensemble(s) {', '.join(repr(u) for u in using)} use it as a step; "
            "unload them first"
        )
    engine.unload(name)
    log.info("unloaded model %r", name)


__all__ = ["CONFIG_PARAMETER", "LoadFailed", "index", "load", "load_here", "unload", "unload_here"]
