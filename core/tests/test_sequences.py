"""Stateful models end to end on real small ONNX models: sequences, their state and controls,
the bounds on them, and the errors of a bad declaration at packaging, at load and at run time.

Needs neuropod-onnx and onnxruntime (``nox -s tests_onnx`` runs this file with them).
"""

from __future__ import annotations

import gc
import io
import json
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neuropod import load_neuropod
from neuropod.cli import main
from neuropod.errors import NeuropodError, PackageError, SequenceError, SequenceLimitError, SpecError
from neuropod.package import parse_config, read_package
from neuropod.sequences import SequenceStep
from neuropod.statespec import SequenceControl, StatePair
from neuropod.testing import run_in_threads

pytest.importorskip("onnxruntime", reason="needs onnxruntime (nox -s tests_onnx runs this file with it)")
onnx = pytest.importorskip("onnx", reason="needs onnx (nox -s tests_onnx runs this file with it)")
packager = pytest.importorskip("neuropod_onnx.packager", reason="needs neuropod-onnx")
helper = onnx.helper
create_onnx_neuropod = packager.create_onnx_neuropod

STATE = [{"input_name": "acc_in", "output_name": "acc_out"}]


def _elem(dtype: str) -> int:
    return onnx.TensorProto.STRING if dtype == "string" else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def package(
    tmp_path: Path, name: str, nodes: list[Any], inputs: list[tuple[str, str, list[Any]]],
    outputs: list[tuple[str, str, list[Any]]], **kwargs: Any,
) -> Path:  # fmt: skip
    """An ONNX package of ``nodes`` with (name, dtype, shape) inputs and outputs."""
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info(n, _elem(d), s) for n, d, s in inputs],
        [helper.make_tensor_value_info(n, _elem(d), s) for n, d, s in outputs],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    spec = [[{"name": n, "dtype": d, "shape": s} for n, d, s in side] for side in (inputs, outputs)]
    path: Path = create_onnx_neuropod(tmp_path / name, name, spec[0], spec[1], onnx_model=model, **kwargs)
    return path


def accumulator(tmp_path: Path, name: str = "acc", width: int = 4, extra: tuple[Any, ...] = (), **kwargs: Any) -> Path:
    """y = acc_out = acc_in + x, float32 ["batch", width]; ``extra`` inputs are left unused."""
    nodes = [helper.make_node("Add", ["acc_in", "x"], ["y"]), helper.make_node("Identity", ["y"], ["acc_out"])]
    ins = [("x", "float32", ["batch", width]), ("acc_in", "float32", ["batch", width]), *extra]
    outs = [("y", "float32", ["batch", width]), ("acc_out", "float32", ["batch", width])]
    return package(tmp_path, name, nodes, ins, outs, **kwargs)


def steps(count: int, seed: int, width: int = 4) -> np.ndarray:
    """Inputs of one sequence: small integers as float32, whose sums are exact."""
    return np.random.default_rng(seed).integers(-50, 50, (count, 1, width)).astype(np.float32)


def sums(xs: np.ndarray) -> np.ndarray:
    return np.cumsum(xs.astype(np.float64), axis=0).astype(np.float32)


@pytest.fixture(scope="module")
def acc_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return accumulator(tmp_path_factory.mktemp("acc"), state_spec=STATE)


@pytest.fixture
def acc(acc_path: Path) -> Any:
    with load_neuropod(acc_path) as model:
        yield model


# -- many sequences --------------------------------------------------------------------------------


def test_interleaved_sequences_from_many_threads_never_see_each_others_state(acc: Any) -> None:
    """16 threads, 4 sequences each, 40 steps per sequence (2,560 steps): every output is exactly
    its own sequence's running sum. Half the threads step their sequences one call each, half in
    one call of all four (infer_sequences)."""
    per_thread, count = 4, 40

    def work(t: int) -> None:
        ids: list[int | str] = [t * 10 + j + 1 if j % 2 else f"thread{t}-{j}" for j in range(per_thread)]
        xs = [steps(count, seed=t * 100 + j) for j in range(per_thread)]
        want = [sums(x) for x in xs]
        rng = np.random.default_rng(t)
        for k in range(count):
            first, last = k == 0, k == count - 1
            if t % 2:
                batch = [SequenceStep(ids[j], start=first, end=last) for j in rng.permutation(per_thread)]
                out = acc.infer_sequences(
                    {"x": np.concatenate([xs[ids.index(s.sequence_id)][k] for s in batch])}, batch
                )["y"]
                for row, s in enumerate(batch):
                    j = ids.index(s.sequence_id)
                    assert np.array_equal(out[row : row + 1], want[j][k]), (s.sequence_id, k)
            else:
                for j in rng.permutation(per_thread):
                    out = acc.infer({"x": xs[j][k]}, sequence_id=ids[j], sequence_start=first, sequence_end=last)["y"]
                    assert np.array_equal(out, want[j][k]), (ids[j], k)

    started = time.monotonic()
    run_in_threads(work, 16)
    assert acc.live_sequences == 0
    assert time.monotonic() - started < 30


