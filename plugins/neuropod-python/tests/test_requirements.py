"""Packages with requirements: locked at packaging, run in lock environments built once and shared.

These build real environments (venv + pip) in one NEUROPOD_HOME for the session: scikit-learn
(from a process that has no scikit-learn), torch (eager PyTorch), a lock pip must refuse, and
an original-format lock of plain pins.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import neuropod
from neuropod import cli, envs
from neuropod.errors import NeuropodError
from neuropod.packagers import create_python_neuropod, create_pytorch_neuropod

from conftest import SKLEARN, lock_envs, write_code

SKLEARN_CODE = """
import os
import pickle

def get_model(data_root):
    with open(os.path.join(data_root, "model.pkl"), "rb") as f:
        pipeline = pickle.load(f)

    def model(x):
        return {"label": pipeline.predict(x).astype("int64"), "proba": pipeline.predict_proba(x)}
    return model
"""

TRAIN = """
import pickle, sys
import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

rng = np.random.default_rng(0)
x = np.concatenate([rng.normal(-2, 1, (40, 3)), rng.normal(2, 1, (40, 3))])
y = np.array([0] * 40 + [1] * 40)
pipeline = make_pipeline(StandardScaler(), LogisticRegression()).fit(x, y)
with open(sys.argv[1], "wb") as f:
    pickle.dump(pipeline, f)
probe = rng.normal(0, 2, (6, 3))
np.savez(sys.argv[2], x=probe, label=pipeline.predict(probe), proba=pipeline.predict_proba(probe))
"""


@pytest.fixture(scope="module")
def sklearn_model(tmp_path_factory: pytest.TempPathFactory, sklearn_python: Path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A scikit-learn pipeline trained in its own venv: the pickle, the code, and its direct predictions."""
    work = tmp_path_factory.mktemp("sklearn-model")
    script = work / "train.py"
    script.write_text(TRAIN)
    subprocess.run([str(sklearn_python), str(script), str(work / "model.pkl"), str(work / "direct.npz")], check=True)
    code = write_code(work / "code", {"sk_model.py": SKLEARN_CODE})
    with np.load(work / "direct.npz") as direct:
        return work / "model.pkl", code, dict(direct)


def package_sklearn(dest: Path, model: tuple[Path, Path, dict[str, np.ndarray]]) -> Path:
    pickle_path, code, direct = model
    path: Path = create_python_neuropod(
        dest, "sk_pipeline", [{"path": pickle_path, "packaged_name": "model.pkl"}],
        [{"python_root": code, "dirs_to_package": [""]}], "sk_model", "get_model",
        [{"name": "x", "dtype": "float64", "shape": ["batch", 3]}],
        [{"name": "label", "dtype": "int64", "shape": ["batch"]}, {"name": "proba", "dtype": "float64", "shape": ["batch", 2]}],
        requirements=f"# the model's only requirement\n{SKLEARN}\n",
        test_input_data={"x": direct["x"]}, test_expected_out={"label": direct["label"], "proba": direct["proba"]},
    )  # fmt: skip
    return path


def test_a_scikit_learn_model_runs_in_its_lock_environment(
    tmp_path: Path, neuropod_home: Path, sklearn_model: tuple[Path, Path, dict[str, np.ndarray]]
) -> None:
    assert importlib.util.find_spec("sklearn") is None, "this test needs a process without scikit-learn"
    before = set(lock_envs(neuropod_home))
    path = package_sklearn(tmp_path / "one", sklearn_model)  # builds the environment (the package's check)
    lock = (path / "0" / "requirements.lock").read_text()
    pins = envs.lock_lines(lock)
    assert any(p.startswith(SKLEARN + " --hash=sha256:") for p in pins), pins
    assert all(" --hash=sha256:" in p for p in pins) and any(p.startswith(("numpy==", "scipy==")) for p in pins)
    built = sorted(set(lock_envs(neuropod_home)) - before)
    assert len(built) == 1 and built[0].startswith("lock-py")

    direct = sklearn_model[2]
    probe = direct["x"][::-1].copy()
    with neuropod.load_neuropod(path) as model:
        assert model.backend.location == f"env:{built[0]}"
        out = model.infer({"x": probe})
    np.testing.assert_array_equal(out["label"], direct["label"][::-1])
    np.testing.assert_allclose(out["proba"], direct["proba"][::-1], rtol=1e-12)
    assert importlib.util.find_spec("sklearn") is None

    # A second package with the same requirements reuses the environment: nothing is built.
    again = package_sklearn(tmp_path / "two", sklearn_model)
    t0 = time.perf_counter()
    with neuropod.load_neuropod(again) as model:
        loaded = time.perf_counter() - t0
        assert model.backend.location == f"env:{built[0]}"
        np.testing.assert_array_equal(model.infer({"x": direct["x"]})["label"], direct["label"])
    assert sorted(set(lock_envs(neuropod_home)) - before) == built
    assert loaded < 30, f"a load with a built environment took {loaded:.1f} s"

    (env,) = [e for e in envs.list_environments() if e.name == built[0]]
    assert env.kind == "lock" and {u["source"] for u in env.used_by} == {str(path), str(again)}
    out_text = io.StringIO()
    assert cli.main(["env", "list"], out_text) == 0
    assert built[0] in out_text.getvalue() and "sk_pipeline" in out_text.getvalue()
    assert SKLEARN in out_text.getvalue()


