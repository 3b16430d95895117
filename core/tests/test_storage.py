"""Packages loaded by URL from a real S3 server (moto's, on 127.0.0.1, through s3fs exactly as a
user's load goes) and from a real web server (ranges, a redirect, a 404, a dropped connection).

The model is the ONNX demo (``out = (x + y) * 2``); expected outputs are computed with numpy.
``nox -s tests_storage`` installs what these need; without it they skip.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("s3fs", reason="needs neuropod[s3] (nox -s tests_storage installs it)")
pytest.importorskip("aiohttp", reason="needs neuropod[http] (nox -s tests_storage installs it)")
moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (nox -s tests_storage installs it)")
pytest.importorskip("neuropod_onnx", reason="needs neuropod-onnx and onnxruntime")
pytest.importorskip("onnxruntime", reason="needs onnxruntime")

import neuropod  # noqa: E402
from _web_server import Site, web_server  # noqa: E402
from neuropod import storage  # noqa: E402
from neuropod.errors import PackageError  # noqa: E402

X = np.array([[1, 2], [3, 4]], np.float32)
Y = np.array([[7, 8], [9, 10]], np.float32)
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _zip_of(directory: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(directory).as_posix())
    return buf.getvalue()


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo package as a directory and a zip, another package (another name) and a tampered zip."""
    from neuropod_onnx.demo import INPUT_SPEC, OUTPUT_SPEC, build_demo, demo_model_bytes
    from neuropod_onnx.packager import create_onnx_neuropod

    root = tmp_path_factory.mktemp("packages")
    directory, _, _ = build_demo(root)
    other = create_onnx_neuropod(root / "other.neuropod", "demo_adder_v2", INPUT_SPEC, OUTPUT_SPEC,
                                 onnx_model=demo_model_bytes())  # fmt: skip
    tampered = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(_zip_of(directory))) as src, zipfile.ZipFile(tampered, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith(".onnx"):
                data = data.replace(b"neuropod-demo", b"neuropod-demX")  # same size, other bytes
            dst.writestr(item, data)
    return {"dir": directory, "zip": _zip_of(directory), "other": _zip_of(other), "tampered": tampered.getvalue()}


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1: its endpoint URL."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in CREDENTIALS.items():
            mp.setenv(k, v)
        port = _free_port()
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.stop()


@pytest.fixture
def bucket(s3_server: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh bucket on the S3 server (and a private cache for the test)."""
    import boto3

    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    client = boto3.client("s3", endpoint_url=s3_server)
    name = "b-" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:16]
    client.create_bucket(Bucket=name)
    return _Bucket(client, name, s3_server)


class _Bucket:
    def __init__(self, client: Any, name: str, endpoint: str) -> None:
        self.client, self.name, self.endpoint = client, name, endpoint
        self.options = {"client_kwargs": {"endpoint_url": endpoint}}

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)
        return f"s3://{self.name}/{key}"

    def put_tree(self, prefix: str, directory: Path) -> str:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                self.put(f"{prefix}/{path.relative_to(directory).as_posix()}", path.read_bytes())
        return f"s3://{self.name}/{prefix}/"


def _check_demo(model: Any) -> None:
    np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], (X + Y) * 2)


def _downloads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "neuropod.storage" and r.getMessage().startswith("downloading")]


# --- S3 ------------------------------------------------------------------------------------------


def test_a_zip_object_and_a_prefix_load_by_url(bucket: _Bucket, packages: dict[str, Any]) -> None:
    for url in (bucket.put("models/adder.neuropod", packages["zip"]), bucket.put_tree("models/adder", packages["dir"])):
        with neuropod.load_neuropod(url, storage_options=bucket.options) as model:
            assert model.name == "demo_adder"
            _check_demo(model)


def test_empty_files_of_a_prefix_are_downloaded(bucket: _Bucket, packages: dict[str, Any]) -> None:
    """A package directory's empty files (a Python model's __init__.py) are part of it too."""
    url = bucket.put_tree("models/adder", packages["dir"])
    bucket.put("models/adder/0/code/__init__.py", b"")
    local = storage.fetch(url, storage_options=bucket.options)
    assert (local / "0" / "code" / "__init__.py").read_bytes() == b""
    assert storage.fetch(url, storage_options=bucket.options) == local  # and the download is complete: reused


def test_old_downloads_are_pruned_and_bad_ones_found(bucket: _Bucket, packages: dict[str, Any]) -> None:
    """`neuropod cache prune` removes the download of an older version once unused for --days;
    `neuropod cache verify` finds a truncated download, and --repair removes it."""
    from neuropod.cli import main

    url = bucket.put("adder.neuropod", packages["zip"])
    first = storage.fetch(url, storage_options=bucket.options).parent
    bucket.put("adder.neuropod", packages["other"])  # a new version of the object: a second download
    second = storage.fetch(url, storage_options=bucket.options).parent
    assert first != second and storage.verify_downloads() == []
    month_ago = time.time() - 40 * 86400
    for entry in (first, second):
        os.utime(entry / "record.json", (month_ago, month_ago))
    storage.fetch(url, storage_options=bucket.options)  # the current version is used again now
    out = io.StringIO()
    assert main(["cache", "prune", "--days", "30", "--dry-run"], out=out) == 0
    assert f"Would remove {url}" in out.getvalue() and "Would remove 1 download(s)" in out.getvalue(), out.getvalue()
    assert first.exists()
    gone = storage.prune_downloads(30)
    assert [(p, u) for p, u, _ in gone] == [(first, url)] and gone[0][2] >= len(packages["zip"])
    assert not first.exists() and second.exists()

    zipped = second / "package.zip"
    zipped.write_bytes(zipped.read_bytes()[:100])
    out = io.StringIO()
    assert main(["cache", "verify"], out=out) == 1
    assert f"{second} ({url}): 'package.zip' holds 100 bytes, not the {len(packages['other']):,} downloaded" \
        in out.getvalue(), out.getvalue()  # fmt: skip
    assert main(["cache", "verify", "--repair"], out=io.StringIO()) == 0
    assert not second.exists() and storage.verify_downloads() == []
    with neuropod.load_neuropod(url, storage_options=bucket.options) as model:  # downloaded again
        assert model.name == "demo_adder_v2"


def test_a_first_load_of_a_small_object_is_one_request(
    bucket: _Bucket, packages: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """S3: the first load of a small object is one GET, whose answer both says what the object is
    and holds it (no HEAD); a later load asks with a HEAD and finds the same download."""
    url = bucket.put("adder.neuropod", packages["zip"])
    caplog.set_level(logging.INFO, "werkzeug")  # moto's server, in this process: one line a request
    caplog.clear()
    first = storage.fetch(url, storage_options=bucket.options)
    requests = [r.getMessage() for r in caplog.records if r.name == "werkzeug" and "adder.neuropod" in r.getMessage()]
    assert len(requests) == 1 and "GET /" in requests[0], requests
    assert first.read_bytes() == packages["zip"]
    caplog.clear()
    assert storage.fetch(url, storage_options=bucket.options) == first
    requests = [r.getMessage() for r in caplog.records if r.name == "werkzeug" and "adder.neuropod" in r.getMessage()]
    assert len(requests) == 1 and "HEAD /" in requests[0], requests


def test_a_first_load_of_a_large_object_keeps_the_first_chunk_it_read(
    bucket: _Bucket, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3, an object larger than a chunk: the GET that said what it is gave its first chunk, and
    the rest is read after it (no HEAD, and no byte read twice)."""
    monkeypatch.setattr(storage.stores, "CHUNK", 64 * 1024)
    data = np.random.default_rng(1).bytes(300 * 1024 + 17)
    url = bucket.put("big.zip", data)
    caplog.set_level(logging.INFO, "werkzeug")
    caplog.clear()
    assert storage.fetch(url, storage_options=bucket.options).read_bytes() == data
    requests = [r.getMessage() for r in caplog.records if r.name == "werkzeug" and "big.zip" in r.getMessage()]
    assert not [m for m in requests if "HEAD /" in m], requests
    assert len(requests) == 5, requests  # 300 KiB + 17 bytes in chunks of 64 KiB: 5 range reads


def test_a_second_load_takes_the_download(
    bucket: _Bucket, packages: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    url = bucket.put("adder.neuropod", packages["zip"])
    for _ in range(3):
        with neuropod.load_neuropod(url, storage_options=bucket.options) as model:
            _check_demo(model)
    assert len(_downloads(caplog)) == 1, caplog.text
    entries = [p for p in storage.downloads_dir().iterdir() if len(p.name) == 64]
    assert len(entries) == 1 and (entries[0] / "package.zip").read_bytes() == packages["zip"]
    record = (entries[0] / "record.json").read_text()
    assert url in record and "testing" not in record  # no credential in the cache


def test_a_changed_object_is_downloaded_again(
    bucket: _Bucket, packages: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    url = bucket.put("adder.neuropod", packages["zip"])
    with neuropod.load_neuropod(url, storage_options=bucket.options) as model:
        assert model.name == "demo_adder"
    bucket.put("adder.neuropod", packages["other"])
    with neuropod.load_neuropod(url, storage_options=bucket.options) as model:
        assert model.name == "demo_adder_v2"
        _check_demo(model)
    assert len(_downloads(caplog)) == 2, caplog.text


def test_a_tampered_object_is_refused(bucket: _Bucket, packages: dict[str, Any]) -> None:
    url = bucket.put("adder.neuropod", packages["tampered"])
    with pytest.raises(PackageError, match=r"^Package s3://b-[0-9a-f]+/adder\.neuropod does not match its manifest\.json "
                       r"\(changed: 0/data/model\.onnx\)"):  # fmt: skip
        neuropod.load_neuropod(url, storage_options=bucket.options)


def test_missing_bucket_key_and_credentials_say_so(bucket: _Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PackageError, match=rf"No Neuropod package at s3://{bucket.name}/nope\.neuropod: no such object"):
        neuropod.load_neuropod(f"s3://{bucket.name}/nope.neuropod", storage_options=bucket.options)
    with pytest.raises(PackageError, match=r"s3://no-such-bucket/adder\.neuropod: the bucket 'no-such-bucket' does "
                       "not exist"):  # fmt: skip
        neuropod.load_neuropod("s3://no-such-bucket/adder.neuropod", storage_options=bucket.options)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    with pytest.raises(PackageError, match=r"No access to s3://.*AWS_ACCESS_KEY_ID.*storage_options") as e:
        neuropod.load_neuropod(f"s3://{bucket.name}/nope.neuropod",
                               storage_options={**bucket.options, "skip_instance_cache": True})  # fmt: skip
    assert "Traceback" not in str(e.value)


def test_bytes_read_ahead_count_only_when_their_md5_proves_them_the_object(
    bucket: _Bucket, packages: dict[str, Any]
) -> None:
    # A URL's first download reads its first chunk while the store is asked what the object is:
    # those bytes may be an older version, so they are used only when the listed MD5 is theirs.
    from concurrent.futures import Future

    url = bucket.put("adder.neuropod", packages["zip"])
    fs, path = storage.stores.open_filesystem(url, dict(bucket.options))
    info = storage.stores.object_info(fs, path, url)

    def read(data: bytes) -> Future[bytes]:
        future: Future[bytes] = Future()
        future.set_result(data)
        return future

    assert storage.transfer.whole_read_ahead(read(packages["zip"]), fs, info) == packages["zip"]
    assert storage.transfer.whole_read_ahead(read(packages["other"]), fs, info) is None  # read before the object changed
    assert storage.transfer.whole_read_ahead(read(packages["zip"][:100]), fs, info) is None  # not all of it
    multipart = {**info, "ETag": '"' + "0" * 32 + '-2"'}  # no MD5 listed: never taken
    assert storage.transfer.whole_read_ahead(read(packages["zip"]), fs, multipart) is None


_KILLED_FETCH = textwrap.dedent("""
    import builtins, sys, time
    from neuropod import storage

    class Slow:  # a download file whose every chunk takes 20 ms to write
        def __init__(self, f):
            self.f = f
        def write(self, b):
            time.sleep(0.02)
            return self.f.write(b)
        def __getattr__(self, name):
            return getattr(self.f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    storage.stores.CHUNK = 64 * 1024
    storage.transfer.open = lambda *a, **k: Slow(builtins.open(*a, **k))  # what storage writes downloads with
    storage.fetch(sys.argv[1], storage_options={"client_kwargs": {"endpoint_url": sys.argv[2]}})
""")


def test_a_killed_download_is_resumed_by_the_next(
    bucket: _Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    data = np.random.default_rng(0).bytes(8 * 1024 * 1024)
    url = bucket.put("big.zip", data)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_FETCH, url, bucket.endpoint], env=os.environ.copy())
    partial: list[Path] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        partial = [p for p in storage.downloads_dir().glob("*.partial") if p.stat().st_size > 1024 * 1024] \
            if storage.downloads_dir().is_dir() else []  # fmt: skip
        if partial:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert partial, "the download never got going"
    have = partial[0].stat().st_size
    assert 0 < have < len(data)
    assert not [p for p in storage.downloads_dir().iterdir() if len(p.name) == 64]  # nothing a load would take
    # Chunks smaller than the object, or the first load's read-ahead would take all of it at once.
    monkeypatch.setattr(storage.stores, "CHUNK", 1024 * 1024)
    path = storage.fetch(url, storage_options=bucket.options)
    assert path.read_bytes() == data
    assert any(m.startswith(f"resuming {url} from byte") for m in (r.getMessage() for r in caplog.records)), caplog.text
    assert not list(storage.downloads_dir().glob("*.partial"))


class _SlowWrites:
    """A download file whose every write takes 40 ms: a download long enough to kill its server in."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def write(self, b: bytes) -> int:
        time.sleep(0.04)
        return int(self.f.write(b))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> _SlowWrites:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.f.__exit__(*exc)


class _Proxy:
    """A TCP proxy on a port of its own to the S3 server of the moment: the endpoint a client keeps
    while servers behind it die and start (a restarted store is back with its objects at once)."""

    def __init__(self) -> None:
        self.backend: int | None = None
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            backend = self.backend
            try:
                upstream = socket.create_connection(("127.0.0.1", backend), timeout=5) if backend else None
            except OSError:
                upstream = None
            if upstream is None:
                client.close()  # no server now: the connection is refused
                continue
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.sock.close()


def test_a_server_killed_mid_download_then_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The S3 server dies in the middle of a download and another comes back with the same object:
    the download retries from the byte where it stopped and completes, with the object's bytes."""
    import builtins

    import boto3

    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    data = np.random.default_rng(2).bytes(4 * 1024 * 1024)

    def start() -> tuple[subprocess.Popen[bytes], int]:
        """A moto server holding the object, on a port of its own."""
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while True:
                with socket.socket() as sock:
                    if sock.connect_ex(("127.0.0.1", port)) == 0:
                        break
                assert proc.poll() is None and time.monotonic() < deadline, "moto's server did not start"
                time.sleep(0.05)
            client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
            client.create_bucket(Bucket="restarted")
            client.put_object(Bucket="restarted", Key="big.zip", Body=data)
        except BaseException:
            proc.kill()  # a server that failed to start or to take the object is not left running
            proc.wait(10)
            raise
        return proc, port

    proxy = _Proxy()
    try:
        server, proxy.backend = start()
    except BaseException:
        proxy.close()
        raise
    try:
        monkeypatch.setattr(storage.stores, "CHUNK", 256 * 1024)
        slow = lambda *a, **k: _SlowWrites(builtins.open(*a, **k))  # noqa: E731, SIM115  # closed by storage
        monkeypatch.setattr(storage.transfer, "open", slow, raising=False)  # what storage writes downloads with
        out: list[Any] = []
        options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{proxy.port}"}}

        def load() -> None:
            try:
                out.append(storage.fetch("s3://restarted/big.zip", storage_options=options))
            except BaseException as e:  # noqa: BLE001  # the test says what it was
                out.append(e)

        thread = threading.Thread(target=load)
        thread.start()
        deadline = time.monotonic() + 60
        partial: list[Path] = []
        while not partial:
            assert time.monotonic() < deadline and thread.is_alive(), f"the download never got going: {out}"
            found = storage.downloads_dir().glob("*.partial") if storage.downloads_dir().is_dir() else []
            partial = [p for p in found if p.is_file() and p.stat().st_size >= 1024 * 1024]
            time.sleep(0.01)
        proxy.backend = None
        server.kill()  # mid-download: about a quarter of it written
        server.wait(10)
        assert partial[0].stat().st_size < len(data)
        time.sleep(0.5)  # down for a while: requests meanwhile are refused
        server, proxy.backend = start()
        thread.join(120)
        assert out and isinstance(out[0], Path), out
        assert out[0].read_bytes() == data
        assert not list(storage.downloads_dir().glob("*.partial"))
    finally:
        proxy.close()
        server.kill()
        server.wait(10)


_TWO_LOADS = textwrap.dedent("""
    import logging, sys, time
    import numpy as np
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    import neuropod
    while time.time() < float(sys.argv[3]):
        time.sleep(0.001)
    with neuropod.load_neuropod(sys.argv[1], storage_options={"client_kwargs": {"endpoint_url": sys.argv[2]}}) as m:
        x = np.array([[1, 2], [3, 4]], np.float32)
        print("out", m.infer({"x": x, "y": x})["out"].tolist())
""")


def test_two_processes_loading_one_url_download_it_once(bucket: _Bucket, packages: dict[str, Any]) -> None:
    url = bucket.put("adder.neuropod", packages["zip"])
    start = str(time.time() + 2.0)  # both start loading at the same instant
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_LOADS, url, bucket.endpoint, start], env=os.environ.copy(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "out [[4.0, 8.0], [12.0, 16.0]]" in out, (out, err)
    downloads = sum(err.count("neuropod.storage downloading ") for _, err in outs)
    assert downloads == 1, [err for _, err in outs]


def test_the_command_takes_package_urls(bucket: _Bucket, packages: dict[str, Any]) -> None:
    url = bucket.put("adder.neuropod", packages["zip"])
    env = {**os.environ, "AWS_ENDPOINT_URL": bucket.endpoint}  # the S3 endpoint, as the AWS tools read it

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "neuropod", *args], capture_output=True, text=True, env=env,
                              timeout=120)  # fmt: skip

    r = run("inspect", url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"Package:   {url} (downloaded to ") and "Name:      demo_adder" in r.stdout
    assert f"neuropod: downloading {url}" in r.stderr
    r = run("test", url)
    assert r.returncode == 0 and "PASSED" in r.stdout, r.stderr
    assert "downloading" not in r.stderr  # the download the first command made
    bucket.put("adder.neuropod", packages["tampered"])
    r = run("inspect", url)
    assert r.returncode == 2 and f"neuropod inspect: error: Package {url} does not match its manifest" in r.stderr, r.stderr
    r = run("env", "prepare", url)  # a list of packages: each downloaded one is named by its URL too
    assert r.returncode == 2 and f"error: Package {url} does not match its manifest" in r.stderr, r.stderr
    r = run("explain", f"s3://{bucket.name}/nope.neuropod")
    assert r.returncode == 2, r.stderr
    assert f"error: No Neuropod package at s3://{bucket.name}/nope.neuropod: no such object" in r.stderr
    assert "Traceback" not in r.stderr


