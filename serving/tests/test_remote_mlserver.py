"""Remote models against MLServer: our client loads scikit-learn models that MLServer serves
with its own runtime (``mlserver_sklearn.SKLearnModel``), reads their metadata and gets the
same numbers as scikit-learn itself.

MLServer pins its own dependencies, so it runs from its own venv, named by
``NEUROPOD_TEST_MLSERVER_PYTHON`` (that venv's python; ``nox -s tests_serving``
builds one and sets it). That python also trains the models and computes the
expected predictions, by calling scikit-learn directly; this process never
imports scikit-learn. One MLServer process serves the whole module.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neuropod
from neuropod.errors import RemoteError, SpecError

from conftest import free_port

ENV = "NEUROPOD_TEST_MLSERVER_PYTHON"
MLSERVER_PYTHON = os.environ.get(ENV)
if not MLSERVER_PYTHON:
    pytest.skip(
        f"MLServer interop needs {ENV}: the python of a venv with mlserver==1.7.1, mlserver-sklearn==1.7.1 and "
        "uvloop<0.22 (`nox -s tests_serving` builds one and sets it)",
        allow_module_level=True,
    )

READY_TIMEOUT_S = 90.0
PROTOCOLS = ["grpc", "http"]
# The OIP datatypes of the models' tensors, as neuropod spec dtypes (the test's own table).
DTYPES = {"FP32": "float32", "FP64": "float64", "INT32": "int32", "INT64": "int64"}
# The served models and their versions.
MODELS = {"classifier": "1", "regressor": "2"}

# Run by MLServer's python with the repository folder and MODELS as arguments:
# trains a 3-class LogisticRegression ("classifier") and a Ridge regressor
# ("regressor") on fixed random data, saves each with joblib beside
# a model-settings.json that declares its inputs and outputs, and saves the
# test rows and what scikit-learn itself predicts for them.
TRAIN = r"""
import json, sys
from importlib.metadata import version
from pathlib import Path

import joblib
import numpy as np
from sklearn.linear_model import LogisticRegression, Ridge

import mlserver_sklearn  # noqa: F401  (the runtime must be importable before MLServer starts)

repo, versions = Path(sys.argv[1]), json.loads(sys.argv[2])
rng = np.random.default_rng(13)
x = rng.normal(size=(300, 4)).astype(np.float32)
score = x @ np.array([1.5, -2.0, 0.5, 1.0], np.float32) + 0.3 * rng.normal(size=300).astype(np.float32)
labels = np.digitize(score, [-1.0, 1.0]).astype(np.int64)
rows = rng.normal(size=(7, 4)).astype(np.float32)
datatypes = {"float32": "FP32", "float64": "FP64", "int32": "INT32", "int64": "INT64"}
models = {
    "classifier": (LogisticRegression().fit(x, labels), ["predict", "predict_proba"]),
    "regressor": (Ridge().fit(x, score), ["predict"]),
}
for name, (model, methods) in models.items():
    folder = repo / name
    folder.mkdir()
    joblib.dump(model, folder / "model.joblib")
    expected = {m: getattr(model, m)(rows) for m in methods}
    np.savez(folder / "expected.npz", features=rows, **expected)
    # MLServer's NumpyCodec sends a 1-D result as [N, 1]: declare it so.
    outputs = [{"name": m, "datatype": datatypes[str(y.dtype)], "shape": [-1, *(y.shape[1:] or (1,))]}
               for m, y in expected.items()]
    (folder / "model-settings.json").write_text(json.dumps({
        "name": name,
        "implementation": "mlserver_sklearn.SKLearnModel",
        "platform": "sklearn",
        "versions": [f"sklearn/{version('scikit-learn')}"],
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": outputs,
        "parameters": {"uri": "./model.joblib", "version": versions[name]},
    }, indent=1))
