"""Package URLs that carry a query: which part of it names the package (``?version=3``) and which
only signs the URL (a presigned URL's ``X-Amz-Signature``, an Azure SAS token's ``sig``...), and
that a signature never shows in a log line, an error or the command's output.

The web-server tests load real ONNX packages (``out = x + y`` and ``out = x - y``, expected values
from numpy) from a local web server; ``nox -s tests_storage`` installs what they need.
"""

from __future__ import annotations

import io
import logging
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import neuropod
from _web_server import Site, web_server
from neuropod import storage
from neuropod.cli import main
from neuropod.errors import PackageError

X = np.array([[1, 2], [3, 4]], np.float32)
Y = np.array([[7, 9], [9, 10]], np.float32)
SECRETS = ("AWSSIGSECRET", "AWSCREDSECRET", "SASSIGSECRET", "userpass")
#: A presigned S3 URL's query and an Azure SAS token, both in one URL.
SIGNED = ("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AWSCREDSECRET%2F20260101%2Fus-east-1%2Fs3&"
          "X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Signature=AWSSIGSECRET&"
          "sv=2022-11-02&sr=b&sp=r&se=2030-01-01T00%3A00%3A00Z&sig=SASSIGSECRET")  # fmt: skip


# --- the download key and redaction, without a store ----------------------------------------------


def test_the_query_names_the_package_but_its_signature_does_not() -> None:
    key = storage.urls.download_url
    base = "https://host/m/download.zip"
    assert key(f"{base}?version=3") != key(f"{base}?version=4")
    assert key(base) == storage.shown(base) == key("https://user:pw@host/m/download.zip#frag")
    # Signed again (another signature, date, expiry, SAS token): the same package.
    assert key(f"{base}?version=3&{SIGNED}") == key(f"{base}?version=3") == f"{base}?version=3"
    again = SIGNED.replace("SECRET", "OTHER").replace("20260101", "20260202")
    assert key(f"{base}?version=3&{again}") == key(f"{base}?version=3&{SIGNED}")
    assert key(f"{base}?X-Goog-Signature=a&X-Goog-Date=1&generation=7") == f"{base}?generation=7"
    cloudfront = "Expires=1767225600&Signature=abc~def&Key-Pair-Id=K2JCJMDEHXQW5F"
    assert key(f"{base}?{cloudfront}") == base
    # Azure's names are signing parameters only beside a SAS signature; elsewhere they name content.
    assert key(f"{base}?sp=2&st=a") == f"{base}?sp=2&st=a"
    assert key(f"{base}?Expires=5") == f"{base}?Expires=5"


def test_every_url_in_a_message_is_redacted() -> None:
    text = ("ClientResponseError: 500, message='Internal Server Error', "
            f"url='https://user:userpass@host:8443/m/a.zip?{SIGNED}' (then URL('s3://b/k?X-Amz-Signature=AWSSIGSECRET')), "
            "query ?sig=SASSIGSECRET&version=3")  # fmt: skip
    shown = storage.urls.redact(text)
    assert not [s for s in SECRETS if s in shown], shown
    assert "url='https://host:8443/m/a.zip' (then URL('s3://b/k'))" in shown, shown
    assert shown.endswith("query ?sig=...&version=3"), shown
    assert storage.urls.redact("no URL here: a=1") == "no URL here: a=1"
    # A URL taken for a path, its // collapsed: still without its query.
    assert (
        storage.urls.redact("https:/host/m/download?sig=SASSIGSECRET: no such file")
        == "https:/host/m/download: no such file"
    )


# --- a web server ---------------------------------------------------------------------------------


def _adder_zip(op: str) -> bytes:
    """A package whose model is ``out = x <op> y``, zipped without compression (the two packages
    have the same size, so that their validators can coincide)."""
    pytest.importorskip("neuropod_onnx", reason="needs neuropod-onnx and onnxruntime")
    pytest.importorskip("onnxruntime", reason="needs onnxruntime")
    from onnx import TensorProto, helper

    from neuropod.packagers import create_onnx_neuropod

    spec = [{"name": n, "dtype": "float32", "shape": ["batch", 2]} for n in ("x", "y")]
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "y"], ["out"])], "adder",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 2]) for n in ("x", "y")],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 2])],
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        package = create_onnx_neuropod(
            Path(tmp) / "adder", "adder", spec, [{"name": "out", "dtype": "float32", "shape": ["batch", 2]}],
            onnx_model=helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
        )  # fmt: skip
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
            for path in sorted(Path(package).rglob("*")):
                if path.is_file():
                    info = zipfile.ZipInfo(path.relative_to(package).as_posix(), (2026, 1, 1, 0, 0, 0))
                    zf.writestr(info, path.read_bytes())
        return buf.getvalue()


