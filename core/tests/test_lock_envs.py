"""Lock environments without pip: reading locks, naming, usage records, listing and pruning.

Building one for real (venv + pip) is tested by the python plugin's tests
(``nox -s tests_python``); here the environments are directories with the
records a build writes.
"""

from __future__ import annotations

import datetime
import io
import json
import sys
from pathlib import Path

import pytest

from neuropod import cli, envs
from neuropod.backend import Backend
from neuropod.errors import PackageError

SKLEARN_LOCK = """\
# Locked by neuropod-python (pip's resolver): install with pip install --no-deps -r requirements.lock
# from these requirements:
#   scikit-learn==1.9.1
joblib==1.6.0 \\
    --hash=sha256:3dbbf9f6e4b592a2357b854608e980fe6390d131d7a82f011a377ef2ebef7aba
scikit-learn==1.9.1 \\
    --hash=sha256:52a0703bbc07ad27f560fa63fa68e4c54dd735bfbbf65b4dd3c225dc7547b6df
"""
HERE = Backend(platform="python", version="3.11.7", framework="cpython", plugin="python")


def test_lock_lines_normalize_comments_continuations_and_hashes() -> None:
    assert envs.lock_lines(SKLEARN_LOCK) == [
        "joblib==1.6.0 --hash=sha256:3dbbf9f6e4b592a2357b854608e980fe6390d131d7a82f011a377ef2ebef7aba",
        "scikit-learn==1.9.1 --hash=sha256:52a0703bbc07ad27f560fa63fa68e4c54dd735bfbbf65b4dd3c225dc7547b6df",
    ]
    # The original Neuropod's locks: plain pins, any case, markers allowed.
    assert envs.lock_lines("torch==1.4.0\n\nSix==1.16.0  # why\nfoo[x]==2; python_version < '3.12'\n") == [
        "torch==1.4.0", "Six==1.16.0", "foo[x]==2; python_version < '3.12'",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "line",
    ["-r other.txt", "--index-url https://example.com/simple", "numpy>=1.23", "numpy", "-e .",
     "./local/dir", "https://example.com/x.whl", "git+https://github.com/a/b"],
)  # fmt: skip
def test_lock_lines_refuse_anything_but_pins(line: str) -> None:
    with pytest.raises(PackageError, match="is not a pinned requirement"):
        envs.lock_lines(f"six==1.16.0\n{line}\n")


def test_lock_lines_refuse_a_dangling_continuation() -> None:
    with pytest.raises(PackageError, match="continuation"):
        envs.lock_lines("six==1.16.0 \\\n")


def test_lock_environment_name_depends_on_pins_and_python_only() -> None:
    name = envs.lock_environment_name(SKLEARN_LOCK, HERE)  # in-process: this interpreter's X.Y
    prefix = f"lock-py{sys.version_info[0]}.{sys.version_info[1]}-"
    assert name.startswith(prefix) and len(name) == len(prefix) + 12
    reordered = "\n".join(reversed(envs.lock_lines(SKLEARN_LOCK))) + "\n# another comment\n"
    assert envs.lock_environment_name(reordered, HERE) == name
    other = Backend(platform="python", version="3.12.1", framework="cpython", location="python:/usr/bin/python3.12")
    assert envs.lock_environment_name(SKLEARN_LOCK, other).startswith("lock-py3.12-")
    assert envs.lock_environment_name("six==1.16.0\n", HERE) != name


def _fake_lock_env(home: Path, name: str, *, used: str | None, summary: str = "scikit-learn==1.9.1") -> Path:
    path = home / "envs" / name
    (path / "bin").mkdir(parents=True)
    record = {
        "format": 1, "name": name, "spec": f"lock: {summary}", "kind": "lock", "python_version": "3.11.7",
        "created": "2020-01-01T00:00:00+00:00", "backends": [{"platform": "python", "version": "3.11.7", "framework": "cpython"}],
    }  # fmt: skip
    (path / envs.ENV_FILE).write_text(json.dumps(record))
    if used is not None:
        envs.locks._record_use(path, "model_a", "/models/a")
        data = json.loads((path / envs.USERS_FILE).read_text())
        data["packages"][0]["last_used"] = used
        (path / envs.USERS_FILE).write_text(json.dumps(data))
    return path


def _ago(days: float) -> str:
    return (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=days)).isoformat(timespec="seconds")


def test_usage_records_keep_the_latest_use_per_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEUROPOD_HOME", str(tmp_path))
    path = _fake_lock_env(tmp_path, "lock-py3.11-aaaaaaaaaaaa", used=_ago(5))
    envs.locks._record_use(path, "model_b", "/models/b")
    envs.locks._record_use(path, "model_a", "/models/a")
    (env,) = envs.list_environments()
    assert env.kind == "lock"
    assert [u["name"] for u in env.used_by] == ["model_a", "model_b"]
    assert env.last_used == env.used_by[0]["last_used"]
    assert envs.environment_backends() == []  # never offered to other packages


