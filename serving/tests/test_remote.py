"""Remote models against real `neuropod serve` processes, over gRPC and REST.

``neuropod.load_neuropod("grpc://...")`` / ``"http://..."``: every dtype,
strings, requested outputs, the exact spec (symbols), checks before sending,
and each failure the issue names (refused connection, unknown model,
server-side spec error, model failure, timeout, TLS, token), a pool of two
servers with one killed, threads, and the CLI's inspect and explain.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("grpc")

import neuropod
from neuropod.cli import main
from neuropod.errors import NeuropodError, PackageError, RemoteError, SpecError
from neuropod.testing import ALL_DTYPES, sample

from conftest import adder_and_echo, free_port, onnx_package, private_caches

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="starts server processes")

TOKEN = "remote-t0ken"
PROTOCOLS = ["grpc", "http"]
X = np.array([[1, 2], [3, 4]], np.float32)
Y = np.array([[10, 20], [30, 40]], np.float32)


class Server:
    """A `neuropod serve` process on free ports; ``url(protocol, model)`` names a model on it."""

    def __init__(self, models: Path, *extra: str, tls: Path | None = None) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.tls = tls
        cmd = [sys.executable, "-m", "neuropod", "serve", str(models), "--http-port", str(self.http_port),
               "--grpc-port", str(self.grpc_port), "--metrics-port", "0", "--quiet", *extra]  # fmt: skip
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        context = ssl.create_default_context(cafile=str(tls / "cert.pem")) if tls else None
        scheme = "https" if tls else "http"
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"neuropod serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.http_port}/v2/health/ready", timeout=1,
                                            context=context) as r:  # fmt: skip
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"neuropod serve was not ready within 60 s:\n{self.output()}")
            time.sleep(0.1)

    def url(self, protocol: str, model: str) -> str:
        if self.tls:
            return f"{protocol}s://127.0.0.1:{self.grpc_port if protocol == 'grpc' else self.http_port}/{model}"
        return f"{protocol}://127.0.0.1:{self.grpc_port if protocol == 'grpc' else self.http_port}/{model}"

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _all_dtypes(models: Path) -> None:
    """``alltypes``: ``out_<dtype>`` is ``in_<dtype>`` (Identity) for every spec dtype."""
    from onnx import helper

    shape = lambda d: ["batch"] if d == "string" else ["batch", 3]  # noqa: E731
    nodes = [helper.make_node("Identity", [f"in_{d}"], [f"out_{d}"]) for d in ALL_DTYPES]
    onnx_package(models / "alltypes", "alltypes", nodes,
                 [(f"in_{d}", d, shape(d)) for d in ALL_DTYPES], [(f"out_{d}", d, shape(d)) for d in ALL_DTYPES])  # fmt: skip


def _reshape4(models: Path) -> None:
    """``reshape4``: x [batch, 2] reshaped to [4]; the model itself fails unless batch is 2."""
    from onnx import TensorProto, helper

    onnx_package(models / "reshape4", "reshape4", [helper.make_node("Reshape", ["x", "four"], ["out"])],
                 [("x", "float32", ["batch", 2])], [("out", "float32", [4])],
                 [helper.make_tensor("four", TensorProto.INT64, [1], [4])])  # fmt: skip


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-remote-"))
    with private_caches(root):
        adder_and_echo(root / "models", echo_as_zip=True)
        _all_dtypes(root / "models")
        _reshape4(root / "models")
        (root / "token").write_text(TOKEN + "\n")
        yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Server]:
    srv = Server(root / "models")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def secure(root: Path) -> Iterator[Server]:
    """A server with TLS (a self-signed cert for 127.0.0.1 and localhost) and a bearer token."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    tls = root / "tls"
    tls.mkdir(exist_ok=True)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tls / "key.pem"),
         "-out", str(tls / "cert.pem"), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    srv = Server(root / "models" / "adder", "--tls-cert", str(tls / "cert.pem"), "--tls-key", str(tls / "key.pem"),
                 "--auth-token-file", str(root / "token"), tls=tls)  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def local(root: Path) -> Iterator[dict[str, Any]]:
    """The same packages loaded in this process, to compare with."""
    names = ["adder", "alltypes", "echo.zip"]
    models = {n.split(".")[0]: neuropod.load_neuropod(root / "models" / n) for n in names}
    yield models
    for m in models.values():
        m.close()


