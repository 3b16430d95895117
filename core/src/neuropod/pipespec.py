"""What a pipeline package declares: its steps (:class:`PipelineStep`, ``pipeline`` in
``config.json``) and the check that they wire together (:func:`check_wiring`).

A pipeline is a package whose steps are packages, wired by tensor name as Triton's ensembles wire
theirs: a step's ``input_map`` names, for each of its model's inputs, the pipeline tensor it reads (a
pipeline input or another step's output), and its ``output_map`` names the pipeline tensor each of
its outputs becomes. The check runs at packaging, at load and when a server builds a pipeline from a
Triton ensemble configuration, so a wiring error is refused before anything runs. How pipelines run
is :mod:`neuropod.pipelines`'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from neuropod.errors import PackageError
from neuropod.spec import Dim, TensorSpec, parse_spec, tensor_name_problem

#: The platform of a pipeline package (its ``config.json``'s ``"platform"``).
PIPELINE_PLATFORM = "pipeline"
_STEP_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
#: Where a pipeline package keeps the packages of its steps: ``0/steps/<step name>``.
STEPS_DIR = "0/steps"


@dataclass(frozen=True)
class PipelineStep:
    """One step of a pipeline: a model, and how its tensors map to the pipeline's.

    The model is a package inside the pipeline package (``package``: a package-relative
    directory, ``0/steps/<name>``) or a model served elsewhere (``url``: ``grpc://host:8001/model``
    and the like), whose spec as it was at packaging is kept here (``input_spec``,
    ``output_spec``) and checked again when the pipeline loads.
    """

    name: str
    #: Step input name -> the pipeline tensor it reads.
    input_map: Mapping[str, str]
    #: Step output name -> the pipeline tensor it becomes. Outputs not named are dropped.
    output_map: Mapping[str, str]
    package: str | None = None
    url: str | None = None
    #: The step model's name (its package's ``name``), for messages.
    model_name: str = ""
    #: For a ``url`` step: the spec the served model had at packaging (its callers' tensors).
    input_spec: tuple[TensorSpec, ...] = ()
    output_spec: tuple[TensorSpec, ...] = ()

    @property
    def where(self) -> str:
        """Where the step's model is: its package path or URL."""
        return self.url or self.package or ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form in ``config.json``."""
        out: dict[str, Any] = {"name": self.name, "model_name": self.model_name}
        if self.package is not None:
            out["package"] = self.package
        if self.url is not None:
            out["url"] = self.url
            out["input_spec"] = [s.to_dict() for s in self.input_spec]
            out["output_spec"] = [s.to_dict() for s in self.output_spec]
        out["input_map"] = dict(self.input_map)
        out["output_map"] = dict(self.output_map)
        return out


@dataclass(frozen=True)
class PipelineSpec:
    """The ``pipeline`` block of a pipeline package's ``config.json``."""

    steps: tuple[PipelineStep, ...]
    #: The most requests that may run inside the pipeline at once (Triton's ensemble
    #: ``max_inflight_requests``); later ones wait for one to finish. 0: no bound.
    max_inflight_requests: int = 0

    def step(self, name: str) -> PipelineStep:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": [s.to_dict() for s in self.steps]}
        if self.max_inflight_requests:
            out["max_inflight_requests"] = self.max_inflight_requests
        return out


@dataclass(frozen=True)
class StepFacts:
    """What the wiring check needs of a step's model: the tensors its callers send and get (a
    stateful model's state and control tensors left out), and how it answers."""

    model_name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    decoupled: bool = False
    stateful: bool = False


@dataclass(frozen=True)
class Wiring:
    """A pipeline whose wiring checked out: its steps in an order that runs each after those it
    reads from (:attr:`order`), grouped in :attr:`levels` of steps that do not depend on one
    another (each level reads only from the levels before it), and the dtype of each tensor."""

    order: tuple[str, ...]
    levels: tuple[tuple[str, ...], ...]
    #: Pipeline tensor -> the step that produces it (pipeline inputs are not in it).
    producers: Mapping[str, str]
    dtypes: Mapping[str, str] = field(default_factory=dict)
    #: The one decoupled step (its responses each run the steps after it), or None.
    decoupled_step: str | None = None
    #: The stateful steps (a request's sequence goes to each of them).
    stateful_steps: tuple[str, ...] = ()


