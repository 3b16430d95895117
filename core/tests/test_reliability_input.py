"""Issue 11, hostile and careless input: tensor names (item 4), argument checks (15), the CLI
(16), JSON from outside the process (17) and package text printed to a terminal (20).

Each test fails on the code before the fix; the fuzz test at the end runs the CLI on random
argument lists and asserts that every run ends with an exit status, never a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import neuropod
from neuropod import cli, envs, hookimpl, plugins
from neuropod.backend import Backend, DeviceCaps
from neuropod.cli import main
from neuropod.devices import load_host
from neuropod.errors import NeuropodError, PackageError
from neuropod.loader import plan
from neuropod.spec import TensorSpec, parse_spec
from neuropod.testdata import run_test_data
from neuropod.versions import satisfies

from _toy_backend import toy_plugin, write_toy

X = np.array([[1, 2], [3, 4]], np.float32)


@pytest.fixture(autouse=True)
def _private_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("NEUROPOD_HOME", str(tmp_path / "home"))


def _strict_stream() -> io.TextIOWrapper:
    """A stream that fails the way a real UTF-8 stdout does on a lone surrogate."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", newline="")


def _text(stream: io.TextIOWrapper) -> str:
    stream.flush()
    buffer = stream.buffer
    assert isinstance(buffer, io.BytesIO)
    return buffer.getvalue().decode("utf-8")


@contextlib.contextmanager
def _strict_stderr(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.TextIOWrapper]:
    err = _strict_stream()
    monkeypatch.setattr(sys, "stderr", err)
    yield err


