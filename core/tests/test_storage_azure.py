"""Packages loaded by ``az://`` (and ``abfs://``) URL from a real Azure Blob emulator (Azurite's, a
Node.js server started here on 127.0.0.1), through adlfs exactly as a user's load goes.

Azurite is the executable ``NEUROPOD_TEST_AZURITE`` names (its ``azurite-blob``), else
``azurite-blob`` on PATH; without either the module skips (``nox -s tests_storage`` installs it with
npm). adlfs is pointed at it the way a user's would be: Azurite's well-known development account in
a connection string, ``AZURE_STORAGE_CONNECTION_STRING``. Containers and blobs are made with
azure-storage-blob directly, not through adlfs. Tested: a zip blob and a prefix of blobs (an empty
one among them) load by ``az://`` URL and infer, and by ``abfs://`` / ``abfss://``; a second load
takes the cached download; a changed blob or blob under the prefix is downloaded again; range reads
of a blob; a missing blob, prefix or container is a PackageError naming the URL;
``neuropod inspect az://...``; and ``storage_options={"connection_string": ...}`` instead of the
environment variable.

Not tested here: credentials and their errors (Azurite's account key is public), Azure AD tokens.

The model is the ONNX demo (``out = (x + y) * 2``); expected outputs are computed with numpy.
``nox -s tests_storage`` installs what these need; without it they skip.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

AZURITE = os.environ.get("NEUROPOD_TEST_AZURITE") or shutil.which("azurite-blob")
if not AZURITE:
    pytest.skip("needs Azurite: NEUROPOD_TEST_AZURITE (the path of its azurite-blob) or azurite-blob on PATH "
                "(nox -s tests_storage installs it with npm)", allow_module_level=True)  # fmt: skip
pytest.importorskip("adlfs", reason="needs neuropod[azure] (nox -s tests_storage installs it)")
blob = pytest.importorskip("azure.storage.blob", reason="needs neuropod[azure] (nox -s tests_storage installs it)")
pytest.importorskip("neuropod_onnx", reason="needs neuropod-onnx and onnxruntime")
pytest.importorskip("onnxruntime", reason="needs onnxruntime")

import neuropod  # noqa: E402
from neuropod import storage  # noqa: E402
from neuropod.errors import PackageError  # noqa: E402

X = np.array([[1, 2], [3, 4]], np.float32)
Y = np.array([[7, 8], [9, 10]], np.float32)
EMPTY = "0/data/empty"  # an empty file of the package, listed in its manifest
# Azurite's development account: the name and key Microsoft publishes for the emulator (in
# Azurite's own sources, EMULATOR_ACCOUNT_NAME and EMULATOR_ACCOUNT_KEY_STR), no secret.
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
START_TIMEOUT_S = 60.0


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


def _add_empty_file(directory: Path) -> Path:
    """``directory`` (a package) with an empty file, listed in its manifest as a package's would be."""
    (directory / EMPTY).write_bytes(b"")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"][EMPTY] = hashlib.sha256(b"").hexdigest()
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=4, sort_keys=True))
    return directory


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo package as a directory and a zip, and another package (another name), each with an empty file."""
    from neuropod_onnx.demo import INPUT_SPEC, OUTPUT_SPEC, build_demo, demo_model_bytes
    from neuropod_onnx.packager import create_onnx_neuropod

    root = tmp_path_factory.mktemp("packages")
    directory, _, _ = build_demo(root)
    # The same files (test data too) with another name: a prefix rewritten with it has nothing left over.
    other = create_onnx_neuropod(root / "other.neuropod", "demo_adder_v2", INPUT_SPEC, OUTPUT_SPEC,
                                 onnx_model=demo_model_bytes(), test_input_data={"x": X, "y": Y},
                                 test_expected_out={"out": (X + Y) * 2})  # fmt: skip
    directory, other = _add_empty_file(Path(directory)), _add_empty_file(Path(other))
    return {"dir": directory, "other_dir": other, "zip": _zip_of(directory), "other": _zip_of(other)}


def _connection_string(endpoint: str) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={endpoint}/{ACCOUNT};")  # fmt: skip


def _wait_for_port(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Until 127.0.0.1:``port`` takes connections; fails (with Azurite's output) if it exits or never does."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"Azurite ({AZURITE}) exited with status {process.returncode} before listening on port "
                        f"{port}:\n{log.read_text(errors='replace')}")  # fmt: skip
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"Azurite ({AZURITE}) did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S:.0f} s:"
                            f"\n{log.read_text(errors='replace')}")  # fmt: skip
            time.sleep(0.1)


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Azurite's blob service on a free port of 127.0.0.1, named by AZURE_STORAGE_CONNECTION_STRING: the
    connection string."""
    assert AZURITE
    if not (os.path.isfile(AZURITE) and os.access(AZURITE, os.X_OK)):
        pytest.fail(f"NEUROPOD_TEST_AZURITE={AZURITE!r} is not an executable (the path of Azurite's azurite-blob)")
    workspace = tmp_path_factory.mktemp("azurite")
    log = workspace / "azurite.log"
    port = _free_port()
    # In memory (nothing written to the workspace, its working directory), no telemetry sent; the
    # API version check off: azure-storage-blob may speak a newer one than this Azurite knows.
    command = [AZURITE, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
               "--extentMemoryLimit", "512", "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=workspace, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _wait_for_port(process, port, log)
        with pytest.MonkeyPatch.context() as mp:
            connection = _connection_string(f"http://127.0.0.1:{port}")
            mp.setenv("AZURE_STORAGE_CONNECTION_STRING", connection)
            # Nothing else of this machine's Azure settings: only the connection string counts.
            for name in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
                         "AZURE_STORAGE_CLIENT_ID", "AZURE_STORAGE_CLIENT_SECRET", "AZURE_STORAGE_TENANT_ID"):  # fmt: skip
                mp.delenv(name, raising=False)
            yield connection
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def container(azurite: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Container]:
    """A fresh container in Azurite (and a private cache for the test)."""
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    name = "c-" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:16]  # 3 to 63 of [a-z0-9-]
    client = blob.BlobServiceClient.from_connection_string(azurite)
    try:
        client.create_container(name)
        yield _Container(client.get_container_client(name), azurite)
    finally:
        client.close()


