"""Pipelines: one package whose steps are packages, run as one model (see :mod:`neuropod.pipespec`
for what the package declares). A step resolves its own backend, so one pipeline can hold steps of
several frameworks and framework versions (through backend environments), and steps served
elsewhere (a model URL).

``load_neuropod`` loads a pipeline package with :func:`load_pipeline` and returns a
:class:`PipelineModel`; :func:`neuropod.plan` gives its :class:`PipelinePlan`.
"""

from neuropod.pipelines.load import STEP_LOAD_ARGS, check_loaded, facts_of, load_pipeline, pipeline_from_models
from neuropod.pipelines.model import PipelineModel
from neuropod.pipelines.plan import PIPELINE_BACKEND, PipelinePlan, StepPlan, plan_pipeline, step_package

__all__ = [
    "PIPELINE_BACKEND",
    "STEP_LOAD_ARGS",
    "PipelineModel",
    "PipelinePlan",
    "StepPlan",
    "check_loaded",
    "facts_of",
    "load_pipeline",
    "pipeline_from_models",
    "plan_pipeline",
    "step_package",
]