@pytest.fixture(scope="module")
def versions() -> dict[str, bytes]:
    pytest.importorskip("aiohttp", reason="needs neuropod[http] (nox -s tests_storage installs it)")
    found = {"3": _adder_zip("Add"), "4": _adder_zip("Sub")}
    assert len(found["3"]) == len(found["4"]) and found["3"] != found["4"]
    return found


@pytest.fixture
def web(versions: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``/download.zip?version=N``: version N's zip, every version with the same ETag and
    Last-Modified (a server whose validators do not tell versions apart); ``/fail.zip`` answers
    its HEAD and then 500 to every GET, ``/denied.zip`` 403, ``/flaky.zip`` 500 to its first GET then version 3."""
    monkeypatch.setenv("NEUROPOD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(storage.transfer, "FIRST_WAIT_S", 0.01)
    site = Site(
        files={"download.zip": versions["3"], "flaky.zip": versions["3"], "fail.zip": versions["3"]},
        versions={"download.zip": versions}, status={"denied.zip": 403}, fail_gets={"fail.zip"}, flaky={"flaky.zip": 1},
        etag='"same-for-every-version"', last_modified="Thu, 01 Jan 2026 00:00:00 GMT",
    )  # fmt: skip
    try:
        with web_server(site) as base:
            yield base
    finally:
        logger = logging.getLogger("neuropod.storage")
        for h in [h for h in logger.handlers if getattr(h, "_neuropod_cli", False)]:  # the command's, on stderr
            logger.removeHandler(h)


def _downloads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "neuropod.storage" and r.getMessage().startswith("downloading ")
    ]


def test_urls_that_differ_in_their_query_are_different_packages(web: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "neuropod.storage")
    with neuropod.load_neuropod(f"{web}/download.zip?version=3") as model:
        np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)
    with neuropod.load_neuropod(f"{web}/download.zip?version=4") as model:
        np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X - Y)
    assert len(_downloads(caplog)) == 2
    # The same version again, presigned twice over: the download made first, not read again.
    for signed in (SIGNED, SIGNED.replace("SECRET", "RESIGNED")):
        with neuropod.load_neuropod(f"{web}/download.zip?version=3&{signed}") as model:
            np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)
    assert len(_downloads(caplog)) == 2, _downloads(caplog)


def _no_secret(text: str) -> None:
    found = [s for s in SECRETS if s in text]
    assert not found, f"{found} in: {text}"


def test_signatures_show_in_no_log_line_nor_error_of_a_load(web: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    base = web.replace("://", "://user:userpass@")
    with neuropod.load_neuropod(f"{base}/flaky.zip?{SIGNED}") as model:  # a 500, retried
        np.testing.assert_array_equal(model.infer({"x": X, "y": Y})["out"], X + Y)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("retrying" in w and "/flaky.zip" in w for w in warnings), warnings
    for name in ("fail", "denied"):
        with pytest.raises(PackageError) as e:
            neuropod.load_neuropod(f"{base}/{name}.zip?{SIGNED}")
        assert f"{web}/{name}.zip" in str(e.value), e.value
        _no_secret(str(e.value))
    assert [r for r in caplog.records if "retrying" in r.getMessage() and "/fail.zip" in r.getMessage()]
    _no_secret(caplog.text)


@pytest.mark.parametrize("command", [["inspect"], ["test"], ["infer", "--input", "x=x.npy", "--input", "y=y.npy"]])
def test_signatures_show_nowhere_in_the_commands_output(
    web: str, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    np.save("x.npy", X)
    np.save("y.npy", Y)
    for name in ("flaky", "fail", "denied"):
        code = main([command[0], f"{web}/{name}.zip?{SIGNED}", *command[1:]], out=io.StringIO())
        err = capsys.readouterr().err
        _no_secret(err)
        if name == "flaky":
            assert "retrying" in err, err
        else:
            assert code == 2 and "error: " in err and f"{web}/{name}.zip" in err, err
    # --debug's traceback carries the HTTP client's exception text, URL and all: redacted too.
    code = main(["--debug", command[0], f"{web}/fail.zip?{SIGNED}", *command[1:]], out=io.StringIO())
    err = capsys.readouterr().err
    assert code == 2 and "Traceback (most recent call last)" in err, err
    _no_secret(err)


def test_the_download_record_holds_no_query(web: str) -> None:
    storage.fetch(f"{web}/download.zip?version=4&{SIGNED}")
    records = list(storage.downloads_dir().glob("*/record.json"))
    assert len(records) == 1
    text = records[0].read_text()
    _no_secret(text)
    assert f'"url": "{web}/download.zip"' in text, text