# --- the model, rebuilt from the server's metadata --------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_spec_backend_and_device_come_from_the_server(server: Server, local: dict[str, Any], protocol: str) -> None:
    import onnxruntime

    with neuropod.load_neuropod(server.url(protocol, "adder")) as model:
        assert isinstance(model, neuropod.NeuropodModel)
        assert model.name == "adder" and model.platform == "onnx"
        # The exact spec, symbol names included (REST parameters / the gRPC trailer).
        assert model.inputs == local["adder"].inputs and model.outputs == local["adder"].outputs
        assert model.backend.id == f"onnx=={onnxruntime.__version__}" == local["adder"].backend.id
        assert model.backend.location == f"remote: {protocol}://127.0.0.1:{server.grpc_port if protocol == 'grpc' else server.http_port}"
        assert model.device == local["adder"].device  # the server's choice: cpu here, cuda:0 on a GPU host
        assert model.package is None
        assert protocol in repr(model)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_dtype_round_trips_exactly(server: Server, local: dict[str, Any], protocol: str) -> None:
    with neuropod.load_neuropod(server.url(protocol, "alltypes")) as model:
        for batch, seed in ((4, 0), (1, 1), (0, 2)):
            inputs = {f"in_{d}": sample(d, (batch,) if d == "string" else (batch, 3), seed) for d in ALL_DTYPES}
            inputs["in_string"][:1] = ["é ü 日本"] if batch else []
            out = model.infer(inputs)
            here = local["alltypes"].infer(inputs)
            assert set(out) == set(here) == {f"out_{d}" for d in ALL_DTYPES}
            for d in ALL_DTYPES:
                got, want = out[f"out_{d}"], here[f"out_{d}"]
                assert got.shape == want.shape == inputs[f"in_{d}"].shape, d
                if d == "string":
                    assert [str(v) for v in got.tolist()] == [str(v) for v in want.tolist()] == inputs["in_string"].tolist()
                else:
                    assert got.dtype == want.dtype == np.dtype(d), d
                    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_strings_and_requested_outputs(server: Server, local: dict[str, Any], protocol: str) -> None:
    n = np.array([1, 2, 3], np.int64)
    s = np.array(["", "naïve", "x" * 1000])
    with neuropod.load_neuropod(server.url(protocol, "echo")) as echo, \
            neuropod.load_neuropod(server.url(protocol, "adder")) as adder:  # fmt: skip
        out = echo.infer({"n": n, "s": s})
        np.testing.assert_array_equal(out["n1"], n + 1)
        assert out["s_out"].tolist() == s.tolist()
        only = echo.infer({"n": n, "s": s}, requested_outputs=["s_out"])
        assert list(only) == ["s_out"] and only["s_out"].tolist() == s.tolist()
        both = adder.infer({"x": X, "y": Y}, requested_outputs=["doubled", "out"])
        assert set(both) == {"doubled", "out"}
        np.testing.assert_array_equal(both["doubled"], local["adder"].infer({"x": X, "y": Y})["doubled"])
        with pytest.raises(SpecError, match="out_nope"):
            adder.infer({"x": X, "y": Y}, requested_outputs=["out_nope"])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_inputs_are_checked_before_sending_with_the_local_words(
    server: Server, local: dict[str, Any], protocol: str
) -> None:
    bad_inputs = [
        {"x": X.astype(np.float64), "y": Y},  # dtype
        {"x": X, "y": Y[:1]},  # symbol batch_size disagrees
        {"x": X, "y": Y, "z": Y},  # unknown
        {"x": X[:, :1], "y": Y[:, :1]},  # fixed dim
    ]
    with neuropod.load_neuropod(server.url(protocol, "adder")) as model:
        pool_server = model._pool.servers[0]
        for inputs in bad_inputs:
            with pytest.raises(SpecError) as remote_err:
                model.infer(inputs)
            with pytest.raises(SpecError) as local_err:
                local["adder"].infer(inputs)
            assert str(remote_err.value) == str(local_err.value)
        assert pool_server.calls == 0, "a call that fails the spec check was sent"
        # A missing input is the backend's to judge (some have optional inputs), here the server's.
        with pytest.raises(RemoteError) as e:
            model.infer({"x": X})
        assert e.value.code == "invalid_argument" and "needs input(s) 'y'" in str(e.value)


