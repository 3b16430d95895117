"""``neuropod compare`` across frameworks: one model as ONNX, torch.export, TorchScript, JAX and
TensorFlow agrees with itself; the same model with one weight changed is caught, its worst element named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from build_package import PERTURBED, hidden, reference, sample_inputs
from compare_support import FRAMEWORKS, Report

from neuropod import load_neuropod


def _by_label(report: Report) -> dict[str, dict]:
    return {c["label"]: c for c in report.data["candidates"]}


def test_five_frameworks_agree(frameworks_report: Report) -> None:
    report = frameworks_report
    assert report.exit_code == 0, report.stdout
    assert report.data["passed"] is True and report.data["exit_code"] == 0
    candidates = _by_label(report)
    assert list(candidates) == [label for label, _, _ in FRAMEWORKS.values()]
    # The inputs were the baseline's bundled test data: one set of 6 rows.
    rows = len(sample_inputs()["x"])
    for label, platform, _ in FRAMEWORKS.values():
        c = candidates[label]
        assert c["status"] == "ok", (label, c["error"])
        assert c["backend"].startswith(f"{platform}=="), (label, c["backend"])
        assert c["model_name"] == "mlp"
        assert c["load_s"] > 0 and c["package_bytes"] > 0
        assert c["latency"]["count"] >= 20 and 0 < c["latency"]["p50"] <= c["latency"]["p99"]
        assert [t["batch_size"] for t in c["throughput"]] == [1, 8]
        assert all(t["items_per_s"] > 0 for t in c["throughput"])
        assert c["memory"]["peak_rss"] > 0
        if label == "ONNX":
            assert c["verdict"] == "baseline"
            continue
        assert c["verdict"] == "agrees", (label, c["outputs"])
        outputs = {o["name"]: o for o in c["outputs"]}
        scores, labels = outputs["scores"], outputs["label"]
        # Floats: compared element by element, the errors computed, and small (float32 rounding).
        assert not scores["exact"] and scores["elements"] == rows * 3 and scores["outside"] == 0
        assert scores["max_abs_error"] is not None and 0 <= scores["max_abs_error"] < 1e-5
        assert scores["max_rel_error"] is not None
        # The argmax: exact, every element equal.
        assert labels["exact"] and labels["dtype"] == "int32" and labels["elements"] == rows
        assert labels["outside"] == 0 and labels["max_abs_error"] is None
    assert report.json.stat().st_size > 0
    assert report.html.read_text().lstrip().lower().startswith("<!doctype html")
    # The terminal table names every candidate and the verdict.
    for label, _, _ in FRAMEWORKS.values():
        assert label in report.stdout


def test_the_baseline_computes_the_model(onnx_package: Path) -> None:
    """The baseline is numpy's model (so the four that agree with it are too)."""
    x = sample_inputs()["x"]
    expected = reference(x)
    with load_neuropod(onnx_package) as model:
        got = model.infer({"x": x})
    np.testing.assert_allclose(got["scores"], expected["scores"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["label"], expected["label"])


def test_a_changed_weight_is_caught(perturbed_report: Report) -> None:
    report = perturbed_report
    assert report.exit_code == 1, report.stdout
    assert report.data["passed"] is False and report.data["exit_code"] == 1
    candidate = _by_label(report)["perturbed"]
    assert candidate["verdict"] == "disagrees"
    scores = {o["name"]: o for o in candidate["outputs"]}["scores"]
    # W2[row, column] += delta changes scores[:, column] by delta * hidden[:, row], nothing else.
    row, column, delta = PERTURBED
    x = sample_inputs()["x"]
    change = np.abs(delta * hidden(x)[:, row])
    worst = scores["worst"][0]
    assert worst["input_set"] == 0
    assert worst["index"] == [int(change.argmax()), column]
    assert worst["abs_error"] == scores["max_abs_error"]
    assert abs(scores["max_abs_error"] - change.max()) < 1e-5
    assert all(w["index"][1] == column for w in scores["worst"])
    # Every element of that column moved beyond the tolerance, the others not at all.
    outside = np.abs(reference(x, perturb=True)["scores"] - reference(x)["scores"]) > 1e-5 + 1e-4 * np.abs(
        reference(x)["scores"]
    )
    assert scores["outside"] == int(outside.sum()) and outside[:, column].all()
    assert "perturbed" in report.stdout
