"""The conformance suite's stateful tests (:class:`StatefulConformance`, a base of
:class:`~neuropod.testing.BackendConformance`): a backend needs nothing of its own for state, which
is tensors in and out of the model, and these tests check that sequences of its models work.

Each backend packages one small model for them, the *accumulator*
(:meth:`StatefulConformance.make_accumulator_package`): its output ``y`` is the running sum of its
input ``x`` over a sequence's steps, kept by the runtime as the state pair ``acc_out -> acc_in``.
Its inputs are small integers as float32, so every expected value (numpy's ``cumsum``) is exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pytest

from neuropod.errors import SequenceError
from neuropod.package import read_package
from neuropod.sequences import SequenceStep
from neuropod.statespec import StatePair
from neuropod.testdata import run_test_data
from neuropod.testing.marks import covers

if TYPE_CHECKING:
    from neuropod.backend import Backend
    from neuropod.model import NeuropodModel

#: The accumulator's width: ``x``, ``acc_in``, ``y`` and ``acc_out`` are float32 ``["batch", WIDTH]``.
WIDTH = 4
#: The accumulator's state pair, as the suite passes it (``state_spec=``) to ``make_accumulator_package``.
ACCUMULATOR_STATE: tuple[dict[str, Any], ...] = ({"input_name": "acc_in", "output_name": "acc_out"},)


def accumulator_spec() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The accumulator's input and output specs (new lists each call): inputs ``x`` and ``acc_in``,
    outputs ``y`` and ``acc_out``, each float32 ``["batch", 4]``, in that order."""
    inputs = [{"name": n, "dtype": "float32", "shape": ["batch", WIDTH]} for n in ("x", "acc_in")]
    outputs = [{"name": n, "dtype": "float32", "shape": ["batch", WIDTH]} for n in ("y", "acc_out")]
    return inputs, outputs


def _steps(count: int, seed: int, rows: int = 1) -> np.ndarray:
    """``count`` inputs ``x`` of one sequence: small integers as float32 (sums of them are exact)."""
    return np.random.default_rng(seed).integers(-50, 50, (count, rows, WIDTH)).astype(np.float32)


def _running_sums(xs: np.ndarray, initial: np.ndarray | float = 0.0) -> np.ndarray:
    """What ``y`` must be at each step: the initial state plus the sum of ``x`` so far."""
    return (np.cumsum(xs.astype(np.float64), axis=0) + initial).astype(np.float32)


