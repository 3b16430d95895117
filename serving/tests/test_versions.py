"""Model versions in Triton's layout (MODEL/1/, MODEL/2/...), version policies, and a local
repository polled while it serves (``--poll-interval``): a new version is picked up and served
by its number, a broken one is reported and replaces nothing, a removed one is unloaded once
the requests running on it finish.

Each version of the model ``scaler`` is a real Python package answering ``y = x * K``; the
expected answers are computed with numpy (:mod:`versions_helpers`).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
pytest.importorskip("httpx")

from neuropod.errors import PackageError
from neuropod_serving.server import ModelRegistry
from neuropod_serving.server.served_versions import VersionPolicy
from versions_helpers import (
    answer,
    build_scalers,
    expected,
    in_background,
    index,
    infer,
    place,
    serving,
    wait_for,
    zip_of,
)  # fmt: skip

from conftest import private_caches

POLL_S = 0.2


@pytest.fixture(scope="module")
def scalers() -> Iterator[dict[int, Path]]:
    """``scaler`` packages with K = 1, 2, 3 (directories), and K = 2 as a zip (key 20)."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-versions-test-"))
    with private_caches(root):
        built = build_scalers(root / "stage")
        built[20] = zip_of(built[2], root / "stage" / "scaler2.neuropod")
        yield built
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def repo(tmp_path: Path, scalers: dict[int, Path]) -> Path:
    """models/scaler/{1/ (a package directory), 2/scaler.neuropod (a zip in the folder), 10/ (K=3)}."""
    models = tmp_path / "models"
    place(scalers[1], models / "scaler" / "1")
    place(scalers[20], models / "scaler" / "2" / "scaler.neuropod")
    place(scalers[3], models / "scaler" / "10")
    (models / "scaler" / "README.txt").write_text("not a version")
    (models / "notes.txt").write_text("not a model")
    return models


def test_every_version_is_served_by_its_number(repo: Path) -> None:
    with serving([repo], policy="all") as (_, http):
        assert answer(http, version="1") == ("1", expected(1))
        assert answer(http, version="2") == ("2", expected(2))
        assert answer(http, version="10") == ("10", expected(3))
        assert answer(http) == ("10", expected(3))  # no version: the latest (10 > 2, as numbers)
        meta = http.get("/v2/models/scaler").json()
        assert meta["versions"] == ["1", "2", "10"]
        assert http.get("/v2/models/scaler/versions/2/ready").status_code == 200
        assert http.get("/v2/models/scaler/versions/2").json()["versions"] == ["1", "2", "10"]
        missing = infer(http, version="3")
        assert missing.status_code == 404
        assert "version '3'" in missing.json()["error"] and "'10'" in missing.json()["error"]
        entries = index(http)
        assert {k: e["state"] for k, e in entries.items()} == {
            ("scaler", "1"): "READY", ("scaler", "2"): "READY", ("scaler", "10"): "READY",
        }  # fmt: skip
        assert http.get("/v2/models/scaler/versions/1/config").json()["name"] == "scaler"


def test_tritonclient_names_versions(repo: Path) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    import numpy as np

    with serving([repo], policy="all") as (_, http):
        client = httpclient.InferenceServerClient(str(http.base_url).removeprefix("http://").rstrip("/"))
        try:
            x = np.array([[1.0, 0.0]], np.float32)
            given = httpclient.InferInput("x", [1, 2], "FP32")
            given.set_data_from_numpy(x)
            result = client.infer("scaler", [given], model_version="2")
            np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
            assert result.get_response()["model_version"] == "2"
            assert client.is_model_ready("scaler", "10") and not client.is_model_ready("scaler", "3")
            assert client.get_model_metadata("scaler", "1")["versions"] == ["1", "2", "10"]
        finally:
            client.close()


@pytest.mark.parametrize(
    ("policy", "served"),
    [(None, ["10"]), ("latest:2", ["2", "10"]), ("specific:1,2,7", ["1", "2"]), ("all", ["1", "2", "10"])],
)
def test_the_version_policy_picks_what_is_served(repo: Path, policy: str | None, served: list[str]) -> None:
    with serving([repo], policy=policy) as (engine, http):
        assert engine.registry.versions("scaler") == served
        entries = index(http)
        for version in ("1", "2", "10"):
            entry = entries[("scaler", version)]
            if version in served:
                assert entry["state"] == "READY"
            else:
                assert entry["state"] == "UNAVAILABLE" and "version policy" in entry["reason"], entry
                assert infer(http, version=version).status_code == 404


