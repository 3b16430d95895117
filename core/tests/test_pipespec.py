"""The pipeline wiring check (neuropod.pipespec) with step models described by hand (StepFacts):
each check's failing case names the step and the tensor; the good cases' order and levels."""

from __future__ import annotations

from typing import Any

import pytest

from neuropod.errors import PackageError
from neuropod.pipespec import PipelineSpec, PipelineStep, StepFacts, check_wiring, parse_pipeline
from neuropod.spec import TensorSpec, parse_spec


def spec(*tensors: tuple[str, str, list[Any]]) -> tuple[TensorSpec, ...]:
    return parse_spec([{"name": n, "dtype": d, "shape": s} for n, d, s in tensors], "spec")


def f32(name: str, *shape: Any) -> tuple[str, str, list[Any]]:
    return (name, "float32", list(shape) or ["batch", 3])


def step(name: str, ins: dict[str, str], outs: dict[str, str], model: str = "") -> PipelineStep:
    return PipelineStep(name, ins, outs, package=f"0/steps/{name}", model_name=model or f"{name}_model")


def facts(ins: tuple[TensorSpec, ...], outs: tuple[TensorSpec, ...], **kw: Any) -> StepFacts:
    return StepFacts("m", ins, outs, **kw)


def unary(name: str = "m", i: str = "x", o: str = "y", *shape: Any, dtype: str = "float32", **kw: Any) -> StepFacts:
    sh = list(shape) or ["batch", 3]
    return StepFacts(name, spec((i, dtype, sh)), spec((o, dtype, sh)), **kw)


IN = spec(f32("in"))
OUT = spec(f32("out"))


def wire(steps: list[PipelineStep], fs: dict[str, StepFacts], inputs: Any = IN, outputs: Any = OUT) -> Any:
    return check_wiring("pipe", inputs, outputs, steps, fs, "pipeline 'pipe'")


def refused(
    match: str, steps: list[PipelineStep], fs: dict[str, StepFacts], inputs: Any = IN, outputs: Any = OUT
) -> str:
    with pytest.raises(PackageError, match=match) as info:
        wire(steps, fs, inputs, outputs)
    assert str(info.value).startswith("pipeline 'pipe': "), str(info.value)
    return str(info.value)


# --- good wiring ---


def test_a_chain_runs_in_order() -> None:
    w = wire(
        [
            step("c", {"x": "t2"}, {"y": "out"}),
            step("a", {"x": "in"}, {"y": "t1"}),
            step("b", {"x": "t1"}, {"y": "t2"}),
        ],
        {"a": unary(), "b": unary(), "c": unary()},
    )
    assert w.order == ("a", "b", "c")
    assert w.levels == (("a",), ("b",), ("c",))
    assert dict(w.producers) == {"t1": "a", "t2": "b", "out": "c"}
    assert w.dtypes["out"] == "float32" and w.decoupled_step is None and w.stateful_steps == ()


def test_a_diamond_has_a_level_of_two() -> None:
    join = facts(spec(f32("p"), f32("q")), spec(f32("s")))
    steps = [
        step("total", {"p": "l", "q": "r"}, {"s": "out"}),
        step("left", {"x": "in"}, {"y": "l"}),
        step("right", {"x": "in"}, {"y": "r"}),
    ]
    w = wire(steps, {"left": unary(), "right": unary(), "total": join})
    assert w.levels == (("left", "right"), ("total",))  # declaration order within a level
    assert w.order == ("left", "right", "total")


def test_levels_of_a_wider_graph() -> None:
    # a, b from inputs; c reads a; d reads a and c; e reads b and d.
    two = facts(spec(f32("p"), f32("q")), spec(f32("s")))
    steps = [
        step("a", {"x": "in"}, {"y": "ta"}),
        step("b", {"x": "in"}, {"y": "tb"}),
        step("c", {"x": "ta"}, {"y": "tc"}),
        step("d", {"p": "ta", "q": "tc"}, {"s": "td"}),
        step("e", {"p": "tb", "q": "td"}, {"s": "out"}),
    ]
    w = wire(steps, {"a": unary(), "b": unary(), "c": unary(), "d": two, "e": two})
    assert w.levels == (("a", "b"), ("c",), ("d",), ("e",))


