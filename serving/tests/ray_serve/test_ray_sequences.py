"""A stateful model on Ray Serve with two replicas: every step of a sequence reaches the replica
that holds its state (handles, gRPC through Ray's gRPC proxy, REST through its HTTP proxy, the
last two read by remote models), value-exact against a running sum; a killed replica's sequences
end with a clear error on their next step while the other replica's go on.

The model is an ONNX accumulator with implicit state: ``y = acc_in + x``, ``acc_out -> acc_in``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("grpc")
pytest.importorskip("onnx")

from ray import serve

import neuropod
from neuropod.errors import SequenceError
from neuropod_serving import ray as neuropod_ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # serving/tests: the shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_support import replica_infos, serve_cluster, wait_running

from conftest import free_port_below_ephemeral, onnx_package, private_caches

APP = "acc"
STEPS = 4


@dataclass
class Served:
    http_port: int
    grpc_port: int


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
def served() -> Iterator[Served]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-ray-seq-"))
    with private_caches(root):  # before ray.init: Ray's workers inherit the environment
        package = accumulator(root / "models" / "acc")
        ports = Served(free_port_below_ephemeral(), free_port_below_ephemeral())
        try:
            with serve_cluster(ports.http_port, ports.grpc_port, num_cpus=2):
                # Sequences outlive a replica's replacement (seconds) without sitting idle past the limit.
                app = neuropod_ray.build(package, num_replicas=2, ray_actor_options={"num_cpus": 0.5},
                                         max_sequence_idle_us=120_000_000)  # fmt: skip
                serve.run(app, name=APP, route_prefix="/")
                yield ports
        finally:
            shutil.rmtree(root, ignore_errors=True)


class Paths:
    """One sequence's steps by one way in: a handle, or a remote model by gRPC or HTTP URL."""

    def __init__(self, served: Served) -> None:
        self.handle = serve.get_app_handle(APP)
        self.grpc = neuropod.load_neuropod(f"grpc://127.0.0.1:{served.grpc_port}/{APP}")
        self.http = neuropod.load_neuropod(f"http://127.0.0.1:{served.http_port}/{APP}")

    def step(self, way: str, sequence_id: int | str, x: np.ndarray, *, start: bool = False, end: bool = False) -> Any:
        if way == "handle":
            call = self.handle.infer.remote({"x": x}, sequence_id=sequence_id, sequence_start=start, sequence_end=end)
            return call.result(timeout_s=60)["y"]
        model = self.grpc if way == "grpc" else self.http
        return model.infer({"x": x}, sequence_id=sequence_id, sequence_start=start, sequence_end=end)["y"]

    def close(self) -> None:
        self.grpc.close()
        self.http.close()


WAYS = ["handle", "grpc", "http"]


def _xs(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-50, 50, size=(n, 1, 4)).astype(np.float32)


def _holders(sequences: list[int | str]) -> dict[int | str, str]:
    """The replica holding each of ``sequences`` (from every replica's info())."""
    found = {}
    for replica, info in replica_infos(APP, 2).items():
        for sid in info["sequences"]:
            found[sid] = replica
    return {sid: found[sid] for sid in sequences if sid in found}


def test_each_sequence_stays_on_the_replica_that_holds_its_state(served: Served) -> None:
    wait_running(APP, 2, 60)
    paths = Paths(served)
    try:
        # Twelve sequences, four per way in, numeric and string ids, one step of each in turn.
        ids: dict[int | str, str] = {}
        for i in range(12):
            ids[(1000 + i) if i % 2 else f"s-{i}"] = WAYS[i % 3]
        xs = {sid: _xs(STEPS, k) for k, sid in enumerate(ids)}
        got: dict[int | str, list[np.ndarray]] = {sid: [] for sid in ids}
        for i in range(STEPS - 1):
            for sid, way in ids.items():
                got[sid].append(paths.step(way, sid, xs[sid][i], start=i == 0))
        holders = _holders(list(ids))
        assert set(holders) == set(ids)  # each live on one replica...
        assert len(set(holders.values())) == 2  # ... and both replicas hold some
        for sid, way in ids.items():
            got[sid].append(paths.step(way, sid, xs[sid][STEPS - 1], end=True))
            np.testing.assert_array_equal(np.stack(got[sid]), np.cumsum(xs[sid], axis=0))
        assert sum(i["live_sequences"] for i in replica_infos(APP, 2).values()) == 0  # all ended
    finally:
        paths.close()


def test_a_killed_replicas_sequences_end_with_a_clear_error_and_the_others_go_on(served: Served) -> None:
    wait_running(APP, 2, 60)
    paths = Paths(served)
    try:
        ids: dict[int | str, str] = {2000 + i: WAYS[i % 3] for i in range(12)}
        xs = {sid: _xs(3, 50 + k) for k, sid in enumerate(ids)}
        for sid, way in ids.items():
            np.testing.assert_array_equal(paths.step(way, sid, xs[sid][0], start=True), xs[sid][0])
        holders = _holders(list(ids))
        infos = replica_infos(APP, 2)
        victim = holders[2000]
        os.kill(infos[victim]["pid"], signal.SIGKILL)
        # Ray replaces the replica (a new one, without the state); then each way in is asked again.
        deadline = time.monotonic() + 60
        while victim in replica_infos(APP, 2):
            assert time.monotonic() < deadline, "the killed replica was not replaced within 60 s"
            time.sleep(0.5)
        wait_running(APP, 2, 60)
        for sid, way in ids.items():
            if holders[sid] == victim:
                with pytest.raises(SequenceError, match="replica that held its state .* is gone") as e:
                    paths.step(way, sid, xs[sid][1])
                assert f"sequence {sid!r} is lost" in str(e.value) and "Start the sequence again" in str(e.value)
                # Started again, it runs from the initial state, on a replica that is there.
                np.testing.assert_array_equal(paths.step(way, sid, xs[sid][1], start=True, end=True), xs[sid][1])
            else:
                y = paths.step(way, sid, xs[sid][1], end=True)
                np.testing.assert_array_equal(y, xs[sid][0] + xs[sid][1])
        assert any(holders[sid] != victim for sid in ids) and any(holders[sid] == victim for sid in ids)
    finally:
        paths.close()
