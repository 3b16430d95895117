"""``neuropod compare`` end to end on small real models: ONNX packages built with onnx.helper, and
python-backend packages for outputs ONNX makes awkward (strings), models that raise, sleep or are slow.

Each candidate runs in a fresh Python process, so every test here uses few candidates and short
timings (``--no-speed`` where speed is not what is tested). Expected values (the worst element, the
shapes, the versions) are computed here independently.
"""

from __future__ import annotations

import datetime
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import pytest
from onnx import helper, numpy_helper

import neuropod
from neuropod import cli
from neuropod.comparison.measure import process_tree
from neuropod.packagers import create_onnx_neuropod, create_python_neuropod

from conftest import make_model, spec

FAST = ["--duration", "0.1", "--warmup", "1", "--batch-sizes", "1,4"]
W = np.arange(12, dtype=np.float32).reshape(3, 4) / 10


def linear(path: Path, *, w: np.ndarray = W, dtype: str = "float32", inp: str = "x", out: str = "out",
           rank3: bool = False) -> str:  # fmt: skip
    """out = x @ w + y, x [batch_size, 3], y and out [batch_size, 4] (an extra axis of 1 with rank3)."""
    mid = [1] if rank3 else []
    n = w.shape[1]
    model = make_model(
        [helper.make_node("MatMul", [inp, "w"], ["xw"]), helper.make_node("Add", ["xw", "y"], [out])],
        [(inp, dtype, ["batch_size", *mid, 3]), ("y", dtype, ["batch_size", *mid, n])],
        [(out, dtype, ["batch_size", *mid, n])],
        [numpy_helper.from_array(w.astype(dtype), "w")],
    )
    return str(create_onnx_neuropod(
        path, "linear", onnx_model=model,
        input_spec=spec((inp, dtype, ["batch_size", *mid, 3]), ("y", dtype, ["batch_size", *mid, n])),
        output_spec=spec((out, dtype, ["batch_size", *mid, n])),
    ))  # fmt: skip


def python_model(path: Path, body: str, inputs: list[tuple[str, str, list[Any]]],
                 outputs: list[tuple[str, str, list[Any]]]) -> str:  # fmt: skip
    """A python-backend package whose ``model(**inputs)`` is ``body`` (numpy as np, time imported)."""
    code = path.parent / f"{path.stem}_code"
    code.mkdir()
    (code / "model.py").write_text(
        "import time\nimport numpy as np\n\n\ndef model(**inputs):\n"
        + "".join(f"    {line}\n" for line in body.strip().splitlines())
        + "\n\ndef get_model(_data):\n    return model\n"
    )
    return str(create_python_neuropod(
        path, path.stem, [], [{"python_root": code, "dirs_to_package": [""]}], "model", "get_model",
        spec(*inputs), spec(*outputs),
    ))  # fmt: skip


LINEAR_PY = ("x = inputs['x']\nif (x < 0).any():\n    raise ValueError('this model takes no negative x')\n"
             "return {'out': x @ np.arange(12, dtype=np.float32).reshape(3, 4) / 10 + inputs['y']}")  # fmt: skip
XY_SPEC = [("x", "float32", ["batch_size", 3]), ("y", "float32", ["batch_size", 4])]
OUT_SPEC = [("out", "float32", ["batch_size", 4])]


def xy_file(path: Path, seed: int, rows: int = 3, **extra: np.ndarray) -> str:
    rng = np.random.default_rng(seed)
    arrays = {"x": rng.standard_normal((rows, 3)).astype(np.float32),
              "y": rng.standard_normal((rows, 4)).astype(np.float32), **extra}  # fmt: skip
    np.savez(path, **arrays)
    return str(path)


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    out = io.StringIO()
    code = cli.main(["compare", *args], out)
    return code, out.getvalue(), capsys.readouterr().err


def verdicts(table: str, labels: list[str]) -> dict[str, str]:
    """Each candidate's verdict, read from its row of the table (the row starts with its label)."""
    rows = {}
    for line in table.splitlines():
        words = line.split()
        if len(words) > 1 and words[0] in labels and words[0] not in rows:
            rows[words[0]] = words[1]
    return rows


