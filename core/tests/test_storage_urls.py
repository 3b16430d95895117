"""Package URLs without any store: which URLs are packages, what messages show of them, and a
missing extra. (Downloads from a real S3 server and a web server: test_storage.py.)"""

from __future__ import annotations

import sys
from typing import Any

import pytest

import neuropod
from neuropod import storage
from neuropod.errors import PackageError, PluginNotInstalledError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("s3://bucket/adder.neuropod", True),
        ("S3://bucket/models/adder/", True),
        ("gs://bucket/adder.zip", True),
        ("az://container/adder.neuropod", True),
        ("abfss://container@account.dfs.core.windows.net/adder/", True),
        ("https://example.com/models/adder.neuropod", True),
        ("https://example.com/models/adder.zip?X-Amz-Signature=abc", True),
        ("http://127.0.0.1:8000/models/adder.ZIP", True),
        # Models on an inference server, not packages:
        ("https://example.com:8000/demo_adder", False),
        ("http://127.0.0.1:8000/v2/models/adder", False),
        ("grpc://127.0.0.1:8001/adder", False),
        ("/models/adder.neuropod", False),
        ("ftp://example.com/adder.neuropod", False),
        (["s3://bucket/a.neuropod"], False),
        (None, False),
    ],
)
def test_which_urls_are_packages(value: Any, expected: bool) -> None:
    assert storage.is_package_url(value) is expected


def test_messages_show_no_credentials_nor_query() -> None:
    url = "https://user:secret@example.com:8443/m/adder.zip?X-Amz-Signature=s3cr3t#frag"
    assert storage.shown(url) == "https://example.com:8443/m/adder.zip"
    assert storage.shown("S3://bucket/models/adder/") == "s3://bucket/models/adder/"


def test_a_missing_filesystem_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if fsspec were not installed
    with pytest.raises(PluginNotInstalledError, match=r"s3://bucket/adder\.neuropod needs fsspec and s3fs: "
                       r"pip install 'neuropod\[s3\]'"):  # fmt: skip
        neuropod.load_neuropod("s3://bucket/adder.neuropod")
    with pytest.raises(PluginNotInstalledError, match=r"pip install 'neuropod\[gcs\]'"):
        storage.fetch("gs://bucket/adder.neuropod")
    with pytest.raises(PluginNotInstalledError, match=r"https://example\.com/adder\.zip needs fsspec and aiohttp: "
                       r"pip install 'neuropod\[http\]'") as e:  # fmt: skip
        storage.fetch("https://user:secret@example.com/adder.zip?sig=1")
    assert "secret" not in str(e.value) and "sig" not in str(e.value)


def test_storage_options_belong_to_package_urls(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="storage_options applies to package URLs"):
        neuropod.load_neuropod(str(tmp_path / "adder.neuropod"), storage_options={"anon": True})
    with pytest.raises(PackageError, match="is not a package URL"):
        storage.fetch("https://example.com:8000/demo_adder")
    with pytest.raises(TypeError, match="storage_options must be a dict"):
        storage.fetch("s3://bucket/adder.neuropod", storage_options=["anon"])  # type: ignore[arg-type]