TORCH_CODE = """
import torch

class Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        with torch.no_grad():
            return {"score": torch.softmax(self.linear(torch.from_numpy(x)), dim=-1)}

def get_model(data_root):
    model = Scorer()
    model.load_state_dict(torch.load(data_root + "/weights.pt"))
    return model.eval()
"""


def test_an_eager_pytorch_module_through_create_pytorch_neuropod(tmp_path: Path, neuropod_home: Path) -> None:
    torch = pytest.importorskip("torch", reason="create_pytorch_neuropod pins the installed torch")
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 2)
    torch.save({"linear.weight": linear.weight.detach(), "linear.bias": linear.bias.detach()}, tmp_path / "weights.pt")
    x = np.random.default_rng(1).normal(size=(5, 4)).astype(np.float32)
    with torch.no_grad():
        expected = torch.softmax(linear(torch.from_numpy(x)), dim=-1).numpy()
    code = write_code(tmp_path / "code", {"scorer.py": TORCH_CODE})
    path = create_pytorch_neuropod(
        tmp_path / "scorer", "scorer", [{"path": tmp_path / "weights.pt", "packaged_name": "weights.pt"}],
        [{"python_root": code, "dirs_to_package": [""]}], "scorer", "get_model",
        [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}], [{"name": "score", "dtype": "float32", "shape": ["batch", 2]}],
        test_input_data={"x": x}, test_expected_out={"score": expected},
    )  # fmt: skip
    lock = (path / "0" / "requirements.lock").read_text()
    assert f"torch=={torch.__version__}" in lock
    with neuropod.load_neuropod(path) as model:
        assert model.backend.location.startswith("env:lock-")
        np.testing.assert_allclose(model.infer({"x": x})["score"], expected, rtol=1e-6)