@pytest.fixture
def base(tmp_path: Path) -> str:
    return linear(tmp_path / "base.neuropod")


# --- agreement -------------------------------------------------------------------------------------


def test_equal_models_agree_and_a_changed_weight_is_caught(base: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    same = linear(tmp_path / "same.neuropod")
    w = W.copy()
    w[1, 2] += 0.5
    changed = linear(tmp_path / "changed.neuropod", w=w)
    sets = [xy_file(tmp_path / "a.npz", 1), xy_file(tmp_path / "b.npz", 2, rows=5)]
    report = tmp_path / "r.json"
    args = [base, same, changed, "--inputs", sets[0], "--inputs", sets[1], "--no-speed", "--json", str(report)]
    code, out, err = run_cli(args, capsys)
    assert code == 1, out + err
    # the worst element, by numpy: only column 2 changes, by 0.5 * x[:, 1]
    diffs, outside = [], 0
    for i, f in enumerate(sets):
        with np.load(f) as data:
            x, y = data["x"].astype(np.float64), data["y"].astype(np.float64)
        want, got = x @ W.astype(np.float64) + y, x @ w.astype(np.float64) + y
        diffs.append((i, np.abs(got - want)))
        outside += int((np.abs(got - want) > 1e-5 + 1e-4 * np.abs(want)).sum())
    i, d = max(diffs, key=lambda p: p[1].max())
    row, col = np.unravel_index(int(np.argmax(d)), d.shape)
    assert col == 2 and outside == 8  # every row of column 2, in 3 + 5 rows
    assert "changed: output 'out' disagrees in 8 of 32 elements" in out
    assert f"set {i + 1} out[{row}, {col}]:" in out
    expected = {"base": "baseline", "same": "agrees", "changed": "disagrees"}
    assert verdicts(out, list(expected)) == expected
    data = json.loads(report.read_text())
    assert data["inputs"]["sets"] == 2 and data["exit_code"] == 1
    (o,) = data["candidates"][2]["outputs"]
    assert (o["name"], o["outside"], o["elements"], o["agrees"]) == ("out", 8, 32, False)
    assert (o["worst"][0]["input_set"], o["worst"][0]["index"]) == (i, [int(row), int(col)])
    assert o["max_abs_error"] == pytest.approx(float(d.max()), rel=1e-4)
    assert data["candidates"][1]["outputs"][0]["agrees"] is True
    # the library gives the same verdicts
    result = neuropod.compare([base, same, changed], inputs=sets, speed=False)
    assert isinstance(result, neuropod.comparison.Comparison)
    assert [c.verdict for c in result.candidates] == [c["verdict"] for c in data["candidates"]]
    assert result.exit_code == 1 and result.candidates[2].outputs[0].outside == 8


def test_strings_bytes_and_integers_are_compared_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inputs = [("x", "float32", ["batch"])]
    outputs = [("label", "string", ["batch"]), ("count", "int64", ["batch"]), ("blob", "bytes", ["batch"])]
    body = ("x = inputs['x']\nlabel = np.array(['pos' if v > 0 else 'neg' for v in x], dtype=object)\n"
            "count = (np.abs(x) * 10).astype(np.int64)\n"
            "blob = np.array([b'v%d\\0\\0' % i for i in range(len(x))], dtype=object)\n"
            "{}return {{'label': label, 'count': count, 'blob': blob}}")  # fmt: skip
    a = python_model(tmp_path / "words.neuropod", body.format(""), inputs, outputs)
    same = python_model(tmp_path / "same.neuropod", body.format(""), inputs, outputs)
    # a trailing NUL less is a different value (numpy's fixed-width bytes would drop it unnoticed)
    changed = "label[x > 1] = 'big'\ncount[x > 1.5] += 1\nblob[0] = b'v0\\0'\n"
    b = python_model(tmp_path / "words2.neuropod", body.format(changed), inputs, outputs)
    np.savez(tmp_path / "x.npz", x=np.array([-0.5, 0.3, 1.2, 2.0], np.float32))
    code, out, err = run_cli([a, same, b, "--inputs", str(tmp_path / "x.npz"), "--no-speed"], capsys)
    assert code == 1, out + err
    assert verdicts(out, ["words", "same", "words2"]) == {"words": "baseline", "same": "agrees", "words2": "disagrees"}
    assert "words2: output 'label' disagrees in 2 of 4 elements" in out
    assert "set 1 label[2]: 'big', baseline 'pos'" in out and "set 1 label[3]: 'big', baseline 'pos'" in out
    assert "words2: output 'count' disagrees in 1 of 4 elements" in out
    assert "set 1 count[3]: 21, baseline 20" in out
    assert "words2: output 'blob' disagrees in 1 of 4 elements" in out
    assert r"set 1 blob[0]: b'v0\x00', baseline b'v0\x00\x00'" in out


# --- the spec check and --map ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "words"),
    [
        ({"dtype": "float64"}, "other's input 'x' is float64, the baseline's is float32"),
        ({"out": "logits"}, "other has no output 'out'"),
        ({"w": np.zeros((3, 5), np.float32)}, "other's output 'out' has size 5 on axis 1, the baseline's has 4"),
        ({"rank3": True}, "other's input 'x' has shape [batch_size, 1, 3], the baseline's [batch_size, 3] (another rank)"),
    ],
)  # fmt: skip
def test_another_problem_is_refused(variant: dict[str, Any], words: str, base: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    other = linear(tmp_path / "other.neuropod", **variant)
    code, out, err = run_cli([base, other, "--no-speed"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("neuropod compare: error: The candidates are not the same problem (")
    assert words in err


def test_a_map_makes_renamed_tensors_comparable(base: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    renamed = linear(tmp_path / "renamed.neuropod", inp="inp", out="logits")
    code, _, err = run_cli([base, renamed, "--no-speed"], capsys)
    assert code == 2 and "renamed has no input 'x'" in err and "renamed has no output 'out'" in err
    code, out, err = run_cli([base, renamed, "--map", "2.logits=out", "--map", "renamed.inp=x", "--no-speed"], capsys)
    assert code == 0, out + err
    assert "note: renamed: its 'logits' is compared as the baseline's 'out'" in out
    assert "note: renamed: its 'inp' is compared as the baseline's 'x'" in out
    assert "PASSED" in out


# --- bad input -------------------------------------------------------------------------------------


def test_bad_input_is_one_clear_line(base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))
    np.savez(tmp_path / "only_x.npz", x=np.zeros((2, 3), np.float32))
    np.savez(tmp_path / "f64.npz", x=np.zeros((2, 3)), y=np.zeros((2, 4)))
    cases = [
        (["--inputs", str(tmp_path / "missing.npz")], f"--inputs {tmp_path / 'missing.npz'}: no such file"),
        (["--inputs", str(tmp_path / "x.npy")], "is a .npy file"),
        (["--inputs", str(tmp_path / "only_x.npz")], "misses y; the baseline's inputs: x, y"),
        (
            ["--inputs", str(tmp_path / "f64.npz")],
            "do not fit the baseline's spec: Tensor 'x' in the input spec is "
            "expected to be of type float32, but was of type float64",
        ),
        (["--map", "2.nosuch=out"], "candidate 'base#2' has no tensor 'nosuch'"),
        (["--map", "5.x=out"], "there is no candidate 5 (there are 2)"),
        (["--map", "nosuch.x=out"], "the left side must name a candidate"),
        (["--dims", "nosuch=3"], "no symbol 'nosuch'; its symbols: batch_size"),
        (["--generate", "0"], "--generate N must be at least 1"),
        (["--generate", "2", "--inputs", str(tmp_path / "f64.npz")], "--inputs and --generate both say"),
        (["--dims", "batch_size=3", "--inputs", str(tmp_path / "f64.npz")], "--inputs and --dims both say"),
        (["--batch-sizes", "1,x"], "--batch-sizes '1,x': 'x' is not a whole number of at least 1"),
        (["--batch-sizes", "0"], "--batch-sizes '0': '0' is not a whole number of at least 1"),
        (["--dims", "batch_size=0"], "--dims 'batch_size=0': '0' is not a whole number of at least 1"),
        (["--json", str(tmp_path / "no" / "r.json")], f"no such directory {tmp_path / 'no'}"),
        (["--html", str(tmp_path / "no" / "r.html")], f"no such directory {tmp_path / 'no'}"),
        (["--json", str(tmp_path)], "it is a directory"),
        (["--rate", "0"], "rate must be a finite number above 0, got 0.0"),
        (["--timeout", "0"], "timeout must be a finite number above 0"),
        (["--max-slowdown", "-1"], "max_slowdown must be a finite number above 0"),
        (["--rtol", "nan"], "rtol must be a finite number of at least 0"),
        (["--warmup", "-1"], "warmup must be a whole number of calls, at least 0"),
    ]
    for extra, words in cases:
        code, out, err = run_cli([base, base, *extra], capsys)
        assert code == 2, extra
        assert out == "", extra
        assert err.startswith("neuropod compare: error: ") and err.count("\n") == 1, (extra, err)
        assert words in err, (extra, err)
        assert "Traceback" not in err


# --- failed candidates -----------------------------------------------------------------------------


def test_candidates_that_fail_are_reported_and_the_rest_compared(base: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    raises = python_model(tmp_path / "raises.neuropod", LINEAR_PY, XY_SPEC, OUT_SPEC)
    crash = "import os, sys\nprint('going down', file=sys.stderr, flush=True)\nos._exit(3)"
    crashes = python_model(tmp_path / "crashes.neuropod", crash, XY_SPEC, OUT_SPEC)
    same = linear(tmp_path / "same.neuropod")
    missing = str(tmp_path / "nosuch.neuropod")
    inputs = xy_file(tmp_path / "in.npz", 4, x=-np.ones((3, 3), np.float32))  # negative: `raises` raises
    report = tmp_path / "r.json"
    args = [base, missing, f"{base}@onnx==0.1", raises, crashes, same, "--inputs", inputs, "--no-speed", "--json",
            str(report)]  # fmt: skip
    code, out, err = run_cli(args, capsys)
    assert code == 1, out + err
    data = json.loads(report.read_text())
    got = {c["label"]: (c["verdict"], c["stage"]) for c in data["candidates"]}
    assert got == {"base": ("baseline", None), "nosuch": ("failed", "load"), "base@onnx==0.1": ("failed", "load"),
                   "raises": ("failed", "run"), "crashes": ("failed", "crash"), "same": ("agrees", None)}  # fmt: skip
    errors = {c["label"]: c["error"] for c in data["candidates"]}
    assert "No Neuropod package at" in errors["nosuch"]
    assert "backend='onnx==0.1'" in errors["base@onnx==0.1"]
    assert errors["raises"].endswith("this model takes no negative x")
    assert errors["crashes"] == "its process ended with status 3 and no result: going down"
    assert "nosuch: FAILED at load: No Neuropod package at" in out
    assert "raises: FAILED at run: " in out and "this model takes no negative x" in out
    expected = {"base": "baseline", "nosuch": "failed", "base@onnx==0.1": "failed", "raises": "failed",
                "crashes": "failed", "same": "agrees"}  # fmt: skip
    assert verdicts(out, list(expected)) == expected


def processes_with(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (an orphan is no longer in this process's tree)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def test_a_candidate_past_its_timeout_is_killed_and_the_rest_compared(
    base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], neuropod_cache: Path
) -> None:
    # in a worker process of its own (@ope): that one is killed too
    sleeps = python_model(tmp_path / "sleeps.neuropod", "time.sleep(30)\nreturn {}", XY_SPEC, OUT_SPEC)
    same = linear(tmp_path / "same.neuropod")
    before = set(process_tree())
    args = [base, f"{sleeps}@ope", same, "--timeout", "3", "--no-speed", "--generate", "1"]
    code, out, err = run_cli(args, capsys)
    assert code == 1, out + err
    assert "sleeps@ope: FAILED at timeout: did not finish within the timeout of 3 s (it was killed)" in out
    expected = {"base": "baseline", "sleeps@ope": "failed", "same": "agrees"}
    assert verdicts(out, list(expected)) == expected
    assert set(process_tree()) == before  # no worker left behind
    if os.path.isdir("/proc"):  # nor an orphan of one, with this test's environment
        assert processes_with(f"NEUROPOD_CACHE_DIR={neuropod_cache}\0") == []


# --- inputs ----------------------------------------------------------------------------------------


def test_generated_inputs_use_the_dims(base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    code, out, err = run_cli([base, "--generate", "3", "--dims", "batch_size=5", "--no-speed", "--json", str(report)],
                             capsys)  # fmt: skip
    assert code == 0, out + err
    inputs = json.loads(report.read_text())["inputs"]
    assert inputs["sets"] == 3
    assert inputs["tensors"] == [{"x": {"dtype": "float32", "shape": [5, 3]},
                                  "y": {"dtype": "float32", "shape": [5, 4]}}] * 3  # fmt: skip
    assert "Inputs: generated from the baseline's spec (seed 0; batch_size=5) (3 sets)" in out


# --- speed -----------------------------------------------------------------------------------------


def test_max_slowdown_fails_a_clearly_slower_candidate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    io_spec = [("x", "float32", ["batch"])]
    fast = python_model(tmp_path / "fast.neuropod", "return {'y': inputs['x'] * 2}", io_spec,
                        [("y", "float32", ["batch"])])  # fmt: skip
    slow = python_model(tmp_path / "slow.neuropod", "time.sleep(0.005)\nreturn {'y': inputs['x'] * 2}", io_spec,
                        [("y", "float32", ["batch"])])  # fmt: skip
    timing = ["--duration", "0.1", "--warmup", "1", "--batch-sizes", "", "--generate", "1"]
    code, out, err = run_cli([fast, slow, *timing, "--max-slowdown", "1.1"], capsys)
    assert code == 1, out + err
    assert "SLOW: slow is " in out and "(--max-slowdown 1.1)" in out
    code, out, err = run_cli([fast, slow, *timing], capsys)
    assert code == 0, out + err
    assert "SLOW" not in out and "PASSED" in out


def test_the_json_report(base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    code, out, err = run_cli([base, f"{base}@onnx", *FAST, "--rate", "100", "--json", str(report)], capsys)
    assert code == 0, out + err
    assert f"wrote {report}" in out
    data = json.loads(report.read_text())
    machine = data["machine"]
    assert machine["cores"] == os.cpu_count() and machine["cpu"] and machine["python"].count(".") == 2
    assert "compare" in data["command"] and "--rate 100" in data["command"]
    assert datetime.datetime.fromisoformat(data["date"]).tzinfo is not None
    assert data["settings"]["rate"] == 100 and data["settings"]["batch_sizes"] == [1, 4]
    assert data["neuropod_version"] == neuropod.__version__
    for c in data["candidates"]:
        assert c["backend"] == f"onnx=={onnxruntime.__version__}"
        assert c["framework"].endswith(f" {onnxruntime.__version__}") and c["framework"].startswith("onnxruntime")
        assert c["load_s"] > 0
        assert c["memory"]["peak_rss"] > c["memory"]["rss_before_load"] > 0
        assert c["latency"]["count"] >= 20 and 0 < c["latency"]["p50"] <= c["latency"]["p99"]
        assert c["server"]["rate"] == 100 and c["server"]["achieved_rate"] > 0 and c["server"]["count"] >= 20
        assert [t["batch_size"] for t in c["throughput"]] == [1, 4]
        assert all(t["items_per_s"] > 0 and t["calls"] >= 10 for t in c["throughput"])
    assert [c["verdict"] for c in data["candidates"]] == ["baseline", "agrees"]
    assert data["candidates"][1]["slowdown"] > 0
