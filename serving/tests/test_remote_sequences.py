"""Remote models' sequences against real ``neuropod serve`` processes, over gRPC and REST: the
sequence parameters sent, the state kept on the server (value-exact against a running sum),
the server's refusals as SequenceError, and a model of two servers keeping each sequence on
the server that holds its state.

The model is an ONNX accumulator with implicit state: ``y = acc_in + x``, ``acc_out -> acc_in``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("grpc")
pytest.importorskip("onnx")

import neuropod
from neuropod.errors import RemoteError, SequenceError, SequenceLimitError
from neuropod.sequences import SequenceStep
from neuropod.testing import served
from neuropod_serving.client import RemoteSequenceError
from neuropod_serving.client._grpc import GrpcTransport
from neuropod_serving.client._http import HttpTransport
from neuropod_serving.client._target import parse_url

from conftest import onnx_package, private_caches

PROTOCOLS = ["grpc", "http"]
MAX_SEQUENCES = 4  # live sequences of one model on the first server


def accumulator(dest: Path) -> Path:
    from onnx import helper

    return onnx_package(
        dest, "acc",
        [helper.make_node("Add", ["x", "acc_in"], ["y"]), helper.make_node("Identity", ["y"], ["acc_out"])],
        [("x", "float32", ["batch", 4]), ("acc_in", "float32", ["batch", 4])],
        [("y", "float32", ["batch", 4]), ("acc_out", "float32", ["batch", 4])],
        state_spec=[{"input_name": "acc_in", "output_name": "acc_out"}],
    )  # fmt: skip


@pytest.fixture(scope="module")
def models() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-remote-seq-"))
    with private_caches(root):
        accumulator(root / "models" / "acc")
        yield root / "models"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(models: Path) -> Iterator[Any]:
    with served(models, options=["--max-sequences", str(MAX_SEQUENCES)]) as s:
        yield s


def _url(server: Any, protocol: str) -> str:
    return f"grpc://{server.grpc}/acc" if protocol == "grpc" else f"{server.http}/acc"


@pytest.fixture(params=PROTOCOLS)
def acc(request: pytest.FixtureRequest, server: Any) -> Iterator[Any]:
    with neuropod.load_neuropod(_url(server, request.param)) as model:
        yield model


def _steps(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-50, 50, size=(n, 1, 4)).astype(np.float32)


def test_interleaved_sequences_keep_their_own_state_on_the_server(acc: Any) -> None:
    assert acc.stateful
    assert [s.name for s in acc.inputs] == ["x"] and [s.name for s in acc.outputs] == ["y"]
    xs = {k: _steps(6, k) for k in range(3)}
    seqs = {k: acc.sequence() for k in xs}
    got: dict[int, list[np.ndarray]] = {k: [] for k in xs}
    for i in range(6):
        for k, seq in seqs.items():  # one step of each sequence in turn
            got[k].append(seq.infer({"x": xs[k][i]}, end=i == 5)["y"])
    for k in xs:
        np.testing.assert_array_equal(np.stack(got[k]), np.cumsum(xs[k], axis=0))
        assert seqs[k].ended


def test_explicit_ids_and_flags_are_sent_as_the_sequence_parameters(acc: Any) -> None:
    x = _steps(3, 7)
    sid = "session-" + acc.urls[0][:4]
    out = [acc.infer({"x": x[0]}, sequence_id=sid, sequence_start=True)["y"]]
    out.append(acc.infer({"x": x[1]}, sequence_id=sid)["y"])
    out.append(acc.infer({"x": x[2]}, sequence_id=sid, sequence_end=True)["y"])
    np.testing.assert_array_equal(np.stack(out), np.cumsum(x, axis=0))
    # START for a live id restarts it from the initial state.
    big = (1 << 64) - 1  # the largest numeric id (a uint64 parameter over gRPC)
    acc.infer({"x": x[0]}, sequence_id=big, sequence_start=True)
    again = acc.infer({"x": x[1]}, sequence_id=big, sequence_start=True, sequence_end=True)["y"]
    np.testing.assert_array_equal(again, x[1])


def test_infer_sequences_sends_one_request_per_step(acc: Any) -> None:
    xs = _steps(3, 11).reshape(3, 4)  # one row for each of three sequences
    ys = _steps(3, 12).reshape(3, 4)
    ids = [101, 102, 103]
    first = acc.infer_sequences({"x": xs}, [SequenceStep(i, start=True) for i in ids])
    np.testing.assert_array_equal(first["y"], xs)
    second = acc.infer_sequences({"x": ys}, [SequenceStep(i, end=True) for i in ids])
    np.testing.assert_array_equal(second["y"], xs + ys)
    with pytest.raises(SequenceError, match="takes? 3|take 3"):
        acc.infer_sequences({"x": ys[:2]}, [SequenceStep(i, start=True) for i in ids])


def test_the_servers_refusals_are_sequence_errors(acc: Any) -> None:
    x = np.ones((1, 4), np.float32)
    with pytest.raises(RemoteSequenceError, match="sequence 987654 is not live") as e:
        acc.infer({"x": x}, sequence_id=987654)
    assert isinstance(e.value, SequenceError) and isinstance(e.value, RemoteError)
    assert e.value.code == "invalid_argument" and e.value.url == acc.urls[0]
    with pytest.raises(SequenceError, match="run it in a sequence"):
        acc.infer({"x": x})  # a stateful model without a sequence: refused here, nothing sent
    with pytest.raises(SequenceError, match="not infer_stream"):
        acc.infer_stream({"x": x})
    with acc.sequence() as seq:
        seq.infer({"x": x})
        with pytest.raises(SequenceError, match="stays on the server"):
            seq.state()
        seq.infer({"x": x}, end=True)
        with pytest.raises(SequenceError, match="has ended"):
            seq.infer({"x": x})
    # More live sequences than the server's bound: refused at once, as a SequenceLimitError.
    live = [acc.sequence() for _ in range(MAX_SEQUENCES)]
    try:
        for seq in live:
            seq.infer({"x": x})
        with pytest.raises(SequenceLimitError) as limit:
            acc.infer({"x": x}, sequence_id="one-too-many", sequence_start=True)
        assert limit.value.code == "resource_exhausted"  # type: ignore[attr-defined]
    finally:
        for seq in live:
            seq.infer({"x": x}, end=True)


def test_two_servers_keep_each_sequence_where_its_state_is(models: Path, server: Any) -> None:
    with contextlib.ExitStack() as second:
        other = second.enter_context(served(models))
        urls = [f"grpc://{server.grpc}/acc", f"{other.http}/acc"]
        with neuropod.load_neuropod(urls) as model:
            xs = {k: _steps(4, 20 + k) for k in range(4)}
            seqs = {k: model.sequence() for k in xs}
            got: dict[int, list[np.ndarray]] = {k: [] for k in xs}
            for i in range(3):
                for k, seq in seqs.items():
                    got[k].append(seq.infer({"x": xs[k][i]})["y"])
            for k in xs:  # a step sent to the other server would have found no state there
                np.testing.assert_array_equal(np.stack(got[k]), np.cumsum(xs[k][:3], axis=0))
            homes = {k: model._homes[seqs[k].id].transport.target.url for k in xs}
            assert set(homes.values()) == set(urls)  # both servers hold sequences
            with pytest.raises(SequenceError, match="was not started through this remote model"):
                model.infer({"x": xs[0][0]}, sequence_id=424242)
            on_other = [k for k in xs if homes[k] == urls[1]]
            on_first = [k for k in xs if homes[k] == urls[0]]
            second.close()  # the second server stops
            for k in on_other:  # the server that held the state is gone: a clear error, no restart
                with pytest.raises(RemoteSequenceError, match="the server that holds its state") as e:
                    seqs[k].infer({"x": xs[k][3]})
                assert f"sequence {seqs[k].id!r}" in str(e.value) and "Start the sequence again" in str(e.value)
            for k in on_first:  # the others go on
                y = seqs[k].infer({"x": xs[k][3]}, end=True)["y"]
                np.testing.assert_array_equal(y, np.cumsum(xs[k], axis=0)[3])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_model_configuration_says_stateful_as_triton_does(server: Any, protocol: str) -> None:
    """What a remote model of another server (Triton) reads: ``sequence_batching`` in the model's
    configuration, over each protocol (here from neuropod serve, which writes it as Triton does)."""
    target = parse_url(_url(server, protocol))
    transport = GrpcTransport(target) if protocol == "grpc" else HttpTransport(target)
    try:
        assert transport.config_flags(10) == (False, True)  # not decoupled; stateful
    finally:
        transport.close()