def test_steps_of_one_sequence_from_two_threads_run_one_at_a_time(acc: Any) -> None:
    """Two threads stepping the same sequence: each step sees the state of the one before (no step
    is lost), whatever the order they run in."""
    acc.infer({"x": np.zeros((1, 4), np.float32)}, sequence_id=99, sequence_start=True)
    one = np.ones((1, 4), np.float32)

    def work(_: int) -> None:
        for _ in range(200):
            acc.infer({"x": one}, sequence_id=99)

    run_in_threads(work, 2)
    out = acc.infer({"x": one}, sequence_id=99, sequence_end=True)
    np.testing.assert_array_equal(out["y"], np.full((1, 4), 401, np.float32))


# -- a sequence's life -----------------------------------------------------------------------------


def kept_state(model: Any, sequence_id: int | str) -> weakref.ref[np.ndarray]:
    """A weak reference to the state array the model keeps for a live sequence (onnxruntime
    allocates it outside numpy's allocator, where tracemalloc does not see it)."""
    return weakref.ref(model._sequences._live[sequence_id].state["acc_in"])


def test_end_frees_the_state_at_once(tmp_path: Path) -> None:
    """A sequence's 4 MB of state is freed by its last step, by seq.close() and by the model's
    close: nothing refers to the array any more, before any sweep."""
    path = accumulator(tmp_path, width=1 << 20, state_spec=STATE)
    x = np.ones((1, 1 << 20), np.float32)
    with load_neuropod(path) as model:
        model.infer({"x": x}, sequence_id=2, sequence_start=True)
        model.infer({"x": x}, sequence_id=2)
        state = kept_state(model, 2)
        assert state() is not None and state().nbytes == x.nbytes
        np.testing.assert_array_equal(state(), 2 * x)
        model.infer({"x": x}, sequence_id=2, sequence_end=True)
        gc.collect()
        assert state() is None, "the state outlived the sequence's last step"
        assert model.live_sequences == 0

        with model.sequence() as seq:
            seq.infer({"x": x})
            state = kept_state(model, seq.id)
            assert state() is not None
        gc.collect()
        assert state() is None and model.live_sequences == 0, "seq.close() kept the state"

        model.infer({"x": x}, sequence_id=3, sequence_start=True)
        state = kept_state(model, 3)
        model.close()
        gc.collect()
        assert state() is None, "closing the model kept the state"


def test_start_for_a_live_id_restarts_it(acc: Any) -> None:
    x = np.full((1, 4), 3, np.float32)
    for _ in range(3):
        acc.infer({"x": x}, sequence_id="s", sequence_start=True)
    assert acc.live_sequences == 1
    with acc.sequence("s") as seq:  # the same id through a Sequence: its first step restarts it too
        np.testing.assert_array_equal(seq.infer({"x": x})["y"], x)
        np.testing.assert_array_equal(seq.infer({"x": x})["y"], 2 * x)
        np.testing.assert_array_equal(seq.state()["acc_in"], 2 * x)
        assert repr(seq).startswith("<Sequence 's' of 'acc', live")
    assert acc.live_sequences == 0
    with pytest.raises(SequenceError, match="has ended"):
        seq.infer({"x": x})
    with pytest.raises(SequenceError, match="has ended; it has no state"):
        seq.state()
    seq.close()  # closing twice is harmless