def test_unmapped_outputs_are_dropped_and_symbols_are_per_step() -> None:
    # Step symbols are the step's own: 'n' of one step and 'batch' of another join through the tensor.
    two_out = StepFacts("m", spec(("x", "float32", ["n", 3])), spec(("y", "float32", ["n", 3]), ("extra", "int64", [])))
    w = wire(
        [step("a", {"x": "in"}, {"y": "t"}), step("b", {"x": "t"}, {"y": "out"})],
        {"a": two_out, "b": unary("m", "x", "y", "k", 3)},
    )
    assert w.order == ("a", "b")


def test_decoupled_and_stateful_steps_are_reported() -> None:
    w = wire([step("a", {"x": "in"}, {"y": "out"})], {"a": unary(decoupled=True)})
    assert w.decoupled_step == "a" and w.stateful_steps == ()
    w = wire(
        [step("a", {"x": "in"}, {"y": "t"}), step("b", {"x": "t"}, {"y": "out"})],
        {"a": unary(stateful=True), "b": unary(stateful=True)},
    )
    assert w.decoupled_step is None and w.stateful_steps == ("a", "b")


# --- each check refused, naming the step and the tensor ---


def test_a_step_input_not_fed() -> None:
    join = facts(spec(f32("p"), f32("q")), spec(f32("s")))
    message = refused(
        "step 'a': input 'q' of model 'a_model' is not fed", [step("a", {"p": "in"}, {"s": "out"})], {"a": join}
    )
    assert "input_map" in message


def test_a_tensor_nobody_produces() -> None:
    message = refused(
        "step 'a' input 'x' reads tensor 'nope', which is neither a pipeline input nor produced",
        [step("a", {"x": "nope"}, {"y": "out"})],
        {"a": unary()},
    )
    assert "tensors: in, out" in message


def test_a_tensor_produced_twice() -> None:
    refused(
        "tensor 't' is produced twice, by step 'a' and by step 'b'",
        [step("a", {"x": "in"}, {"y": "t"}), step("b", {"x": "in"}, {"y": "t"}), step("c", {"x": "t"}, {"y": "out"})],
        {"a": unary(), "b": unary(), "c": unary()},
    )


def test_an_output_mapped_onto_a_pipeline_input() -> None:
    refused(
        "step 'a' output 'y' is mapped to 'in', which is a pipeline input",
        [step("a", {"x": "in"}, {"y": "in"})],
        {"a": unary()},
    )


@pytest.mark.parametrize(
    ("ins", "outs", "match"),
    [
        (
            {"x": "in", "z": "in"},
            {"y": "out"},
            "step 'a': 'z' is not an input of its model 'a_model'; its inputs are: x",
        ),
        (
            {"x": "in"},
            {"y": "out", "w": "t"},
            "step 'a': 'w' is not an output of its model 'a_model'; its outputs are: y",
        ),
    ],
)
def test_an_unknown_name_in_a_map(ins: dict[str, str], outs: dict[str, str], match: str) -> None:
    refused(match, [step("a", ins, outs)], {"a": unary()})


def test_a_dtype_mismatch_between_steps() -> None:
    refused(
        "tensor 't' is float32 \\(step 'a' output 'y'\\), but step 'b' input 'x' takes int32",
        [step("a", {"x": "in"}, {"y": "t"}), step("b", {"x": "t"}, {"y": "out"})],
        {"a": unary(), "b": unary(dtype="int32")},
        outputs=spec(("out", "int32", ["batch", 3])),
    )


def test_a_dtype_mismatch_with_a_pipeline_input_and_output() -> None:
    refused(
        "tensor 'in' is int64 \\(pipeline input 'in'\\), but step 'a' input 'x' takes float32",
        [step("a", {"x": "in"}, {"y": "out"})],
        {"a": unary()},
        inputs=spec(("in", "int64", ["batch", 3])),
    )
    refused(
        "pipeline output 'out' is declared float64, but step 'a' output 'y' is float32",
        [step("a", {"x": "in"}, {"y": "out"})],
        {"a": unary()},
        outputs=spec(("out", "float64", ["batch", 3])),
    )


def test_a_fixed_size_mismatch_across_steps() -> None:
    message = refused(
        "shapes disagree on tensor 't' \\(dimension 1\\)",
        [step("a", {"x": "in"}, {"y": "t"}), step("b", {"x": "t"}, {"y": "out"})],
        {"a": unary(), "b": unary("m", "x", "y", "batch", 4)},
        outputs=spec(f32("out", "batch", 4)),
    )
    assert "step 'a' output 'y'" in message and "step 'b' input 'x'" in message
    assert " 3" in message and " 4" in message