def test_version_policies_parse() -> None:
    assert VersionPolicy.parse("latest") == VersionPolicy("latest", 1)
    assert VersionPolicy.parse("latest:3").select(["1", "2", "3", "4"]) == ["2", "3", "4"]
    assert VersionPolicy.parse("all").select(["10", "9"]) == ["9", "10"]
    assert VersionPolicy.parse("specific:3, 1").select(["1", "2", "3"]) == ["1", "3"]
    assert str(VersionPolicy.parse("specific:3,1")) == "specific:1,3"
    for bad in ("newest", "latest:0", "latest:x", "specific:", "specific:a", "all:2", ""):
        with pytest.raises(ValueError, match="a version policy is latest, latest:N, all, or specific"):
            VersionPolicy.parse(bad)


def test_neuropod_serve_refuses_a_bad_version_policy(capsys: pytest.CaptureFixture[str]) -> None:
    from neuropod_serving.cli import add_arguments

    parser = argparse.ArgumentParser(prog="neuropod serve")
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["models", "--version-policy", "newest"])
    assert "a version policy is latest, latest:N, all, or specific" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["models", "--poll-interval", "0"])
    assert "a number of seconds above 0" in capsys.readouterr().err


def test_a_broken_version_folder_fails_the_start_or_is_listed(repo: Path) -> None:
    (repo / "scaler" / "11").mkdir()  # a version folder with no package in it
    with pytest.raises(PackageError, match=r"version 11 of model 'scaler' holds no package"):
        ModelRegistry.load([repo])
    with serving([repo], policy="specific:1") as (_, http):  # not a version the policy serves
        entry = index(http)[("scaler", "11")]
        assert entry["state"] == "UNAVAILABLE" and "holds no package" in entry["reason"], entry
        assert answer(http) == ("1", expected(1))


def test_a_model_folder_serves_its_packages_under_its_own_name(repo: Path, scalers: dict[int, Path]) -> None:
    place(scalers[2], repo / "doubler" / "1")  # the package is named "scaler"; the folder says "doubler"
    with serving([repo]) as (engine, http):
        r = infer(http, model="doubler")
        assert r.status_code == 200 and r.json()["model_name"] == "doubler", r.text
        assert r.json()["outputs"][0]["data"] == expected(2)
        assert http.get("/v2/models/doubler").json()["name"] == "doubler"
        assert sorted(engine.registry.names()) == ["doubler", "scaler"]


def test_packages_standing_alone_are_version_1_beside_model_folders(repo: Path, scalers: dict[int, Path]) -> None:
    from versions_helpers import CODE

    from conftest import python_package

    python_package(repo.parent / "stage" / "tripler", "tripler", CODE.format(k=3))
    place(repo.parent / "stage" / "tripler", repo / "tripler")
    with serving([repo]) as (_, http):
        assert answer(http, model="tripler") == ("1", expected(3))
        assert answer(http, model="tripler", version="1") == ("1", expected(3))
        assert index(http)[("tripler", "1")]["state"] == "READY"


def test_polling_picks_up_new_versions_and_a_broken_one_replaces_nothing(repo: Path, scalers: dict[int, Path]) -> None:
    shutil.rmtree(repo / "scaler" / "10")
    shutil.rmtree(repo / "scaler" / "2")
    with serving([repo], poll=POLL_S) as (engine, http):
        assert answer(http) == ("1", expected(1))
        refused = http.post("/v2/repository/models/scaler/load", json={})
        assert refused.status_code == 400 and "--poll-interval" in refused.json()["error"]
        assert http.post("/v2/repository/models/scaler/unload", json={}).status_code == 400

        place(scalers[2], repo / "scaler" / "2")  # a new version: served within the poll interval
        wait_for("version 2 to serve", lambda: answer(http)[0] == "2")
        assert answer(http) == ("2", expected(2))
        wait_for("version 1 to be unloaded", lambda: engine.registry.versions("scaler") == ["2"])
        assert "version policy" in index(http)[("scaler", "1")]["reason"]

        broken = place(scalers[3], repo.parent / "broken3")
        (broken / "config.json").write_text("{not json")
        place(broken, repo / "scaler" / "3")  # a broken new version: reported, version 2 keeps serving
        wait_for("version 3's failure to be listed",
                 lambda: index(http)[("scaler", "3")]["reason"] != "not loaded")  # fmt: skip
        entry = index(http)[("scaler", "3")]
        assert entry["state"] == "UNAVAILABLE" and "the last load failed" in entry["reason"], entry
        assert "config.json" in entry["reason"], entry
        assert index(http)[("scaler", "2")]["state"] == "READY"
        for _ in range(3):  # polls that find it unchanged do not retry it, nor unload version 2
            assert answer(http) == ("2", expected(2))
            assert engine.registry.versions("scaler") == ["2"]
            time.sleep(POLL_S)

        shutil.rmtree(repo / "scaler" / "3")
        place(scalers[3], repo / "scaler" / "3")  # fixed: it loads, and replaces version 2
        wait_for("version 3 to serve", lambda: answer(http)[0] == "3")
        assert answer(http) == ("3", expected(3))
        wait_for("version 2 to be unloaded", lambda: engine.registry.versions("scaler") == ["3"])
        assert index(http)[("scaler", "3")]["reason"] == ""