# --- failures ----------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_refused_connection(protocol: str) -> None:
    url = f"{protocol}://127.0.0.1:{free_port()}/adder"
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as e:
        neuropod.load_neuropod(url)
    assert e.value.code == "unavailable" and e.value.url == url
    assert url in str(e.value) and "cannot reach the server" in str(e.value)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unknown_model_and_version(server: Server, protocol: str) -> None:
    with pytest.raises(RemoteError) as e:
        neuropod.load_neuropod(server.url(protocol, "nope"))
    assert e.value.code == "not_found"
    assert server.url(protocol, "nope") in str(e.value) and "unknown model: 'nope' is not found" in str(e.value)
    with pytest.raises(RemoteError, match="only version '1'") as e:
        neuropod.load_neuropod(server.url(protocol, "adder/7"))
    assert e.value.code == "not_found"
    with neuropod.load_neuropod(server.url(protocol, "adder/1")) as model:
        np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_side_errors_carry_the_servers_words(server: Server, protocol: str) -> None:
    with neuropod.load_neuropod(server.url(protocol, "adder")) as model:
        # The client's own check is skipped here (the transport is called directly), so
        # the server's spec check answers: invalid_argument, naming the tensor.
        transport = model._pool.servers[0].transport
        with pytest.raises(RemoteError) as e:
            transport.infer({"x": X.astype(np.int32), "y": Y}, None, 10)
        assert e.value.code == "invalid_argument" and "'x'" in str(e.value)
        assert e.value.server_message and "'x'" in e.value.server_message
    with neuropod.load_neuropod(server.url(protocol, "reshape4")) as model:
        np.testing.assert_array_equal(model.infer({"x": X})["out"], X.reshape(4))
        with pytest.raises(RemoteError) as e:
            model.infer({"x": np.ones((3, 2), np.float32)})  # fits the spec; the model fails
        assert e.value.code == "internal" and "model 'reshape4' failed" in str(e.value)
        np.testing.assert_array_equal(model.infer({"x": X})["out"], X.reshape(4))  # still serving


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_timeout(root: Path, protocol: str) -> None:
    # A batch that waits 5 s for more requests: a call with a shorter timeout gives up.
    slow = Server(root / "models" / "adder", "--max-batch-size", "64", "--max-queue-delay-us", "5000000")
    try:
        with neuropod.load_neuropod(slow.url(protocol, "adder"), timeout=0.5) as model:
            t0 = time.monotonic()
            with pytest.raises(RemoteError) as e:
                model.infer({"x": X, "y": Y})
            took = time.monotonic() - t0
            assert e.value.code == "deadline_exceeded" and "no answer within 0.5 s" in str(e.value)
            assert 0.4 < took < 3, took
            with pytest.raises(RemoteError, match="within 0.2 s"):
                model.infer({"x": X, "y": Y}, timeout=0.2)
            out = model.infer({"x": X, "y": Y}, timeout=30)  # waits out the batch delay
            np.testing.assert_array_equal(out["out"], X + Y)
    finally:
        slow.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_tls_and_token(secure: Server, protocol: str) -> None:
    assert secure.tls is not None
    cert = secure.tls / "cert.pem"
    url = secure.url(protocol, "adder")
    with neuropod.load_neuropod(url, auth_token=TOKEN, ca_cert=cert) as model:
        np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)
    # A certificate nobody said to trust.
    with pytest.raises(RemoteError) as e:
        neuropod.load_neuropod(url, auth_token=TOKEN, retries=0)
    assert e.value.code == "tls" and url in str(e.value), str(e.value)
    # No token, and a wrong one.
    for token in (None, "wrong"):
        with pytest.raises(RemoteError) as e:
            neuropod.load_neuropod(url, auth_token=token, ca_cert=cert)
        assert e.value.code == "unauthenticated" and "auth_token" in str(e.value)
        assert TOKEN not in str(e.value)
    # Plain text to a TLS port fails as such, quickly.
    plain = url.replace("grpcs://", "grpc://").replace("https://", "http://")
    with pytest.raises(RemoteError) as e:
        neuropod.load_neuropod(plain, auth_token=TOKEN, retries=0, connect_timeout=5)
    assert e.value.code in ("unavailable", "protocol", "tls", "deadline_exceeded"), e.value