def test_a_step_of_a_sequence_that_is_not_live_names_it(acc: Any) -> None:
    x = np.ones((1, 4), np.float32)
    with pytest.raises(
        SequenceError, match=r"sequence 12345 is not live on model 'acc': it was never started .*no idle limit"
    ):
        acc.infer({"x": x}, sequence_id=12345)
    acc.infer({"x": x}, sequence_id="gone", sequence_start=True, sequence_end=True)
    with pytest.raises(SequenceError, match="sequence 'gone' is not live on model 'acc': it ended"):
        acc.infer({"x": x}, sequence_id="gone")
    acc.configure_sequences(max_idle_s=0.05)
    try:
        acc.infer({"x": x}, sequence_id=7, sequence_start=True)
        acc.infer({"x": x}, sequence_id=8, sequence_start=True)
        time.sleep(0.12)
        with pytest.raises(SequenceError, match=r"sequence 7 is not live .* idle limit \(0\.05 s\)"):
            acc.infer({"x": x}, sequence_id=7)
        assert acc.live_sequences <= 1  # 8 is freed by the next sweep (or was already)
        with pytest.raises(SequenceError, match=r"sequence 8 is not live .* idle limit \(0\.05 s\)"):
            acc.infer({"x": x}, sequence_id=8)
        assert acc.live_sequences == 0
        out = acc.infer({"x": x}, sequence_id=7, sequence_start=True, sequence_end=True)  # START revives it
        np.testing.assert_array_equal(out["y"], x)
    finally:
        acc.configure_sequences()
    for bad, match in ((0, "out of range"), (2**64, "out of range"), ("", "must not be empty"), (1.5, "not float")):
        with pytest.raises(SequenceError, match=match):
            acc.infer({"x": x}, sequence_id=bad, sequence_start=True)


def test_a_step_that_arrives_in_time_keeps_its_sequence_alive(acc: Any) -> None:
    # A server queues a step before it runs: touch_sequence starts its idle time again on arrival.
    x = np.ones((1, 4), np.float32)
    acc.configure_sequences(max_idle_s=0.2)
    try:
        acc.infer({"x": x}, sequence_id=41, sequence_start=True)
        time.sleep(0.12)
        acc.touch_sequence(41)  # arrived in time; it waits in a queue past the limit
        acc.touch_sequence(999)  # not live: nothing happens
        time.sleep(0.12)
        out = acc.infer({"x": x}, sequence_id=41, sequence_end=True)
        np.testing.assert_array_equal(out["y"], 2 * x)
    finally:
        acc.configure_sequences()


def test_the_bound_on_live_sequences(acc: Any) -> None:
    x = np.ones((1, 4), np.float32)
    acc.configure_sequences(max_live=2)
    try:
        acc.infer({"x": x}, sequence_id=1, sequence_start=True)
        acc.infer({"x": x}, sequence_id=2, sequence_start=True)
        with pytest.raises(SequenceLimitError, match=r"2 live sequences, its most \(2\); sequence 3 cannot start"):
            acc.infer({"x": x}, sequence_id=3, sequence_start=True)
        with pytest.raises(SequenceLimitError):
            acc.infer_sequences({"x": np.ones((2, 4), np.float32)}, [SequenceStep(1), SequenceStep(4, start=True)])
        np.testing.assert_array_equal(acc.infer({"x": x}, sequence_id=1)["y"], 2 * x)  # 1's state was not touched
        acc.infer({"x": x}, sequence_id=2, sequence_start=True)  # restarting a live one is no new one
        acc.infer({"x": x}, sequence_id=2, sequence_end=True)
        acc.infer({"x": x}, sequence_id=3, sequence_start=True)
        assert acc.live_sequences == 2
        with pytest.raises(ValueError, match="max_live"):
            acc.configure_sequences(max_live=0)
    finally:
        acc.configure_sequences()
        acc.infer({"x": x}, sequence_id=1, sequence_end=True)
        acc.infer({"x": x}, sequence_id=3, sequence_end=True)


