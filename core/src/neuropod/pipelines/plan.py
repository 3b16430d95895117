"""Which backend runs each step of a pipeline: :class:`PipelinePlan`, what :func:`neuropod.plan`
(and ``neuropod explain``) gives for a pipeline package."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from neuropod._version import __version__
from neuropod.backend import Backend, DeviceCaps
from neuropod.devices import Host
from neuropod.errors import NoBackendError, PackageError
from neuropod.package import Package, read_package
from neuropod.pipespec import PIPELINE_PLATFORM, PipelineStep, step_levels
from neuropod.resolve import Candidate, Resolution

#: The backend a pipeline reports: the core runs the steps, each on its own backend.
PIPELINE_BACKEND = Backend(
    platform=PIPELINE_PLATFORM, version=__version__, framework="neuropod", plugin="neuropod",
    plugin_distribution=f"neuropod {__version__}", location="in-process",
)  # fmt: skip


#: What a pipeline's plan chooses once every step resolves: the pipeline itself, on the CPU.
PIPELINE_CANDIDATE = Candidate(PIPELINE_BACKEND, DeviceCaps(), "cpu", "runs its steps, each on its own backend")


@dataclass(frozen=True)
class StepPlan:
    """One step of a pipeline, planned: the resolution of its package here, or the URL of the
    server that runs it (a remote step is checked when the pipeline loads)."""

    step: PipelineStep
    resolution: Resolution | None = None
    package: Package | None = None

    @property
    def resolved(self) -> bool:
        return self.resolution is None or self.resolution.chosen is not None

    def describe(self) -> str:
        """One line: the step, its model, and what runs it here."""
        head = f"step {self.step.name!r} (model {self.step.model_name!r})"
        if self.resolution is None:
            return f"{head}: served at {self.step.url} (checked when the pipeline loads)"
        chosen = self.resolution.chosen
        if chosen is None:
            return f"{head}: no backend can run it here"
        return f"{head}: {chosen.backend.id} on {chosen.device} ({chosen.backend.location})"


@dataclass(frozen=True)
class PipelinePlan(Resolution):
    """A pipeline's resolution: each step's (:attr:`steps`). It resolves when every step does;
    then :attr:`chosen` is the pipeline itself (:data:`PIPELINE_BACKEND`, on the CPU: each step
    picks its own device)."""

    steps: tuple[StepPlan, ...] = ()

    def unresolved(self) -> StepPlan | None:
        """The first step nothing here can run, or None."""
        return next((s for s in self.steps if not s.resolved), None)

    def table(self) -> str:
        return "\n".join("  " + s.describe() for s in self.steps)

    def summary(self) -> str:
        try:  # by level: steps of one level run side by side
            levels = step_levels([s.step for s in self.steps], self.config.name)
            names = " -> ".join(", ".join(level) for level in levels)
        except PackageError:
            names = ", ".join(s.step.name for s in self.steps)
        head = f"Pipeline {self.config.name!r}: {len(self.steps)} steps ({names})"
        bad = self.unresolved()
        if bad is None:
            return f"{head}; every step can run here."
        assert bad.resolution is not None
        return f"{head}.\nIt cannot run here: step {bad.step.name!r} cannot. {bad.resolution.summary()}"

    def advice(self) -> str:
        bad = self.unresolved()
        if bad is None or bad.resolution is None:
            return ""
        return f"step {bad.step.name!r}: {bad.resolution.advice()}"

    def explain(self) -> str:
        parts = [self.summary(), f"Host: {self.host.name}", "Steps:", self.table()]
        for s in self.steps:
            if s.resolution is None:
                continue
            # A step that resolves: what was chosen; one that does not: every candidate and why.
            text = s.resolution.summary()
            if s.resolution.chosen is None:
                text += f"\nCandidates:\n{s.resolution.table()}"
            parts.append(f"Step {s.step.name!r} ({s.step.where}):\n{textwrap.indent(text, '  ')}")
        return "\n".join(parts)

    def raise_if_unresolved(self) -> Candidate:
        bad = self.unresolved()
        if bad is not None:
            assert bad.resolution is not None
            raise NoBackendError(f"{self.summary()}\nCandidates for step {bad.step.name!r}:\n{bad.resolution.table()}")
        assert self.chosen is not None
        return self.chosen


def step_package(pipeline: Package, step: PipelineStep) -> Package:
    """The package of an embedded step (read without checking its files again: the pipeline's
    manifest covers them, and was checked when the pipeline was read)."""
    assert step.package is not None
    path = pipeline.root / step.package
    if not (path / "config.json").is_file():
        raise PackageError(
            f"{pipeline.source}: step {step.name!r} names package {step.package!r}, which is not in the pipeline package"
        )
    return read_package(path, verify=False)


def plan_pipeline(package: Package, host: Host, plan_step: Callable[[Package], Resolution]) -> PipelinePlan:
    """Plan each step of a pipeline package with ``plan_step`` (the loader's :func:`~neuropod.plan`)."""
    spec = package.config.pipeline
    assert spec is not None
    steps = []
    for step in spec.steps:
        if step.url is not None:
            steps.append(StepPlan(step))
            continue
        pkg = step_package(package, step)
        steps.append(StepPlan(step, plan_step(pkg), pkg))
    resolved = all(s.resolved for s in steps)
    return PipelinePlan(
        config=package.config, host=host, candidates=(PIPELINE_CANDIDATE,),
        chosen=PIPELINE_CANDIDATE if resolved else None, steps=tuple(steps),
    )  # fmt: skip


__all__ = ["PIPELINE_BACKEND", "PIPELINE_CANDIDATE", "PipelinePlan", "StepPlan", "plan_pipeline", "step_package"]
