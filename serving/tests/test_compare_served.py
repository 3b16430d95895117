"""`neuropod compare` of a package against models served by a real `neuropod serve` (one per module,
requiring a bearer token): the package against itself over gRPC and REST, a served model that answers
differently, one of another problem, pins on a served URL, and a server that is not given its token."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")

from neuropod.cli import main
from neuropod.testing import Served, served

from conftest import ADDER_IN, ADDER_OUT, adder_and_echo, free_port, onnx_package, private_caches

TOKEN = "compare-served-token"
QUICK = ["--duration", "0.1", "--warmup", "1", "--batch-sizes", "1"]
X = np.array([[1.5, -2.0], [3.25, 4.0], [0.5, 8.0]], np.float32)
Y = np.array([[10.0, 20.0], [-30.0, 40.0], [0.25, -1.0]], np.float32)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``adder`` and ``echo`` (conftest), ``tripler``: the adder's spec, but doubled = 3 * (x + y)."""
    from onnx import TensorProto, helper

    root = tmp_path_factory.mktemp("compare-served")
    with private_caches(root):
        models = root / "models"
        adder_and_echo(models, echo_as_zip=False)
        onnx_package(models / "tripler", "tripler",
                     [helper.make_node("Add", ["x", "y"], ["out"]), helper.make_node("Mul", ["out", "k"], ["doubled"])],
                     ADDER_IN, ADDER_OUT, [helper.make_tensor("k", TensorProto.FLOAT, [], [3.0])])  # fmt: skip
        (root / "token").write_text(TOKEN + "\n")
        (root / "wrong").write_text("not-the-token\n")
        np.savez(root / "set.npz", x=X, y=Y)
        yield root


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Served]:
    with served(root / "models", options=["--auth-token-file", str(root / "token")]) as s:
        yield s