def test_sequences_only_for_stateful_models(tmp_path: Path, acc: Any) -> None:
    x = np.ones((1, 4), np.float32)
    with pytest.raises(SequenceError, match=r"carries state .* model\.sequence\(\)"):
        acc.infer({"x": x})
    with pytest.raises(SequenceError, match=r"infer_stream"):
        acc.infer_stream({"x": x})
    with pytest.raises(SequenceError, match="appears more than once"):
        acc.infer_sequences({"x": np.ones((2, 4), np.float32)}, [SequenceStep(5, start=True), SequenceStep(5)])
    with pytest.raises(SequenceError, match="rows"):
        acc.infer_sequences(
            {"x": np.ones((3, 4), np.float32)}, [SequenceStep(5, start=True), SequenceStep(6, start=True)]
        )
    assert acc.live_sequences == 0
    stateless = accumulator(tmp_path, "plain")
    with load_neuropod(stateless) as model:
        assert not model.stateful and model.state_spec == ()
        both = {"x": x, "acc_in": x}
        np.testing.assert_array_equal(model.infer(both)["y"], 2 * x)
        with pytest.raises(SequenceError, match="'plain' is not stateful"):
            model.infer(both, sequence_id=1, sequence_start=True)
        with pytest.raises(SequenceError, match="not stateful"):
            model.sequence()


# -- state and controls ----------------------------------------------------------------------------


def test_initial_state_given_as_an_array(tmp_path: Path) -> None:
    initial = np.array([[10, 20, 30, 40]], np.float32)
    path = accumulator(tmp_path, state_spec=[{**STATE[0], "initial_state": initial}])
    assert np.array_equal(np.load(path / "0" / "state" / "initial_0.npy"), initial)
    stored = json.loads((path / "config.json").read_text())["state_spec"]
    assert stored == [{
        "input_name": "acc_in", "output_name": "acc_out", "dtype": "float32", "shape": [1, 4],
        "initial_state": {"data_file": "0/state/initial_0.npy"},
    }]  # fmt: skip
    xs = steps(3, seed=5)
    with load_neuropod(path) as model, model.sequence() as seq:
        np.testing.assert_array_equal(seq.state()["acc_in"], initial)
        for x, want in zip(xs, sums(xs)):
            np.testing.assert_array_equal(seq.infer({"x": x})["y"], initial + want)
    with pytest.raises(PackageError, match=r"state_spec\[0\]: an initial_state array must be numeric"):
        accumulator(tmp_path, "strings", state_spec=[{**STATE[0], "initial_state": np.array([["a"] * 4])}])
    with pytest.raises(NeuropodError, match=r"initial state of 'acc_in' .* is float32 \[1, 3\], not float32 \[1, 4\]"):
        accumulator(
            tmp_path,
            "narrow",
            state_spec=[{**STATE[0], "shape": [1, 4], "initial_state": np.zeros((1, 3), np.float32)}],
        )
    assert not (tmp_path / "narrow").exists()


CONTROL_OUTS = [helper.make_node("Identity", [n], [n + "_out"]) for n in ("start", "ready", "end", "corrid")]
CONTROLS = [
    {"name": "start", "kind": "CONTROL_SEQUENCE_START"},
    {"name": "ready", "kind": "CONTROL_SEQUENCE_READY"},
    {"name": "end", "kind": "CONTROL_SEQUENCE_END"},
    {"name": "corrid", "kind": "CONTROL_SEQUENCE_CORRID"},
]


def controls_model(tmp_path: Path, name: str, corrid: str, shape: list[Any]) -> Path:
    """A model that outputs its controls (``<name>_out``) and ``y = x``."""
    flags = [(n, "int32", shape) for n in ("start", "ready", "end")]
    ins = [("x", "float32", shape), *flags, ("corrid", corrid, shape)]
    outs = [("y", "float32", shape), *[(n + "_out", d, s) for n, d, s in ins[1:]]]
    nodes = [helper.make_node("Identity", ["x"], ["y"]), *CONTROL_OUTS]
    return package(tmp_path, name, nodes, ins, outs, sequence_controls=CONTROLS)


