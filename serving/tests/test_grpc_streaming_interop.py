"""Triton's own clients against a decoupled model served by neuropod over gRPC, unchanged:
Triton's example ``simple_grpc_custom_repeat.py`` (vendored byte for byte in triton_examples/, run as a
subprocess), tritonclient.grpc.aio's ``stream_infer``, and ``perf_analyzer --streaming``.

The model is grpc_stream_models.py's repeat_int32 python package (Triton's interface). perf_analyzer
runs when ``../shared/tools/perf-analyzer`` (beside the checkout; it fetches perf_analyzer on first use)
or ``perf_analyzer`` on PATH can run it; otherwise that test is skipped, saying why.
"""

from __future__ import annotations

import asyncio
import csv
import io
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")
aioclient = pytest.importorskip("tritonclient.grpc.aio")

from grpc_stream_models import StreamServer, repeat_inputs, stream_server  # noqa: E402

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE / "triton_examples" / "simple_grpc_custom_repeat.py"


@pytest.fixture(scope="module")
def server() -> Iterator[StreamServer]:
    with stream_server() as s:
        yield s


def test_tritons_own_example_unchanged(server: StreamServer) -> None:
    """simple_grpc_custom_repeat.py: 10 responses of repeat_int32 on a stream, checked by the example itself."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "-u", f"localhost:{server.port}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: Decoupled API" in proc.stdout
    assert [line for line in proc.stdout.splitlines() if " : " in line] == [f"{v} : {v}" for v in range(100, 110)]
    server.wait_closed(100, within=5)


def test_tritonclient_aio_stream_infer(server: StreamServer) -> None:
    """tritonclient.grpc.aio: two requests from an async iterator, every response in order with its request's id."""

    async def run() -> list[tuple[str, int, int]]:
        client = aioclient.InferenceServerClient(f"127.0.0.1:{server.port}")
        try:

            async def requests() -> AsyncIterator[dict[str, Any]]:
                yield {
                    "model_name": "repeat_int32",
                    "inputs": repeat_inputs(aioclient, [5, 6, 7], 1000),
                    "request_id": "x",
                }
                yield {"model_name": "repeat_int32", "inputs": repeat_inputs(aioclient, [8]), "request_id": "y"}

            got = []
            responses = client.stream_infer(inputs_iterator=requests())
            async for result, error in responses:
                assert error is None, error
                got.append((result.get_response().id, int(result.as_numpy("OUT")[0]), int(result.as_numpy("IDX")[0])))
                if len(got) == 4:
                    responses.cancel()
                    break
            return got
        finally:
            await client.close()

    assert asyncio.run(run()) == [("x", 5, 0), ("x", 6, 1), ("x", 7, 2), ("y", 8, 0)]


def _perf_analyzer() -> list[str] | None:
    shared = HERE.parent.parent.parent / "shared" / "tools" / "perf-analyzer"
    if shared.exists():
        return [str(shared)]
    found = shutil.which("perf_analyzer")
    return [found] if found else None


def test_perf_analyzer_streaming(server: StreamServer, tmp_path: Path) -> None:
    """perf_analyzer --streaming against repeat_int32 (8 responses a request, no delays): it reads the
    model's configuration (decoupled), sends requests on streams, and counts each request done at its empty
    final response."""
    command = _perf_analyzer()
    if command is None:
        pytest.skip("perf_analyzer not found (neither ../shared/tools/perf-analyzer nor perf_analyzer on PATH)")
    out = tmp_path / "pa.csv"
    full = [
        *command, "-m", "repeat_int32", "-u", f"127.0.0.1:{server.port}", "-i", "grpc", "--streaming",
        "--concurrency-range", "2:2", "--measurement-mode", "count_windows", "--measurement-request-count", "40",
        "--stability-percentage", "100", "--max-trials", "3", "--input-data", "zero",
        "--shape", "IN:8", "--shape", "DELAY:8", "--shape", "WAIT:1", "-f", str(out),
    ]  # fmt: skip
    try:
        proc = subprocess.run(full, capture_output=True, text=True, timeout=240)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"perf_analyzer cannot run here: {e}")
    if proc.returncode != 0 and "Measurement Settings" not in proc.stdout:
        # It never started measuring: fetching it or its loader failed (no network, no apt), or it cannot run.
        pytest.skip(f"perf_analyzer cannot run here ({proc.returncode}): {(proc.stderr or proc.stdout)[-500:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Detected decoupled model" in proc.stdout  # from the model configuration's transaction policy
    # The server-side breakdown: each request counted once, its compute the generator's time.
    counts = re.findall(r"Inference count: (\d+)", proc.stdout)
    assert counts and int(counts[-1]) > 0, proc.stdout[-3000:]
    [row] = list(csv.DictReader(io.StringIO(out.read_text())))
    assert float(row["Inferences/Second"]) > 0
    assert float(row["Response Throughput"]) == pytest.approx(8 * float(row["Inferences/Second"]), rel=0.05)