def compare(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    out = io.StringIO()
    code = main(["compare", *argv], out)
    return code, out.getvalue(), capsys.readouterr().err


def test_a_package_and_itself_served_over_grpc_and_rest_agree(
    root: Path, server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    grpc_url, rest_url = f"grpc://{server.grpc}/adder", f"{server.http}/adder"
    report = root / "served.json"
    code, out, err = compare(str(root / "models" / "adder"), grpc_url, rest_url, "--inputs", str(root / "set.npz"),
                             "--auth-token-file", str(root / "token"), *QUICK, "--json", str(report),
                             capsys=capsys)  # fmt: skip
    assert code == 0, out + err
    assert "PASSED: every candidate agrees with the baseline" in out
    assert f"[2/3] {grpc_url}: loading" in err and f"[3/3] {rest_url}: done" in err
    data: dict[str, Any] = json.loads(report.read_text())
    base, over_grpc, over_rest = data["candidates"]
    assert [c["verdict"] for c in data["candidates"]] == ["baseline", "agrees", "agrees"]
    assert (base["remote"], base["location"]) == (False, "in-process")
    for c, where in ((over_grpc, f"grpc://{server.grpc}"), (over_rest, server.http)):
        # Where it ran, and what the server says runs it; the same ONNX graph, so the same float32 answers.
        assert (c["remote"], c["location"], c["model_name"]) == (True, f"remote: {where}", "adder")
        assert c["backend"] == base["backend"] and c["device"] == "cpu" and c["package_bytes"] is None
        assert {o["name"]: (o["elements"], o["outside"], o["max_abs_error"]) for o in c["outputs"]} == {
            "out": (6, 0, 0.0), "doubled": (6, 0, 0.0)}  # fmt: skip
        assert c["latency"]["count"] >= 20 and c["throughput"][0]["batch_size"] == 1
        # Its memory is this side's: the note says the server's is not in it.
        assert c["memory"]["peak_rss"] > 0 and c["memory"]["gpu_bytes"] is None
        assert "the client's process only" in c["memory"]["note"] and "server's" in c["memory"]["note"]
    assert base["memory"]["note"] is None


def test_a_served_model_that_answers_differently_is_caught(
    root: Path, server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"grpc://{server.grpc}/tripler"
    report = root / "tripler.json"
    code, out, err = compare(str(root / "models" / "adder"), url, "--inputs", str(root / "set.npz"), "--no-speed",
                             "--auth-token-file", str(root / "token"), "--json", str(report), capsys=capsys)  # fmt: skip
    assert code == 1, out + err
    outputs = {o["name"]: o for o in json.loads(report.read_text())["candidates"][1]["outputs"]}
    assert outputs["out"]["outside"] == 0 and outputs["doubled"]["outside"] == 6
    # The worst element, computed here: |3s - 2s| = |s| is largest where |x + y| is.
    s = X + Y
    index = np.unravel_index(np.argmax(np.abs(s)), s.shape)
    worst = outputs["doubled"]["worst"][0]
    assert tuple(worst["index"]) == index and worst["input_set"] == 0
    assert (worst["value"], worst["baseline"]) == (3 * s[index], 2 * s[index])
    assert outputs["doubled"]["max_abs_error"] == pytest.approx(abs(s[index]))
    # The table names it too: the output, how many elements, the worst first.
    assert f"{url}: output 'doubled' disagrees in 6 of 6 elements" in out, out
    assert f"set 1 doubled[{', '.join(map(str, index))}]: " in out and "\nFAILED" in out


def test_a_served_model_of_another_problem_is_refused_with_the_differences(
    root: Path, server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{server.http}/echo"
    code, out, err = compare(str(root / "models" / "adder"), url, "--no-speed", "--auth-token-file",
                             str(root / "token"), capsys=capsys)  # fmt: skip
    assert code == 2 and out == ""
    assert err.startswith("neuropod compare: error: The candidates are not the same problem (8 differences):")
    assert f"{url} has no input 'x' (the baseline's x: float32 [batch_size, 2])" in err
    assert f"{url} has an output 's_out' the baseline does not have (s_out: string [batch_size])" in err


def test_a_served_url_takes_no_pins_but_use_ope_applies_to_the_packages(
    root: Path, server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    package, token = str(root / "models" / "adder"), ["--auth-token-file", str(root / "token")]
    for pin, named in (("@cpu", "(cpu)"), ("@ope", "(ope)"), ("@onnx==1.20.1", "(onnx==1.20.1)")):
        for url in (f"grpc://{server.grpc}/adder", f"{server.http}/adder"):
            code, out, err = compare(package, url + pin, "--no-speed", *token, capsys=capsys)
            assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
            assert (f"neuropod compare: error: Candidate '{url}{pin}' is a served model, which runs where it is "
                    f"served: pins {named}") in err  # fmt: skip
    # --use-ope runs the package in a worker process; the served model is called as before.
    report = root / "ope.json"
    code, out, err = compare(package, f"grpc://{server.grpc}/adder", "--use-ope", "--no-speed", *token, "--json",
                             str(report), capsys=capsys)  # fmt: skip
    assert code == 0, out + err
    base, remote = json.loads(report.read_text())["candidates"]
    assert base["use_ope"] is True and remote["use_ope"] is False and remote["verdict"] == "agrees"


def test_a_server_that_needs_a_token_fails_the_candidate_that_has_none(
    root: Path, server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    package = str(root / "models" / "adder")
    grpc_url, rest_url, nowhere = (f"grpc://{server.grpc}/adder", f"{server.http}/adder",
                                   f"grpc://127.0.0.1:{free_port()}/adder")  # fmt: skip
    report = root / "refused.json"
    # Without the token: each served candidate fails to load, saying what the server wants and how to give
    # it; the package is still run, and the comparison fails (1).
    code, out, err = compare(package, grpc_url, rest_url, nowhere, "--no-speed", "--json", str(report), capsys=capsys)
    assert code == 1, out + err
    base, *failed = json.loads(report.read_text())["candidates"]
    assert base["verdict"] == "baseline" and base["status"] == "ok"
    assert [(c["status"], c["stage"]) for c in failed] == [("failed", "load")] * 3
    for c in failed[:2]:
        assert "the server refused the call's credentials" in c["error"] and "Bearer <token>" in c["error"]
        assert c["error"].endswith("give the server's token with --auth-token-file FILE (in Python: "
                                   "remote_options={'auth_token': ...})")  # fmt: skip
        assert f"{c['label']}: FAILED at load: " in out
    assert "cannot reach the server at grpc://127.0.0.1:" in failed[2]["error"]
    assert "--auth-token-file" not in failed[2]["error"]
    # A wrong token: refused too, with no advice to pass one.
    code, out, err = compare(package, grpc_url, "--no-speed", "--auth-token-file", str(root / "wrong"),
                             "--json", str(report), capsys=capsys)  # fmt: skip
    assert code == 1, out + err
    refused = json.loads(report.read_text())["candidates"][1]
    assert "refused the call's credentials" in refused["error"] and "give the server's token" not in refused["error"]