def test_controls_are_filled_for_each_sequence_batched_or_not(tmp_path: Path) -> None:
    path = controls_model(tmp_path, "numeric", "uint64", ["batch", 1])
    with load_neuropod(path) as model:
        assert model.stateful and model.sequence_batching and [s.name for s in model.inputs] == ["x"]
        assert [s.name for s in model.outputs] == ["y", "start_out", "ready_out", "end_out", "corrid_out"]
        x = np.ones((1, 1), np.float32)
        out = model.infer({"x": x}, sequence_id=2**64 - 1, sequence_start=True)
        assert out["corrid_out"].dtype == np.uint64 and out["corrid_out"].tolist() == [[2**64 - 1]]
        assert [out[n].tolist() for n in ("start_out", "ready_out", "end_out")] == [[[1]], [[1]], [[0]]]
        out = model.infer({"x": x}, sequence_id=2**64 - 1, sequence_end=True)
        assert [out[n].tolist() for n in ("start_out", "ready_out", "end_out")] == [[[0]], [[1]], [[1]]]
        # Three sequences in one call, two rows each is refused (no state: one row per sequence).
        batch = [SequenceStep(5, start=True), SequenceStep(6, end=True, start=True), SequenceStep(7, start=True)]
        out = model.infer_sequences({"x": np.arange(3, dtype=np.float32).reshape(3, 1)}, batch)
        assert out["corrid_out"].ravel().tolist() == [5, 6, 7]
        assert out["start_out"].ravel().tolist() == [1, 1, 1] and out["end_out"].ravel().tolist() == [0, 1, 0]
        assert out["y"].ravel().tolist() == [0, 1, 2]
        out = model.infer_sequences({"x": np.ones((2, 1), np.float32)}, [SequenceStep(7, end=True), SequenceStep(5)])
        assert out["corrid_out"].ravel().tolist() == [7, 5] and out["start_out"].ravel().tolist() == [0, 0]
        assert out["end_out"].ravel().tolist() == [1, 0]
        with pytest.raises(SequenceError, match="numeric sequence ids"):
            model.infer({"x": x}, sequence_id="text", sequence_start=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # packaging's step runs a sequence with a string id of its own
        path = controls_model(tmp_path, "strings", "string", ["batch", 1])
    with load_neuropod(path) as model:
        out = model.infer({"x": np.ones((1, 1), np.float32)}, sequence_id="walker-7", sequence_start=True)
        assert [str(v) for v in out["corrid_out"].ravel()] == ["walker-7"]
        with model.sequence() as seq:
            assert isinstance(seq.id, str)
            assert [str(v) for v in seq.infer({"x": np.ones((1, 1), np.float32)})["corrid_out"].ravel()] == [seq.id]
        with pytest.raises(SequenceError, match="string sequence ids"):
            model.infer({"x": np.ones((1, 1), np.float32)}, sequence_id=7, sequence_start=True)

    path = controls_model(tmp_path, "unbatched", "int64", [1])
    with load_neuropod(path) as model:
        assert model.stateful and not model.sequence_batching
        assert "does not lead with a batch symbol" in model.sequence_batching_problem
        out = model.infer({"x": np.ones(1, np.float32)}, sequence_id=3, sequence_start=True, sequence_end=True)
        assert out["corrid_out"].tolist() == [3] and out["start_out"].tolist() == [1] and out["end_out"].tolist() == [1]
        with model.sequence() as seq:  # an id of its own that the int64 control holds
            assert seq.infer({"x": np.ones(1, np.float32)})["corrid_out"].tolist() == [seq.id]
        with pytest.raises(SequenceError, match=rf"sequence id {2**63} is too large .* ids up to {2**63 - 1}"):
            model.infer({"x": np.ones(1, np.float32)}, sequence_id=2**63, sequence_start=True)
        with pytest.raises(SequenceError, match="cannot run 2 sequences in one call"):
            model.infer_sequences(
                {"x": np.ones(2, np.float32)}, [SequenceStep(1, start=True), SequenceStep(2, start=True)]
            )


# -- bad declarations --------------------------------------------------------------------------------

FLAG = (("flag", "float32", ["batch", 1]),)
BAD = [
    ({"state_spec": "acc_in"}, r"state_spec must be a list of state pairs"),
    ({"state_spec": [{"input_name": "nope", "output_name": "acc_out"}]}, r"state_spec\[0\]: input_name 'nope' is not an input"),
    ({"state_spec": [{"input_name": "acc_in", "output_name": "nope"}]}, r"state_spec\[0\]: output_name 'nope' is not an output"),
    ({"state_spec": [{**STATE[0], "dtype": "int32"}]}, r"state_spec\[0\]: the state is int32, but input 'acc_in' is float32"),
    ({"state_spec": [{**STATE[0], "shape": [1, 5]}]}, r"state_spec\[0\]: state shape \[1, 5\] does not fit input 'acc_in'"),
    ({"state_spec": [{**STATE[0], "shape": [4]}]}, r"state_spec\[0\]: state shape \[4\] does not fit .* 1 dims against 2"),
    ({"state_spec": [{**STATE[0], "size": 4}]}, r"state_spec\[0\]: unknown key\(s\) size"),
    ({"state_spec": [{**STATE[0], "initial_state": "ones"}]}, r"state_spec\[0\]: initial_state must be \"zero\""),
    ({"state_spec": [STATE[0], STATE[0]]}, r"state_spec: input_name 'acc_in' is in more than one state pair"),
    ({"sequence_controls": {"name": "flag"}}, r"sequence_controls must be a list"),
    ({"sequence_controls": [{"name": "flag", "kind": "CONTROL_FOO"}]}, r"sequence_controls\[0\]: kind 'CONTROL_FOO' is not one of"),
    ({"sequence_controls": [{"name": "nope", "kind": "CONTROL_SEQUENCE_START"}]}, r"sequence_controls\[0\]: 'nope' is not an input"),
    ({"sequence_controls": [{"name": "flag", "kind": "CONTROL_SEQUENCE_CORRID"}]}, r"sequence_controls\[0\]: .*'flag' is float32; it must be an integer"),
    ({"sequence_controls": [{"name": "flag"}]}, r"sequence_controls\[0\] must be an object with exactly 'name' and 'kind'"),
    ({"sequence_controls": [{"name": "x", "kind": "CONTROL_SEQUENCE_START"}]}, r"sequence_controls\[0\]: control input 'x' is \[batch, 4\]"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "match"), BAD, ids=[m.split(":")[0][:30] for _, m in BAD])
def test_a_bad_declaration_is_refused_at_packaging_naming_the_entry(tmp_path: Path, kwargs: Any, match: str) -> None:
    with pytest.raises(PackageError, match=match):
        accumulator(tmp_path, extra=FLAG, **kwargs)
    assert not (tmp_path / "acc").exists()


def concat_model(tmp_path: Path, name: str, **kwargs: Any) -> Path:
    """A model whose acc_out is twice as wide as its state: [acc_in, x] side by side."""
    nodes = [
        helper.make_node("Add", ["acc_in", "x"], ["y"]),
        helper.make_node("Concat", ["acc_in", "x"], ["acc_out"], axis=1),
    ]
    ins = [("x", "float32", ["batch", 4]), ("acc_in", "float32", ["batch", 4])]
    outs = [("y", "float32", ["batch", 4]), ("acc_out", "float32", ["batch", None])]
    return package(tmp_path, name, nodes, ins, outs, **kwargs)


def test_a_state_output_that_does_not_fit_is_caught_at_packaging_and_at_run_time(tmp_path: Path) -> None:
    # Packaging runs one step on zeros (no test data given) ...
    with pytest.raises(
        SpecError, match=r"state output 'acc_out' is float32 \[1, 8\], but its state_spec says float32 \[1, 4\]"
    ):
        concat_model(tmp_path, "wide", state_spec=STATE)
    assert not (tmp_path / "wide").exists()
    # ... or on the test data.
    with pytest.raises(SpecError, match="state output 'acc_out'"):
        concat_model(tmp_path, "wide", state_spec=STATE, test_input_data={"x": np.ones((1, 4), np.float32)})
    # A declaration given at load is checked at the first step: the state is named, and the
    # sequence that failed on its first step is not live.
    path = concat_model(tmp_path, "plain")
    with load_neuropod(path, sequences={"state_spec": STATE}) as model:
        with pytest.raises(SpecError, match=r"model 'plain': state output 'acc_out' .*\(sequence\(s\) 4\)"):
            model.infer({"x": np.ones((1, 4), np.float32)}, sequence_id=4, sequence_start=True)
        assert model.live_sequences == 0
        with pytest.raises(SequenceError, match="sequence 4 is not live"):
            model.infer({"x": np.ones((1, 4), np.float32)}, sequence_id=4)


def test_sequences_given_at_load(tmp_path: Path) -> None:
    path = accumulator(tmp_path, "plain", extra=(("flag", "int32", ["batch", 1]),))
    amend = {"state_spec": STATE, "sequence_controls": [{"name": "flag", "kind": "CONTROL_SEQUENCE_START"}]}
    xs = steps(3, seed=8)
    for given in (amend, json.dumps(amend)):
        with load_neuropod(path, sequences=given) as model:
            assert model.stateful and [s.name for s in model.inputs] == ["x"]
            assert model.state_spec == (StatePair("acc_in", "acc_out", "float32", (1, 4)),)
            assert model.sequence_controls == (SequenceControl("flag", "CONTROL_SEQUENCE_START"),)
            with model.sequence() as seq:
                for x, want in zip(xs, sums(xs)):
                    np.testing.assert_array_equal(seq.infer({"x": x})["y"], want)
    assert "state_spec" not in json.loads((path / "config.json").read_text())  # the package is unchanged
    for bad, match in (
        ({"state": STATE}, "sequences must be a mapping with 'state_spec' and/or 'sequence_controls'"),
        ("{not json", "sequences: not JSON"),
        ({"state_spec": [{"input_name": "nope", "output_name": "acc_out"}]}, r"with the sequences given at load: state_spec\[0\]: input_name 'nope'"),
        ({"sequence_controls": [{"name": "flag", "kind": "START"}]}, r"sequence_controls\[0\]: kind 'START'"),
    ):  # fmt: skip
        with pytest.raises(PackageError, match=match):
            load_neuropod(path, sequences=bad)


def test_decoupled_and_stateful_is_refused() -> None:
    data = {
        "name": "both", "platform": "python", "decoupled": True,
        "input_spec": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}, {"name": "acc_in", "dtype": "float32", "shape": ["batch", 4]}],
        "output_spec": [{"name": "acc_out", "dtype": "float32", "shape": ["batch", 4]}],
        "state_spec": STATE,
    }  # fmt: skip
    with pytest.raises(PackageError, match="a decoupled model cannot also carry sequence state or controls"):
        parse_config(data, "both/config.json")