def _with_lock(tmp: Path, lock: str) -> Path:
    """A python package without requirements whose lock is then written by hand (and the manifest updated)."""
    code = write_code(tmp / "code", {"plain.py": "def get_model(_):\n    return lambda x: {'out': x + 1}\n"})
    path: Path = create_python_neuropod(
        tmp / "pkg", "plain", [], [{"python_root": code, "dirs_to_package": [""]}], "plain", "get_model",
        [{"name": "x", "dtype": "int32", "shape": [None]}], [{"name": "out", "dtype": "int32", "shape": [None]}],
    )  # fmt: skip
    (path / "0" / "requirements.lock").write_text(lock)
    manifest = json.loads((path / "manifest.json").read_text())
    import hashlib

    manifest["files"]["0/requirements.lock"] = hashlib.sha256(lock.encode()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_a_lock_pip_cannot_install_leaves_nothing_behind(
    tmp_path: Path, neuropod_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = lock_envs(neuropod_home)
    path = _with_lock(tmp_path, "six==1.16.0 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    capsys.readouterr()
    with pytest.raises(NeuropodError) as info:
        neuropod.load_neuropod(path)
    text = str(info.value)
    assert "pip install of the requirements of model 'plain' (the lock)" in text
    assert "DO NOT MATCH THE HASHES" in text and "Package the model on the Python and platform it runs on" in text
    assert lock_envs(neuropod_home) == before
    # While it ran: a line per step with its time, and none of pip's output (that is in the error).
    steps = [line for line in capsys.readouterr().err.splitlines() if line.startswith("  ")]
    assert len(steps) == 2, steps
    assert re.fullmatch(r"  creating the virtual environment \(.+\) \.\.\. [0-9]+\.[0-9] s", steps[0]), steps
    assert re.fullmatch(r"  installing 1 locked requirement \.\.\. failed after [0-9]+\.[0-9] s", steps[1]), steps


def test_an_original_lock_of_plain_pins(tmp_path: Path, neuropod_home: Path) -> None:
    # The original's locks were pip-compile output without hashes (e.g. "torch==1.4.0").
    path = _with_lock(tmp_path, "six==1.16.0\n")
    built_before = lock_envs(neuropod_home)
    out = io.StringIO()
    assert cli.main(["env", "prepare", "--verbose", str(path)], out) == 0
    text = out.getvalue()
    if lock_envs(neuropod_home) != built_before:  # built now (not by an earlier test): each step, and pip's words
        for step in ("creating the virtual environment", "installing 1 locked requirement",
                     "installing the neuropod core and neuropod-python", "checking what the new environment offers"):
            assert re.search(rf"^  {step}.*: [0-9]+\.[0-9] s$", text, re.M), (step, text)
        assert "Successfully installed six-1.16.0" in text, text
    assert re.search(r"^plain: environment lock-py\S+ ready \(", text, re.M), text
    with neuropod.load_neuropod(path) as model:
        assert model.backend.location.startswith("env:lock-")
        np.testing.assert_array_equal(model.infer({"x": np.arange(3, dtype=np.int32)})["out"], np.arange(1, 4))
        version = subprocess.run(
            [str(Path(model.python)), "-c", "import six; print(six.__version__)"], capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    assert version == "1.16.0"
    with pytest.raises(NeuropodError, match="is not a pinned requirement"):
        neuropod.load_neuropod(_with_lock(tmp_path / "bad", "six>=1\n"))


def test_neuropod_demo_python(tmp_path: Path, neuropod_home: Path) -> None:
    # `neuropod demo python`: packaging (requirements "scikit-learn", locked) and running, step by step.
    out = io.StringIO()
    assert cli.main(["demo", "python", "--dir", str(tmp_path)], out) == 0
    text = out.getvalue()
    for step in ("1. Packaging a small python model", "Requires:", "3. Resolution on this machine", "output label",
                 "SpecError: Dim 1 of tensor 'x' in the input spec is expected to be of size 4, but was of size 3"):
        assert step in text, step
    # Its answers against the nearest class mean of the packaged training data (computed here with numpy).
    path = tmp_path / "demo_flowers"
    with np.load(path / "0" / "data" / "train.npz") as data:
        means = np.stack([data["x"][data["y"] == k].mean(axis=0) for k in (0, 1)])
    probe = neuropod.load_neuropod(path)
    try:
        x = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.1, 5.6, 2.1], [5.0, 3.3, 1.6, 0.3], [6.4, 2.9, 5.3, 1.9]])
        result = probe.infer({"x": x})
    finally:
        probe.close()
    nearest = np.argmin(((x[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    np.testing.assert_array_equal(result["label"], nearest)
    np.testing.assert_allclose(result["proba"].sum(axis=1), 1.0)


def test_prune_removes_the_lock_environments(tmp_path: Path, neuropod_home: Path) -> None:
    built = lock_envs(neuropod_home)
    if not built:
        pytest.skip("no lock environment was built in this session")
    out = io.StringIO()
    assert cli.main(["env", "prune", "--days", "3650"], out) == 0
    assert lock_envs(neuropod_home) == built
    out = io.StringIO()
    assert cli.main(["env", "prune", "--days", "0", "--dry-run"], out) == 0
    assert all(name in out.getvalue() for name in built) and lock_envs(neuropod_home) == built
    # An environment a loaded model's worker runs from is kept.
    with neuropod.load_neuropod(_with_lock(tmp_path, "six==1.16.0\n")) as model:
        busy = model.backend.location[len("env:"):]
        assert cli.main(["env", "prune", "--days", "0"], io.StringIO()) == 0
        assert lock_envs(neuropod_home) == [busy]
        np.testing.assert_array_equal(model.infer({"x": np.zeros(2, np.int32)})["out"], np.ones(2, np.int32))
    assert cli.main(["env", "prune", "--days", "0"], io.StringIO()) == 0
    assert lock_envs(neuropod_home) == []
