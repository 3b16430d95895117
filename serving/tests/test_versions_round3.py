"""A polled repository that keeps being followed whatever its versions do: a version whose code
exits while it loads is a failed load (the poll goes on), deleting the last model of a folder
unloads it, version swaps under load fail no request (REST and gRPC), and a server stops within
seconds while its object store hangs.

Each version of the model ``scaler`` is a real Python package answering ``y = x * K``; expected
answers are computed with numpy (:mod:`versions_helpers`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
pytest.importorskip("httpx")

from versions_helpers import answer, build_scalers, expected, index, infer, place, serving, wait_for

from conftest import private_caches, python_package

POLL_S = 0.1

#: A version whose code parses arguments at import, as a training script does: with the arguments
#: it was packaged with it loads; where the server loads it (SCALER_ARGS empty) argparse exits
#: (SystemExit) for want of a required one.
EXITS_AT_IMPORT = """
import argparse
import os

_parser = argparse.ArgumentParser(prog="train.py")
_parser.add_argument("--checkpoint", required=True)
ARGS = _parser.parse_args(os.environ.get("SCALER_ARGS", "--checkpoint packaged").split())

def get_model(data_root):
    return lambda x: {"y": x}
"""


@pytest.fixture(scope="module")
def scalers() -> Iterator[dict[int, Path]]:
    """``scaler`` packages with K = 1, 2, 3, and one (key 0) whose code exits at import."""
    root = Path(tempfile.mkdtemp(prefix="neuropod-versions3-test-"))
    with private_caches(root):
        built = build_scalers(root / "stage")
        built[0] = python_package(root / "stage" / "exits" / "scaler", "scaler", EXITS_AT_IMPORT)
        yield built
    shutil.rmtree(root, ignore_errors=True)


def test_a_version_that_exits_while_loading_is_a_failed_load_and_polling_goes_on(
    tmp_path: Path, scalers: dict[int, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCALER_ARGS", "")
    repo = tmp_path / "models"
    place(scalers[1], repo / "scaler" / "1")
    place(scalers[2], repo / "doubler" / "1")
    caplog.set_level(logging.INFO, logger="neuropod_serving.server")
    with serving([repo], poll=POLL_S) as (engine, http):
        assert answer(http) == ("1", expected(1))
        place(scalers[0], repo / "scaler" / "2")  # its code raises SystemExit while it loads
        wait_for("version 2's failure to be listed", lambda: "the last load failed" in index(http)[("scaler", "2")]["reason"])
        entry = index(http)[("scaler", "2")]
        assert entry["state"] == "UNAVAILABLE" and "SystemExit" in entry["reason"], entry
        assert answer(http) == ("1", expected(1))  # version 1 keeps serving
        assert any("loading version 2 of model 'scaler' failed" in r.getMessage() and "SystemExit" in r.getMessage()
                   for r in caplog.records), caplog.text  # fmt: skip

        place(scalers[3], repo / "scaler" / "3")  # a later good version is still picked up
        wait_for("version 3 to serve", lambda: answer(http)[0] == "3")
        assert answer(http) == ("3", expected(3))
        shutil.rmtree(repo / "doubler")  # and a removal
        wait_for("model doubler to be unloaded", lambda: infer(http, model="doubler").status_code == 404)
        assert engine._poller is not None and engine._poller.is_alive()


def test_deleting_the_last_model_of_a_folder_unloads_it(tmp_path: Path, scalers: dict[int, Path]) -> None:
    repo = tmp_path / "models"
    place(scalers[1], repo / "scaler" / "1")
    with serving([repo], poll=POLL_S) as (engine, http):
        assert answer(http) == ("1", expected(1))
        shutil.rmtree(repo / "scaler")  # the folder is there, readable, and empty: an empty repository
        wait_for("model scaler to be unloaded", lambda: infer(http).status_code == 404)
        assert engine.registry.names() == [] and index(http) == {}
        place(scalers[2], repo / "scaler" / "1")  # and a model placed there again is loaded
        wait_for("model scaler to serve again", lambda: infer(http).status_code == 200)
        assert answer(http) == ("1", expected(2))


def test_a_missing_repository_folder_unloads_nothing(tmp_path: Path, scalers: dict[int, Path]) -> None:
    repo = tmp_path / "models"
    place(scalers[1], repo / "scaler" / "1")
    with serving([repo], poll=POLL_S) as (engine, http):
        shutil.rmtree(repo)  # a missing path (an unmounted volume): nothing is unloaded
        time.sleep(5 * POLL_S)
        assert answer(http) == ("1", expected(1))
        assert engine.registry.versions("scaler") == ["1"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a folder whatever its permissions")
def test_an_unreadable_repository_folder_unloads_nothing(tmp_path: Path, scalers: dict[int, Path]) -> None:
    repo = tmp_path / "models"
    place(scalers[1], repo / "scaler" / "1")
    with serving([repo], poll=POLL_S) as (engine, http):
        repo.chmod(0)
        try:
            time.sleep(5 * POLL_S)
            assert engine.registry.versions("scaler") == ["1"]
        finally:
            repo.chmod(0o755)
        assert answer(http) == ("1", expected(1))