def run_cli(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` with stdout and stderr that refuse what a terminal's encoder refuses."""
    out = _strict_stream()
    with _strict_stderr(monkeypatch) as err:
        code = main(list(argv), out)
    return code, _text(out), _text(err)


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("neuropod "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


class EchoPlugin:
    """Platform "echo": every output of the spec is input ``x``; the package decides the names."""

    @hookimpl
    def supported_versions(self) -> list[Backend]:
        return [Backend("echo", "1.0.0", "echoframework")]

    @hookimpl
    def device_caps(self, backend: Backend) -> DeviceCaps | None:
        return DeviceCaps(cpu=True) if backend.platform == "echo" else None

    @hookimpl
    def load_model(self, package: Any, backend: Backend, device: str, options: dict[str, Any]) -> Any:
        return [s.name for s in package.config.output_spec] if backend.platform == "echo" else None

    @hookimpl
    def infer(self, model: Any, inputs: dict[str, np.ndarray], requested_outputs: list[str] | None) -> Any:
        return {name: inputs["x"] for name in model}


@contextlib.contextmanager
def echo_plugin() -> Iterator[None]:
    assert plugins.register(EchoPlugin(), "echo")
    try:
        yield
    finally:
        plugins.unregister("echo")


def hand_written_package(path: Path, output_name: str, name: str = "echo") -> Path:
    """A package directory written by hand, as Neuropod 0.3 packages are (no manifest)."""
    path.mkdir(parents=True)
    config = {
        "name": name, "platform": "echo", "platform_version_semver": "*",
        "input_spec": [{"name": "x", "dtype": "float32", "shape": [2, 2]}],
        "output_spec": [{"name": output_name, "dtype": "float32", "shape": [2, 2]}],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    (path / "0" / "data").mkdir(parents=True)
    (path / "0" / "data" / "model.txt").write_text("echo")
    return path


# --- item 4: tensor names are safe file names; --output-dir cannot be left ----------


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "must be a non-empty string"),
        (".", "names a directory"),
        ("..", "names a directory"),
        ("a\x00b", "control character '\\x00'"),
        ("a\nb", "control character '\\n'"),
        ("\x1b[2J", "control character '\\x1b'"),
        ("a\x7f", "control character '\\x7f'"),
        ("a\x85", "control character '\\x85'"),
        ("a" * 256, "256 UTF-8 bytes"),
        ("é" * 128, "256 UTF-8 bytes"),
        ("a\udcff", "lone surrogate"),
    ],
)
def test_item4_unsafe_tensor_names_are_refused(name: str, problem: str) -> None:
    entry = {"name": name, "dtype": "float32", "shape": [1]}
    with pytest.raises(PackageError) as info:
        parse_spec([entry], "config.json: output_spec")
    message = str(info.value)
    assert message.startswith("config.json: output_spec[0].name") and problem in message
    if name:
        assert "a tensor name must be non-empty" in message
    # A TensorSpec built in code goes through the same rule.
    if name:
        with pytest.raises(PackageError, match="is not a valid tensor name"):
            parse_spec([TensorSpec(name, "float32", (1,))], "output_spec")


ORDINARY_NAMES = ["x", "x:0", "input.1", "...", "a b", "naïve", "a" * 255, "é" * 127, "日本", "a/b", "../x"]
# Triton's (and TensorFlow's) tensor names.
ORDINARY_NAMES += ["a\\b", "InceptionV3/Predictions/Softmax:0"]


@pytest.mark.parametrize("name", ORDINARY_NAMES)
def test_item4_ordinary_tensor_names_are_kept(name: str) -> None:
    (spec,) = parse_spec([{"name": name, "dtype": "float32", "shape": [1]}], "spec")
    assert spec.name == name


def test_item4_hand_written_package_cannot_write_outside_output_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # '/' may be in a tensor name (Triton's models use 'dense/BiasAdd:0'): --output-dir escapes it
    # in the file name, so '../escaped' is a file inside the directory, never one outside it.
    package = hand_written_package(tmp_path / "pkg", "../escaped")
    np.save(tmp_path / "x.npy", X)
    out_dir = tmp_path / "work" / "out"
    with echo_plugin():
        code, _, err = run_cli(monkeypatch, "infer", str(package), "-i", f"x={tmp_path / 'x.npy'}",
                               "--output-dir", str(out_dir))  # fmt: skip
    assert code == 0, err
    assert not (tmp_path / "work" / "escaped.npy").exists()
    assert sorted(p.name for p in out_dir.iterdir()) == ["..%2Fescaped.npy"]
    np.testing.assert_array_equal(np.load(out_dir / "..%2Fescaped.npy"), X)


def test_item4_output_path_that_leads_out_through_a_link_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = hand_written_package(tmp_path / "pkg", "out")
    np.save(tmp_path / "x.npy", X)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (out_dir / "out.npy").symlink_to(victim)
    with echo_plugin():
        code, _, err = run_cli(monkeypatch, "infer", str(package), "-i", f"x={tmp_path / 'x.npy'}",
                               "--output-dir", str(out_dir))  # fmt: skip
        assert victim.read_text() == "keep me"
        assert_one_line_error(code, err, "Output 'out' of model 'echo' cannot be written", "leads out of the directory")
        # Without the link the same command writes the output inside the directory.
        (out_dir / "out.npy").unlink()
        code, _, err = run_cli(monkeypatch, "infer", str(package), "-i", f"x={tmp_path / 'x.npy'}",
                               "--output-dir", str(out_dir))  # fmt: skip
    assert code == 0, err
    np.testing.assert_array_equal(np.load(out_dir / "out.npy"), X)


# --- item 15: argument types and values, before any work ---------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"timeout": math.inf}, ValueError, "timeout must be a positive, finite number of seconds"),
        ({"timeout": math.nan}, ValueError, "timeout must be a positive, finite number"),
        ({"timeout": -1}, ValueError, "timeout must be a positive"),
        ({"timeout": 0}, ValueError, "timeout must be a positive"),
        ({"timeout": 1e300}, ValueError, "timeout must be a positive"),
        ({"timeout": "5"}, TypeError, "timeout must be a number of seconds or None, not str"),
        ({"timeout": True}, TypeError, "timeout must be a number of seconds or None, not bool"),
        ({"workers": 1.5}, TypeError, "workers must be an int >= 1, not float"),
        ({"workers": 0}, ValueError, "workers must be at least 1, not 0"),
        ({"workers": True}, TypeError, "workers must be an int >= 1, not bool"),
        ({"workers": "2"}, TypeError, "workers must be an int >= 1, not str"),
        ({"backend": 1}, TypeError, "backend must be a str"),
        ({"device": 3}, TypeError, "device must be a str"),
        ({"restart": "yes"}, TypeError, "restart must be True or False, not str"),
        ({"verify": "no"}, TypeError, "verify must be True or False, not str"),
        ({"use_ope": 1}, TypeError, "use_ope must be True or False, not int"),
    ],
)
def test_item15_load_arguments_are_checked_before_the_package_is_read(
    kwargs: dict[str, Any], error: type[Exception], needle: str, tmp_path: Path
) -> None:
    # The package does not exist: an error about the argument proves nothing was read first.
    with pytest.raises(error) as info:
        neuropod.load_neuropod(tmp_path / "no-such-package", **kwargs)
    assert not isinstance(info.value, NeuropodError)
    assert needle in str(info.value)


def test_item15_good_arguments_still_load(tmp_path: Path) -> None:
    path = write_toy(tmp_path / "m")
    with toy_plugin(), neuropod.load_neuropod(path, timeout=2.5, workers=np.int64(1), verify=np.bool_(True)) as model:
        np.testing.assert_array_equal(model.infer({"x": X, "y": X})["out"], X + X)


def test_item15_plan_and_run_test_data_check_their_arguments_first(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-package"
    with pytest.raises(TypeError, match="device must be a str"):
        plan(missing, device=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="package must be a path"):
        plan(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rtol must be a finite number >= 0, not nan"):
        run_test_data(missing, rtol=math.nan)
    with pytest.raises(ValueError, match="workers must be at least 1"):
        run_test_data(missing, workers=-3)


@pytest.mark.parametrize(
    ("requested", "needle"),
    [
        (5, "requested_outputs must be a list of output names (str), not int: write e.g. requested_outputs=['out']"),
        (b"out", "not bytes"),
        ([1], "must hold output names (str), but holds int 1"),
        ({"out": 1}, "not dict"),
    ],
)
def test_item15_requested_outputs_of_the_wrong_type(requested: Any, needle: str, tmp_path: Path) -> None:
    path = write_toy(tmp_path / "m")
    with toy_plugin(), neuropod.load_neuropod(path) as model:
        with pytest.raises(TypeError) as info:
            model.infer({"x": X, "y": X}, requested_outputs=requested)
        assert needle in str(info.value)
        # A single str is one name, never its characters.
        assert list(model.infer({"x": X, "y": X}, requested_outputs="out")) == ["out"]


@pytest.mark.parametrize(
    ("version", "range_", "needle"),
    [
        (None, "^1", "version must be a str"),
        (1, "^1", "version must be a str"),
        ("1.0", None, "range_ must be a str"),
        ("1.0", 1.0, "range_ must be a str"),
    ],
)
def test_item15_satisfies_argument_types(version: Any, range_: Any, needle: str) -> None:
    with pytest.raises(TypeError) as info:
        satisfies(version, range_)
    assert needle in str(info.value)


# --- item 16: the CLI ends every bad input with one line ---------------------------


def _npy_with_header(path: Path, header_bytes: int) -> Path:
    header = repr({"descr": "<f4", "fortran_order": False, "shape": (1,), "pad": "a" * header_bytes}).encode()
    padding = (64 - (12 + len(header) + 1) % 64) % 64
    body = header + b" " * padding + b"\n"
    path.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", len(body)) + body + b"\x00" * 4)
    return path


def test_item16_long_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    long = str(tmp_path / ("a" * 5000))
    code, _, err = run_cli(monkeypatch, "inspect", long)
    assert_one_line_error(code, err, "neuropod inspect: error:")
    code, _, err = run_cli(monkeypatch, "backends", "--host", long)
    assert_one_line_error(code, err, "neuropod backends: error: Host file", "File name too long")
    assert len(err) < 1000, "a 5000-character path is shortened in the message"
    np.save(tmp_path / "x.npy", X)
    code, _, err = run_cli(monkeypatch, "infer", str(tmp_path), "-i", f"x={long}")
    assert_one_line_error(code, err, "neuropod infer: error: --input x:", "File name too long")
    assert len(err) < 1000


@pytest.mark.parametrize(
    ("error", "needles"),
    [
        (OSError(36, "File name too long", "a" * 5000), ["neuropod inspect: error: File name too long: 'aaa", "aaa...aaa", "aaa'"]),
        (PermissionError(13, "Permission denied", "/x", None, "/y"), ["error: Permission denied: '/x' -> '/y'"]),
        (ValueError("bad\nvalue"), ["neuropod inspect: error: bad value"]),
        (UnicodeEncodeError("ascii", "\udcff", 0, 1, "no"), ["error: UnicodeEncodeError:"]),
        (RuntimeError("oops"), ["error: unexpected RuntimeError: oops", "run again with --debug"]),
    ],
)
def test_item16_errors_escaping_a_command_are_one_line(
    error: Exception, needles: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails(args: Any, out: Any) -> int:
        raise error

    monkeypatch.setattr(cli, "cmd_inspect", fails)
    code, _, err = run_cli(monkeypatch, "inspect", "pkg")
    assert_one_line_error(code, err, *needles)
    assert len(err) < 1000
    code, _, err = run_cli(monkeypatch, "--debug", "inspect", "pkg")
    assert code == 2 and "Traceback (most recent call last)" in err and f"{type(error).__name__}" in err
    assert err.rstrip().splitlines()[-1].startswith("neuropod inspect: error:")


def test_item16_interrupt_and_broken_pipe_keep_their_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    for error, status in ((KeyboardInterrupt(), 130), (BrokenPipeError(32, "Broken pipe"), 0)):
        def fails(args: Any, out: Any, error: BaseException = error) -> int:
            raise error

        monkeypatch.setattr(cli, "cmd_inspect", fails)
        code, _, err = run_cli(monkeypatch, "inspect", "pkg")
        assert code == status and "error" not in err


def test_item16_bad_npy_inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toy(tmp_path / "m")
    np.save(tmp_path / "y.npy", X)
    big = _npy_with_header(tmp_path / "big.npy", 20_000)
    np.savez(tmp_path / "both.npz", x=X)
    y = f"y={tmp_path / 'y.npy'}"
    with toy_plugin():
        code, _, err = run_cli(monkeypatch, "infer", str(path), "-i", "x=/dev/null", "-i", y)
        assert_one_line_error(code, err, "--input x: /dev/null is empty")
        code, _, err = run_cli(monkeypatch, "infer", str(path), "-i", f"x={big}", "-i", y)
        assert_one_line_error(code, err, f"--input x: {big} is not a readable .npy file", "max_header_size")
        code, _, err = run_cli(monkeypatch, "infer", str(path), "-i", f"x={tmp_path / 'both.npz'}", "-i", y)
        assert_one_line_error(code, err, "is a .npz archive; give one .npy file per input")
        code, _, err = run_cli(monkeypatch, "infer", str(path), "-i", f"x={tmp_path}", "-i", y)
        assert_one_line_error(code, err, "cannot be read: Is a directory")


def test_item16_output_dir_that_cannot_be_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toy(tmp_path / "m")
    np.save(tmp_path / "x.npy", X)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    inputs = ["-i", f"x={tmp_path / 'x.npy'}", "-i", f"y={tmp_path / 'x.npy'}"]
    with toy_plugin() as plugin:
        code, _, err = run_cli(monkeypatch, "infer", str(path), *inputs, "--output-dir", str(a_file / "sub"))
        assert_one_line_error(code, err, f"--output-dir '{a_file / 'sub'}' cannot be created: Not a directory")
        code, _, err = run_cli(monkeypatch, "infer", str(path), *inputs, "--output-dir", str(a_file))
        assert_one_line_error(code, err, f"--output-dir '{a_file}' exists and is not a directory")
        assert not plugin.loaded, "a bad --output-dir fails before the model is loaded"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root may write anywhere")
def test_item16_output_dir_permission_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toy(tmp_path / "m")
    np.save(tmp_path / "x.npy", X)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with toy_plugin():
        code, _, err = run_cli(monkeypatch, "infer", str(path), "-i", f"x={tmp_path / 'x.npy'}",
                               "-i", f"y={tmp_path / 'x.npy'}", "--output-dir", str(locked / "out"))  # fmt: skip
    assert_one_line_error(code, err, "cannot be created: Permission denied")


@pytest.mark.parametrize(
    ("memory", "needle"),
    [
        ("1e400", "memory_total is inf"),
        ("-1e400", "memory_total is -inf"),
        ("NaN", "memory_total is nan"),
        ("-5", "memory_total is -5 but must be a non-negative number of bytes"),
        ("9" * 5000, "not a host description"),
        ("1" + "0" * 400, "but must be at most"),
        ('"99999999999999999999 TiB"', "but must be at most"),
    ],
)
def test_item16_host_file_memory(memory: str, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = tmp_path / "host.json"
    host.write_text(f'{{"gpus": [{{"name": "g", "compute_capability": "8.0", "memory_total": {memory}}}]}}')
    code, _, err = run_cli(monkeypatch, "backends", "--host", str(host))
    assert_one_line_error(code, err, "neuropod backends: error: Host file", needle)


def test_item16_lone_surrogates_in_argv_are_printed_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What argv holds for a path with the byte 0xff (Python decodes argv with surrogateescape).
    odd = str(tmp_path / "m\udcff")
    code, _, err = run_cli(monkeypatch, "inspect", odd)
    assert_one_line_error(code, err, "No Neuropod package at", "m\\udcff")
    code, _, err = run_cli(monkeypatch, "inspect", str(tmp_path), "--bogus\udcff")
    assert code == 2 and "unrecognized arguments: --bogus\\udcff" in err and "Traceback" not in err
    code, _, err = run_cli(monkeypatch, "\udcff")
    assert code == 2 and "invalid choice" in err


@pytest.mark.skipif(sys.platform != "linux", reason="needs a file system that takes any bytes in names")
def test_item16_undecodable_package_path_in_a_real_process(tmp_path: Path) -> None:
    package = write_toy(Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/m\xff")))
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    result = subprocess.run(
        [sys.executable, "-m", "neuropod.cli", "inspect", os.fsencode(package)], capture_output=True, env=env,
    )
    assert result.returncode == 0, result.stderr
    assert b"Traceback" not in result.stderr
    assert b"Package:   " + os.fsencode(str(tmp_path)) + b"/m\\udcff" in result.stdout


def test_item16_os_and_value_errors_are_one_line_and_debug_shows_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long = str(tmp_path / ("a" * 5000))
    code, _, err = run_cli(monkeypatch, "backends", "--host", long)
    assert_one_line_error(code, err, "File name too long")
    code, _, err = run_cli(monkeypatch, "--debug", "backends", "--host", long)
    assert code == 2 and "Traceback (most recent call last)" in err
    assert err.rstrip().splitlines()[-1].startswith("neuropod backends: error: Host file")


# --- item 17: JSON from outside is bounded; one bad record spoils nothing else ------


def _env_dir(name: str, record: str | None) -> Path:
    """An environment directory laid out as create_environment leaves it (see test_envs.fake_env)."""
    path = envs.envs_dir() / name
    (path / "bin").mkdir(parents=True)
    os.symlink(sys.executable, path / "bin" / "python")
    if record is not None:
        (path / envs.ENV_FILE).write_text(record)
    return path


def _good_record(name: str, version: str) -> str:
    return json.dumps({
        "format": 1, "name": name, "spec": f"toy=={version}", "python_version": "3.11.7", "neuropod": "0.4.0",
        "neuropod_fingerprint": envs.core_fingerprint(Path(neuropod.__file__).parent),
        "backends": [{"platform": "toy", "version": version, "framework": "toyframework", "plugin": "toy",
                      "plugin_distribution": "toy-plugin 1.0", "cpu": True, "cuda": None, "compute_capabilities": []}],
    })  # fmt: skip


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ("[" * 100_000 + "]" * 100_000, "nests more than 64 levels deep"),
        ('{"backends": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests more than 64 levels deep"),
        ('{"backends": {"platform": "toy"}}', "'backends' is {'platform': 'toy'}, not a list"),
        ('{"backends": [{"platform": "toy", "version": "3.0.0", "framework": "f", "cpu": "yes"}]}',
         "'cpu' is 'yes', not true or false"),
        ('{"backends": [{"platform": "toy", "version": "3.0.0", "framework": "f", "compute_capabilities": "8.0"}]}',
         "'compute_capabilities' is '8.0', not a list of strings"),
        ('{"backends": 7}', "'backends' is 7, not a list"),
        ('{"n": ' + "9" * 5000 + "}", "digits"),
    ],
)
def test_item17_a_bad_environment_record_leaves_the_others_usable(
    record: str, problem: str, tmp_path: Path
) -> None:
    _env_dir("bad", record)
    _env_dir("toy-3.0.0", _good_record("toy-3.0.0", "3.0.0"))
    found = {e.name: e for e in envs.list_environments()}
    assert not found["bad"].ok and problem in found["bad"].problem
    assert "neuropod env remove bad" in found["bad"].problem
    assert found["toy-3.0.0"].ok
    # Resolution still sees the good environment's backend, and a second listing works the same.
    with toy_plugin():
        resolution = plan(write_toy(tmp_path / "m", platform_version_semver=">=3"))
    assert resolution.chosen is not None and resolution.chosen.backend.location == "env:toy-3.0.0"
    assert [e.name for e in envs.list_environments()] == ["bad", "toy-3.0.0"]


def test_item17_pip_direct_url_nested_deep_is_ignored() -> None:
    assert envs.builder._direct_path('{"url": ' + "[" * 100_000 + "]" * 100_000 + "}") is None


def test_item17_host_file_nested_deep(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"gpus": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for _ in range(2):  # the second read is as good as the first
        with pytest.raises(NeuropodError, match=r"Host file '.*deep\.json': not a host description: it nests more"):
            load_host(deep)
    good = tmp_path / "good.json"
    good.write_text('{"name": "ok", "gpus": [{"name": "g", "compute_capability": "8.0", "memory_total": "8GiB"}]}')
    assert load_host(good).gpus[0].memory_total == 8 * 2**30


def test_item17_host_file_that_never_ends(tmp_path: Path) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    with pytest.raises(NeuropodError, match="Host file '/dev/zero': not a host description: it is .* characters long"):
        load_host("/dev/zero")


# --- item 20: package text reaches the terminal escaped ----------------------------


EVIL = "evil\x1b[2J\x1b]0;pwned\x07\nPASSED\u202eexe.txt\x9b"


def test_item20_inspect_escapes_package_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toy(tmp_path / "m", name=EVIL, platform="toy", exported_with={"toy\x1b[31m": "1.0\r\n"},
                     input_tensor_device={"x": "GPU\x1b[0m"})  # fmt: skip
    (path / "0" / "data" / "notes\x1b[5m.txt").write_text("")
    code, out, err = run_cli(monkeypatch, "inspect", "--no-verify", str(path))
    assert code == 0, err
    for raw in ("\x1b", "\x07", "\r", "\u202e", "\x9b"):
        assert raw not in out
    assert "Name:      evil\\x1b[2J\\x1b]0;pwned\\x07\\nPASSED\\u202eexe.txt\\x9b" in out
    assert "Made with: toy\\x1b[31m 1.0\\r\\n" in out
    assert "GPU\\x1b[0m" in out and "notes\\x1b[5m.txt" in out
    assert not any(line.startswith("PASSED") for line in out.splitlines())
    # --json is ASCII: json.dumps escapes every control and non-ASCII character.
    code, out, _ = run_cli(monkeypatch, "inspect", "--json", "--no-verify", str(path))
    assert code == 0 and out.isascii() and "\x1b" not in out
    assert json.loads(out)["name"] == EVIL


def test_item20_explain_test_and_infer_escape_package_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toy(tmp_path / "m", name=EVIL)
    np.save(tmp_path / "x.npy", X)
    with toy_plugin():
        for argv in (
            ["explain", str(path)],
            ["test", str(path)],
            ["infer", str(path), "-i", f"x={tmp_path / 'x.npy'}", "-i", f"y={tmp_path / 'x.npy'}"],
        ):
            code, out, err = run_cli(monkeypatch, *argv)
            assert code == 0, err
            assert "\x1b" not in out and "\u202e" not in out and "\x9b" not in out, argv
            assert "evil\\x1b[2J" in out, argv


# --- item 16: fuzz over CLI argument lists -----------------------------------------


_ODD = st.sampled_from([
    "", " ", "-", "--", "=", "x=", "=x", "\udcff", "\x1b[31m", "a\x00b", "\n", "\u202e", "é", "日本", "💥",
    "a" * 5000, "../x", "/dev/null", "/dev/zero", "/nonexistent", "/", ".", "nan", "inf", "-1", "1e400",
])  # fmt: skip
_TEXT = st.one_of(_ODD, st.text(max_size=20), st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=8))


@st.composite
def _argv(draw: st.DrawFn, paths: dict[str, str]) -> list[str]:
    real = st.sampled_from(sorted(paths.values()))
    value = st.one_of(_TEXT, real, st.builds(lambda a, b: f"{a}={b}", _TEXT, st.one_of(real, _TEXT)))
    # Output dirs stay under the scratch directory, whatever the text ('..' is left out: we may be root).
    out_dir = _TEXT.filter(lambda t: ".." not in t and "\x00" not in t).map(lambda t: f"{paths['scratch']}/{t}")
    command = draw(st.sampled_from(["backends", "inspect", "explain", "test", "infer", "env", "demo", "bogus"]))
    argv = [command]
    if draw(st.booleans()):
        argv.insert(0, draw(st.sampled_from(["--debug", "--bogus", "-h"])))
    if command == "env":
        argv.append(draw(st.sampled_from(["list", "remove", "nope"])))  # never create: it runs pip
    elif command == "demo":
        # Only names that are no demo's: a real demo builds a model and takes seconds.
        argv.append(draw(_TEXT.filter(lambda t: t.strip() not in ("", "onnx") and not t.startswith("-"))))
    elif command in ("inspect", "explain", "test", "infer"):
        argv.append(draw(st.one_of(real, _TEXT)))
    flags = ["--json", "--host", "--device", "--backend", "--no-verify", "--quiet-spec", "--trust-pickle",
             "--rtol", "--atol", "-i", "--input", "-o", "--output-dir", "--name", "--auth-token-file",
             "--bogus"]  # fmt: skip
    for _ in range(draw(st.integers(0, 5))):
        flag = draw(st.sampled_from(flags))
        argv.append(flag)
        if flag == "--output-dir":
            argv.append(draw(out_dir))
        elif flag not in ("--json", "--no-verify", "--quiet-spec", "--trust-pickle", "--bogus"):
            argv.append(draw(value))
    if draw(st.booleans()):
        argv.append(draw(value))
    return argv


def test_item16_fuzz_cli_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.chdir(scratch)  # relative paths the fuzz makes land here
    np.save(tmp_path / "x.npy", X)
    host = tmp_path / "host.json"
    host.write_text('{"gpus": [{"name": "g", "compute_capability": "8.0", "memory_total": "8GiB"}]}')
    paths = {
        "package": str(write_toy(tmp_path / "m")),
        "evil": str(write_toy(tmp_path / "evil", name=EVIL)),
        "x": str(tmp_path / "x.npy"),
        "host": str(host),
        "scratch": str(scratch),
    }

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_argv(paths))
    def check(argv: list[str]) -> None:
        code, out, err = run_cli(monkeypatch, *argv)
        assert isinstance(code, int)
        assert "Traceback" not in out
        if "--debug" not in argv:
            assert "Traceback" not in err, (argv, err)
        assert "unexpected" not in err, (argv, err)  # the catch-all for bugs must not be reached
        for raw in ("\x1b", "\x00", "\u202e"):
            assert raw not in out and raw not in err, (argv, out, err)

    with toy_plugin():
        check()
