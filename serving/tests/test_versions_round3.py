"""A polled repository that keeps being followed whatever its versions do: a version whose code
exits while it loads is a failed load (the poll goes on), deleting the last model of a folder
unloads it, version swaps under load fail no request (REST and gRPC), and a server stops within
seconds while its object store hangs.

Each version of the model ``scaler`` is a real Python package answering ``y = x * K``; expected
answers are computed with numpy (:mod:`versions_helpers`).
"""

from __future__ import annotations

import functools
import http.server
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
pytest.importorskip("httpx")

from versions_helpers import answer, build_scalers, expected, index, infer, place, serving, wait_for, zip_of

from conftest import free_port, private_caches, python_package

POLL_S = 0.1
#: How soon a server stops after SIGINT or SIGTERM while a poll waits on a store that does not answer.
STOP_WITHIN_S = 8.0

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
        wait_for(
            "version 2's failure to be listed", lambda: "the last load failed" in index(http)[("scaler", "2")]["reason"]
        )
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


class _Store(http.server.SimpleHTTPRequestHandler):
    """A web server's files (a package URL's) that stops answering once ``hang`` is set: it
    accepts each connection and never replies, until ``release`` is set."""

    hang = threading.Event()
    release = threading.Event()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _stalled(self) -> bool:
        if self.hang.is_set():
            self.release.wait(60)
            return True
        return False

    def do_HEAD(self) -> None:
        if not self._stalled():
            super().do_HEAD()

    def do_GET(self) -> None:
        if not self._stalled():
            super().do_GET()


@pytest.fixture
def hanging_store(tmp_path: Path, scalers: dict[int, Path]) -> Iterator[tuple[str, type[_Store]]]:
    """(the URL of a ``scaler`` package zip on a local web server, its handler class: set ``hang``)."""
    pytest.importorskip("aiohttp", reason="needs neuropod[http] (nox -s tests_serving installs it)")
    (tmp_path / "www").mkdir()
    zip_of(scalers[1], tmp_path / "www" / "scaler.neuropod")
    handler = type("Store", (_Store,), {"hang": threading.Event(), "release": threading.Event()})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(tmp_path / "www"))
    )
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/scaler.neuropod", handler
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_server_stops_within_seconds_while_its_polled_store_hangs(
    tmp_path: Path, hanging_store: tuple[str, type[_Store]], sig: signal.Signals
) -> None:
    import httpx

    url, store = hanging_store
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neuropod", "serve", url, "--poll-interval", str(POLL_S), "--http-port", str(port),
             "--grpc-port", "0", "--metrics-port", "0", "--quiet"],
            stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy(),
        )  # fmt: skip
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            def ready() -> bool:
                assert proc.poll() is None, log.read_text()
                try:
                    return client.get("/v2/health/ready").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for("the server to start", ready, 60)
            assert answer(client) == ("1", expected(1))
        store.hang.set()  # the store now accepts connections and never answers: a poll waits on it
        time.sleep(10 * POLL_S)
        stopped = time.monotonic()
        proc.send_signal(sig)
        try:
            proc.wait(STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"neuropod serve did not exit within {STOP_WITHIN_S} s of {sig.name}:\n{log.read_text()}")
        assert time.monotonic() - stopped < STOP_WITHIN_S
        if sig == signal.SIGINT:  # Ctrl-C closes the models: it waited for the poll a bounded time, and said so
            assert "did not end within" in log.read_text(), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_version_swaps_under_load_fail_no_request(tmp_path: Path, scalers: dict[int, Path]) -> None:
    """Five swaps of the latest version while client threads send requests naming no version,
    over REST and gRPC: every request succeeds, answered by one of the versions (its K)."""
    import httpx

    import neuropod
    from neuropod.errors import NeuropodError
    from neuropod_serving.server.grpc_server import start_grpc_server
    from neuropod_serving.server.launcher import GIL_SWITCH_S

    repo = tmp_path / "models"
    factor = {1: 1, 2: 2, 3: 3, 4: 1, 5: 2, 6: 3}  # version -> the K of its package
    place(scalers[1], repo / "scaler" / "1")
    x = np.array([[1.0, 0.0]], np.float32)  # a REST request's
    rows = np.stack([np.arange(2048, dtype=np.float32) + 1, np.zeros(2048, np.float32)], axis=1)  # a gRPC one's
    stop = threading.Event()
    failures: list[str] = []
    answered: list[str] = []  # the protocol of each request answered

    def check(y: Any, sent: np.ndarray, protocol: str) -> None:
        k = [k for k in (1, 2, 3) if np.array_equal(np.asarray(y, np.float32).reshape(sent.shape), sent * k)]
        if not k:
            failures.append(f"a wrong answer: {y}")
        answered.append(protocol)

    with serving([repo], poll=POLL_S) as (engine, http):
        grpc_server, grpc_port = start_grpc_server(engine, "127.0.0.1:0", access_log=False)
        base = str(http.base_url)

        def rest_client() -> None:
            with httpx.Client(base_url=base, timeout=30) as client:
                while not stop.is_set():
                    r = infer(client)
                    if r.status_code != 200:
                        failures.append(f"REST {r.status_code}: {r.text}")
                    else:
                        check(r.json()["outputs"][0]["data"], x, "REST")

        def grpc_client() -> None:
            with neuropod.load_neuropod(f"grpc://127.0.0.1:{grpc_port}/scaler") as model:
                while not stop.is_set():
                    try:
                        check(model.infer({"x": rows})["y"], rows, "gRPC")
                    except NeuropodError as e:  # every failure is counted, and the test fails on any
                        failures.append(f"gRPC: {e}")

        clients = [
            threading.Thread(target=c, daemon=True) for c in (rest_client, rest_client, grpc_client, grpc_client)
        ]
        switch = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_S)  # as neuropod serve runs: threads take turns often
        try:
            for c in clients:
                c.start()
            wait_for("requests to run", lambda: len(answered) > 20)
            for version in range(2, 7):  # five swaps: each new version replaces the one before
                place(scalers[factor[version]], repo / "scaler" / str(version))
                wait_for(
                    f"version {version} alone to serve",
                    lambda v=version: engine.registry.versions("scaler") == [str(v)],
                )
                seen = len(answered)
                wait_for("requests on the new version", lambda seen=seen: len(answered) > seen + 20)
        finally:
            stop.set()
            for c in clients:
                c.join(30)
            grpc_server.stop(0)
            sys.setswitchinterval(switch)
        assert not failures, f"{len(failures)} of {len(answered) + len(failures)} requests failed: {failures[:5]}"
        assert answered.count("REST") > 100 and answered.count("gRPC") > 100, (
            answered.count("REST"),
            answered.count("gRPC"),
        )
        assert answer(http) == ("6", expected(3))