def test_polling_unloads_a_removed_version_once_its_requests_finish(repo: Path, scalers: dict[int, Path]) -> None:
    shutil.rmtree(repo / "scaler" / "10")
    with serving([repo], policy="all", poll=POLL_S) as (engine, http):
        assert engine.registry.versions("scaler") == ["1", "2"]
        slow, out = in_background(lambda: infer(http, version="2", seconds=1.5))
        wait_for("the slow request to run", lambda: engine._runners[("scaler", "2")].gate.running > 0)
        shutil.rmtree(repo / "scaler" / "2")
        wait_for("version 2 to stop serving", lambda: engine.registry.versions("scaler") == ["1"])
        assert infer(http, version="2").status_code == 404
        slow.join(30)
        assert out and out[0].status_code == 200, out
        assert out[0].json()["model_version"] == "2"
        assert out[0].json()["outputs"][0]["data"] == expected(2, 1.5)  # it ran to the end on version 2
        assert answer(http) == ("1", expected(1))

        place(scalers[2], repo / "doubler" / "4")  # a new model is loaded; a removed one unloaded
        wait_for("model doubler to serve", lambda: infer(http, model="doubler").status_code == 200)
        assert answer(http, model="doubler") == ("4", expected(2))
        shutil.rmtree(repo / "scaler")
        wait_for("model scaler to be unloaded", lambda: infer(http).status_code == 404)
        assert ("scaler", "1") not in index(http)


def test_every_server_process_polls(repo: Path, scalers: dict[int, Path], tmp_path: Path) -> None:
    """``neuropod serve --processes 2 --poll-interval``: whichever process a connection reaches
    serves the new version once it is polled, and each refuses repository loads."""
    import os
    import subprocess
    import sys

    import httpx

    from conftest import free_port

    shutil.rmtree(repo / "scaler" / "10")
    shutil.rmtree(repo / "scaler" / "2")
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neuropod", "serve", str(repo), "--processes", "2", "--poll-interval", str(POLL_S),
             "--http-port", str(port), "--grpc-port", "0", "--metrics-port", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy(),
        )  # fmt: skip
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:

            def ready() -> bool:
                assert proc.poll() is None, log.read_text()
                try:
                    return http.get("/v2/health/ready").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for("the server to start", ready, 60)
            assert answer(http) == ("1", expected(1))
            place(scalers[2], repo / "scaler" / "2")
            time.sleep(5 * POLL_S)
            for _ in range(8):  # new connections: both processes answer
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as fresh:
                    wait_for("version 2 in every process", lambda fresh=fresh: answer(fresh)[0] == "2", 10)
                    refused = fresh.post("/v2/repository/models/scaler/load", json={})
                    assert refused.status_code == 400 and "--poll-interval" in refused.text
    finally:
        proc.terminate()
        proc.wait(30)
    assert log.read_text().count("loaded version 2 of model 'scaler'") == 2, log.read_text()


def test_hidden_names_are_skipped(repo: Path, scalers: dict[int, Path]) -> None:
    """A copy being made under a hidden name (to be renamed into place) is not a model nor a version."""
    place(scalers[2], repo / ".doubler.tmp")  # a package directory, hidden
    place(scalers[2], repo / "scaler" / "11" / ".scaler.neuropod")  # a version folder whose only package is hidden
    with serving([repo], policy="specific:1,2,10") as (engine, http):
        assert engine.registry.names() == ["scaler"]
        entry = index(http)[("scaler", "11")]
        assert entry["state"] == "UNAVAILABLE" and "holds no package" in entry["reason"], entry
