"""Triton's ensemble configuration (JSON form) as a repository load sends it: what is read, and each
refusal naming its field. The served side (pipelines made of served models) is test_pipelines_served.py's."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from neuropod.pipespec import PipelineSpec, PipelineStep
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.server.ensemble_config import (
    check_package_scheduling,
    ensemble_scheduling,
    is_ensemble,
    load_config,
    parse_ensemble,
    spec_entries,
)

CONFIG: dict[str, Any] = {
    "name": "ens",
    "platform": "ensemble",
    "max_batch_size": 4,
    "input": [{"name": "RAW", "data_type": "TYPE_STRING", "dims": [1]}],
    "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": ["-1", 3]}],
    "ensemble_scheduling": {
        "step": [
            {"model_name": "pre", "model_version": -1, "input_map": {"in": "RAW"}, "output_map": {"o": "mid"}},
            {"model_name": "net", "model_version": "2", "input_map": {"x": "mid"}, "output_map": {"y": "OUT"}},
            {"model_name": "pre", "input_map": {"in": "RAW"}, "output_map": {"o": "mid2"}},
        ],
        "max_inflight_requests": 3,
    },
    "parameters": {"anything": {"string_value": "ignored"}},
}


def test_what_is_read() -> None:
    config = parse_ensemble(CONFIG, "ens")
    assert [(s.name, s.model_name, s.version) for s in config.steps] == [
        ("pre", "pre", None),
        ("net", "net", "2"),  # protobuf's JSON writes int64 as a string
        ("pre#2", "pre", None),  # a model used again is another step
    ]
    assert config.models == ("pre", "net")
    assert config.max_batch_size == 4 and config.max_inflight_requests == 3
    assert config.steps[1].input_map == {"x": "mid"} and config.steps[1].output_map == {"y": "OUT"}
    # TYPE_STRING becomes bytes where a step takes bytes; max_batch_size adds the batch dimension.
    assert spec_entries(config.inputs, True, {"RAW": "bytes"}) == [
        {"name": "RAW", "dtype": "bytes", "shape": ["batch_size", 1]}
    ]
    assert spec_entries(config.inputs, False, {}) == [{"name": "RAW", "dtype": "string", "shape": [1]}]
    assert spec_entries(config.outputs, False, {}) == [{"name": "OUT", "dtype": "float32", "shape": [None, 3]}]


def test_which_configs_are_ensembles() -> None:
    assert is_ensemble({"platform": "ensemble"}) and is_ensemble({"backend": "ensemble"})
    assert is_ensemble({"ensemble_scheduling": {}})
    assert not is_ensemble({"platform": "onnxruntime_onnx", "max_batch_size": 8})
    assert load_config('{"platform": "ensemble"}', "here") == {"platform": "ensemble"}
    with pytest.raises(ProtocolError, match="here is not JSON"):
        load_config("{nope", "here")
    with pytest.raises(ProtocolError, match="here is a JSON object .* not list"):
        load_config("[1]", "here")


def _without(path: tuple[Any, ...]) -> dict[str, Any]:
    config = copy.deepcopy(CONFIG)
    target: Any = config
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return config


def _with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    config = copy.deepcopy(CONFIG)
    target: Any = config
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return config


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (_with(("name",), "other"), "name 'other' is not the name it is loaded as"),
        (_with(("platform",), "onnxruntime_onnx"), "platform 'onnxruntime_onnx' is not an ensemble's"),
        (_with(("dynamic_batching",), {}), "field 'dynamic_batching' is not one this server takes"),
        (_without(("ensemble_scheduling",)), "ensemble_scheduling is an object"),
        (_with(("ensemble_scheduling", "step"), []), "ensemble_scheduling.step is a list of at least one step"),
        (_with(("ensemble_scheduling", "step", 0, "model_name"), ""), r"step\[0\].model_name is the name of a model"),
        (_with(("ensemble_scheduling", "step", 1, "model_namespace"), "ns"), r"step\[1\].model_namespace is not"),
        (_with(("ensemble_scheduling", "step", 1, "model_version"), "latest"), r"step\[1\].model_version is a whole"),
        (_with(("ensemble_scheduling", "step", 0, "input_map"), {"in": 3}), r"step\[0\].input_map is an object"),
        (_with(("ensemble_scheduling", "step", 0, "batching"), 1), r"field 'batching' is not one this server takes"),
        (_with(("ensemble_scheduling", "max_inflight_requests"), -1), "max_inflight_requests is 0 to"),
        (_with(("input", 0, "data_type"), "TYPE_BF17"), r"input\[0\].data_type is one of Triton's TYPE_\* names"),
        (_with(("input", 0, "dims"), "1"), r"input\[0\].dims is a list"),
        (_with(("input", 0, "reshape"), {"shape": [1]}), r"field 'reshape' is not one this server takes"),
        (_with(("output", 0, "optional"), True), r"output\[0\].optional True is not supported"),
        (_without(("output",)), "output is a list of at least one tensor"),
        (_with(("max_batch_size",), -2), "max_batch_size is 0 to"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_each_refusal_names_the_field(config: dict[str, Any], words: str) -> None:
    with pytest.raises(ProtocolError, match=words) as info:
        parse_ensemble(config, "ens")
    assert "the ensemble configuration of model 'ens'" in str(info.value)


SPEC = PipelineSpec(
    (
        PipelineStep("pre", {"in": "RAW"}, {"o": "mid"}, package="0/steps/pre"),
        PipelineStep("net", {"x": "mid"}, {"y": "OUT"}, package="0/steps/net"),
    ),
    max_inflight_requests=2,
)


def test_a_pipeline_packages_scheduling_is_written_and_checked() -> None:
    named = [{"model_name": s.name, "model_version": -1} for s in SPEC.steps]
    block = ensemble_scheduling(named, SPEC)
    assert block == {
        "step": [
            {"model_name": "pre", "model_version": -1, "input_map": {"in": "RAW"}, "output_map": {"o": "mid"}},
            {"model_name": "net", "model_version": -1, "input_map": {"x": "mid"}, "output_map": {"y": "OUT"}},
        ],
        "max_inflight_requests": 2,
    }
    check_package_scheduling(block, SPEC, "here")  # its own: accepted
    swapped = {**block, "step": block["step"][::-1]}
    with pytest.raises(ProtocolError, match=r"step\[0\] disagrees with the pipeline package's step 'pre'"):
        check_package_scheduling(swapped, SPEC, "here")
    with pytest.raises(ProtocolError, match="max_inflight_requests 5 disagrees with the package's 2"):
        check_package_scheduling({**block, "max_inflight_requests": 5}, SPEC, "here")
    with pytest.raises(ProtocolError, match="disagrees with the pipeline package's steps \\(pre, net\\)"):
        check_package_scheduling({"step": block["step"][:1]}, SPEC, "here")