class StatefulConformance:
    """The stateful half of the conformance suite; implement :meth:`make_accumulator_package`."""

    if TYPE_CHECKING:
        platform: ClassVar[str]
        device: ClassVar[str]

        def _backend(self) -> Backend: ...

        def _load(self, path: Path, **options: Any) -> NeuropodModel: ...

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        """Package the accumulator, a small real model of this platform, and return its path.

        The model has the specs of :func:`accumulator_spec`: inputs ``x`` and ``acc_in``, outputs
        ``y`` and ``acc_out``, all float32 ``["batch", 4]``, and computes ``y = acc_in + x`` and
        ``acc_out = acc_in + x`` row by row (any batch size). Pass ``packager_kwargs`` to the
        platform's packager unchanged: the suite always gives ``state_spec`` (the pair
        ``acc_out -> acc_in`` of :data:`ACCUMULATOR_STATE`, sometimes with an initial state array),
        and sometimes ``test_input_data`` / ``test_expected_out``. Write the package under
        ``tmp_path / name``; the packager's own check runs one step of the model.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement make_accumulator_package")

    @covers("load_model", "infer", runs_model=True)
    def test_sequence_accumulates(self, tmp_path: Path) -> None:
        """A sequence's steps see the state its earlier steps left: ``y`` is the running sum of ``x``;
        state and control inputs are not the caller's; ending the sequence frees its state."""
        self._backend()
        xs = _steps(6, seed=1)
        path = self.make_accumulator_package(
            tmp_path, "accumulator", state_spec=list(ACCUMULATOR_STATE),
            test_input_data={"x": xs[0]}, test_expected_out={"y": xs[0]},
        )  # fmt: skip
        config = read_package(path).config
        assert config.state_spec == (StatePair("acc_in", "acc_out", "float32", (1, WIDTH)),), config.state_spec
        assert config.sequence_controls == ()
        report = run_test_data(path, device=self.device, backend=self.platform)  # one step of a new sequence
        assert report.passed, report.mismatches
        with self._load(path) as model:
            assert model.stateful and model.sequence_batching, model.sequence_batching_problem
            assert [s.name for s in model.inputs] == ["x"] and [s.name for s in model.outputs] == ["y"]
            with pytest.raises(SequenceError, match="sequence"):
                model.infer({"x": xs[0]})  # a stateful model runs in a sequence
            expected = _running_sums(xs)
            with model.sequence() as seq:
                np.testing.assert_array_equal(seq.state()["acc_in"], np.zeros((1, WIDTH), np.float32))
                for x, want in zip(xs, expected):
                    out = seq.infer({"x": x})
                    assert set(out) == {"y"}, set(out)
                    assert out["y"].dtype == np.float32 and out["y"].shape == (1, WIDTH)
                    np.testing.assert_array_equal(out["y"], want)
                    np.testing.assert_array_equal(seq.state()["acc_in"], want)
                assert model.live_sequences == 1
            assert model.live_sequences == 0
            with pytest.raises(SequenceError, match=repr(seq.id)):
                model.infer({"x": xs[0]}, sequence_id=seq.id)  # ended: a new step must start it again

    @covers("load_model", "infer", runs_model=True)
    def test_sequences_interleaved(self, tmp_path: Path) -> None:
        """Steps of several sequences (numeric and string ids) in any order each see only their own
        state, from an initial state stored with the package; START on a live id restarts it; END
        frees the state at once."""
        self._backend()
        initial = np.arange(1, WIDTH + 1, dtype=np.float32).reshape(1, WIDTH) * 10
        path = self.make_accumulator_package(
            tmp_path, "accumulator_initial", state_spec=[{**ACCUMULATOR_STATE[0], "initial_state": initial}]
        )
        ids: list[int | str] = [1, 2, "walker", 2**64 - 1]
        count = 5
        xs = {sid: _steps(count, seed=10 + i) for i, sid in enumerate(ids)}
        order = [sid for sid in ids for _ in range(count)]
        np.random.default_rng(3).shuffle(order)
        done = dict.fromkeys(ids, 0)
        with self._load(path) as model:
            for sid in order:
                k = done[sid]
                out = model.infer(
                    {"x": xs[sid][k]}, sequence_id=sid, sequence_start=k == 0, sequence_end=k == count - 1
                )
                np.testing.assert_array_equal(
                    out["y"], _running_sums(xs[sid], initial)[k], err_msg=f"sequence {sid!r} step {k}"
                )
                done[sid] = k + 1
                assert model.live_sequences == sum(0 < n < count for n in done.values())
            assert model.live_sequences == 0
            with pytest.raises(SequenceError, match="'walker'"):
                model.infer({"x": xs["walker"][0]}, sequence_id="walker")
            # START for a live id starts it again from the initial state.
            x = xs[1][0]
            model.infer({"x": x}, sequence_id=1, sequence_start=True)
            out = model.infer({"x": x}, sequence_id=1, sequence_start=True, sequence_end=True)
            np.testing.assert_array_equal(out["y"], initial + x)
            assert model.live_sequences == 0

    @covers("load_model", "infer", runs_model=True)
    def test_infer_sequences_in_one_call(self, tmp_path: Path) -> None:
        """``infer_sequences`` runs one step of several sequences in one call of the model (inputs,
        states and outputs stacked along the batch), with the values of running them one by one."""
        self._backend()
        path = self.make_accumulator_package(tmp_path, "accumulator_batched", state_spec=list(ACCUMULATOR_STATE))
        # Rounds of (sequence, start, end): sequences join and leave between calls.
        rounds = [
            [("a", True, False), ("b", True, False), ("c", True, False)],
            [("c", False, False), ("a", False, False), ("b", False, True)],
            [("a", False, False), ("d", True, False), ("c", False, True)],
            [("d", False, True), ("a", False, True)],
        ]
        xs = {sid: _steps(4, seed=20 + i) for i, sid in enumerate("abcd")}
        taken = dict.fromkeys("abcd", 0)
        with self._load(path) as model:
            for steps in rounds:
                x = np.concatenate([xs[sid][taken[sid]] for sid, _, _ in steps])
                batched = model.infer_sequences({"x": x}, [SequenceStep(sid, start, end) for sid, start, end in steps])
                assert set(batched) == {"y"} and batched["y"].shape == (len(steps), WIDTH)
                for row, (sid, start, end) in enumerate(steps):
                    k = taken[sid]
                    alone = model.infer(
                        {"x": xs[sid][k]}, sequence_id=f"alone-{sid}", sequence_start=start, sequence_end=end
                    )
                    np.testing.assert_array_equal(
                        batched["y"][row : row + 1], alone["y"], err_msg=f"sequence {sid} step {k}"
                    )
                    np.testing.assert_array_equal(alone["y"], _running_sums(xs[sid])[k])
                    taken[sid] = k + 1
            assert model.live_sequences == 0

    @covers("load_model", "infer", runs_model=True)
    def test_sequences_in_a_worker(self, tmp_path: Path) -> None:
        """The same in a worker process (``use_ope=True``): values, ``seq.state()``, interleaved
        sequences, several in one call, and END freeing the state."""
        self._backend()
        path = self.make_accumulator_package(tmp_path, "accumulator_worker", state_spec=list(ACCUMULATOR_STATE))
        xs = {sid: _steps(4, seed=30 + sid) for sid in (1, 2)}
        with self._load(path, use_ope=True) as model:
            assert model.stateful
            with model.sequence() as seq:
                for x, want in zip(xs[1], _running_sums(xs[1])):
                    np.testing.assert_array_equal(seq.infer({"x": x})["y"], want)
                np.testing.assert_array_equal(seq.state()["acc_in"], want)
            assert model.live_sequences == 0
            for k in range(4):
                steps = [SequenceStep(sid, start=k == 0, end=k == 3) for sid in (2, 1)]
                out = model.infer_sequences({"x": np.concatenate([xs[2][k], xs[1][k]])}, steps)
                np.testing.assert_array_equal(out["y"][0:1], _running_sums(xs[2])[k])
                np.testing.assert_array_equal(out["y"][1:2], _running_sums(xs[1])[k])
            assert model.live_sequences == 0
            with pytest.raises(SequenceError, match="sequence 2 is not live"):
                model.infer({"x": xs[2][0]}, sequence_id=2)


__all__ = ["ACCUMULATOR_STATE", "WIDTH", "StatefulConformance", "accumulator_spec"]
