"""The neuropod command, run in-process with main(argv, out) and as a real subprocess."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from neuropod import plugins
from neuropod.cli import main

from _toy_backend import toy_plugin, write_toy

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "uber-neuropod-0.3"
HOSTS = Path(__file__).parent / "hosts"
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"Neuropod 0.3 fixtures not found at {FIXTURES}")


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out), out.getvalue()


FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) if FIXTURES.is_dir() else []


@needs_fixtures
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_explain_original_packages(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each 0.3 package: its spec is printed and the missing backend is named with its wheel."""
    monkeypatch.setenv("NEUROPOD_PLUGINS", "onnx")  # whatever else this venv has, only ONNX may load
    plugins.reset()  # plugins an earlier test loaded in this process are forgotten: only ONNX loads
    config = json.loads((FIXTURES / name / "config.json").read_text())
    try:
        code, out = run("explain", str(FIXTURES / name))
    finally:
        monkeypatch.undo()
        plugins.reset()  # the next test loads what this venv has again
    assert code == 1, "nothing can run it here"
    assert f"Platform:  {config['platform']}" in out
    for entry in config["input_spec"] + config["output_spec"]:
        assert entry["name"] in out
    wheel = {"tensorflow": "neuropod-tensorflow", "torchscript": "neuropod-torchscript"}[config["platform"]]
    assert f"No backend for platform '{config['platform']}' is installed: {plugins.pip_install(wheel)}" in out
    assert "Manifest:  none (a Neuropod 0.3 package)" in out


@needs_fixtures
def test_inspect_json_of_an_original_package() -> None:
    code, out = run("inspect", "--json", str(FIXTURES / "tf_addition_model"))
    data = json.loads(out)
    assert code == 0 and data["platform"] == "tensorflow" and data["platform_version_semver"] == "*"
    assert [s["name"] for s in data["input_spec"]] == ["x", "y"]
    assert "0/data/model.pb" in data["files"]