# --- a pool of servers, threads, closing ------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pool_spreads_calls_and_skips_a_dead_server(root: Path, server: Server, protocol: str) -> None:
    other = Server(root / "models" / "adder")
    try:
        urls = [server.url(protocol, "adder"), other.url(protocol, "adder")]
        with neuropod.load_neuropod(urls, timeout=10) as model:
            for _ in range(10):
                np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)
            calls = [s.calls for s in model._pool.servers]
            assert min(calls) >= 4, calls  # least outstanding, ties in turn
            other.stop(signal.SIGKILL)
            for _ in range(10):  # every call still answered: the dead one is retried elsewhere, then skipped
                np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)
            dead = model._pool.servers[1]
            assert dead.failures >= 1 and dead.down_until > time.monotonic()
            states = model.status(timeout=2)
            assert states[0]["ready"] is True and "error" in states[1], states
    finally:
        other.stop()


def test_pool_with_every_server_down_names_them() -> None:
    urls = [f"grpc://127.0.0.1:{free_port()}/m", f"http://127.0.0.1:{free_port()}/m"]
    with pytest.raises(RemoteError) as e:
        neuropod.load_neuropod(urls)
    assert all(u in str(e.value) for u in urls) and e.value.code == "unavailable"


def test_servers_that_disagree_on_the_spec_are_refused(server: Server) -> None:
    with pytest.raises(RemoteError, match="disagree on its spec"):
        neuropod.load_neuropod([server.url("grpc", "adder"), server.url("http", "echo")])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_threads_share_one_model(server: Server, protocol: str) -> None:
    from neuropod.testing import run_in_threads

    with neuropod.load_neuropod(server.url(protocol, "adder")) as model:

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for i in range(30):
                x = rng.random((1 + i % 4, 2), dtype=np.float32)
                y = rng.random((1 + i % 4, 2), dtype=np.float32)
                out = model.infer({"x": x, "y": y})
                np.testing.assert_array_equal(out["out"], x + y)
                np.testing.assert_array_equal(out["doubled"], (x + y) * 2)

        run_in_threads(work, 8)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_close(server: Server, protocol: str) -> None:
    model = neuropod.load_neuropod(server.url(protocol, "adder"))
    model.infer({"x": X, "y": Y})
    model.close()
    model.close()
    with pytest.raises(NeuropodError, match="closed"):
        model.infer({"x": X, "y": Y})


def test_big_tensors_are_views_of_the_received_message(server: Server) -> None:
    big = np.random.default_rng(0).random((40_000, 3), dtype=np.float32)  # 480 kB
    for protocol in PROTOCOLS:
        with neuropod.load_neuropod(server.url(protocol, "alltypes")) as model:
            inputs = {f"in_{d}": sample(d, (1,) if d == "string" else (1, 3)) for d in ALL_DTYPES}
            inputs = {k: np.repeat(v, 40_000, axis=0) for k, v in inputs.items()}
            inputs["in_float32"] = big
            out = model.infer(inputs)["out_float32"]
            np.testing.assert_array_equal(out, big)
            assert not out.flags.owndata  # made over the received buffer, not copied out of it
            assert out.flags.writeable is (protocol == "http")


# --- options and the CLI ------------------------------------------------------


def test_options_that_do_not_apply(server: Server) -> None:
    url = server.url("grpc", "adder")
    with pytest.raises(ValueError, match="device='cuda:0' does not apply to a remote model"):
        neuropod.load_neuropod(url, device="cuda:0")
    with pytest.raises(ValueError, match="use_ope"):
        neuropod.load_neuropod(url, use_ope=True)
    with pytest.raises(NeuropodError, match="'threads' is not an option of remote models"):
        neuropod.load_neuropod(url, threads=2)
    with pytest.raises(TypeError, match="retries"):
        neuropod.load_neuropod(url, retries=-1)
    for bad in ("grpc://127.0.0.1:8001", "grpc://127.0.0.1:8001/a/b/c", "grpc://:8001/m", "grpc://h:8001/m?x=1",
                "grpc://u:p@h/m", "grpc://h:99999/m"):  # fmt: skip
        with pytest.raises(ValueError, match="Remote model URL"):
            neuropod.load_neuropod(bad)
    # With neuropod-serving's schemes installed, another scheme is a mistyped URL: nothing to install.
    with pytest.raises(PackageError, match="unknown scheme ftp://; the known schemes are grpc, grpcs, http, https"):
        neuropod.load_neuropod("ftp://host/m")


