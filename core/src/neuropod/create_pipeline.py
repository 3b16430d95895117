"""``create_pipeline_neuropod``: one package whose steps are packages (``from neuropod.packagers
import create_pipeline_neuropod``; the core registers it as it registers nothing else, under the
``neuropod.packagers`` entry points, so it is found like every framework's packager).

Each step's package is copied into the pipeline package (``0/steps/<step>/``); a package given by
URL (``s3://...``, an ``https://`` zip) is downloaded and copied in too, so the pipeline is one
self-contained artifact. A step that is a model on a server (``grpc://host:8001/model``, an OIP
``http://`` URL) stays a reference: its spec is recorded and checked again when the pipeline loads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from neuropod import remote, storage
from neuropod.create import create_package, package_options
from neuropod.errors import PackageError, RemoteError
from neuropod.loader import load_neuropod
from neuropod.package import FileSource, Package, read_package
from neuropod.pipelines import facts_of
from neuropod.pipespec import (
    PIPELINE_PLATFORM,
    STEPS_DIR,
    PipelineSpec,
    PipelineStep,
    StepFacts,
    check_wiring,
    is_step_name,
    parse_max_inflight,
    parse_tensor_map,
)
from neuropod.spec import parse_spec
from neuropod.stateful import caller_specs

_STEP_KEYS = ("package", "input_map", "output_map", "name", "load_options")


def create_pipeline_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    steps: Sequence[Mapping[str, Any]],
    input_spec: Iterable[Mapping[str, Any]],
    output_spec: Iterable[Mapping[str, Any]],
    *,
    max_inflight_requests: int = 0,
    **options: Any,
) -> Path:
    """Package a pipeline: models run one after another (or side by side), wired by tensor name.

    :param steps: each ``{"package": PATH_OR_URL, "input_map": {step_input: pipeline_tensor},
        "output_map": {step_output: pipeline_tensor}}``, as a Triton ensemble's steps, with an
        optional ``"name"`` (default: the step's model name; it names the step's folder, its
        errors and its statistics) and ``"load_options"`` (for a served step: the options its
        URL needs at packaging, such as ``timeout``; not stored). ``package`` is a package
        directory or zip, a package URL (downloaded and copied in), or a model server's URL
        (referenced: that server must serve it when the pipeline runs). Every input of a step's
        model must be fed, by a pipeline input or another step's output; outputs not in
        ``output_map`` are dropped.
    :param input_spec: the pipeline's inputs, as any packager's.
    :param output_spec: the pipeline's outputs: each is some step's output.
    :param max_inflight_requests: the most requests that may be inside the pipeline at once
        (later ones wait; Triton's ensemble ``max_inflight_requests``). 0: no bound.
    :param options: the common packaging keywords (:class:`~neuropod.create.PackageOptions`):
        test data runs through the whole pipeline; ``neuropod_load_args`` (say ``step_options``)
        are used when the new package is checked. ``platform_version_semver``,
        ``custom_ops``, ``state_spec`` and ``sequence_controls`` belong to the steps' packages.
    :raises PackageError: a step that cannot be read, or wiring that does not fit (naming the step
        and the tensor): an input not fed, a dtype or shape that disagrees across steps, a cycle,
        a pipeline output no step produces.
    """
    for key in ("platform_version_semver", "custom_ops", "state_spec", "sequence_controls", "decoupled"):
        if key in options:
            raise TypeError(f"create_pipeline_neuropod() does not take {key!r}: it belongs to the steps' packages")
    package_options("create_pipeline_neuropod", options)  # unknown keywords fail before any step is read
    inputs = parse_spec(input_spec, "input_spec")
    outputs = parse_spec(output_spec, "output_spec")
    inflight = parse_max_inflight(max_inflight_requests, "max_inflight_requests")
    if isinstance(steps, (str, bytes, Mapping)) or not isinstance(steps, Sequence) or not steps:
        raise PackageError(
            f"steps must be a non-empty list of steps ({{'package', 'input_map', 'output_map'}}), not {steps!r:.80}"
        )
    parsed: list[PipelineStep] = []
    facts: dict[str, StepFacts] = {}
    files: dict[str, FileSource] = {}
    for i, entry in enumerate(steps):
        step, fact, source = _read_step(entry, f"steps[{i}]")
        if step.name in facts:
            raise PackageError(f"steps[{i}]: two steps are named {step.name!r}; give one a 'name' of its own")
        parsed.append(step)
        facts[step.name] = fact
        if source is not None:
            files[f"{STEPS_DIR}/{step.name}"] = source
    wiring = check_wiring(model_name, inputs, outputs, parsed, facts, f"pipeline {model_name!r}")
    decoupled = wiring.decoupled_step is not None
    return create_package(
        "create_pipeline_neuropod", neuropod_path, model_name, PIPELINE_PLATFORM, inputs, outputs, files,
        {"default_input_tensor_device": "CPU", **options, "decoupled": decoupled},
        pipeline=PipelineSpec(tuple(parsed), inflight),
    )  # fmt: skip


def _read_step(entry: Any, where: str) -> tuple[PipelineStep, StepFacts, Path | None]:
    """One step as the caller gave it: the step, its model's facts, and the package directory to copy in."""
    if not isinstance(entry, Mapping):
        raise PackageError(
            f"{where} must be a dict with 'package', 'input_map' and 'output_map', not {type(entry).__name__}"
        )
    unknown = sorted(set(entry) - set(_STEP_KEYS))
    if unknown:
        raise PackageError(f"{where}: unknown key {unknown[0]!r} (a step takes {', '.join(_STEP_KEYS)})")
    source = entry.get("package")
    if not isinstance(source, (str, os.PathLike, Package)):
        raise PackageError(f"{where}: 'package' must be a package path or URL, not {source!r:.60}")
    input_map = parse_tensor_map(entry.get("input_map"), f"{where}: input_map")
    output_map = parse_tensor_map(entry.get("output_map"), f"{where}: output_map")
    if isinstance(source, str) and remote.is_remote(source) and not storage.is_package_url(source):
        return _served_step(entry, source, input_map, output_map, where)
    if isinstance(source, str) and storage.is_package_url(source):
        source = storage.fetch(source)
    try:
        package = source if isinstance(source, Package) else read_package(source)
    except PackageError as e:
        raise PackageError(f"{where}: {e}") from None
    name = _name(entry, package.name, where)
    _, ins, outs = caller_specs(package)
    config = package.config
    stateful = bool(config.state_spec or config.sequence_controls)
    if entry.get("load_options") is not None:
        raise PackageError(f"{where}: 'load_options' is for a step served at a URL; {package.name!r} is a package")
    step = PipelineStep(name, input_map, output_map, package=f"{STEPS_DIR}/{name}", model_name=package.name)
    return step, StepFacts(package.name, ins, outs, config.decoupled, stateful), package.root


def _served_step(
    entry: Mapping[str, Any], url: str, input_map: dict[str, str], output_map: dict[str, str], where: str
) -> tuple[PipelineStep, StepFacts, None]:
    """A step that a server runs: its model is asked for its spec now, and referenced by URL."""
    options = entry.get("load_options") or {}
    if not isinstance(options, Mapping):
        raise PackageError(f"{where}: 'load_options' must be a dict of load_neuropod keywords for the URL")
    try:
        model = load_neuropod(url, **options)
    except RemoteError as e:
        # The server must serve the step now: its spec is what the pipeline is checked against.
        raise RemoteError(
            f"{where}: the step served at {url} cannot be packaged, its server must answer now: {e}",
            url=e.url, code=e.code, server_message=e.server_message,
        ) from e  # fmt: skip
    with model:
        name = _name(entry, model.name, where)
        fact = facts_of(model)
    step = PipelineStep(
        name, input_map, output_map, url=url, model_name=fact.model_name, input_spec=fact.inputs,
        output_spec=fact.outputs,
    )
    return step, fact, None


def _name(entry: Mapping[str, Any], model_name: str, where: str) -> str:
    name = entry.get("name", model_name)
    if not is_step_name(name):
        raise PackageError(
            f"{where}: {name!r:.60} cannot name a step (letters, digits, '_', '-' and '.'); give the step a 'name'"
        )
    return str(name)


__all__ = ["create_pipeline_neuropod"]