# --- https:// (a local web server) ----------------------------------------------------------------


@pytest.fixture
def web(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Site]]:
    """Files with ETags and byte ranges; ``/old/...`` redirects to ``/...``; the first GET of a name
    in ``drop`` stops halfway (the connection closed)."""
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(storage.transfer, "FIRST_WAIT_S", 0.05)
    site = Site(redirects={"/old/": "/"}, drop_over=1024)
    with web_server(site) as base:
        yield base, site


def test_https_urls_of_zips_load_through_redirects_and_retries(
    web: tuple[str, Site], packages: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    base, site = web
    site.files["adder.neuropod"] = packages["zip"]
    with neuropod.load_neuropod(f"{base}/adder.neuropod") as model:
        _check_demo(model)
    with neuropod.load_neuropod(f"{base}/old/adder.neuropod") as model:  # a redirect, then the same object
        _check_demo(model)
    # A connection that drops halfway is retried from where it stopped.
    site.files["again.zip"] = packages["zip"]
    site.drop.add("again.zip")
    with neuropod.load_neuropod(f"{base}/again.zip") as model:
        _check_demo(model)
    assert not site.drop  # it did drop
    assert any("retrying" in r.getMessage() for r in caplog.records), caplog.text


def test_https_404_says_no_package(web: tuple[str, Site]) -> None:
    base, _ = web
    with pytest.raises(PackageError, match=r"No Neuropod package at http://127\.0\.0\.1:\d+/missing\.zip"):
        neuropod.load_neuropod(f"{base}/missing.zip")


def test_the_cache_holds_only_finished_downloads(bucket: _Bucket, packages: dict[str, Any]) -> None:
    url = bucket.put("adder.neuropod", packages["zip"])
    storage.fetch(url, storage_options=bucket.options)
    names = sorted(p.name for p in storage.downloads_dir().iterdir())
    assert names[-1] == "urls" and all(len(n) == 64 for n in names[:-1]), names
    shutil.rmtree(storage.downloads_dir())  # a cleared cache is downloaded into again
    assert storage.fetch(url, storage_options=bucket.options).read_bytes() == packages["zip"]