def test_a_bad_url_on_the_command_line_is_a_plain_message(capsys: pytest.CaptureFixture[str]) -> None:
    """The URL's own words, not Python's class name in front of them."""
    for url, why in (("grpc://h:99999/m", "is not a valid URL"), ("grpc://:8001/m", "names no host")):
        assert main(["inspect", url]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"neuropod inspect: error: Remote model URL {url!r} {why}"), err
        assert "ValueError" not in err and len(err.splitlines()) == 1


def test_inspect_and_explain_a_url(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    url = server.url("grpc", "adder")
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "adder" in out and "batch_size" in out and "Inputs:" in out and "model ready" in out
    assert "onnx==" in out and "server neuropod" in out
    assert main(["inspect", "--json", server.url("http", "adder")]) == 0
    data = __import__("json").loads(capsys.readouterr().out)
    assert data["name"] == "adder" and data["servers"][0]["ready"] is True
    assert [s["shape"] for s in data["input_spec"]] == [["batch_size", 2], ["batch_size", 2]]
    assert main(["explain", "--quiet-spec", url]) == 0
    assert "served by 1 of 1 server(s)" in capsys.readouterr().out
    assert main(["explain", url, "--device", "cpu"]) == 2
    assert "apply to local packages" in capsys.readouterr().err
    assert main(["inspect", f"grpc://127.0.0.1:{free_port()}/adder"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_a_model_not_ready_is_refused_at_load_and_explained(root: Path) -> None:
    # A server whose model was unloaded through the repository API: metadata may
    # still be answered (or not), and readiness says no.
    srv = Server(root / "models" / "adder")
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{srv.http_port}/v2/repository/models/adder/unload",
                                     method="POST", data=b"{}")  # fmt: skip
        with contextlib.closing(urllib.request.urlopen(req, timeout=10)):
            pass
        for protocol in PROTOCOLS:
            with pytest.raises(RemoteError) as e:
                neuropod.load_neuropod(srv.url(protocol, "adder"))
            assert e.value.code in ("not_found", "unavailable")
    finally:
        srv.stop()


def test_client_import_pulls_in_no_framework_or_server_library() -> None:
    code = (
        "import sys, neuropod, neuropod_serving.client\n"
        "bad = [m for m in ('onnxruntime', 'grpc', 'starlette', 'uvicorn', 'google.protobuf') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr


def test_load_from_many_threads_at_once(server: Server) -> None:
    errors: list[BaseException] = []

    def load() -> None:
        try:
            with neuropod.load_neuropod(server.url("grpc", "adder")) as m:
                m.infer({"x": X, "y": Y})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_a_keep_alive_connection_the_server_closed_is_replaced(server: Server) -> None:
    """uvicorn closes a keep-alive connection idle for 5 s: the next call notices and goes on a new one."""
    with neuropod.load_neuropod(server.url("http", "adder")) as model:
        model.infer({"x": X, "y": Y})
        transport = model._pool.servers[0].transport
        idle = transport._idle[0]
        time.sleep(5.5)
        np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)
        assert transport._idle and transport._idle[0] is not idle  # replaced, not reused
        assert model._pool.servers[0].failures == 0


@contextlib.contextmanager
def _answering(answers: dict[str, bytes]) -> Iterator[str]:
    """A plain HTTP server (Python's http.server) answering GET paths with fixed bodies: a
    server that speaks HTTP but not the protocol as we expect. Yields its base URL."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = answers.get(self.path, b"{}")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_server_answering_json_nested_too_deep_is_a_protocol_error() -> None:
    """Answers are read with the core's bounded JSON reader: a hostile or broken server's
    deeply nested JSON gives a RemoteError, not a RecursionError."""
    deep = b"[" * 200_000 + b"]" * 200_000
    with _answering({"/v2/models/m": deep}) as base, pytest.raises(RemoteError) as e:
        neuropod.load_neuropod(f"{base}/m")
    assert e.value.code == "protocol" and f"{base}/m" in str(e.value) and "not a JSON object" in str(e.value)


def test_metadata_that_is_no_spec_is_a_protocol_error_naming_the_url() -> None:
    bad = b'{"name":"m","inputs":[{"name":"x","datatype":"COMPLEX64","shape":[2]}],"outputs":[]}'
    with _answering({"/v2/models/m": bad}) as base, pytest.raises(RemoteError) as e:
        neuropod.load_neuropod(f"{base}/m", check_ready=False)
    assert e.value.code == "protocol" and f"{base}/m" in str(e.value) and "cannot be read as a spec" in str(e.value)
    assert "COMPLEX64" in str(e.value)