def test_a_symbol_meaning_two_sizes() -> None:
    # Step 'j' binds 'n' on both inputs: p comes from 'a' (fixed 3 columns), q from 'b' (fixed 5 columns).
    join = facts(spec(("p", "float32", ["batch", "n"]), ("q", "float32", ["batch", "n"])), spec(f32("s", "batch", "n")))
    message = refused(
        "shapes disagree on tensor",
        [
            step("a", {"x": "in"}, {"y": "t3"}),
            step("b", {"x": "in5"}, {"y": "t5"}),
            step("j", {"p": "t3", "q": "t5"}, {"s": "out"}),
        ],
        {"a": unary(), "b": unary("m", "x", "y", "batch", 5), "j": join},
        inputs=spec(f32("in"), f32("in5", "batch", 5)),
        outputs=spec(f32("out", "batch", None)),
    )
    assert "step 'j' input 'q' (shape [batch, n]) gives it symbol 'n', which" in message, message
    assert "makes it 5" in message and "makes 3" in message, message


def test_a_symbol_joining_two_pipeline_sizes_through_steps() -> None:
    # The pipeline's own symbol 'batch' binds input and output; a step that changes the first
    # dimension from 'batch' to a fixed 2 on an input whose batch is fixed 4 disagrees.
    refused(
        "shapes disagree on tensor 'in' \\(dimension 0\\)",
        [step("a", {"x": "in"}, {"y": "out"})],
        {"a": unary("m", "x", "y", 2, 3)},
        inputs=spec(f32("in", 4, 3)),
        outputs=spec(f32("out", "batch", 3)),
    )


def test_a_rank_mismatch() -> None:
    message = refused(
        "tensor 't' has 2 dimensions for step 'a' output 'y' but 3 for step 'b' input 'x'",
        [step("a", {"x": "in"}, {"y": "t"}), step("b", {"x": "t"}, {"y": "o"})],
        {"a": unary(), "b": unary("m", "x", "y", "batch", 3, 1)},
        outputs=(),
    )
    assert "batch, 3, 1" in message or "(batch, 3, 1)" in message or "3, 1" in message


def test_a_cycle_shows_the_loop() -> None:
    two = facts(spec(f32("p"), f32("q")), spec(f32("s")))
    message = refused(
        "the steps form a cycle",
        [
            step("a", {"p": "in", "q": "tc"}, {"s": "ta"}),
            step("b", {"x": "ta"}, {"y": "tb"}),
            step("c", {"x": "tb"}, {"y": "tc"}),
            step("d", {"x": "ta"}, {"y": "out"}),
        ],
        {"a": two, "b": unary(), "c": unary(), "d": unary()},
    )
    loop = message.split("cycle: ", 1)[1]
    # Every step of the loop and the tensor between each pair, ending where it began.
    for part in (
        "step 'a' -> tensor 'ta' -> step 'b'",
        "step 'b' -> tensor 'tb' -> step 'c'",
        "step 'c' -> tensor 'tc' -> step 'a'",
    ):
        assert part in loop + " -> " + loop.split(" -> ", 2)[-1] or part in loop, loop
    assert loop.count("step ") == 4 and "'d'" not in loop, loop


def test_a_step_reading_its_own_output_is_a_cycle() -> None:
    two = facts(spec(f32("p"), f32("q")), spec(f32("s")))
    message = refused(
        "cycle: step 'a' -> tensor 'out' -> step 'a'", [step("a", {"p": "in", "q": "out"}, {"s": "out"})], {"a": two}
    )
    assert message.endswith("step 'a'")


def test_a_pipeline_output_not_produced() -> None:
    refused(
        "pipeline output 'other' is not produced by any step \\(step outputs: out\\)",
        [step("a", {"x": "in"}, {"y": "out"})],
        {"a": unary()},
        outputs=spec(f32("out"), f32("other")),
    )
    refused(
        "pipeline output 'in' is not produced by any step \\(a pipeline input",
        [step("a", {"x": "in"}, {"y": "out"})],
        {"a": unary()},
        outputs=spec(f32("in")),
    )


def test_two_decoupled_steps() -> None:
    refused(
        "steps 'a' and 'b' are both decoupled",
        [step("a", {"x": "in"}, {"y": "t"}), step("b", {"x": "t"}, {"y": "out"})],
        {"a": unary(decoupled=True), "b": unary(decoupled=True)},
    )