@needs_fixtures
def test_test_command_refuses_pickle_without_trust(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run("test", str(FIXTURES / "torchscript_addition_model_single_output"))
    assert code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "test_data.pkl, a pickle" in err and "--trust-pickle" in err
    assert "Traceback" not in err


def test_explain_with_described_hosts(tmp_path: Path) -> None:
    path = write_toy(tmp_path / "m", input_tensor_device={"x": "GPU", "y": "GPU"})
    with toy_plugin(gpu=True):
        code, out = run("explain", str(path), "--host", str(HOSTS / "two-a100.json"), "--quiet-spec")
        assert code == 0
        assert "Chosen: toy==2.0.0 on cuda:0." in out and "Host: two A100s" in out
        code, out = run("explain", str(path), "--host", str(HOSTS / "laptop-cpu.json"), "--quiet-spec")
        assert "Chosen: toy==2.0.0 on cpu." in out
        code, out = run("explain", str(path), "--device", "cpu", "--backend", "toy==1.0.0", "--quiet-spec")
        assert "Chosen: toy==1.0.0 on cpu." in out


def test_backends_lists_the_toy_backend_and_host() -> None:
    with toy_plugin(gpu=True):
        code, out = run("backends")
        assert code == 0
        assert "toy==1.0.0" in out and "toy==2.0.0" in out and "cuda 12.1" in out
        assert "Host: this machine" in out
        code, out = run("backends", "--json", "--host", str(HOSTS / "one-h100.json"))
        data = json.loads(out)
        assert {b["version"] for b in data["backends"] if b["platform"] == "toy"} == {"1.0.0", "2.0.0"}
        assert data["host"]["gpus"][0]["compute_capability"] == "9.0"


def test_test_and_infer_commands(tmp_path: Path) -> None:
    path = write_toy(tmp_path / "m")
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", x * 10)
    with toy_plugin():
        code, out = run("test", str(path))
        assert code == 0 and "PASSED: 1 output(s) match" in out
        code, out = run("infer", str(path), "-i", f"x={tmp_path / 'x.npy'}", "-i", f"y={tmp_path / 'y.npy'}",
                        "--output-dir", str(tmp_path / "out"))  # fmt: skip
        assert code == 0
        np.testing.assert_array_equal(np.load(tmp_path / "out" / "out.npy"), x * 11)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "/nonexistent"], "No Neuropod package at /nonexistent"),
        (["infer", "{pkg}", "-i", "x"], "--input 'x' must be NAME=FILE.npy"),
        (["infer", "{pkg}", "-i", "x=/nonexistent.npy"], "no such file /nonexistent.npy"),
        (["explain", "{pkg}", "--host", "/nonexistent.json"], "/nonexistent.json"),
        (["explain", "{pkg}", "--backend", "toy==>1"], "Invalid version range '==>1'"),
        (["test", "{pkg}", "--device", "tpu"], "'tpu'"),
    ],
)
def test_errors_are_one_line_without_traceback(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_toy(tmp_path / "m")
    with toy_plugin():
        code, _ = run(*[a.replace("{pkg}", str(path)) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("days", ["nan", "-1"])
def test_env_prune_days_that_are_not_a_count(
    days: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN reached prune_environments and came back as "ValueError: ..."; both now name the option."""
    monkeypatch.setenv("NEUROPOD_HOME", str(tmp_path / "home"))
    code, out = run("env", "prune", "--days", days)
    assert (code, out) == (2, "")
    assert capsys.readouterr().err == f"neuropod env: error: --days must be a number >= 0, not {days}\n"


def test_command_line_entry_point(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "neuropod.cli", "inspect", str(write_toy(tmp_path / "m"))],
        capture_output=True, text=True, check=True,
    )
    assert "Name:      toy_adder" in result.stdout and "Symbols:   batch_size" in result.stdout
    result = subprocess.run([sys.executable, "-m", "neuropod.cli", "--version"], capture_output=True, text=True)
    assert result.stdout.strip().startswith("neuropod 0.4")


# --- commands from other distributions (entry point group neuropod.commands) ---

_COMMAND_MODULE = '''
def add_arguments(parser):
    parser.add_argument("word")
    parser.add_argument("--times", type=int, default=1)

def run(args):
    print(" ".join([args.word] * args.times))
    return 7
'''


def _command_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """A distribution on sys.path whose entry point adds `neuropod echo` (and `neuropod serve`)."""
    site = tmp_path / "site"
    info = site / "neuropod_echo-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: neuropod-echo\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[neuropod.commands]\necho = np_echo_cmd\nbackends = np_echo_cmd\n")
    (site / "np_echo_cmd.py").write_text(source)
    monkeypatch.syspath_prepend(str(site))
    sys.modules.pop("np_echo_cmd", None)


def test_plugin_command_runs_with_its_own_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _command_distribution(tmp_path, monkeypatch, _COMMAND_MODULE)
    assert main(["echo", "hi", "--times", "3"]) == 7
    assert capsys.readouterr().out == "hi hi hi\n"
    assert main(["--help"]) == 0
    assert "(from neuropod-echo)" in capsys.readouterr().out
    # A plugin cannot replace a built-in command, and listing commands imports no plugin module.
    sys.modules.pop("np_echo_cmd", None)
    assert main(["backends", "--json"], out=io.StringIO()) == 0
    assert "np_echo_cmd" not in sys.modules


def test_broken_plugin_command_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _command_distribution(tmp_path, monkeypatch, "raise ImportError('no module named starlette')\n")
    assert main(["echo", "hi"]) == 2
    err = capsys.readouterr().err
    assert "`neuropod echo` from neuropod-echo failed to load: ImportError: no module named starlette" in err
    assert "Traceback" not in err


def test_serve_without_neuropod_serving_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import neuropod.cli.plugin_commands

    monkeypatch.setattr(neuropod.cli.plugin_commands, "_plugin_commands", dict)
    assert main(["serve", "model.neuropod", "--http-port", "9000"]) == 2
    assert plugins.pip_install("'neuropod-serving[server]'") in capsys.readouterr().err