class _Container:
    def __init__(self, client: Any, connection: str) -> None:
        self.client, self.name, self.connection = client, client.container_name, connection

    def put(self, key: str, data: bytes) -> str:
        self.client.upload_blob(key, data, overwrite=True)
        return f"az://{self.name}/{key}"

    def put_tree(self, prefix: str, directory: Path) -> str:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                self.put(f"{prefix}/{path.relative_to(directory).as_posix()}", path.read_bytes())
        return f"az://{self.name}/{prefix}/"


def _check_demo(model: Any) -> None:
    np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], (X + Y) * 2)


def _downloads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "neuropod.storage" and r.getMessage().startswith("downloading")]


def test_a_zip_object_and_a_prefix_load_by_url(container: _Container, packages: dict[str, Any]) -> None:
    for url in (container.put("models/adder.neuropod", packages["zip"]),
                container.put_tree("models/adder", packages["dir"])):  # fmt: skip
        assert url.startswith("az://")
        with neuropod.load_neuropod(url) as model:
            assert model.name == "demo_adder"
            _check_demo(model)


def test_abfs_urls_load_too(container: _Container, packages: dict[str, Any]) -> None:
    container.put("adder.neuropod", packages["zip"])
    container.put_tree("models/adder", packages["dir"])
    for url in (f"abfs://{container.name}/adder.neuropod", f"abfs://{container.name}/models/adder/",
                f"abfss://{container.name}/adder.neuropod"):  # fmt: skip
        with neuropod.load_neuropod(url) as model:
            assert model.name == "demo_adder"
            _check_demo(model)


def test_empty_files_of_a_prefix_are_downloaded(container: _Container, packages: dict[str, Any]) -> None:
    url = container.put_tree("models/adder", packages["dir"])
    local = storage.fetch(url)
    assert (local / EMPTY).is_file() and (local / EMPTY).read_bytes() == b""
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == \
        sorted(p.relative_to(packages["dir"]).as_posix() for p in packages["dir"].rglob("*") if p.is_file())  # fmt: skip
    assert storage.fetch(url) == local  # and the download is complete: reused


