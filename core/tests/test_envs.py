"""Backend environments without creating real ones: reading, listing, removing,
resolution with environment candidates, the CLI, and creation's failure paths.

Real environments (pip, onnxruntime downloads) are tested in
``plugins/neuropod-onnx/tests/test_environments.py``.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import neuropod
from neuropod import cli, envs, plugins
from neuropod.backend import Backend
from neuropod.errors import NeuropodError, NoBackendError
from neuropod.loader import plan

from _toy_backend import toy_plugin, write_toy


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NEUROPOD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "home"


def fake_env(name: str, versions: list[str], platform: str = "toy", *, python: bool = True) -> Path:
    """An environment directory as create_environment leaves it, with the running interpreter linked in."""
    path = envs.envs_dir() / name
    (path / "bin").mkdir(parents=True)
    if python:
        os.symlink(sys.executable, path / "bin" / "python")
    record = {
        "format": 1,
        "name": name,
        "spec": f"{platform}=={versions[0]}",
        "created": "2026-01-01T00:00:00+00:00",
        "python_version": "3.11.7",
        "neuropod": "0.4.0",
        "neuropod_fingerprint": envs.core_fingerprint(Path(neuropod.__file__).parent),
        "backends": [
            {"platform": platform, "version": v, "framework": "toyframework", "plugin": platform,
             "plugin_distribution": "toy-plugin 1.0", "cpu": True, "cuda": None, "compute_capabilities": []}
            for v in versions
        ],
    }
    (path / envs.ENV_FILE).write_text(json.dumps(record))
    return path


def test_home_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NEUROPOD_HOME", str(tmp_path / "nh"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert envs.neuropod_home() == tmp_path / "nh"
    monkeypatch.delenv("NEUROPOD_HOME")
    assert envs.neuropod_home() == tmp_path / "xdg" / "neuropod"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert envs.neuropod_home() == tmp_path / "user" / ".local" / "share" / "neuropod"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("onnx==1.20.1", ("onnx", "1.20.1")), (" onnx == 1.20.* ", ("onnx", "1.20.*")),
     ("torchscript==2.13.0+cpu", ("torchscript", "2.13.0+cpu")), ("tensorflow==2.16", ("tensorflow", "2.16"))],
)
def test_parse_spec(spec: str, expected: tuple[str, str]) -> None:
    assert envs.parse_spec(spec) == expected


@pytest.mark.parametrize("spec", ["onnx", "onnx>=1.20", "onnx==", "onnx==latest", "==1.2", "onnx==1.20.1,<2"])
def test_bad_spec_says_what_is_accepted(spec: str) -> None:
    with pytest.raises(NeuropodError, match=r"is not PLATFORM==VERSION: write e.g. 'onnx==1.20.1'.*platforms: aoti, jax, keras, onnx"):
        envs.parse_spec(spec)


def test_unknown_platform() -> None:
    with pytest.raises(NeuropodError, match=r"unknown platform 'caffe'; the platforms are: aoti, jax, keras, onnx, tensorflow"):
        envs.parse_spec("caffe==1.0")


def test_list_reads_records_and_marks_broken_ones(home: Path) -> None:
    assert envs.list_environments() == []
    fake_env("toy-1.5.0", ["1.5.0"])
    fake_env("toy-3.0.0", ["3.0.0"], python=False)
    (envs.envs_dir() / "half-made").mkdir()
    (envs.envs_dir() / "garbled").mkdir()
    (envs.envs_dir() / "garbled" / envs.ENV_FILE).write_text("{not json")
    (envs.envs_dir() / ".tmp-toy-9-abc").mkdir()  # being created: not an environment yet
    found = {e.name: e for e in envs.list_environments()}
    assert sorted(found) == ["garbled", "half-made", "toy-1.5.0", "toy-3.0.0"]
    good = found["toy-1.5.0"]
    assert good.ok and good.spec == "toy==1.5.0" and good.python == good.path / "bin" / "python"
    assert good.python_version == "3.11.7" and good.path == home / "envs" / "toy-1.5.0"
    (backend, caps), = good.backends
    assert backend == Backend("toy", "1.5.0", "toyframework", "toy", "toy-plugin 1.0", "env:toy-1.5.0")
    assert caps.cpu and not caps.gpu
    assert "interpreter" in found["toy-3.0.0"].problem and "--replace" in found["toy-3.0.0"].problem
    assert "incomplete" in found["half-made"].problem and "neuropod env remove half-made" in found["half-made"].problem
    assert "unreadable" in found["garbled"].problem
    # Only usable environments offer backends.
    assert [b.location for b, _ in envs.environment_backends()] == ["env:toy-1.5.0"]


def test_get_and_remove(home: Path) -> None:
    fake_env("toy-1.5.0", ["1.5.0"])
    assert envs.get_environment("toy-1.5.0").name == "toy-1.5.0"
    assert envs.environment_of(Backend("toy", "1.5.0", "toyframework", location="env:toy-1.5.0")).name == "toy-1.5.0"
    assert envs.environment_of(Backend("toy", "1.0.0", "toyframework")) is None
    with pytest.raises(NeuropodError, match=r"No backend environment 'nope' .*the environments are: toy-1.5.0"):
        envs.get_environment("nope")
    with pytest.raises(NeuropodError, match="not a valid environment name"):
        envs.get_environment("../etc")
    envs.remove_environment("toy-1.5.0")
    assert not (home / "envs" / "toy-1.5.0").exists()
    assert os.listdir(home / "envs") == []  # no trash left
    with pytest.raises(NeuropodError, match="there are none"):
        envs.remove_environment("toy-1.5.0")


def test_resolution_prefers_in_process_and_falls_back_to_environments(tmp_path: Path) -> None:
    fake_env("toy-1.5.0", ["1.5.0"])
    fake_env("toy-0.9.0", ["0.9.0"])
    with toy_plugin():  # toy 1.0.0 in this process
        # Both the in-process 1.0.0 and the env's 1.5.0 fit: in-process wins, though older.
        r = plan(write_toy(tmp_path / "any", platform_version_semver="*"))
        assert r.chosen is not None and r.chosen.backend.location == "in-process"
        assert sum(c.accepted for c in r.candidates) == 3
        # Only an environment has it.
        r = plan(write_toy(tmp_path / "new", platform_version_semver="~1.5"))
        assert r.chosen is not None and (r.chosen.backend.id, r.chosen.backend.location) == ("toy==1.5.0", "env:toy-1.5.0")
        assert "env:toy-1.5.0" in r.table() and "in-process" in r.table()
        r = plan(write_toy(tmp_path / "old", platform_version_semver="<1"))
        assert r.chosen is not None and r.chosen.backend.location == "env:toy-0.9.0"
        # A pin reaches into environments too.
        r = plan(write_toy(tmp_path / "pin"), backend="toy==1.5.0")
        assert r.chosen is not None and r.chosen.backend.location == "env:toy-1.5.0"
        # Nothing fits: every candidate is in the table, with where it lives.
        r = plan(write_toy(tmp_path / "none", platform_version_semver=">=2"))
        assert r.chosen is None
        table = r.table()
        for where in ("in-process", "env:toy-1.5.0", "env:toy-0.9.0"):
            assert where in table
        assert "neuropod env create toy==VERSION" in r.advice()
        # An exact pin (an AOTInductor package's range) names the version to create.
        for pin in ("==2.0.1", "2.0.1", "=2.0.1"):
            assert "neuropod env create toy==2.0.1." in plan(write_toy(tmp_path / f"exact{pin}", platform_version_semver=pin)).advice()


def test_environment_backend_is_never_run_in_process(tmp_path: Path) -> None:
    with toy_plugin(), pytest.raises(NoBackendError, match="lives in env:toy-1.5.0, not in this process"):
        plugins.bound_hook("load_model", Backend("toy", "1.5.0", "toyframework", "toy", location="env:toy-1.5.0"))


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(list(argv), out)
    return code, out.getvalue()


def test_cli_list_backends_remove(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = run_cli("env", "list")
    assert code == 0 and "No backend environments in" in text and "neuropod env create" in text
    fake_env("toy-1.5.0", ["1.5.0"])
    (envs.envs_dir() / "half-made").mkdir()
    code, text = run_cli("env", "list")
    assert code == 0
    assert "toy-1.5.0  toy==1.5.0" in text and "toy==1.5.0 (cpu)" in text and str(home / "envs" / "toy-1.5.0") in text
    assert "half-made" in text and "UNUSABLE" in text and "half-made: incomplete" in text
    code, text = run_cli("env", "list", "--json")
    data = json.loads(text)
    assert [e["name"] for e in data["environments"]] == ["half-made", "toy-1.5.0"]
    assert data["environments"][1]["backends"][0]["location"] == "env:toy-1.5.0"
    code, text = run_cli("backends")
    assert "Backend environments" in text and "env:toy-1.5.0" in text
    code, text = run_cli("backends", "--json")
    assert [e["name"] for e in json.loads(text)["environments"]] == ["half-made", "toy-1.5.0"]
    code, text = run_cli("env", "remove", "toy-1.5.0")
    assert code == 0 and "Removed backend environment 'toy-1.5.0'" in text
    code, _ = run_cli("env", "remove", "toy-1.5.0")
    assert code == 2 and "No backend environment 'toy-1.5.0'" in capsys.readouterr().err


def test_cli_explain_shows_where(tmp_path: Path) -> None:
    fake_env("toy-1.5.0", ["1.5.0"])
    with toy_plugin():
        code, text = run_cli("explain", str(write_toy(tmp_path / "m", platform_version_semver="^1.5")), "--quiet-spec")
    assert code == 0
    assert "Chosen: toy==1.5.0 on cpu." in text
    assert any(line.lstrip().startswith("*") and "env:toy-1.5.0" in line for line in text.splitlines())


def test_create_refuses_bad_specs_and_existing_names_before_doing_anything(home: Path) -> None:
    with pytest.raises(NeuropodError, match="is not PLATFORM==VERSION"):
        envs.create_environment("onnx>=1.20", out=io.StringIO())
    fake_env("onnx-1.20.1", ["1.20.1"], platform="onnx")
    with pytest.raises(NeuropodError, match=r"'onnx-1.20.1' already exists .*neuropod env remove onnx-1.20.1.*--replace"):
        envs.create_environment("onnx==1.20.1", out=io.StringIO())
    with pytest.raises(NeuropodError, match="--python 'no-such-python3.99': no such interpreter"):
        envs.create_environment("onnx==1.20.1", name="other", python="no-such-python3.99", out=io.StringIO())
    assert sorted(os.listdir(home / "envs")) == ["onnx-1.20.1"]


def test_failed_creation_leaves_nothing(home: Path, tmp_path: Path) -> None:
    # An "interpreter" whose venv step fails, the way a broken Python would.
    bad = tmp_path / "badpython"
    bad.write_text("#!/bin/sh\necho 'this python is broken' >&2\nexit 3\n")
    bad.chmod(0o755)
    out = io.StringIO()
    with pytest.raises(NeuropodError, match=r"(?s)failed \(exit status 3\).*this python is broken"):
        envs.create_environment("onnx==1.20.1", python=str(bad), out=out)
    # The step and its time; the interpreter's own output only in the error.
    assert re.fullmatch(rf"Creating a backend environment for onnx==1\.20\.1 named 'onnx-1\.20\.1':\n"
                        rf"  creating the virtual environment \({re.escape(str(bad))}\) \.\.\. failed after [0-9.]+ s\n",
                        out.getvalue()), out.getvalue()  # fmt: skip
    assert os.listdir(home / "envs") == []
    out = io.StringIO()
    with pytest.raises(NeuropodError, match=r"(?s)failed \(exit status 3\).*this python is broken"):
        envs.create_environment("onnx==1.20.1", python=str(bad), out=out, verbose=True)
    assert "    this python is broken\n" in out.getvalue()  # verbose: streamed as it ran
    assert re.search(r"^  creating the virtual environment \(.*\): failed after [0-9.]+ s$", out.getvalue(), re.M)
    assert os.listdir(home / "envs") == []


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"url": "file:///{tmp}/core", "dir_info": {"editable": True}}, "{tmp}/core"),
        ({"url": "file:///{tmp}/core", "dir_info": {}}, "{tmp}/core"),
        ({"url": "file:///{tmp}/neuropod-0.4.0-py3-none-any.whl", "archive_info": {}},
         "{tmp}/neuropod-0.4.0-py3-none-any.whl"),
        ({"url": "file:///{tmp}/gone", "dir_info": {}}, None),  # moved away: fall back to the index
        ({"url": "https://example.com/neuropod-0.4.0.whl", "archive_info": {}}, None),
        ({"url": "git+https://example.com/neuropod", "vcs_info": {"vcs": "git"}}, None),
    ],
)
def test_local_sources(tmp_path: Path, record: dict[str, Any], expected: str | None) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "neuropod-0.4.0-py3-none-any.whl").write_bytes(b"")
    tmp = str(tmp_path).lstrip("/")
    text = json.dumps({k: v.replace("/{tmp}", "/" + tmp) if k == "url" else v for k, v in record.items()})
    assert envs.builder._direct_path(text) == (expected.replace("{tmp}", str(tmp_path)) if expected else None)


def test_requirements_pin_the_core_and_the_framework() -> None:
    reqs = envs.install_requirements("tensorflow", "2.16.2")
    assert len(reqs) == 3 and reqs[2] == "tensorflow-cpu==2.16.2"
    # Our core comes from where this one was installed from, or is pinned: never a bare `neuropod`.
    assert reqs[0] == "neuropod==0.4.0" or os.path.exists(reqs[0])
    assert reqs[1] == "neuropod-tensorflow==0.4.0" or os.path.exists(reqs[1])


def test_environment_with_another_core_is_unusable(home: Path, tmp_path: Path) -> None:
    path = fake_env("toy-1.5.0", ["1.5.0"])
    assert envs.get_environment("toy-1.5.0").ok
    record = json.loads((path / envs.ENV_FILE).read_text())
    # Another core: the same files but one changed, as after editing an editable install.
    other = tmp_path / "other-core"
    shutil.copytree(Path(neuropod.__file__).parent, other, ignore=shutil.ignore_patterns("__pycache__"))
    assert envs.core_fingerprint(other) == record["neuropod_fingerprint"]
    (other / "envs" / "records.py").write_text((other / "envs" / "records.py").read_text() + "\n# changed\n")
    record["neuropod_fingerprint"] = envs.core_fingerprint(other)
    (path / envs.ENV_FILE).write_text(json.dumps(record))
    env = envs.get_environment("toy-1.5.0")
    assert "is not the one running here" in env.problem and "neuropod env create toy==1.5.0 --replace" in env.problem
    assert envs.environment_backends() == []
