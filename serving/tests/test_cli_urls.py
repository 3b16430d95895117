"""The `neuropod` commands that take a remote model's URL (inspect, explain, infer, test), run against
a real `neuropod serve` that requires a bearer token: --auth-token-file, exit statuses, mistyped
schemes, and what `test` says about URLs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")

from neuropod.cli import main
from neuropod.errors import PackageError
from neuropod.loader import load_neuropod
from neuropod.testing import Served, served

from conftest import adder_and_echo, free_port, private_caches

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("cli-urls")
    with private_caches(root):
        adder_and_echo(root / "models", echo_as_zip=False)
        (root / "token").write_text(TOKEN + "\n")
        (root / "wrong").write_text("not-the-token\n")
        (root / "empty").write_text("\n\n")
        yield root


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Served]:
    with served(root / "models", options=["--auth-token-file", str(root / "token")]) as s:
        yield s


def _urls(server: Served, model: str = "adder") -> list[str]:
    return [f"grpc://{server.grpc}/{model}", f"{server.http}/{model}"]


def test_inspect_and_explain_send_the_token_from_the_file(
    root: Path, server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    token = ["--auth-token-file", str(root / "token")]
    for url in _urls(server):
        assert main(["inspect", url, *token]) == 0
        out = capsys.readouterr().out
        assert "Model:     adder at " in out and "model ready" in out and "batch_size" in out
        assert main(["inspect", "--json", url, *token]) == 0
        assert json.loads(capsys.readouterr().out)["servers"][0]["ready"] is True
        assert main(["explain", url, *token]) == 0
        out = capsys.readouterr().out
        assert "Inputs:" in out and "served by 1 of 1 server(s)" in out


def test_without_the_token_or_with_a_wrong_one_the_commands_fail_with_status_2(
    root: Path, server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    for url in _urls(server):
        for extra in ([], ["--auth-token-file", str(root / "wrong")]):
            for command in ("inspect", "explain"):
                # Refused is an error (2), not "no server has it" (explain's 1).
                assert main([command, url, *extra]) == 2
                err = capsys.readouterr().err
                assert f"neuropod {command}: error: " in err and "refused the call's credentials" in err
                # Without a token the message says how the command sends one; with a wrong one, not again.
                assert ("pass the token with --auth-token-file FILE" in err) is (extra == [])


def test_infer_sends_the_token_and_returns_the_servers_outputs(
    root: Path, server: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.array([[1.5, 2.0], [3.0, 4.0]], np.float32)
    y = np.array([[10.0, 20.0], [30.0, 40.0]], np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    inputs = ["--input", f"x={tmp_path / 'x.npy'}", "--input", f"y={tmp_path / 'y.npy'}"]
    for i, url in enumerate(_urls(server)):
        out_dir = tmp_path / f"out{i}"
        args = ["infer", url, *inputs, "--auth-token-file", str(root / "token"), "--output-dir", str(out_dir)]
        assert main(args) == 0
        assert "(remote: " in capsys.readouterr().out
        np.testing.assert_array_equal(np.load(out_dir / "out.npy"), np.array([[11.5, 22], [33, 44]], np.float32))
        np.testing.assert_array_equal(np.load(out_dir / "doubled.npy"), np.array([[23, 44], [66, 88]], np.float32))
        assert main(["infer", url, *inputs]) == 2
        assert "pass the token with --auth-token-file FILE" in capsys.readouterr().err
        # The file's token is what load_neuropod(auth_token=) sends: the same outputs from Python.
        with load_neuropod(url, auth_token=TOKEN) as model:
            np.testing.assert_array_equal(model.infer({"x": x, "y": y})["out"], x + y)


def test_a_token_file_that_cannot_give_a_token_is_a_clear_error(
    root: Path, server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _urls(server)[0]
    (root / "latin1").write_bytes(b"caf\xe9\n")
    for path, why in ((root / "empty", "is empty; put the token on its first line"),
                      (root / "missing", "cannot be read: No such file or directory"),
                      (root, "cannot be read: Is a directory"),
                      (root / "latin1", "cannot be read: not UTF-8 text (invalid continuation byte)"),
                      (Path("/dev/zero"), "is larger than 64 KiB; it should hold the token on its first line")):  # fmt: skip
        assert main(["inspect", url, "--auth-token-file", str(path)]) == 2
        assert why in capsys.readouterr().err
    # A local package has no server to send it to.
    for command in ("inspect", "explain"):
        assert main([command, str(root / "models" / "adder"), "--auth-token-file", str(root / "token")]) == 2
        assert "--auth-token-file applies to a remote model's URL" in capsys.readouterr().err


def test_explain_exits_1_when_no_server_has_the_model(
    root: Path, server: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the CLI's convention (explain: 1 when nothing can run it) and the remote models guide say."""
    token = ["--auth-token-file", str(root / "token")]
    for url in (f"grpc://127.0.0.1:{free_port()}/adder", f"http://127.0.0.1:{free_port()}/adder",
                *_urls(server, "nosuchmodel")):  # fmt: skip
        assert main(["explain", url, *token]) == 1
        captured = capsys.readouterr()
        assert "No server has the model ready: calls would fail." in captured.out and captured.err == ""
        assert ("cannot reach the server" if "nosuchmodel" not in url else "does not serve this model") in captured.out
    guide = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "remote.md"
    if guide.is_file():  # a checkout (the guide's own example runs this too, under nox -s docs)
        assert "ready (exit status 1 when none has)" in " ".join(guide.read_text().split())


def test_test_of_a_url_says_what_test_does(server: Served, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["test", _urls(server)[0]]) == 2
    err = capsys.readouterr().err
    assert "is a remote model; `neuropod test` runs the test data bundled in a package" in err
    assert "neuropod infer URL --input NAME=FILE.npy" in err and "No Neuropod package" not in err


def test_a_mistyped_scheme_lists_the_known_ones(server: Served, capsys: pytest.CaptureFixture[str]) -> None:
    port = server.grpc.rsplit(":", 1)[1]
    assert main(["inspect", f"grpcc://127.0.0.1:{port}/adder"]) == 2
    err = capsys.readouterr().err
    assert (f"Model URL 'grpcc://127.0.0.1:{port}/adder': unknown scheme grpcc://; the known schemes are "
            "grpc, grpcs, http, https (did you mean grpc://?)") in err  # fmt: skip
    assert "pip install" not in err
    with pytest.raises(PackageError, match=r"unknown scheme ftp://; the known schemes are grpc, grpcs, http, https$"):
        load_neuropod("ftp://host/m")
