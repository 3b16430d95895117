"""Pipelines of served models, made by a repository load's Triton ensemble configuration.

``POST /v2/repository/models/<name>/load`` (or gRPC RepositoryModelLoad) with a ``config`` whose
platform is ``"ensemble"`` (:mod:`~neuropod_serving.server.ensemble_config`), under a name that is
no package of the repository, makes a pipeline (:func:`neuropod.pipelines.pipeline_from_models`) of
the models its steps name, which the server already serves, and serves it under that name: one
model with its own spec (the configuration's ``input``/``output``), checked like a pipeline
package's before it serves (a step input nothing feeds, a dtype or symbol that disagrees, a cycle,
an output nothing makes, a model not served: refused, naming the tensor or model).

Its steps call the served models directly (not through their batchers and queues; the ensemble
has its own), so each step's calls are counted as the pipeline's steps (statistics
``<ensemble>/<step>``), not in the composing model's own statistics.

While an ensemble uses a model:

- reloading that model rebuilds the ensemble over the new version before the old one is closed
  (requests running on the old ensemble finish first); if the new version no longer wires, the
  ensemble stops serving (logged, with why) rather than run a closed model;
- unloading that model is refused, naming the ensembles (unload them first);
- loading the ensemble's name again without a config rebuilds it from its configuration.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from pathlib import Path

from neuropod.errors import NeuropodError, PackageError
from neuropod.pipelines import pipeline_from_models
from neuropod.spec import parse_spec
from neuropod_serving.errors import UnknownModelError
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.server.engine import Engine
from neuropod_serving.server.ensemble_config import EnsembleConfig, spec_entries
from neuropod_serving.server.registry import ServedModel

log = logging.getLogger("neuropod_serving.server")

#: Engines whose loads and unloads are watched for the models their ensembles use.
_watched: weakref.WeakSet[Engine] = weakref.WeakSet()


def made_here(engine: Engine, name: str) -> EnsembleConfig | None:
    """The ensemble configuration model ``name`` was made from, when it is such an ensemble and
    no package of the repository has that name; else None."""
    served = engine.registry.latest(name)
    if served is None or served.ensemble is None:
        return None
    try:
        engine.registry.package_path(name)
    except UnknownModelError:
        return served.ensemble
    except NeuropodError:
        return None
    return None


def in_repository(engine: Engine, name: str) -> bool:
    """Whether a package of the repository is named ``name`` (a load then loads it)."""
    try:
        engine.registry.package_path(name)
    except UnknownModelError:
        return False
    except NeuropodError:
        return True  # there is one, broken or twice: the load says why
    return True


def load_ensemble(engine: Engine, config: EnsembleConfig, drain_s: float = 30.0) -> ServedModel:
    """Serve the pipeline ``config`` makes of served models, in place of the ensemble of that name
    served before (which finishes its requests first; it keeps serving if this one is refused).

    :raises ProtocolError: a step names a model not served, or the steps do not wire (the message
        names the step and tensor).
    """
    _watch(engine)
    with engine._lock:
        served = build(engine, config)
        _serve(engine, served, drain_s)
    return served


def build(engine: Engine, config: EnsembleConfig) -> ServedModel:
    """The pipeline of ``config`` over the models ``engine`` serves now (not served yet).

    :raises ProtocolError: as :func:`load_ensemble`.
    """
    where = f"the ensemble configuration of model {config.name!r}"
    composing: dict[str, ServedModel] = {}
    for step in config.steps:
        if step.model_name == config.name:
            raise ProtocolError(f"{where}: step {step.name!r} names the ensemble itself")
        try:
            composing[step.name] = engine.registry.get(step.model_name, step.version)
        except UnknownModelError as e:
            raise ProtocolError(
                f"{where}: step {step.name!r} names model {step.model_name!r}"
                f"{'' if step.version is None else ' version ' + step.version}, which this server does not serve "
                f"({e}); load it first"
            ) from None
    # TYPE_STRING is Triton's name for any BYTES tensor: bytes where the step it meets takes bytes.
    dtypes: dict[str, str] = {}
    for step in config.steps:
        model = composing[step.name].model
        for specs, mapping in ((model.inputs, step.input_map), (model.outputs, step.output_map)):
            kinds = {s.name: s.dtype for s in specs}
            for own, tensor in mapping.items():
                if kinds.get(own) == "bytes":
                    dtypes[tensor] = "bytes"
    batched = config.max_batch_size > 0
    steps = [{"name": s.name, "input_map": dict(s.input_map), "output_map": dict(s.output_map)} for s in config.steps]
    try:
        input_spec = parse_spec(spec_entries(config.inputs, batched, dtypes), f"{where}: input")
        output_spec = parse_spec(spec_entries(config.outputs, batched, dtypes), f"{where}: output")
        pipeline = pipeline_from_models(
            config.name, {k: v.model for k, v in composing.items()}, steps, input_spec, output_spec,
            max_inflight_requests=config.max_inflight_requests, where=where,
        )  # fmt: skip
    except PackageError as e:
        raise ProtocolError(str(e)) from None
    # The labels of the steps' outputs that become the ensemble's (for classification requests).
    labels: dict[str, tuple[str, ...]] = {}
    for step in config.steps:
        step_config = getattr(getattr(composing[step.name].model, "package", None), "config", None)
        for out, tensor in step.output_map.items():
            found = getattr(step_config, "output_labels", {}).get(out)
            if found and tensor in {s.name for s in output_spec}:
                labels[tensor] = found
    if labels:
        package = pipeline.package
        pipeline.package = dataclasses.replace(
            package, config=dataclasses.replace(package.config, output_labels=labels)
        )
    return ServedModel(pipeline, Path(where), where=where, ensemble=config)


def _serve(engine: Engine, served: ServedModel, drain_s: float) -> None:
    """Serve ``served`` (the engine's lock held); the ensemble it replaces is drained and closed."""
    config = served.ensemble
    assert config is not None
    defaults = engine.default_settings
    batch = max(1, config.max_batch_size)
    # The ensemble runs in the server's process; its steps wherever their models run.
    served.settings = dataclasses.replace(
        defaults, max_batch_size=batch, workers=1, device=None, sequences=None,
        preferred_batch_sizes=tuple(n for n in defaults.preferred_batch_sizes if n <= batch),
        overridden=("ensemble_scheduling", *(("max_batch_size",) if config.max_batch_size else ())),
    )  # fmt: skip
    old = engine.registry.put(served)
    old_runner = engine._runners.get((served.name, served.version))
    try:
        engine._start(served)
    except BaseException:  # e.g. a stateful ensemble in a server of several processes: nothing changes
        if old is not None:
            engine.registry.put(old)
        else:
            engine.registry.remove(served.name, served.version)
        served.model.close()
        raise
    engine._update_loaded()
    engine._notify(served.name, served)
    if old is not None:
        engine._retire([(old, old_runner)], drain_s)


def _watch(engine: Engine) -> None:
    if engine not in _watched:
        _watched.add(engine)
        engine.listeners.append(functools.partial(_composing_changed, weakref.ref(engine)))


def _composing_changed(ref: weakref.ref[Engine], name: str, now: ServedModel | None) -> None:
    """A listener of the engine's loads and unloads (called with its lock held, before the model
    replaced is closed): the ensembles using model ``name`` move to what serves it now."""
    engine = ref()
    if engine is None:
        return
    for dependent in [s for s in engine.registry if s.ensemble is not None and name in s.ensemble.models]:
        assert dependent.ensemble is not None
        if now is None:
            _stop(engine, dependent, f"model {name!r}, its step, was unloaded")
            continue
        try:
            rebuilt = build(engine, dependent.ensemble)
        except NeuropodError as e:
            _stop(engine, dependent, f"it no longer wires over the model {name!r} now served: {e}")
            continue
        steps = getattr(dependent.model, "steps", {})
        if all(rebuilt.model.steps[k] is m for k, m in steps.items()):  # type: ignore[attr-defined]
            rebuilt.model.close()  # nothing it uses changed (a load that failed)
            continue
        log.info("model %r was reloaded: ensemble %r now runs over it", name, dependent.name)
        _serve(engine, rebuilt, 30.0)


def _stop(engine: Engine, served: ServedModel, why: str) -> None:
    log.error("ensemble %r stopped serving: %s", served.name, why)
    retired = engine._remove(served.name, [served.version])
    engine._update_loaded()
    engine._notify(served.name, None)
    engine._retire(retired, 30.0)


def users(engine: Engine, name: str) -> list[str]:
    """The ensembles (made by load configurations) that use model ``name``, by name."""
    return sorted({s.name for s in engine.registry if s.ensemble is not None and name in s.ensemble.models})


__all__ = ["build", "in_repository", "load_ensemble", "made_here", "users"]