def parse_pipeline(data: Any, where: str) -> PipelineSpec | None:
    """Read the ``pipeline`` block of a ``config.json`` (None when absent): its structure only;
    :func:`check_wiring` checks that the steps fit together, once their models are known.

    :raises PackageError: naming the step and the field that is wrong.
    """
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise PackageError(f"{where} must be an object with a list of 'steps', not {type(data).__name__}")
    unknown = sorted(set(data) - {"steps", "max_inflight_requests"})
    if unknown:
        raise PackageError(
            f"{where}: unknown field {unknown[0]!r} (a pipeline has 'steps' and 'max_inflight_requests')"
        )
    steps = data.get("steps")
    if not isinstance(steps, Sequence) or isinstance(steps, (str, bytes)) or not steps:
        raise PackageError(f"{where}: 'steps' must be a non-empty list of steps, not {steps!r:.80}")
    inflight = parse_max_inflight(data.get("max_inflight_requests", 0), f"{where}: max_inflight_requests")
    parsed = tuple(_parse_step(s, f"{where}: steps[{i}]") for i, s in enumerate(steps))
    check_step_names([s.name for s in parsed], where)
    return PipelineSpec(parsed, inflight)


def parse_max_inflight(value: Any, where: str) -> int:
    """``max_inflight_requests``: a whole number >= 0 (0 or null: no bound)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PackageError(f"{where} must be a whole number >= 0 (0: no bound), not {value!r:.60}")
    return value


def _parse_step(data: Any, where: str) -> PipelineStep:
    if not isinstance(data, Mapping):
        raise PackageError(f"{where} must be an object with 'name', 'package' or 'url', 'input_map' and 'output_map'")
    known = {"name", "model_name", "package", "url", "input_map", "output_map", "input_spec", "output_spec"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PackageError(f"{where}: unknown field {unknown[0]!r} (a step has {', '.join(sorted(known))})")
    name = data.get("name")
    package, url = data.get("package"), data.get("url")
    if (package is None) == (url is None):
        raise PackageError(f"{where}: a step has exactly one of 'package' (a path in the pipeline package) or 'url'")
    for key, value in (("package", package), ("url", url), ("model_name", data.get("model_name", ""))):
        if value is not None and not isinstance(value, str):
            raise PackageError(f"{where}: {key!r} must be a string, not {value!r:.60}")
    if package is not None and not _inside(package):
        raise PackageError(f"{where}: 'package' must be a relative path inside the pipeline package, not {package!r}")
    in_spec = parse_spec(data.get("input_spec") or [], f"{where}: input_spec") if url is not None else ()
    out_spec = parse_spec(data.get("output_spec") or [], f"{where}: output_spec") if url is not None else ()
    return PipelineStep(
        name=_step_name(name, where),
        input_map=parse_tensor_map(data.get("input_map"), f"{where}: input_map"),
        output_map=parse_tensor_map(data.get("output_map"), f"{where}: output_map"),
        package=package,
        url=url,
        model_name=data.get("model_name") or "",
        input_spec=in_spec,
        output_spec=out_spec,
    )


def _step_name(name: Any, where: str) -> str:
    if not is_step_name(name):
        raise PackageError(f"{where}: 'name' must be a step name (letters, digits, '_', '-', '.'), not {name!r:.60}")
    return str(name)


def is_step_name(name: object) -> bool:
    """Whether ``name`` can name a step (it names the step's folder in the package, too)."""
    return isinstance(name, str) and _STEP_NAME.fullmatch(name) is not None and name not in (".", "..")


def check_step_names(names: Sequence[str], where: str) -> None:
    """Step names are unique (each names its statistics, its errors and its folder)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise PackageError(f"{where}: two steps are named {name!r}; give each step its own name")
        seen.add(name)


def parse_tensor_map(value: Any, where: str) -> dict[str, str]:
    """An ``input_map`` or ``output_map``: an object of tensor name to tensor name."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PackageError(f"{where} must map the step's tensor names to pipeline tensor names, not {value!r:.80}")
    out: dict[str, str] = {}
    for key, target in value.items():
        for name in (key, target):
            problem = tensor_name_problem(name)
            if problem is not None:
                raise PackageError(f"{where}: {name!r:.60} is not a tensor name: {problem}")
        out[key] = target
    return out


def _inside(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and ":" not in parts[0]


# --- the wiring check ---


def check_wiring(
    name: str,
    input_spec: Sequence[TensorSpec],
    output_spec: Sequence[TensorSpec],
    steps: Sequence[PipelineStep],
    facts: Mapping[str, StepFacts],
    where: str,
) -> Wiring:
    """Check that a pipeline's steps wire together, and work out the order they run in.

    Every step input is fed (by a pipeline input or another step's output), each tensor is
    produced once, dtypes match where a tensor is read, shapes agree across steps (a symbol
    bound in one step means the same size wherever that tensor goes; fixed sizes must be equal),
    the steps form no cycle, and every pipeline output is produced.

    :param facts: step name -> its model's tensors.
    :param where: the package or configuration, for messages.
    :raises PackageError: naming the step and the tensor that do not fit.
    """
    pipeline_inputs = {s.name: s for s in input_spec}
    check_step_names([s.name for s in steps], where)
    producers: dict[str, str] = {}
    produced: dict[str, tuple[str, TensorSpec]] = {}  # tensor -> (step, that step's output spec)
    for step in steps:
        fact = facts[step.name]
        _check_map_keys(step, "input", step.input_map, fact.inputs, where, every=True)
        _check_map_keys(step, "output", step.output_map, fact.outputs, where, every=False)
        outs = {s.name: s for s in fact.outputs}
        for out, tensor in step.output_map.items():
            if tensor in pipeline_inputs:
                raise PackageError(
                    f"{where}: step {step.name!r} output {out!r} is mapped to {tensor!r}, which is a pipeline input; "
                    "a tensor has one source"
                )
            if tensor in producers:
                raise PackageError(
                    f"{where}: tensor {tensor!r} is produced twice, by step {producers[tensor]!r} and by step "
                    f"{step.name!r}; a tensor has one source"
                )
            producers[tensor] = step.name
            produced[tensor] = (step.name, outs[out])
    known = ", ".join(sorted([*pipeline_inputs, *producers])) or "(none)"
    for step in steps:
        for inp, tensor in step.input_map.items():
            if tensor not in pipeline_inputs and tensor not in producers:
                raise PackageError(
                    f"{where}: step {step.name!r} input {inp!r} reads tensor {tensor!r}, which is neither a pipeline "
                    f"input nor produced by a step (tensors: {known})"
                )
    for spec in output_spec:
        if spec.name not in producers:
            extra = " (a pipeline input; an output must come from a step)" if spec.name in pipeline_inputs else ""
            raise PackageError(
                f"{where}: pipeline output {spec.name!r} is not produced by any step{extra} (step outputs: "
                f"{', '.join(sorted(producers)) or '(none)'})"
            )
    levels = _levels(steps, producers, where)
    dtypes = _check_dtypes(steps, facts, pipeline_inputs, produced, output_spec, where)
    _Shapes(where).check(steps, facts, input_spec, produced, output_spec)
    decoupled = [s.name for s in steps if facts[s.name].decoupled]
    stateful = tuple(s.name for s in steps if facts[s.name].stateful)
    if len(decoupled) > 1:
        raise PackageError(
            f"{where}: steps {decoupled[0]!r} and {decoupled[1]!r} are both decoupled; a pipeline may hold one step "
            "that answers with many responses"
        )
    if decoupled and stateful:
        raise PackageError(
            f"{where}: step {decoupled[0]!r} is decoupled and step {stateful[0]!r} is stateful; a pipeline cannot hold "
            "both (a decoupled model cannot be stateful either)"
        )
    order = tuple(n for level in levels for n in level)
    return Wiring(order, levels, producers, dtypes, decoupled[0] if decoupled else None, stateful)


def _check_map_keys(
    step: PipelineStep, kind: str, mapping: Mapping[str, str], specs: Sequence[TensorSpec], where: str, *, every: bool
) -> None:
    names = [s.name for s in specs]
    for key in mapping:
        if key not in names:
            raise PackageError(
                f"{where}: step {step.name!r}: {key!r} is not an {kind} of its model {step.model_name!r}; its {kind}s "
                f"are: {', '.join(names) or '(none)'}"
            )
    if every:
        missing = [n for n in names if n not in mapping]
        if missing:
            raise PackageError(
                f"{where}: step {step.name!r}: input {missing[0]!r} of model {step.model_name!r} is not fed; add it to "
                "the step's input_map with the pipeline tensor it reads"
            )


def step_levels(steps: Sequence[PipelineStep], where: str) -> tuple[tuple[str, ...], ...]:
    """The steps' dependency levels from their maps alone (what ``neuropod inspect`` shows; the
    models are not read): each level reads only pipeline inputs and the levels before it.

    :raises PackageError: the steps form a cycle.
    """
    producers: dict[str, str] = {}
    for step in steps:
        for tensor in step.output_map.values():
            producers.setdefault(tensor, step.name)
    return _levels(steps, producers, where)


def _levels(steps: Sequence[PipelineStep], producers: Mapping[str, str], where: str) -> tuple[tuple[str, ...], ...]:
    """The steps in dependency levels (declaration order within a level); a cycle is refused."""
    needs = {s.name: {producers[t] for t in s.input_map.values() if t in producers} for s in steps}
    done: set[str] = set()
    levels: list[tuple[str, ...]] = []
    while len(done) < len(steps):
        level = tuple(s.name for s in steps if s.name not in done and needs[s.name] <= done)
        if not level:
            raise PackageError(f"{where}: the steps form a cycle: {_cycle(steps, producers, done)}")
        levels.append(level)
        done.update(level)
    return tuple(levels)


def _cycle(steps: Sequence[PipelineStep], producers: Mapping[str, str], done: set[str]) -> str:
    """One cycle among the steps not yet placed, as ``step a -> tensor t -> step b -> ... -> step a``."""
    by_name = {s.name: s for s in steps}
    start = next(s.name for s in steps if s.name not in done)
    path: list[tuple[str, str]] = []  # (step, tensor it reads from the next step back)
    seen: dict[str, int] = {}
    current = start
    while current not in seen:
        seen[current] = len(path)
        tensor = next(t for t in by_name[current].input_map.values() if t in producers and producers[t] not in done)
        path.append((current, tensor))
        current = producers[tensor]
    loop = path[seen[current] :]
    loop.reverse()  # producer first
    parts = []
    for _step, tensor in loop:
        parts.append(f"step {producers[tensor]!r} -> tensor {tensor!r} -> ")
    return "".join(parts) + f"step {loop[-1][0]!r}" if loop else start


def _check_dtypes(
    steps: Sequence[PipelineStep], facts: Mapping[str, StepFacts], pipeline_inputs: Mapping[str, TensorSpec],
    produced: Mapping[str, tuple[str, TensorSpec]], output_spec: Sequence[TensorSpec], where: str,
) -> dict[str, str]:  # fmt: skip
    dtypes = {n: s.dtype for n, s in pipeline_inputs.items()}
    source = {n: f"pipeline input {n!r}" for n in pipeline_inputs}
    for tensor, (producer, spec) in produced.items():
        dtypes[tensor] = spec.dtype
        source[tensor] = f"step {producer!r} output {spec.name!r}"
    for step in steps:
        ins = {s.name: s for s in facts[step.name].inputs}
        for inp, tensor in step.input_map.items():
            if ins[inp].dtype != dtypes[tensor]:
                raise PackageError(
                    f"{where}: tensor {tensor!r} is {dtypes[tensor]} ({source[tensor]}), but step {step.name!r} input "
                    f"{inp!r} takes {ins[inp].dtype}"
                )
    for spec in output_spec:
        if spec.dtype != dtypes[spec.name]:
            raise PackageError(
                f"{where}: pipeline output {spec.name!r} is declared {spec.dtype}, but {source[spec.name]} is "
                f"{dtypes[spec.name]}"
            )
    return dtypes


class _Shapes:
    """Shapes across steps, by union-find: each dimension of each pipeline tensor, and each symbol
    of each model (a model's symbols are its own: ``batch`` of one step is not ``batch`` of another
    unless a tensor joins them), is a node; a fixed size is a value a node's class may hold once."""

    def __init__(self, where: str):
        self.where = where
        self.parent: dict[Any, Any] = {}
        self.value: dict[Any, tuple[int, str]] = {}  # root -> (size, who says so)
        self.rank: dict[str, tuple[int, str]] = {}  # tensor -> (rank, who says so)

    def _find(self, node: Any) -> Any:
        parent = self.parent.setdefault(node, node)
        if parent != node:
            parent = self.parent[node] = self._find(parent)
        return parent

    def _union(self, a: Any, b: Any, tensor: str, dim: int, via: str = "") -> None:
        ra, rb = self._find(a), self._find(b)
        if ra == rb:
            return
        va, vb = self.value.get(ra), self.value.get(rb)
        if va is not None and vb is not None and va[0] != vb[0]:
            but = f"{via}, which {vb[1]} makes {vb[0]}" if via else f"{vb[1]} makes it {vb[0]}"
            raise PackageError(
                f"{self.where}: shapes disagree on tensor {tensor!r} (dimension {dim}): {va[1]} makes it {va[0]}, "
                f"but {but}"
            )
        self.parent[rb] = ra
        if va is None and vb is not None:
            self.value[ra] = vb

    def _bind(self, tensor: str, spec: TensorSpec, scope: str, who: str) -> None:
        """Tensor ``tensor`` has spec ``spec`` as ``who`` sees it, whose symbols live in ``scope``."""
        known = self.rank.get(tensor)
        if known is not None and known[0] != len(spec.shape):
            raise PackageError(
                f"{self.where}: tensor {tensor!r} has {known[0]} dimensions for {known[1]} but {len(spec.shape)} for "
                f"{who} (shape {spec.describe_shape()})"
            )
        if known is None:
            self.rank[tensor] = (len(spec.shape), who)
        for i, d in enumerate(spec.shape):
            self._dim(tensor, i, d, scope, f"{who} (shape {spec.describe_shape()})")

    def _dim(self, tensor: str, i: int, d: Dim, scope: str, who: str) -> None:
        node = ("dim", tensor, i)
        self._find(node)
        if d is None:
            return
        if isinstance(d, int):
            const = ("size", tensor, i, who)
            self.parent[const] = const
            self.value[const] = (d, who)
            self._union(node, const, tensor, i)
        else:
            self._union(node, ("symbol", scope, d), tensor, i, f"{who} gives it symbol {d!r}")

    def check(
        self, steps: Sequence[PipelineStep], facts: Mapping[str, StepFacts], input_spec: Sequence[TensorSpec],
        produced: Mapping[str, tuple[str, TensorSpec]], output_spec: Sequence[TensorSpec],
    ) -> None:  # fmt: skip
        for spec in input_spec:
            self._bind(spec.name, spec, "", f"pipeline input {spec.name!r}")
        for tensor, (producer, spec) in produced.items():
            self._bind(tensor, spec, producer, f"step {producer!r} output {spec.name!r}")
        for step in steps:
            ins = {s.name: s for s in facts[step.name].inputs}
            for inp, tensor in step.input_map.items():
                self._bind(tensor, ins[inp], step.name, f"step {step.name!r} input {inp!r}")
        for spec in output_spec:
            self._bind(spec.name, spec, "", f"pipeline output {spec.name!r}")


__all__ = [
    "PIPELINE_PLATFORM",
    "STEPS_DIR",
    "PipelineSpec",
    "PipelineStep",
    "StepFacts",
    "Wiring",
    "check_step_names",
    "is_step_name",
    "check_wiring",
    "parse_max_inflight",
    "parse_pipeline",
    "parse_tensor_map",
    "step_levels",
]
