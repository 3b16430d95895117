"""`neuropod compare` of one ONNX package under this session's onnxruntime and under the releases of
two backend environments (``PKG@onnx==1.20.1``): the same answers, each candidate's backend and where
it ran, and memory measured over the environment's worker process too.

The environments are the session's (``two_envs`` in conftest.py, shared with test_environments.py),
so they run only with ``NEUROPOD_TEST_ENVS=1`` (``nox -s tests_envs``).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neuropod import cli, envs
from neuropod_onnx import _installed

from conftest import NEWER, OLD

pytestmark = [
    pytest.mark.envs,
    pytest.mark.skipif(
        os.environ.get("NEUROPOD_TEST_ENVS") != "1",
        reason="uses backend environments (downloads onnxruntime 1.20.1 and 1.24.4): set NEUROPOD_TEST_ENVS=1",
    ),
]

HERE = _installed()[0][1]  # this process's onnxruntime, e.g. 1.31.1


def test_one_package_under_three_onnxruntime_releases_agrees(
    two_envs: dict[str, envs.Environment], make_adder: Callable[..., Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    pkg = str(make_adder(platform_version_semver=">=1.20"))
    rng = np.random.default_rng(7)
    x, y = (rng.standard_normal((3, 2)).astype(np.float32) for _ in range(2))
    np.savez(tmp_path / "set.npz", x=x, y=y)
    report = tmp_path / "r.json"
    out = io.StringIO()
    code = cli.main(["compare", pkg, f"{pkg}@onnx=={OLD}", f"newer={pkg}@onnx=={NEWER}",
                     "--inputs", str(tmp_path / "set.npz"), "--duration", "0.1", "--warmup", "1",
                     "--batch-sizes", "1", "--json", str(report)], out)  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, out.getvalue() + err
    assert "PASSED: every candidate agrees with the baseline" in out.getvalue()
    assert f"[2/3] adder0@onnx=={OLD}: loading" in err and "[3/3] newer: done" in err

    data: dict[str, Any] = json.loads(report.read_text())
    base, old, newer = data["candidates"]
    assert [c["verdict"] for c in data["candidates"]] == ["baseline", "agrees", "agrees"]
    # Which onnxruntime ran each, and where: this process's release in the worker process itself,
    # the pinned ones in a worker started from their environment's interpreter.
    assert (base["backend"], base["location"]) == (f"onnx=={HERE}", "in-process")
    assert (old["backend"], old["location"], old["backend_pin"]) == (f"onnx=={OLD}", f"env:onnx-{OLD}", f"onnx=={OLD}")
    assert (newer["backend"], newer["location"]) == (f"onnx=={NEWER}", f"env:onnx-{NEWER}")
    assert old["framework"] == f"onnxruntime {OLD}" and base["framework"] == f"onnxruntime {HERE}"
    # Both outputs compared over the 3 x 2 elements of the set given; x + y and (x + y) * 2 are exact
    # in float32 under every release.
    for c in (old, newer):
        assert {o["name"]: (o["elements"], o["outside"], o["max_abs_error"]) for o in c["outputs"]} == {
            "out": (6, 0, 0.0), "doubled": (6, 0, 0.0)}  # fmt: skip
        assert c["latency"]["count"] >= 20 and c["throughput"][0]["batch_size"] == 1
    # Memory: the environment's candidate is two processes (the comparison's worker and the backend
    # environment's worker it started), both counted; the in-process one is one process.
    assert base["memory"]["note"] is None and base["memory"]["peak_rss"] > 0
    for c in (old, newer):
        assert "summed over 2 processes" in c["memory"]["note"], c["memory"]
        assert c["memory"]["peak_rss"] > base["memory"]["peak_rss"], (c["memory"], base["memory"])
    assert data["inputs"]["source"] == f"--inputs {tmp_path / 'set.npz'}"