def test_prune_removes_only_lock_environments_unused_for_n_days(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEUROPOD_HOME", str(tmp_path))
    _fake_lock_env(tmp_path, "lock-py3.11-old000000000", used=_ago(40))
    _fake_lock_env(tmp_path, "lock-py3.11-new000000000", used=_ago(1))
    _fake_lock_env(tmp_path, "lock-py3.11-never0000000", used=None)  # created in 2020, never used
    backend_env = tmp_path / "envs" / "onnx-1.20.1"
    backend_env.mkdir()
    (backend_env / envs.ENV_FILE).write_text(json.dumps({"name": "onnx-1.20.1", "created": "2020-01-01T00:00:00+00:00"}))

    assert sorted(e.name for e in envs.prune_environments(30, dry_run=True)) == [
        "lock-py3.11-never0000000", "lock-py3.11-old000000000",
    ]  # fmt: skip
    assert len(envs.list_environments()) == 4  # a dry run removes nothing
    out = io.StringIO()
    assert cli.main(["env", "prune", "--days", "30"], out) == 0
    assert "Removed 2 lock environment(s) unused for 30 day(s)" in out.getvalue()
    assert "model_a" in out.getvalue()
    assert sorted(p.name for p in (tmp_path / "envs").iterdir() if not p.name.startswith(".")) == [
        "lock-py3.11-new000000000", "onnx-1.20.1",
    ]  # fmt: skip
    assert [e.name for e in envs.prune_environments(0)] == ["lock-py3.11-new000000000"]
    with pytest.raises(ValueError, match="days must be a number >= 0"):
        envs.prune_environments(-1)


def test_env_list_shows_lock_environments_with_their_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEUROPOD_HOME", str(tmp_path))
    _fake_lock_env(tmp_path, "lock-py3.11-bbbbbbbbbbbb", used=_ago(2), summary="scikit-learn==1.9.1 (7 pins)")
    out = io.StringIO()
    assert cli.main(["env", "list"], out) == 0
    text = out.getvalue()
    assert "Lock environments" in text
    assert "lock-py3.11-bbbbbbbbbbbb" in text and "scikit-learn==1.9.1 (7 pins)" in text and "model_a" in text
    out = io.StringIO()
    assert cli.main(["env", "list", "--json"], out) == 0
    (record,) = json.loads(out.getvalue())["environments"]
    assert record["kind"] == "lock" and record["used_by"][0]["source"] == "/models/a"
    out = io.StringIO()
    assert cli.main(["env", "remove", "lock-py3.11-bbbbbbbbbbbb"], out) == 0
    assert out.getvalue().startswith("Removed lock environment 'lock-py3.11-bbbbbbbbbbbb'")


def test_inspect_shows_the_locked_requirements(tmp_path: Path) -> None:
    from neuropod.package import parse_config, write_package

    from _toy_backend import ADD_CONFIG

    path = write_package(
        tmp_path / "m", parse_config(dict(ADD_CONFIG), "toy config"),
        {"0/data/op.json": b'{"op": "add"}', "0/requirements.lock": SKLEARN_LOCK.encode()},
    )  # fmt: skip
    out = io.StringIO()
    assert cli.main(["inspect", str(path)], out) == 0
    assert "Requires:  2 pinned (joblib==1.6.0, scikit-learn==1.9.1); runs in a worker" in out.getvalue()


def test_env_prepare_says_when_a_package_needs_no_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from _toy_backend import toy_plugin, write_toy

    monkeypatch.setenv("NEUROPOD_HOME", str(tmp_path / "home"))
    out = io.StringIO()
    with toy_plugin():
        assert cli.main(["env", "prepare", str(write_toy(tmp_path / "m"))], out) == 0
    assert "needs no environment of its own (runs with toy==" in out.getvalue()
    assert not (tmp_path / "home" / "envs").exists()


def test_prune_skips_an_environment_a_running_process_was_started_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    monkeypatch.setenv("NEUROPOD_HOME", str(tmp_path))
    path = _fake_lock_env(tmp_path, "lock-py3.11-busy00000000", used=_ago(90))
    (path / "bin" / "python").symlink_to(sys.executable)
    worker = subprocess.Popen(
        [str(path / "bin" / "python"), "-c", "import time; print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Once it prints, it is the environment's interpreter (not the fork before exec) that runs.
        assert worker.stdout is not None and worker.stdout.readline() == "up\n"
        assert envs.prune_environments(30) == [] and path.is_dir()
    finally:
        worker.kill()
        worker.wait()
    assert [e.name for e in envs.prune_environments(30)] == ["lock-py3.11-busy00000000"]
    assert not path.exists()
