"""Triton's four sequence client examples, unchanged, against ``neuropod serve``.

The examples (vendored byte for byte in triton_examples/, run as subprocesses with ``-u``) are
``simple_http_sequence_sync_infer_client.py``, ``simple_grpc_sequence_sync_infer_client.py``,
``simple_grpc_sequence_stream_infer_client.py`` and ``simple_grpc_aio_sequence_stream_infer_client.py``,
each run as Triton's own QA runs them: plainly (``simple_sequence`` with two numeric ids and one
UUID string id) and with ``-d`` (``simple_dyna_sequence`` with numeric ids, whose CORRID the server
fills, and ``simple_string_dyna_sequence``, an accumulator with implicit state, with the string id
"1002"). The models (sequence_models.py) are declared both ways: with the packaging keywords, and
packaged plain and made stateful by Triton's model configuration sent with a repository load.
Each example checks its answers itself; the values it prints are checked here too, against
sequence_models.expected_outputs.

``perf_analyzer`` in its sequence mode (``--sequence-length``, ``--sequence-id-range``) runs when
``../shared/tools/perf-analyzer`` (beside the checkout) or ``perf_analyzer`` on PATH can run it;
otherwise that test is skipped, saying why.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("grpc")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")
pytest.importorskip("onnx")

from neuropod import load_neuropod
from neuropod.testing import served
from sequence_models import DYNA, SIMPLE, STRING_DYNA, expected_outputs, sequence_repository, triton_config

from conftest import ExampleServer as Server
from conftest import private_caches

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE / "triton_examples"
#: Each example, the protocol it speaks and the line it prints when every answer was right.
SCRIPTS = {
    "simple_http_sequence_sync_infer_client.py": ("http", "PASS: Sequence"),
    "simple_grpc_sequence_sync_infer_client.py": ("grpc", "PASS: Sequence"),
    "simple_grpc_sequence_stream_infer_client.py": ("grpc", "PASS: Sequence"),
    "simple_grpc_aio_sequence_stream_infer_client.py": ("grpc", "PASS: grpc aio sequence stream"),
}
#: What every example sends: three sequences of these values after a first one (0, 100, 20).
VALUES = [11, 7, 5, 3, 2, 0, 1]


@pytest.fixture(scope="module", params=["keywords", "config"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """``neuropod serve`` over Triton's three sequence models: packaged with ``sequence_controls`` /
    ``state_spec`` ("keywords"), or packaged plain and loaded again with Triton's configuration
    ("config")."""
    via = request.param
    root = Path(tempfile.mkdtemp(prefix=f"neuropod-triton-seq-{via}-"))
    try:
        with private_caches(root):
            names = sequence_repository(root / "models", via="keywords" if via == "keywords" else "plain")
            with served(root / "models", options=["--max-batch-size", "8"]) as where:
                s = Server(via, where.http, where.grpc)
                if via == "config":
                    for name in names:
                        body = {"parameters": {"config": json.dumps(triton_config(name))}}
                        status, text = s.post(f"/v2/repository/models/{name}/load", body)
                        assert status == 200, f"load of {name} with Triton's config: {status} {text}"
                yield s
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _expected(dyna: bool) -> list[tuple[int, int, int]]:
    """The three columns an example prints: its two numeric sequences and its string one."""
    first = [0, *VALUES]
    negated = [-v for v in VALUES]
    if dyna:
        columns = [expected_outputs(DYNA, first, 1000), expected_outputs(DYNA, [100, *negated], 1001),
                   expected_outputs(STRING_DYNA, [20, *negated], "1002")]  # fmt: skip
    else:
        # The string sequence's id is a UUID; simple_sequence's answers do not depend on it.
        columns = [expected_outputs(SIMPLE, first, 1000), expected_outputs(SIMPLE, [100, *negated], 1001),
                   expected_outputs(SIMPLE, [20, *negated], "a-uuid")]  # fmt: skip
    return list(zip(*columns))


@pytest.mark.parametrize("dyna", [False, True], ids=["simple_sequence", "dyna"])
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_tritons_sequence_example_unchanged(server: Server, script: str, dyna: bool) -> None:
    """The example, run as Triton's QA runs it (``-u URL``, and ``-d``), exits 0 with its PASS line
    and prints each step's three answers as computed apart."""
    protocol, passed = SCRIPTS[script]
    url = server.http.removeprefix("http://") if protocol == "http" else server.grpc
    command = [sys.executable, str(EXAMPLES / script), "-u", url, *(["-d"] if dyna else [])]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert passed in proc.stdout.splitlines(), output[-3000:]
    printed = [tuple(int(v) for v in m.groups()) for m in re.finditer(r"^\[\d+\] (-?\d+) : (-?\d+) : (-?\d+)$",
                                                                       proc.stdout, re.MULTILINE)]  # fmt: skip
    assert printed == _expected(dyna), proc.stdout
    # Each sequence's last step (END) freed its state on the server.
    with urllib.request.urlopen(f"{server.http}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    live = dict(re.findall(r'^neuropod_sequences_live\{model="([^"]+)"\} (\S+)$', metrics, re.MULTILINE))
    assert {name: float(v) for name, v in live.items()} == dict.fromkeys([SIMPLE, DYNA, STRING_DYNA], 0.0), live


@pytest.mark.parametrize(("name", "sequence_id"), [(SIMPLE, 1000), (SIMPLE, "4b9e-a-uuid"), (DYNA, 1001),
                                                   (STRING_DYNA, "1002")])  # fmt: skip
def test_the_models_in_process(tmp_path: Path, name: str, sequence_id: int | str) -> None:
    """The packages (declared with the keywords) answer each step as Triton describes its models, in
    process: ``model.infer(..., sequence_id=, sequence_start=, sequence_end=)``, START on the first
    step and END on the last, against expected_outputs."""
    with private_caches(tmp_path):
        sequence_repository(tmp_path / "models")
        model = load_neuropod(tmp_path / "models" / name)
        try:
            values = [20, *(-v for v in VALUES)]
            got = []
            for i, value in enumerate(values):
                out = model.infer({"INPUT": np.array([[value]], np.int32)}, sequence_id=sequence_id,
                                  sequence_start=i == 0, sequence_end=i == len(values) - 1)  # fmt: skip
                got.append(int(out["OUTPUT"][0, 0]))
            assert got == expected_outputs(name, values, sequence_id)
            assert model.live_sequences == 0  # END freed it
        finally:
            model.close()


def _perf_analyzer() -> list[str] | None:
    shared = HERE.parent.parent.parent / "shared" / "tools" / "perf-analyzer"
    if shared.exists():
        return [str(shared)]
    found = shutil.which("perf_analyzer")
    return [found] if found else None


@pytest.mark.parametrize("server", ["keywords"], indirect=True)
def test_perf_analyzer_sequences(server: Server, tmp_path: Path) -> None:
    """perf_analyzer's sequence mode against simple_dyna_sequence over gRPC: it reads the model's
    configuration (sequence_batching), runs 4 concurrent sequences of 5 steps each with ids from
    a range, and every request succeeds."""
    command = _perf_analyzer()
    if command is None:
        pytest.skip("perf_analyzer not found (neither ../shared/tools/perf-analyzer nor perf_analyzer on PATH)")
    with urllib.request.urlopen(f"{server.http}/v2/models/{DYNA}/config", timeout=30) as r:
        config = json.loads(r.read())
    assert "sequence_batching" in config, config  # what tells perf_analyzer to send sequences
    # Unbatched as configured, the batch dim is one of INPUT's dims, which perf_analyzer needs given.
    shape = ["--shape", "INPUT:1,1"] if config.get("max_batch_size", 0) == 0 else []
    out = tmp_path / "pa.csv"
    full = [
        *command, "-m", DYNA, "-u", server.grpc, "-i", "grpc", "--concurrency-range", "4:4",
        "--sequence-length", "5", "--sequence-length-variation", "0", "--sequence-id-range", "1:1000",
        "--measurement-mode", "count_windows", "--measurement-request-count", "100", "--stability-percentage", "100",
        "--max-trials", "3", "--input-data", "zero", *shape, "-f", str(out),
    ]  # fmt: skip
    try:
        proc = subprocess.run(full, capture_output=True, text=True, timeout=240)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"perf_analyzer cannot run here: {e}")
    if proc.returncode != 0 and "Measurement Settings" not in proc.stdout and "error:" not in proc.stdout:
        # It never started: fetching it or its loader failed (no network, no apt), or it cannot run.
        pytest.skip(f"perf_analyzer cannot run here ({proc.returncode}): {(proc.stderr or proc.stdout)[-500:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Its client counts whole sequences; the server counts every step as a successful request.
    sequences = re.findall(r"Sequence count: (\d+)", proc.stdout)
    assert sequences and int(sequences[-1]) > 0, proc.stdout[-3000:]
    [row] = list(csv.DictReader(io.StringIO(out.read_text())))
    assert float(row["Inferences/Second"]) > 0
