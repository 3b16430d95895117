"""Packages loaded by ``gs://`` URL from a real Google Cloud Storage emulator (gcp-storage-emulator's,
in this process on 127.0.0.1), through gcsfs exactly as a user's load goes.

The emulator is named the way Google's own clients take it, ``STORAGE_EMULATOR_HOST``, with no
credentials: gcsfs then talks to it anonymously. Buckets and objects are made with the emulator's
JSON API directly (urllib), not through gcsfs. Tested: a zip object and a prefix of files (an empty
one among them) load by URL and infer; a second load takes the cached download; a changed object
or file under the prefix is downloaded again; range reads of an object; the store's ``md5Hash``
is the object's MD5 (what lets a first load keep the bytes it read ahead); a missing object,
prefix or bucket is a PackageError naming the URL; ``neuropod inspect gs://...``; and
``storage_options={"endpoint_url": ..., "token": "anon"}`` instead of the environment variable.

Not tested here: credentials and their errors (the emulator takes any request or none).

The model is the ONNX demo (``out = (x + y) * 2``); expected outputs are computed with numpy.
``nox -s tests_storage`` installs what these need; without it they skip.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("gcsfs", reason="needs neuropod[gcs] (nox -s tests_storage installs it)")
emulator = pytest.importorskip("gcp_storage_emulator.server",
                               reason="needs gcp-storage-emulator (nox -s tests_storage installs it)")  # fmt: skip
pytest.importorskip("neuropod_onnx", reason="needs neuropod-onnx and onnxruntime")
pytest.importorskip("onnxruntime", reason="needs onnxruntime")

import neuropod  # noqa: E402
from neuropod import storage  # noqa: E402
from neuropod.errors import PackageError  # noqa: E402

X = np.array([[1, 2], [3, 4]], np.float32)
Y = np.array([[7, 8], [9, 10]], np.float32)
EMPTY = "0/data/empty"  # an empty file of the package, listed in its manifest


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


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """gcp-storage-emulator on a free port of 127.0.0.1, named by STORAGE_EMULATOR_HOST: its URL."""
    with pytest.MonkeyPatch.context() as mp:
        endpoint = f"http://127.0.0.1:{_free_port()}"
        mp.setenv("STORAGE_EMULATOR_HOST", endpoint)
        # No credentials of this machine's (gcsfs tries Google's default ones first): anonymous.
        mp.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        mp.setenv("CLOUDSDK_CONFIG", str(tmp_path_factory.mktemp("gcloud")))
        mp.setenv("NO_GCE_CHECK", "true")  # off GCE, do not wait for its metadata server
        server = emulator.create_server("127.0.0.1", int(endpoint.rsplit(":", 1)[1]), in_memory=True)
        server.start()
        try:
            yield endpoint
        finally:
            server.stop()


@pytest.fixture
def bucket(gcs_server: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Bucket:
    """A fresh bucket in the emulator (and a private cache for the test)."""
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    name = "b-" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:16]
    _request(f"{gcs_server}/storage/v1/b?project=test", json.dumps({"name": name}).encode(), "application/json")
    return _Bucket(name, gcs_server)


def _request(url: str, data: bytes, content_type: str) -> None:
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": content_type})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200, r.read()


class _Bucket:
    def __init__(self, name: str, endpoint: str) -> None:
        self.name, self.endpoint = name, endpoint

    def put(self, key: str, data: bytes) -> str:
        # A multipart upload, the content in base64: the emulator's media upload fails on an empty body.
        body = "\r\n".join([
            "--part", "Content-Type: application/json", "", json.dumps({"name": key}),
            "--part", "Content-Type: application/octet-stream", "Content-Transfer-Encoding: base64", "",
            base64.b64encode(data).decode(), "--part--", "",
        ]).encode()  # fmt: skip
        _request(f"{self.endpoint}/upload/storage/v1/b/{self.name}/o?uploadType=multipart", body,
                 "multipart/related; boundary=part")  # fmt: skip
        return f"gs://{self.name}/{key}"

    def put_tree(self, prefix: str, directory: Path) -> str:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                self.put(f"{prefix}/{path.relative_to(directory).as_posix()}", path.read_bytes())
        return f"gs://{self.name}/{prefix}/"


def _check_demo(model: Any) -> None:
    np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], (X + Y) * 2)


def _downloads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "neuropod.storage" and r.getMessage().startswith("downloading")]


def test_a_zip_object_and_a_prefix_load_by_url(bucket: _Bucket, packages: dict[str, Any]) -> None:
    for url in (bucket.put("models/adder.neuropod", packages["zip"]), bucket.put_tree("models/adder", packages["dir"])):
        with neuropod.load_neuropod(url) as model:
            assert model.name == "demo_adder"
            _check_demo(model)


def test_empty_files_of_a_prefix_are_downloaded(bucket: _Bucket, packages: dict[str, Any]) -> None:
    url = bucket.put_tree("models/adder", packages["dir"])
    local = storage.fetch(url)
    assert (local / EMPTY).is_file() and (local / EMPTY).read_bytes() == b""
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == \
        sorted(p.relative_to(packages["dir"]).as_posix() for p in packages["dir"].rglob("*") if p.is_file())  # fmt: skip
    assert storage.fetch(url) == local  # and the download is complete: reused


def test_a_second_load_takes_the_download(
    bucket: _Bucket, packages: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    url = bucket.put("adder.neuropod", packages["zip"])
    for _ in range(3):
        with neuropod.load_neuropod(url) as model:
            _check_demo(model)
    assert len(_downloads(caplog)) == 1, caplog.text
    entries = [p for p in storage.downloads_dir().iterdir() if len(p.name) == 64]
    assert len(entries) == 1 and (entries[0] / "package.zip").read_bytes() == packages["zip"]
    record = json.loads((entries[0] / "record.json").read_text())
    assert record["url"] == url and record["identity"].get("generation"), record  # what GCS says identifies it
    prefix = bucket.put_tree("models/adder", packages["dir"])
    for _ in range(2):
        with neuropod.load_neuropod(prefix) as model:
            _check_demo(model)
    assert len(_downloads(caplog)) == 2, caplog.text


def test_a_changed_object_is_downloaded_again(
    bucket: _Bucket, packages: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    url = bucket.put("adder.neuropod", packages["zip"])
    with neuropod.load_neuropod(url) as model:
        assert model.name == "demo_adder"
    bucket.put("adder.neuropod", packages["other"])
    with neuropod.load_neuropod(url) as model:
        assert model.name == "demo_adder_v2"
        _check_demo(model)
    assert len(_downloads(caplog)) == 2, caplog.text


def test_a_changed_file_under_a_prefix_is_downloaded_again(
    bucket: _Bucket, packages: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    url = bucket.put_tree("models/adder", packages["dir"])
    with neuropod.load_neuropod(url) as model:
        assert model.name == "demo_adder"
    bucket.put_tree("models/adder", packages["other_dir"])  # the same file names, other config and manifest
    with neuropod.load_neuropod(url) as model:
        assert model.name == "demo_adder_v2"
        _check_demo(model)
    assert len(_downloads(caplog)) == 2, caplog.text


def test_range_reads_and_the_listed_md5(
    bucket: _Bucket, packages: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = bucket.put("adder.neuropod", packages["zip"])
    fs, path = storage.stores.open_filesystem(url, {})
    info = storage.stores.object_info(fs, path, url)
    # GCS's md5Hash is the object's MD5: a first load may keep the chunk it read ahead.
    assert storage.stores.listed_md5(fs, info) == hashlib.md5(packages["zip"], usedforsecurity=False).hexdigest()
    # Chunks smaller than the object: the read-ahead is not all of it, so it is read in ranges, in parallel.
    monkeypatch.setattr(storage.stores, "CHUNK", 256)
    assert len(packages["zip"]) > 4 * storage.stores.CHUNK
    ranged: list[int] = []
    copy_ranges = storage.transfer._copy_ranges
    monkeypatch.setattr(storage.transfer, "_copy_ranges", lambda *a, **k: ranged.append(1) or copy_ranges(*a, **k))
    assert storage.fetch(url).read_bytes() == packages["zip"]
    assert ranged, "not read in ranges"


def test_a_missing_object_prefix_or_bucket_names_the_url(bucket: _Bucket) -> None:
    with pytest.raises(PackageError, match=rf"^No Neuropod package at gs://{bucket.name}/nope\.neuropod: no such object"):
        neuropod.load_neuropod(f"gs://{bucket.name}/nope.neuropod")
    with pytest.raises(PackageError, match=rf"^No Neuropod package at gs://{bucket.name}/models/nope/: no such object"):
        neuropod.load_neuropod(f"gs://{bucket.name}/models/nope/")
    with pytest.raises(PackageError, match=r"^No Neuropod package at gs://no-such-bucket/adder\.neuropod: the bucket "
                       "'no-such-bucket' does not exist"):  # fmt: skip
        neuropod.load_neuropod("gs://no-such-bucket/adder.neuropod")


def test_the_command_takes_gs_urls(bucket: _Bucket, packages: dict[str, Any]) -> None:
    url = bucket.put("adder.neuropod", packages["zip"])

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "neuropod", *args], capture_output=True, text=True,
                              env=os.environ.copy(), timeout=120)  # fmt: skip

    r = run("inspect", url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"Package:   {url} (downloaded to ") and "Name:      demo_adder" in r.stdout
    r = run("test", url)
    assert r.returncode == 0 and "PASSED" in r.stdout, r.stderr
    assert "downloading" not in r.stderr  # the download the first command made
    r = run("inspect", f"gs://{bucket.name}/nope.neuropod")
    assert r.returncode == 2 and f"No Neuropod package at gs://{bucket.name}/nope.neuropod" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


_LOAD_WITH_OPTIONS = textwrap.dedent("""
    import sys
    import numpy as np
    import neuropod
    with neuropod.load_neuropod(sys.argv[1], storage_options={"endpoint_url": sys.argv[2], "token": "anon"}) as m:
        x = np.array([[1, 2], [3, 4]], np.float32)
        print("out", m.infer({"x": x, "y": x})["out"].tolist())
""")


def test_storage_options_name_the_endpoint(bucket: _Bucket, packages: dict[str, Any]) -> None:
    """``storage_options={"endpoint_url": ..., "token": "anon"}`` instead of STORAGE_EMULATOR_HOST.

    gcsfs 2026.x's default filesystem (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT, on by default) asks each
    bucket's layout over gRPC first; with ``token="anon"`` it retries that against the emulator (no
    gRPC) for about a minute per operation. The plain GCSFileSystem is what works with an emulator.
    """
    url = bucket.put("adder.neuropod", packages["zip"])
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    r = subprocess.run([sys.executable, "-c", _LOAD_WITH_OPTIONS, url, bucket.endpoint], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "out [[4.0, 8.0], [12.0, 16.0]]" in r.stdout, (r.stdout, r.stderr)
