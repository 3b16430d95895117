"""A decoupled model streaming through the Ray Serve deployment: Ray's streaming handles (the
deployment's ``infer_stream`` generator), REST ``infer_stream`` through Ray's HTTP proxy (Server-Sent
Events) and gRPC ``ModelStreamInfer`` through Ray's gRPC proxy, the last two read by remote models.

One small cluster (one CPU, one replica) for the module. The model is ``repeat``
(serving/tests/streaming_models.py): responses in order, as they are made (the gate), a caller that
stops closes the model's generator in the replica (the mark), an error after some responses.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("grpc")
pytest.importorskip("neuropod_python")  # the decoupled model's backend

import grpc
from ray import serve

import neuropod
from neuropod.errors import RemoteError
from neuropod_serving import ray as neuropod_ray
from neuropod_serving.client._grpc import split_stream_response
from neuropod_serving.protocol import grpc_codec as codec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # serving/tests: the shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ray_support import serve_cluster

from streaming_models import repeat_inputs, repeat_package, wait_for

from conftest import free_port_below_ephemeral, private_caches

APP = "repeat"


@dataclass
class Served:
    root: Path
    http_port: int
    grpc_port: int


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-ray-stream-"))
    with private_caches(root):  # before ray.init: Ray's workers inherit the environment
        package = repeat_package(root / "models" / "repeat")
        ports = Served(root, free_port_below_ephemeral(), free_port_below_ephemeral())
        try:
            with serve_cluster(ports.http_port, ports.grpc_port, num_cpus=1):
                serve.run(neuropod_ray.build(package, ray_actor_options={"num_cpus": 0.5}), name=APP, route_prefix="/")
                yield ports
        finally:
            shutil.rmtree(root, ignore_errors=True)


def test_a_streaming_handle_gets_each_response_as_it_is_made(served: Served, tmp_path: Path) -> None:
    handle = serve.get_app_handle(APP).options(stream=True)
    gate = tmp_path / "gate"
    responses = handle.infer_stream.remote(repeat_inputs([4, 5, 6]), None, {"gate": str(gate)})
    seen = []
    for i, outputs in enumerate(responses):
        seen.append((int(outputs["OUT"][0]), int(outputs["IDX"][0])))
        Path(f"{gate}.{i + 1}").touch()  # the model makes response i + 1 only now
    assert seen == [(4, 0), (5, 1), (6, 2)]
    # Requested outputs, and a cancelled call closes the model's generator in the replica.
    mark = tmp_path / "mark"
    responses = handle.infer_stream.remote(repeat_inputs(list(range(100)), 50_000), ["IDX"], {"mark": str(mark)})
    first = next(iter(responses))
    assert list(first) == ["IDX"] and first["IDX"].tolist() == [0]
    responses.cancel()
    assert wait_for(mark, "closed", 5.0), "cancelling the handle's call did not close the model's generator"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_remote_models_stream_through_rays_proxies(served: Served, protocol: str, tmp_path: Path) -> None:
    port = served.http_port if protocol == "http" else served.grpc_port
    with neuropod.load_neuropod(f"{protocol}://127.0.0.1:{port}/{APP}") as model:
        assert model.decoupled
        gate = tmp_path / "gate"
        seen = []
        with model.infer_stream(repeat_inputs([7, 8, 9]), parameters={"gate": str(gate)}, timeout=60) as responses:
            for i, outputs in enumerate(responses):
                seen.append(int(outputs["OUT"][0]))
                Path(f"{gate}.{i + 1}").touch()
        assert seen == [7, 8, 9]
        # An error after two responses: both arrive, then the model's error.
        responses = model.infer_stream(repeat_inputs([1, 2, -3]))
        assert [int(next(responses)["OUT"][0]) for _ in range(2)] == [1, 2]
        with pytest.raises(RemoteError, match="negative value -3 at 2"):
            next(responses)
        # Closing the stream closes the model's generator in the replica.
        mark = tmp_path / "mark"
        responses = model.infer_stream(repeat_inputs(list(range(100)), 50_000), parameters={"mark": str(mark)})
        assert next(responses)["OUT"].tolist() == [0]
        responses.close()
        assert wait_for(mark, "closed", 5.0), f"closing a {protocol} stream did not close the model's generator"


def test_grpc_stream_error_for_an_unknown_model(served: Served) -> None:
    # Ray's proxy routes by application: a request naming another model within it gets the
    # replica's error_message (the stream goes on), as neuropod serve's ModelStreamInfer answers.
    requests = [
        codec.build_model_infer_request("nope", repeat_inputs([1])).SerializeToString(),
        codec.build_model_infer_request(APP, repeat_inputs([3, 4])).SerializeToString(),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        answers = [split_stream_response(a) for a in call(iter(requests), metadata=(("application", APP),), timeout=60)]
    assert len(answers) == 3
    assert "nope" in answers[0][0]
    outs = [codec.deserialize_model_infer_response(a).outputs["OUT"].tolist() for e, a in answers[1:] if not e]
    assert outs == [[3], [4]]
