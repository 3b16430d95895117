"""The core's side of remote models: URLs are recognised and handed to the handler of their
scheme (the ``neuropod.remotes`` entry points); without one, loading says what to install."""

from __future__ import annotations

import re
from typing import Any

import pytest

import neuropod
from neuropod import plugins, remote
from neuropod.errors import NeuropodError, PluginNotInstalledError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("grpc://host:8001/m", True),
        ("HTTPS://host/m", True),
        (["grpc://a/m", "http://b/m"], True),
        (("grpc://a/m",), True),
        ("model.neuropod", False),
        ("./grpc:/x", False),
        ("C:\\models\\m.neuropod", False),
        ([], False),
        (["grpc://a/m", "local.neuropod"], False),
        (42, False),
    ],
)
def test_what_counts_as_remote(value: Any, expected: bool) -> None:
    assert remote.is_remote(value) is expected


class _EntryPoint:
    """An entry point as importlib-metadata lists it: a name, a value, and load()."""

    def __init__(self, name: str, value: str, target: Any) -> None:
        self.name, self.value, self._target = name, value, target

    def load(self) -> Any:
        return self._target


def test_without_a_handler_loading_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "_handlers", dict)
    for url in ("grpc://127.0.0.1:8001/adder", "https://gpu-pool/adder"):
        with pytest.raises(PluginNotInstalledError, match=re.escape(plugins.pip_install("'neuropod-serving[client]'"))):
            neuropod.load_neuropod(url)
    with pytest.raises(PluginNotInstalledError, match="No handler for kafka:// model URLs.*installed schemes: none"):
        neuropod.load_neuropod("kafka://broker/model")


def test_the_handler_of_the_scheme_gets_the_urls_and_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, dict[str, Any]]] = []

    def handler(urls: Any, **options: Any) -> str:
        calls.append((urls, options))
        return "a model"

    eps = {s: _EntryPoint(s, "company_remote:load", handler) for s in ("corp", "corps")}
    monkeypatch.setattr(remote, "_handlers", lambda: eps)
    assert neuropod.load_neuropod("corp://host/m", timeout=3, token="x") == "a model"
    assert neuropod.load_neuropod(["CORP://a/m", "corps://b/m"]) == "a model"
    # verify= has nothing to check remotely; a None timeout is no option at all.
    assert calls == [("corp://host/m", {"timeout": 3, "token": "x"}), (["CORP://a/m", "corps://b/m"], {})]


def test_options_of_local_models_are_refused_for_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "_handlers", lambda: {"corp": _EntryPoint("corp", "x:y", lambda u, **o: u)})
    for option, value in (("device", "cuda:0"), ("backend", "onnx"), ("use_ope", True), ("workers", 2), ("restart", True)):
        with pytest.raises(ValueError, match=f"{option}=.* does not apply to a remote model"):
            neuropod.load_neuropod("corp://h/m", **{option: value})


def test_schemes_from_different_plugins_are_not_mixed(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = {"a": _EntryPoint("a", "one:load", None), "b": _EntryPoint("b", "two:load", None)}
    monkeypatch.setattr(remote, "_handlers", lambda: eps)
    with pytest.raises(NeuropodError, match="different plugins"):
        neuropod.load_neuropod(["a://h/m", "b://h/m"])


def test_remote_error_is_a_neuropod_error() -> None:
    e = neuropod.RemoteError("Remote model grpc://h/m: no answer", url="grpc://h/m", code="deadline_exceeded")
    assert isinstance(e, NeuropodError) and e.url == "grpc://h/m" and e.code == "deadline_exceeded"
    assert e.server_message is None


def test_explain_and_infer_of_a_url_from_another_plugin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    """A third-party handler's model without status(): explain says so (not 'no server ready');
    infer says where the model ran."""
    np = pytest.importorskip("numpy")
    from neuropod.backend import Backend
    from neuropod.cli import main
    from neuropod.spec import parse_spec

    class Model:
        name, platform = "m", "corp"
        backend = Backend(platform="corp", version="1", framework="", location="remote: corp://h")
        device = "cpu"
        inputs = tuple(parse_spec([{"name": "x", "dtype": "float32", "shape": [2]}], "m"))
        outputs = inputs

        def infer(self, inputs: Any, requested_outputs: Any = None) -> Any:
            return {"x": inputs["x"] * 2}

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(remote, "_handlers", lambda: {"corp": _EntryPoint("corp", "x:y", lambda u, **o: Model())})
    assert main(["explain", "--quiet-spec", "corp://h/m"]) == 0
    assert "reports no per-server status" in capsys.readouterr().out
    np.save(tmp_path / "x.npy", np.array([1, 2], np.float32))
    assert main(["infer", "corp://h/m", "--input", f"x={tmp_path / 'x.npy'}"]) == 0
    out = capsys.readouterr().out
    assert "with corp==1 on cpu (remote: corp://h)" in out and "[2., 4.]" in out


def test_a_mistyped_scheme_names_the_known_ones_instead_of_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = {s: _EntryPoint(s, "neuropod_serving.client:load", None) for s in (*remote.CLIENT_SCHEMES, "corp")}
    monkeypatch.setattr(remote, "_handlers", lambda: eps)
    with pytest.raises(NeuropodError) as e:
        neuropod.load_neuropod("grpcc://host:8001/m")
    assert str(e.value) == ("Model URL 'grpcc://host:8001/m': unknown scheme grpcc://; the known schemes are "
                            "corp, grpc, grpcs, http, https (did you mean grpc://?)")  # fmt: skip
    assert isinstance(e.value, ValueError) and not isinstance(e.value, PluginNotInstalledError)
    with pytest.raises(NeuropodError, match=r"unknown scheme s3://; the known schemes are corp, grpc, grpcs, http, https$"):
        neuropod.load_neuropod(["grpc://a/m", "s3://bucket/m"])
