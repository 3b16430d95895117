"""A rollout fails no request: a request that named no version runs on the model's latest version
when it is admitted, whatever swapped while it was read and decoded (REST, gRPC, Server-Sent Events,
gRPC streams), and a version that stops serving waits for the streams open on it.

The races are played in order, not waited for: the swap is made from inside the server's own
lookup (``Engine.current`` or ``Engine.get``), right after it answered with the version being
replaced, which is the moment a poll's swap could slip in between a request's lookup and its
admission. The models are Python packages computing ``y = x * K``, K per version, so the answer
says which version ran.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("grpc")

from streaming_models import repeat_inputs, repeat_package  # noqa: E402
from versions_helpers import build_scalers, expected, infer, place, serving  # noqa: E402

from conftest import private_caches  # noqa: E402


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("admission")
    with private_caches(root):
        scalers = build_scalers(root / "stage", (1, 2))
        yield {"scaler1": scalers[1], "scaler2": scalers[2], "repeat": repeat_package(root / "repeat" / "repeat")}


def _swap_once(engine: Any, lookup: str, repo: Path, source: Path, model: str) -> list[float]:
    """Make ``engine.<lookup>`` put version 2 of ``model`` in place of version 1 the first time it
    answers for ``model``: it answers with version 1, then the swap runs to its end (version 1
    drained and closed). Returns the list the swap's end time lands in."""
    real: Callable[..., Any] = getattr(engine, lookup)
    done: list[float] = []

    def looked_up(served_or_name: Any, version: str | None = None) -> Any:
        found = real(served_or_name, version)
        name = served_or_name if isinstance(served_or_name, str) else served_or_name.name
        if not done and name == model:
            place(source, repo / model / "2")
            engine.load(model)
            done.append(time.monotonic())
        return found

    setattr(engine, lookup, looked_up)
    return done


@pytest.mark.parametrize("protocol", ["rest", "grpc"])
def test_a_request_whose_version_is_swapped_before_admission_runs_on_the_new_one(
    tmp_path: Path, packages: dict[str, Path], protocol: str
) -> None:
    import neuropod
    from neuropod_serving.server.grpc_server import start_grpc_server

    repo = tmp_path / "models"
    place(packages["scaler1"], repo / "scaler" / "1")
    x = np.array([[3.0, 0.0]], np.float32)
    with serving([repo]) as (engine, http):
        done = _swap_once(engine, "current", repo, packages["scaler2"], "scaler")
        if protocol == "rest":
            r = infer(http)
            assert r.status_code == 200, r.text
            body = r.json()
            assert (body["model_version"], body["outputs"][0]["data"]) == ("2", expected(2))
        else:
            server, port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
            try:
                with neuropod.load_neuropod(f"grpc://127.0.0.1:{port}/scaler") as model:
                    np.testing.assert_array_equal(model.infer({"x": x})["y"], x * 2)
            finally:
                server.stop(0)
        assert done, "the swap never ran: the request did not look its version up"
        assert engine.registry.versions("scaler") == ["2"]


def test_a_request_naming_a_version_swapped_out_before_admission_is_not_found(
    tmp_path: Path, packages: dict[str, Path]
) -> None:
    repo = tmp_path / "models"
    place(packages["scaler1"], repo / "scaler" / "1")
    with serving([repo]) as (engine, http):
        _swap_once(engine, "get", repo, packages["scaler2"], "scaler")
        r = infer(http, version="1")
        assert r.status_code == 404, r.text
        assert "unloaded" in r.json()["error"]


def _sse_events(response: Any) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]


@pytest.mark.parametrize("protocol", ["sse", "grpc"])
def test_a_stream_whose_version_is_swapped_while_it_is_read_opens_on_the_new_one(
    tmp_path: Path, packages: dict[str, Path], protocol: str
) -> None:
    import neuropod
    from neuropod_serving.server.grpc_server import start_grpc_server

    repo = tmp_path / "models"
    place(packages["repeat"], repo / "repeat" / "1")
    with serving([repo]) as (engine, http):
        if protocol == "sse":
            # The lookup that starts the request, before its body is read and decoded.
            done = _swap_once(engine, "get", repo, packages["repeat"], "repeat")
            r = http.post("/v2/models/repeat/generate_stream", json={"IN": [4, 5], "DELAY": [0, 0], "WAIT": 0})
            assert r.status_code == 200, r.text
            events = _sse_events(r)
            assert [e["OUT"] for e in events] == [4, 5], events
            assert {e["model_version"] for e in events} == {"2"}, events
        else:
            server, port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
            try:
                with neuropod.load_neuropod(f"grpc://127.0.0.1:{port}/repeat") as model:
                    # After the client read the model's metadata: the lookup of the stream's call.
                    done = _swap_once(engine, "get", repo, packages["repeat"], "repeat")
                    with model.infer_stream(repeat_inputs([4, 5])) as responses:
                        got = [int(r["OUT"][0]) for r in responses]
                assert got == [4, 5]
            finally:
                server.stop(0)
        assert done, "the swap never ran"
        assert engine.registry.versions("repeat") == ["2"]


def test_a_version_that_stops_serving_waits_for_its_open_streams(tmp_path: Path, packages: dict[str, Path]) -> None:
    repo = tmp_path / "models"
    place(packages["repeat"], repo / "repeat" / "1")
    with serving([repo]) as (engine, _http):
        old = engine.get("repeat")
        values = list(range(1, 9))
        swapped: list[float] = []
        with engine.open_stream(old, repeat_inputs(values, delay_us=40_000)) as stream:
            got = [int(next(stream)["OUT"][0])]
            place(packages["repeat"], repo / "repeat" / "2")
            swap = threading.Thread(target=lambda: (engine.load("repeat"), swapped.append(time.monotonic())))
            swap.start()
            got += [int(r["OUT"][0]) for r in stream]
            ended = time.monotonic()
        swap.join(30)
        assert got == values
        assert swapped and swapped[0] >= ended, "version 1 was closed while a stream still ran on it"
        assert engine.registry.versions("repeat") == ["2"]


def test_a_refused_stream_leaves_nothing_for_a_swap_to_wait_for(tmp_path: Path, packages: dict[str, Path]) -> None:
    """A stream refused at its model's limit of open streams (429) holds nothing of its version:
    once the stream that was open closes, a swap closes the old version at once, not after 30 s."""
    from neuropod_serving.errors import ModelBusyError
    from neuropod_serving.server import Engine, ModelRegistry
    from neuropod_serving.server.streams import StreamLimits

    repo = tmp_path / "models"
    place(packages["repeat"], repo / "repeat" / "1")
    engine = Engine(ModelRegistry.load([repo]), stream_limits=StreamLimits(max_open=1))
    try:
        old = engine.get("repeat")
        with engine.open_stream(old, repeat_inputs([1])) as stream:
            with pytest.raises(ModelBusyError):
                engine.open_stream(old, repeat_inputs([2]))
            assert [int(r["OUT"][0]) for r in stream] == [1]
        place(packages["repeat"], repo / "repeat" / "2")
        started = time.monotonic()
        engine.load("repeat")
        assert time.monotonic() - started < 5, "the swap waited for a stream that never opened"
        assert engine.registry.versions("repeat") == ["2"]
    finally:
        engine.close()
