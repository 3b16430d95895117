"""A model repository in a bucket (``neuropod serve s3://bucket/models/``), polled while it
serves: a real S3 server (moto's, on 127.0.0.1) driven through s3fs as a user's server reaches
S3, with its endpoint and credentials from the environment (AWS_ENDPOINT_URL and friends).

A version added to the bucket is picked up within the poll interval and served by its number;
a broken one is listed with its reason while the others keep serving; a removed one is unloaded
once the request running on it finished. ``nox -s tests_storage`` installs what these need.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("s3fs", reason="needs neuropod[s3] (nox -s tests_storage installs it)")
moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (nox -s tests_storage installs it)")
pytest.importorskip("uvicorn")
pytest.importorskip("neuropod_python")
httpx = pytest.importorskip("httpx")

from neuropod.errors import PackageError  # noqa: E402
from neuropod_serving.server import ModelRegistry  # noqa: E402
from versions_helpers import (  # noqa: E402
    answer,
    build_scalers,
    expected,
    in_background,
    index,
    infer,
    serve_command,
    serving,
    wait_for,
)  # fmt: skip

from conftest import free_port, private_caches  # noqa: E402

POLL_S = 0.3
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip


@pytest.fixture(scope="module")
def scalers() -> Iterator[dict[int, Path]]:
    root = Path(tempfile.mkdtemp(prefix="neuropod-versions-s3-test-"))
    with private_caches(root):
        yield build_scalers(root / "stage")
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1, and the environment that points s3fs at it."""
    with pytest.MonkeyPatch.context() as mp:
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        for k, v in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
            mp.setenv(k, v)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            yield endpoint
        finally:
            server.stop()


class Bucket:
    def __init__(self, endpoint: str, name: str) -> None:
        import boto3

        self.client = boto3.client("s3", endpoint_url=endpoint)
        self.name = name
        self.client.create_bucket(Bucket=name)

    def put_tree(self, prefix: str, directory: Path) -> None:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                self.client.put_object(Bucket=self.name, Key=f"{prefix}/{path.relative_to(directory).as_posix()}",
                                       Body=path.read_bytes())  # fmt: skip

    def put_zip(self, key: str, directory: Path, *, garble_config: bool = False) -> None:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            for path in sorted(directory.rglob("*")):
                if path.is_file():
                    rel = path.relative_to(directory).as_posix()
                    zf.writestr(rel, b"{not json" if garble_config and rel == "config.json" else path.read_bytes())
        self.client.put_object(Bucket=self.name, Key=key, Body=buf.getvalue())

    def delete_prefix(self, prefix: str) -> None:
        listed = self.client.list_objects_v2(Bucket=self.name, Prefix=prefix).get("Contents", [])
        for obj in listed:
            self.client.delete_object(Bucket=self.name, Key=obj["Key"])


@pytest.fixture
def bucket(s3_endpoint: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    return Bucket(s3_endpoint, "b-" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:16])


def test_a_bucket_repository_is_polled_while_it_serves(bucket: Bucket, scalers: dict[int, Path]) -> None:
    bucket.put_tree("models/scaler/1", scalers[1])  # a package directory as objects
    url = f"s3://{bucket.name}/models/"
    with serving([url], policy="all", poll=POLL_S) as (engine, http):
        assert answer(http) == ("1", expected(1))
        assert engine.registry.get("scaler").where == f"s3://{bucket.name}/models/scaler/1/"

        bucket.put_zip("models/scaler/2/scaler.neuropod", scalers[2])  # a new version, as a zip object
        wait_for("version 2 to serve", lambda: "2" in engine.registry.versions("scaler"))
        assert answer(http, version="2") == ("2", expected(2))
        assert answer(http) == ("2", expected(2))
        assert answer(http, version="1") == ("1", expected(1))

        bucket.put_zip("models/scaler/3/scaler.neuropod", scalers[3], garble_config=True)  # broken
        wait_for("version 3's failure to be listed", lambda: "the last load failed" in index(http).get(("scaler", "3"), {}).get("reason", ""))
        entry = index(http)[("scaler", "3")]
        assert entry["state"] == "UNAVAILABLE" and f"s3://{bucket.name}/models/scaler/3/scaler.neuropod" in entry["reason"]
        assert engine.registry.versions("scaler") == ["1", "2"]
        assert answer(http) == ("2", expected(2))

        slow, out = in_background(lambda: infer(http, version="2", seconds=1.5))
        wait_for("the slow request to run", lambda: engine._runners[("scaler", "2")].gate.running > 0)
        bucket.delete_prefix("models/scaler/2/")
        wait_for("version 2 to stop serving", lambda: engine.registry.versions("scaler") == ["1"])
        assert infer(http, version="2").status_code == 404
        slow.join(30)
        assert out and out[0].status_code == 200 and out[0].json()["outputs"][0]["data"] == expected(2, 1.5), out
        assert answer(http) == ("1", expected(1))


def test_an_unchanged_bucket_is_not_downloaded_again(bucket: Bucket, scalers: dict[int, Path],
                                                      caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    import logging

    bucket.put_tree("models/scaler/1", scalers[1])
    caplog.set_level(logging.INFO, logger="neuropod.storage")
    with serving([f"s3://{bucket.name}/models/"], poll=0.1) as (_, http):
        time.sleep(1.0)  # several polls
        assert answer(http) == ("1", expected(1))
    downloads = [r for r in caplog.records if r.name == "neuropod.storage" and r.getMessage().startswith("downloading")]
    assert len(downloads) == 1, [r.getMessage() for r in downloads]


def test_bucket_repository_errors_name_the_url(bucket: Bucket, s3_endpoint: str) -> None:
    with pytest.raises(PackageError, match=rf"No Neuropod package at s3://{bucket.name}/nothing/"):
        ModelRegistry.load([f"s3://{bucket.name}/nothing/"])
    with pytest.raises(PackageError, match=r"the bucket 'no-such-bucket' does not exist"):
        ModelRegistry.load(["s3://no-such-bucket/models/"])
    bucket.client.put_object(Bucket=bucket.name, Key="other/readme.txt", Body=b"hello")
    with pytest.raises(PackageError, match=rf"s3://{bucket.name}/other/ holds no Neuropod package"):
        ModelRegistry.load([f"s3://{bucket.name}/other/"])


def test_neuropod_serve_takes_a_bucket_url(bucket: Bucket, scalers: dict[int, Path], tmp_path: Path) -> None:
    """The command itself, in its own process: the start-up table lists the bucket's versions."""
    bucket.put_tree("models/scaler/1", scalers[1])
    bucket.put_zip("models/scaler/2/scaler.neuropod", scalers[2])
    with serve_command([f"s3://{bucket.name}/models/", "--version-policy", "all", "--poll-interval", "5"], free_port(),
                       poll=0.2) as served, httpx.Client(base_url=served.http, timeout=30) as http:  # fmt: skip
        assert answer(http, version="1") == ("1", expected(1))
        assert answer(http) == ("2", expected(2))
    assert "scaler (version 1)" in served.output and "scaler (version 2)" in served.output, served.output