def test_decoupled_and_stateful() -> None:
    refused(
        "step 'b' is decoupled and step 'a' is stateful",
        [step("a", {"x": "in"}, {"y": "t"}), step("b", {"x": "t"}, {"y": "out"})],
        {"a": unary(stateful=True), "b": unary(decoupled=True)},
    )


def test_two_steps_of_one_name() -> None:
    refused(
        "two steps are named 'a'",
        [step("a", {"x": "in"}, {"y": "t"}), step("a", {"x": "t"}, {"y": "out"})],
        {"a": unary()},
    )


# --- parse_pipeline: the config.json block ---


def good_step(**over: Any) -> dict[str, Any]:
    return {
        "name": "a",
        "model_name": "m",
        "package": "0/steps/a",
        "input_map": {"x": "in"},
        "output_map": {"y": "out"},
        **over,
    }


def test_parse_round_trips() -> None:
    url = {
        "name": "r",
        "url": "grpc://host:8001/m",
        "model_name": "m",
        "input_map": {"x": "out"},
        "output_map": {"y": "o2"},
        "input_spec": [{"name": "x", "dtype": "float32", "shape": [3]}],
        "output_spec": [{"name": "y", "dtype": "float32", "shape": [3]}],
    }
    parsed = parse_pipeline({"steps": [good_step(), url], "max_inflight_requests": 4}, "config.json: pipeline")
    assert isinstance(parsed, PipelineSpec) and parsed.max_inflight_requests == 4
    assert [s.name for s in parsed.steps] == ["a", "r"] and parsed.step("r").where == "grpc://host:8001/m"
    assert parsed.step("a").where == "0/steps/a" and parsed.step("r").input_spec[0].shape == (3,)
    again = parse_pipeline(parsed.to_dict(), "again")
    assert again == parsed
    assert parse_pipeline(None, "x") is None
    with pytest.raises(KeyError):
        parsed.step("nope")


@pytest.mark.parametrize(
    ("block", "match"),
    [
        ([], "must be an object with a list of 'steps', not list"),
        ({"steps": [good_step()], "extra": 1}, "unknown field 'extra'"),
        ({"steps": []}, "'steps' must be a non-empty list"),
        ({"steps": "abc"}, "'steps' must be a non-empty list"),
        ({"steps": [good_step()], "max_inflight_requests": -1}, "max_inflight_requests must be a whole number >= 0"),
        ({"steps": [good_step()], "max_inflight_requests": True}, "max_inflight_requests must be a whole number"),
        ({"steps": [good_step()], "max_inflight_requests": 1.5}, "max_inflight_requests must be a whole number"),
        ({"steps": [3]}, "steps\\[0\\] must be an object"),
        ({"steps": [good_step(color="red")]}, "steps\\[0\\]: unknown field 'color'"),
        ({"steps": [good_step(url="grpc://h/m")]}, "exactly one of 'package'"),
        ({"steps": [{k: v for k, v in good_step().items() if k != "package"}]}, "exactly one of 'package'"),
        ({"steps": [good_step(package=7)]}, "'package' must be a string"),
        ({"steps": [good_step(model_name=7)]}, "'model_name' must be a string"),
        ({"steps": [good_step(package="../elsewhere")]}, "'package' must be a relative path inside"),
        ({"steps": [good_step(package="/abs/path")]}, "'package' must be a relative path inside"),
        ({"steps": [good_step(name="a b")]}, "'name' must be a step name"),
        ({"steps": [good_step(name="..")]}, "'name' must be a step name"),
        ({"steps": [good_step(name=None)]}, "'name' must be a step name"),
        ({"steps": [good_step(name="x" * 129)]}, "'name' must be a step name"),
        ({"steps": [good_step(input_map=["x"])]}, "steps\\[0\\]: input_map must map the step's tensor names"),
        ({"steps": [good_step(output_map={"y": ""})]}, "steps\\[0\\]: output_map: '' is not a tensor name"),
        ({"steps": [good_step(input_map={3: "in"})]}, "input_map: 3 is not a tensor name"),
        ({"steps": [good_step(), good_step(package="0/steps/b")]}, "two steps are named 'a'"),
        ({"steps": [{**good_step(package=None), "url": "grpc://h/m", "input_spec": [{"name": "x"}]}]}, "input_spec"),
    ],
)
def test_parse_refuses_malformed_blocks(block: Any, match: str) -> None:
    with pytest.raises(PackageError, match=match) as info:
        parse_pipeline(block, "config.json: pipeline")
    assert str(info.value).startswith("config.json: pipeline"), str(info.value)