def test_a_state_input_cannot_also_be_a_control() -> None:
    one = [{"name": n, "dtype": "int32", "shape": ["batch", 1]} for n in ("x", "flag")]
    data = {
        "name": "twice", "platform": "onnx", "input_spec": one, "output_spec": [{**one[0], "name": "flag_out"}],
        "state_spec": [{"input_name": "flag", "output_name": "flag_out"}],
        "sequence_controls": [{"name": "flag", "kind": "CONTROL_SEQUENCE_START"}],
    }  # fmt: skip
    with pytest.raises(
        PackageError, match="twice/config.json: input 'flag' is both a state input and a CONTROL_SEQUENCE_START control"
    ):
        parse_config(data, "twice/config.json")


# -- the package -----------------------------------------------------------------------------------


def test_config_json_round_trip_and_inspect(tmp_path: Path) -> None:
    controls = [{"name": "flag", "kind": "CONTROL_SEQUENCE_START"}]
    path = accumulator(tmp_path, extra=(("flag", "int32", ["batch", 1]),), state_spec=STATE, sequence_controls=controls)
    data = json.loads((path / "config.json").read_text())
    assert data["state_spec"] == [{**STATE[0], "dtype": "float32", "shape": [1, 4], "initial_state": "zero"}]
    assert data["sequence_controls"] == controls
    config = read_package(path).config
    assert parse_config(config.to_dict(), "again") == config
    assert config.to_dict()["state_spec"] == data["state_spec"]
    out = io_run("inspect", str(path))
    assert "Sequences: stateful" in out
    assert "state    acc_out -> acc_in: float32 [1, 4] (starts as zeros)" in out
    assert "control  flag: CONTROL_SEQUENCE_START" in out


def test_neuropod_infer_runs_one_step_of_a_new_sequence(tmp_path: Path, acc_path: Path) -> None:
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.save(tmp_path / "x.npy", x)
    out = io_run("infer", str(acc_path), "--input", f"x={tmp_path / 'x.npy'}", "--output-dir", str(tmp_path / "out"))
    assert "stateful: one step of a new sequence" in out
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "y.npy"), x)  # from the zero state: 0 + x
    assert not (tmp_path / "out" / "acc_out.npy").exists()  # the state is not the caller's


def io_run(*argv: str) -> str:
    out = io.StringIO()
    assert main(list(argv), out) == 0, out.getvalue()
    return out.getvalue()