def test_a_second_load_takes_the_download(
    container: _Container, packages: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    url = container.put("adder.neuropod", packages["zip"])
    for _ in range(3):
        with neuropod.load_neuropod(url) as model:
            _check_demo(model)
    assert len(_downloads(caplog)) == 1, caplog.text
    entries = [p for p in storage.downloads_dir().iterdir() if len(p.name) == 64]
    assert len(entries) == 1 and (entries[0] / "package.zip").read_bytes() == packages["zip"]
    record = json.loads((entries[0] / "record.json").read_text())
    assert record["url"] == url and record["identity"].get("etag"), record  # what Azure says identifies it
    prefix = container.put_tree("models/adder", packages["dir"])
    for _ in range(2):
        with neuropod.load_neuropod(prefix) as model:
            _check_demo(model)
    assert len(_downloads(caplog)) == 2, caplog.text


def test_a_changed_object_is_downloaded_again(
    container: _Container, packages: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    url = container.put("adder.neuropod", packages["zip"])
    with neuropod.load_neuropod(url) as model:
        assert model.name == "demo_adder"
    container.put("adder.neuropod", packages["other"])  # within the same second: only the ETag tells
    with neuropod.load_neuropod(url) as model:
        assert model.name == "demo_adder_v2"
        _check_demo(model)
    assert len(_downloads(caplog)) == 2, caplog.text


def test_a_changed_file_under_a_prefix_is_downloaded_again(
    container: _Container, packages: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    url = container.put_tree("models/adder", packages["dir"])
    with neuropod.load_neuropod(url) as model:
        assert model.name == "demo_adder"
    container.put_tree("models/adder", packages["other_dir"])  # the same file names, other config and manifest
    with neuropod.load_neuropod(url) as model:
        assert model.name == "demo_adder_v2"
        _check_demo(model)
    assert len(_downloads(caplog)) == 2, caplog.text


def test_the_listed_md5_lets_a_first_load_keep_what_it_read_ahead(
    container: _Container, packages: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blob's Content-MD5, as adlfs lists it, is its MD5: the bytes read ahead while the store is
    asked what the blob is are the download (one read of the blob, not two)."""
    url = container.put("adder.neuropod", packages["zip"])
    fs, path = storage.stores.open_filesystem(url, {})
    assert storage.stores.listed_md5(fs, fs.info(path)) == hashlib.md5(packages["zip"]).hexdigest()
    opened: list[str] = []
    original = type(fs).open
    monkeypatch.setattr(type(fs), "open", lambda self, *a, **k: opened.append(a[0]) or original(self, *a, **k))
    assert storage.fetch(url).read_bytes() == packages["zip"]
    assert opened == []  # the read-ahead was the download


def test_range_reads(container: _Container, packages: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    url = container.put("adder.neuropod", packages["zip"])
    # Chunks smaller than the blob: it is read in ranges, in parallel.
    monkeypatch.setattr(storage.stores, "CHUNK", 256)
    assert len(packages["zip"]) > 4 * storage.stores.CHUNK
    ranged: list[int] = []
    copy_ranges = storage.transfer._copy_ranges
    monkeypatch.setattr(storage.transfer, "_copy_ranges", lambda *a, **k: ranged.append(1) or copy_ranges(*a, **k))
    assert storage.fetch(url).read_bytes() == packages["zip"]
    assert ranged, "not read in ranges"


def test_a_missing_object_prefix_or_container_names_the_url(container: _Container) -> None:
    with pytest.raises(PackageError, match=rf"^No Neuropod package at az://{container.name}/nope\.neuropod: no such "
                       "object"):  # fmt: skip
        neuropod.load_neuropod(f"az://{container.name}/nope.neuropod")
    with pytest.raises(PackageError, match=rf"^No Neuropod package at az://{container.name}/models/nope/: no such "
                       "object"):  # fmt: skip
        neuropod.load_neuropod(f"az://{container.name}/models/nope/")
    with pytest.raises(PackageError, match=r"^No Neuropod package at az://no-such-container/adder\.neuropod: the "
                       "container 'no-such-container' does not exist"):  # fmt: skip
        neuropod.load_neuropod("az://no-such-container/adder.neuropod")


def test_the_command_takes_az_urls(container: _Container, packages: dict[str, Any]) -> None:
    url = container.put("adder.neuropod", packages["zip"])

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "neuropod", *args], capture_output=True, text=True,
                              env=os.environ.copy(), timeout=120)  # fmt: skip

    r = run("inspect", url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"Package:   {url} (downloaded to ") and "Name:      demo_adder" in r.stdout
    r = run("test", url)
    assert r.returncode == 0 and "PASSED" in r.stdout, r.stderr
    assert "downloading" not in r.stderr  # the download the first command made
    r = run("inspect", f"az://{container.name}/nope.neuropod")
    assert r.returncode == 2 and f"No Neuropod package at az://{container.name}/nope.neuropod" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


_LOAD_WITH_OPTIONS = textwrap.dedent("""
    import sys
    import numpy as np
    import neuropod
    with neuropod.load_neuropod(sys.argv[1], storage_options={"connection_string": sys.argv[2]}) as m:
        x = np.array([[1, 2], [3, 4]], np.float32)
        print("out", m.infer({"x": x, "y": x})["out"].tolist())
""")


def test_storage_options_give_the_connection_string(container: _Container, packages: dict[str, Any]) -> None:
    """``storage_options={"connection_string": ...}`` instead of AZURE_STORAGE_CONNECTION_STRING (in a
    process of its own: fsspec keeps filesystems made with the variable set)."""
    url = container.put("adder.neuropod", packages["zip"])
    env = {k: v for k, v in os.environ.items() if k != "AZURE_STORAGE_CONNECTION_STRING"}
    r = subprocess.run([sys.executable, "-c", _LOAD_WITH_OPTIONS, url, container.connection], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "out [[4.0, 8.0], [12.0, 16.0]]" in r.stdout, (r.stdout, r.stderr)