print(json.dumps({p: version(p) for p in ("mlserver", "mlserver-sklearn", "scikit-learn")}))
"""


@dataclass
class MLServer:
    """The running MLServer and what the test needs to know about its models."""

    http_port: int
    grpc_port: int
    repo: Path
    versions: dict[str, str]

    def url(self, protocol: str, model: str, version: str | None = None) -> str:
        port = self.grpc_port if protocol == "grpc" else self.http_port
        return f"{protocol}://127.0.0.1:{port}/{model}" + (f"/{version}" if version else "")

    def expected(self, model: str) -> dict[str, np.ndarray]:
        with np.load(self.repo / model / "expected.npz") as data:
            return {k: data[k] for k in data.files}

    def rest_metadata(self, model: str) -> dict[str, Any]:
        """What MLServer's REST API says about ``model``, read with urllib."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/models/{model}", timeout=10) as r:
            body: dict[str, Any] = json.load(r)
        return body


def _tail(log: Path, lines: int = 60) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_ready(proc: subprocess.Popen[bytes], http_port: int, log: Path) -> None:
    """Until the server and every model answer ready; fails with MLServer's log on exit or timeout."""
    pending = [f"http://127.0.0.1:{http_port}/v2/health/ready"]
    pending += [f"http://127.0.0.1:{http_port}/v2/models/{m}/ready" for m in MODELS]
    deadline = time.monotonic() + READY_TIMEOUT_S
    while pending:
        if proc.poll() is not None:
            pytest.fail(f"MLServer exited with status {proc.returncode} while starting; its log:\n{_tail(log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"MLServer was not ready after {READY_TIMEOUT_S:.0f} s ({pending[0]}); its log:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(pending[0], timeout=2) as r:
                if r.status == 200:
                    pending.pop(0)
                    continue
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to MLServer's process group (a clean shutdown), SIGKILL after 15 s; nothing of it is left."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the leader left behind in its group
    proc.wait(10)


@pytest.fixture(scope="module")
def mlserver() -> Iterator[MLServer]:
    python = Path(MLSERVER_PYTHON or "")
    if not python.is_file():
        pytest.fail(f"{ENV}={MLSERVER_PYTHON!r} is not a file: it must be the python of a venv with MLServer")
    repo = Path(tempfile.mkdtemp(prefix="neuropod-mlserver-"))
    try:
        trained = subprocess.run([str(python), "-c", TRAIN, str(repo), json.dumps(MODELS)], capture_output=True, text=True, timeout=180)
        if trained.returncode != 0:
            pytest.fail(f"training the scikit-learn models with {ENV}={python} failed:\n{trained.stderr[-3000:]}")
        versions = json.loads(trained.stdout.splitlines()[-1])
        http_port, grpc_port = free_port(), free_port()
        settings = {
            "debug": False, "host": "127.0.0.1", "http_port": http_port, "grpc_port": grpc_port,
            "parallel_workers": 0, "metrics_endpoint": None,
            "metrics_dir": str(repo / ".metrics"), "environments_dir": str(repo / ".envs"),
        }  # fmt: skip
        (repo / "settings.json").write_text(json.dumps(settings, indent=1))
        log = repo / "mlserver.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(python.parent / "mlserver"), "start", str(repo)], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=repo, start_new_session=True,
            )  # fmt: skip
        try:
            _wait_ready(proc, http_port, log)
            yield MLServer(http_port, grpc_port, repo, versions)
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def test_mlserver_is_the_one_asked_for(mlserver: MLServer) -> None:
    """The venv holds the MLServer this interop is pinned to, and the server says so too."""
    assert mlserver.versions["mlserver"] == "1.7.1"
    assert mlserver.versions["mlserver-sklearn"] == "1.7.1"
    with urllib.request.urlopen(f"http://127.0.0.1:{mlserver.http_port}/v2", timeout=10) as r:
        assert json.load(r) == {"name": "mlserver", "version": "1.7.1", "extensions": []}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", list(MODELS))
def test_spec_is_what_mlserver_says(mlserver: MLServer, protocol: str, model: str) -> None:
    meta = mlserver.rest_metadata(model)
    with (mlserver.repo / model / "model-settings.json").open() as f:
        declared = json.load(f)
    # MLServer passes the declared metadata through unchanged (so the expectation below is its own words).
    assert meta["inputs"] == declared["inputs"] and meta["outputs"] == declared["outputs"]
    assert meta["platform"] == "sklearn"

    def specs(entries: list[dict[str, Any]]) -> list[tuple[str, str, tuple[int | None, ...]]]:
        return [(e["name"], DTYPES[e["datatype"]], tuple(None if d == -1 else d for d in e["shape"])) for e in entries]

    with neuropod.load_neuropod(mlserver.url(protocol, model)) as remote:
        assert remote.name == model
        assert [(s.name, s.dtype, tuple(s.shape)) for s in remote.inputs] == specs(meta["inputs"])
        assert [(s.name, s.dtype, tuple(s.shape)) for s in remote.outputs] == specs(meta["outputs"])
    assert specs(meta["inputs"]) == [("features", "float32", (None, 4))]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", list(MODELS))
