"""The proxy is transparent: the backend conformance suite, run through `neuropod serve` and a remote load.

:class:`neuropod.testing.BackendConformance` packages real ONNX models and
asserts what every backend must do (every dtype, symbols, requested outputs,
bad inputs, closing, threads). Here each model it loads is served by the real
server (REST and gRPC on their own threads, in this process) and loaded back
by URL, so the same assertions run on a :class:`RemoteModel`; every call is
also run on the package loaded in-process, and the two outputs must be
identical (dtype, shape and every bit).

What differs, by design: the remote model's ``backend`` is the server's
backend seen from here (same platform and version; plugin ``"remote"``, its
location the server's URL), so :meth:`_backend` says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("grpc")

import neuropod
from neuropod.backend import Backend
from neuropod.testing import ALL_DTYPES, BackendConformance
from neuropod_serving import __version__
from neuropod_serving.client import RemoteBackend
from neuropod_serving.server import Engine, ModelRegistry, create_app
from neuropod_serving.server.grpc_server import start_grpc_server

from conftest import onnx_package, serve_in_thread


class _ThroughTheServer(BackendConformance):
    platform = "onnx"
    distribution = "neuropod-onnx"
    framework_modules = ("onnxruntime", "onnx")
    dtypes = ALL_DTYPES
    protocol: ClassVar[str]

    def make_package(
        self, tmp_path: Path, name: str, input_spec: list[dict[str, Any]], output_spec: list[dict[str, Any]],
        **packager_kwargs: Any,
    ) -> Path:
        """One ONNX Identity node per input/output pair (as the ONNX plugin's own suite does)."""
        from onnx import helper

        return onnx_package(
            tmp_path / name, name, [helper.make_node("Identity", [i["name"]], [o["name"]]) for i, o in zip(input_spec, output_spec)],
            [(s["name"], s["dtype"], s["shape"]) for s in input_spec],
            [(s["name"], s["dtype"], s["shape"]) for s in output_spec], **packager_kwargs,
        )  # fmt: skip

    def make_accumulator_package(self, tmp_path: Path, name: str, **packager_kwargs: Any) -> Path:
        pytest.skip(
            "a remote model's sequences keep their state on the server (no seq.state(), no use_ope): "
            "test_remote_sequences.py and test_sequence_protocol.py run them through the server"
        )

    @pytest.fixture(autouse=True)
    def _servers(self) -> Iterator[None]:
        self._stack = contextlib.ExitStack()
        self._location = ""
        with self._stack:
            yield

    def _serve(self, path: Path) -> str:
        """Serve ``path`` for the rest of the test; the URL of its model over this class's protocol."""
        engine = Engine(ModelRegistry.load([path]))
        self._stack.callback(engine.close)
        if self.protocol == "grpc":
            server, port = start_grpc_server(engine, "127.0.0.1:0")
            self._stack.callback(server.stop, None)
        else:
            port = self._stack.enter_context(serve_in_thread(create_app(engine)))
        self._location = f"remote: {self.protocol}://127.0.0.1:{port}"
        return f"{self.protocol}://127.0.0.1:{port}/{next(iter(engine.registry)).name}"

    def _load(self, path: Path, **options: Any) -> Any:
        local = neuropod.load_neuropod(path, device=self.device, backend=self.platform)
        self._stack.callback(local.close)
        if options:  # the local load takes no such option either; the remote one must refuse it too
            with pytest.raises(neuropod.NeuropodError) as local_error:
                neuropod.load_neuropod(path, **options)
        remote = neuropod.load_neuropod(self._serve(path), **options)
        if options:
            assert local_error.value is not None
        through = remote.infer

        def infer(inputs: Any, requested_outputs: Any = None) -> dict[str, np.ndarray]:
            out = through(inputs, requested_outputs)
            here = local.infer(inputs, requested_outputs)
            assert list(out) == list(here)
            for name, got in out.items():
                want = here[name]
                assert got.shape == want.shape and got.dtype.kind == want.dtype.kind, name
                if got.dtype.kind in "OU":
                    assert got.tolist() == want.tolist(), name
                else:
                    assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
            return out

        remote.infer = infer  # the suite's calls run remotely, each compared with the in-process answer
        return remote

    def _backend(self) -> Backend:
        here = super()._backend()
        return RemoteBackend(platform=here.platform, version=here.version, framework="", plugin="remote",
                             plugin_distribution=f"neuropod-serving {__version__}", location=self._location)  # fmt: skip


class TestThroughGrpc(_ThroughTheServer):
    protocol = "grpc"


class TestThroughRest(_ThroughTheServer):
    protocol = "http"