def test_a_package_replaced_by_an_unreadable_file_keeps_the_one_served(
    tmp_path: Path, scalers: dict[int, Path]
) -> None:
    """A package of a flat repository (no version folders) overwritten by a file that is no
    package (a corrupt or half-copied upload) is a failed load of that model: the model loaded
    before keeps serving, the index says why, and a good package put there later replaces it."""
    repo = tmp_path / "models"
    place(zip_of(scalers[1], tmp_path / "k1.zip"), repo / "scaler.zip")
    with serving([repo], poll=POLL_S) as (_engine, http):
        assert answer(http) == ("1", expected(1))
        bad = tmp_path / "bad.zip"
        bad.write_bytes(b"PK\x03\x04 not a whole zip")
        os.remove(repo / "scaler.zip")
        place(bad, repo / "scaler.zip")
        wait_for("the failure to be listed", lambda: any(e.get("reason") for e in index(http).values()))
        time.sleep(3 * POLL_S)
        assert answer(http) == ("1", expected(1))
        [entry] = index(http).values()
        assert entry["state"] == "READY" and "no longer a Neuropod package" in entry["reason"], entry
        os.remove(repo / "scaler.zip")
        place(zip_of(scalers[2], tmp_path / "k2.zip"), repo / "scaler.zip")
        wait_for("the good package to serve", lambda: answer(http) == ("1", expected(2)))


def test_a_package_url_whose_file_turns_unreadable_keeps_the_one_served(
    tmp_path: Path, scalers: dict[int, Path]
) -> None:
    """The same for a polled package URL: the download of its new bytes is no package, and the
    model loaded before keeps serving until a good package is there."""
    pytest.importorskip("aiohttp", reason="needs neuropod[http] (nox -s tests_serving installs it)")
    www = tmp_path / "www"
    www.mkdir()
    zip_of(scalers[1], www / "scaler.neuropod")
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(www)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/scaler.neuropod"
    try:
        with serving([url], poll=POLL_S) as (engine, http_client):
            assert answer(http_client) == ("1", expected(1))
            (www / "scaler.neuropod").write_bytes(b"PK\x03\x04 not a whole zip")
            wait_for("the failure to be listed", lambda: any(e.get("reason") for e in index(http_client).values()))
            time.sleep(3 * POLL_S)
            assert answer(http_client) == ("1", expected(1))
            assert engine.registry.versions("scaler") == ["1"]
            os.remove(www / "scaler.neuropod")
            zip_of(scalers[3], www / "scaler.neuropod")
            wait_for("the good package to serve", lambda: answer(http_client) == ("1", expected(3)))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
