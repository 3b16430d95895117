"""Loading a pipeline: each step's model where it belongs (:func:`load_pipeline`), or a pipeline
over models already loaded (:func:`pipeline_from_models`, what ``neuropod serve`` does with a Triton
ensemble configuration)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from neuropod.errors import PackageError, RemoteError
from neuropod.model import NeuropodModel
from neuropod.package import ModelConfig, Package
from neuropod.pipelines.model import PipelineModel
from neuropod.pipelines.plan import PIPELINE_CANDIDATE, PipelinePlan, step_package
from neuropod.pipespec import PIPELINE_PLATFORM, PipelineSpec, PipelineStep, StepFacts, Wiring, check_wiring
from neuropod.spec import TensorSpec

#: ``load_neuropod``'s keywords that a pipeline hands to each step (``step_options`` adds to them per step).
STEP_LOAD_ARGS = ("device", "use_ope", "workers", "restart", "timeout", "verify")


def facts_of(model: NeuropodModel) -> StepFacts:
    """What the wiring check needs of a loaded model."""
    return StepFacts(model.name, tuple(model.inputs), tuple(model.outputs), model.decoupled, model.stateful)


def check_loaded(package: Package, models: Mapping[str, NeuropodModel]) -> Wiring:
    """The pipeline's wiring against its steps' models as loaded (a served step's model may have
    changed since packaging: its spec is checked again here)."""
    config = package.config
    assert config.pipeline is not None
    for step in config.pipeline.steps:
        if step.url is None:
            continue
        model = models[step.name]
        was = {s.name: (s.dtype, s.shape) for s in (*step.input_spec, *step.output_spec)}
        now = {s.name: (s.dtype, s.shape) for s in (*model.inputs, *model.outputs)}
        if was != now:
            raise PackageError(
                f"{package.source}: step {step.name!r} is served at {step.url}, whose model no longer has the spec it "
                f"had when the pipeline was packaged (then: {_specs(step.input_spec, step.output_spec)}; now: "
                f"{_specs(model.inputs, model.outputs)})"
            )
    facts = {name: facts_of(m) for name, m in models.items()}
    return check_wiring(config.name, config.input_spec, config.output_spec, config.pipeline.steps, facts,
                        str(package.source))  # fmt: skip


def _specs(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> str:
    return f"inputs {', '.join(map(str, inputs))}; outputs {', '.join(map(str, outputs))}"


def load_pipeline(
    package: Package, plan: PipelinePlan, load: Callable[..., NeuropodModel], *,
    step_options: Mapping[str, Mapping[str, Any]] | None, options: Mapping[str, Any],
) -> PipelineModel:  # fmt: skip
    """Load each step of a pipeline package with ``load`` (the loader's ``load_neuropod``) and
    return the pipeline.

    :param options: ``load_neuropod``'s keywords for every embedded step (``device``,
        ``use_ope``...; a served step takes only its ``step_options``).
    :param step_options: step name -> more keywords for that step's ``load_neuropod``
        (``{"net": {"use_ope": True}}``, a served step's ``timeout`` or ``auth_token``).
    :raises PackageError: a step named in ``step_options`` that the pipeline does not have, or a
        step's model that no longer wires (a served step whose model changed).
    :raises NoBackendError: a step nothing here can run (the message names it).
    """
    spec = package.config.pipeline
    assert spec is not None
    plan.raise_if_unresolved()
    extra = dict(step_options or {})
    unknown = sorted(set(extra) - {s.name for s in spec.steps})
    if unknown:
        raise PackageError(
            f"step_options names step {unknown[0]!r}, which pipeline {package.name!r} does not have; its steps are: "
            f"{', '.join(s.name for s in spec.steps)}"
        )
    planned = {s.step.name: s.package for s in plan.steps}
    models: dict[str, NeuropodModel] = {}
    try:
        for step in spec.steps:
            own = dict(extra.get(step.name) or {})
            if step.url is not None:
                models[step.name] = _load_served(package, step, step.url, load, own)
            else:
                pkg = planned.get(step.name) or step_package(package, step)
                models[step.name] = load(pkg, **{**options, **own})
        wiring = check_loaded(package, models)
        return PipelineModel(package, plan, models, wiring)
    except BaseException:
        for model in models.values():
            model.close()
        raise


def _load_served(
    package: Package, step: PipelineStep, url: str, load: Callable[..., NeuropodModel], options: Mapping[str, Any]
) -> NeuropodModel:
    """A served step's model; a server that cannot be reached (or does not serve it) is a
    :class:`~neuropod.errors.RemoteError` naming the pipeline, the step and its URL."""
    try:
        return load(url, **options)
    except RemoteError as e:
        raise RemoteError(
            f"pipeline {package.name!r}: step {step.name!r} is served at {url}, which cannot be loaded: {e}",
            url=e.url, code=e.code, server_message=e.server_message,
        ) from e  # fmt: skip


def pipeline_from_models(
    name: str,
    models: Mapping[str, NeuropodModel],
    steps: Sequence[Mapping[str, Any]],
    input_spec: Sequence[TensorSpec],
    output_spec: Sequence[TensorSpec],
    *,
    max_inflight_requests: int = 0,
    where: str = "",
) -> PipelineModel:
    """A pipeline over models already loaded (a server's, which keep serving on their own and are
    not closed with the pipeline).

    :param models: step name -> the model that runs it.
    :param steps: ``{"name", "input_map", "output_map"}`` for each step (``name`` is a key of ``models``).
    :param where: what the pipeline came from, for messages (``"ensemble configuration of model 'x'"``).
    :raises PackageError: a wiring error, naming the step and the tensor.
    """
    where = where or f"pipeline {name!r}"
    parsed = []
    for i, entry in enumerate(steps):
        step_name = entry.get("name")
        if not isinstance(step_name, str) or step_name not in models:
            raise PackageError(f"{where}: steps[{i}] names model {step_name!r}, which is not given")
        model = models[step_name]
        parsed.append(PipelineStep(
            name=step_name, input_map=dict(entry.get("input_map") or {}), output_map=dict(entry.get("output_map") or {}),
            package=f"models/{step_name}", model_name=model.name,
        ))  # fmt: skip
    facts = {s.name: facts_of(models[s.name]) for s in parsed}
    wiring = check_wiring(name, input_spec, output_spec, parsed, facts, where)
    decoupled = wiring.decoupled_step is not None
    config = ModelConfig(
        name=name, platform=PIPELINE_PLATFORM, platform_version_semver="*", input_spec=tuple(input_spec),
        output_spec=tuple(output_spec), input_tensor_device={s.name: "CPU" for s in input_spec},
        exported_with={}, decoupled=decoupled, pipeline=PipelineSpec(tuple(parsed), max_inflight_requests),
    )  # fmt: skip
    package = Package(root=Path("."), config=config, source=Path(where), manifest=None, backend_config={})
    first = next(iter(models.values()), None)
    if first is None:
        raise PackageError(f"{where}: a pipeline needs at least one step")
    plan = PipelinePlan(config=config, host=first.resolution.host, candidates=(PIPELINE_CANDIDATE,), chosen=PIPELINE_CANDIDATE, steps=())
    return PipelineModel(package, plan, models, wiring, owns_steps=False)


__all__ = ["STEP_LOAD_ARGS", "check_loaded", "facts_of", "load_pipeline", "pipeline_from_models"]