def test_infer_gives_what_sklearn_gives(mlserver: MLServer, protocol: str, model: str) -> None:
    expected = mlserver.expected(model)
    rows = expected.pop("features")
    with neuropod.load_neuropod(mlserver.url(protocol, model, MODELS[model])) as remote:
        out = remote.infer({"features": rows})
        one = remote.infer({"features": rows[:1]})
    assert sorted(out) == sorted(expected) == sorted(one)
    for name, want in expected.items():
        # MLServer's NumpyCodec sends scikit-learn's 1-D results as [N, 1].
        want = want.reshape(len(rows), -1)
        for got, rows_want in ((out[name], want), (one[name], want[:1])):
            assert got.dtype == rows_want.dtype and got.shape == rows_want.shape, (name, got.dtype, got.shape)
            if want.dtype.kind == "i":
                np.testing.assert_array_equal(got, rows_want)  # class labels: exactly
            else:
                np.testing.assert_allclose(got, rows_want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_requested_outputs(mlserver: MLServer, protocol: str) -> None:
    expected = mlserver.expected("classifier")
    with neuropod.load_neuropod(mlserver.url(protocol, "classifier")) as remote:
        out = remote.infer({"features": expected["features"]}, requested_outputs=["predict_proba"])
    assert list(out) == ["predict_proba"]
    np.testing.assert_allclose(out["predict_proba"], expected["predict_proba"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("model", "version"), [("no-such-model", None), ("regressor", "9")])
def test_unknown_model_or_version_names_the_url(mlserver: MLServer, protocol: str, model: str, version: str | None) -> None:
    url = mlserver.url(protocol, model, version)
    with pytest.raises(RemoteError) as info:
        neuropod.load_neuropod(url, retries=0)
    assert info.value.url == url and url in str(info.value)
    assert info.value.code == "not_found"
    # MLServer's own words: "Model no-such-model not found", "Model regressor with version 9 not found".
    assert info.value.server_message is not None and f"Model {model}" in info.value.server_message
    assert "not found" in str(info.value)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_wrong_shape_stops_before_the_server(mlserver: MLServer, protocol: str) -> None:
    rows = mlserver.expected("classifier")["features"]
    with neuropod.load_neuropod(mlserver.url(protocol, "classifier")) as remote:
        with pytest.raises(SpecError, match="features"):
            remote.infer({"features": rows[:, :3]})
        with pytest.raises(SpecError, match="features"):
            remote.infer({"features": rows.astype(np.float64)})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_model_failure_reaches_the_user(mlserver: MLServer, protocol: str) -> None:
    """A NaN passes any spec; scikit-learn refuses it inside MLServer, and the user hears of it."""
    url = mlserver.url(protocol, "regressor")
    rows = mlserver.expected("regressor")["features"].copy()
    rows[2, 1] = np.nan
    with neuropod.load_neuropod(url) as remote:
        with pytest.raises(RemoteError) as info:
            remote.infer({"features": rows})
        # The model still works afterwards.
        assert remote.infer({"features": rows[:2]})["predict"].shape == (2, 1)
    assert info.value.url == url and url in str(info.value)
    assert info.value.server_message and info.value.server_message in str(info.value)
    if protocol == "grpc":
        # MLServer's gRPC status carries scikit-learn's own words.
        assert info.value.code == "internal"
        assert "Input X contains NaN" in info.value.server_message
    else:
        # MLServer's REST API takes JSON only, and JSON has no NaN: a bare NaN token is refused (422);
        # a null (MLServer's own NaN) reaches scikit-learn, whose ValueError comes back as a bare 500.
        if info.value.code == "invalid_argument":
            assert "JSON decode error" in info.value.server_message
        else:
            assert (info.value.code, info.value.server_message) == ("internal", "Internal Server Error")
