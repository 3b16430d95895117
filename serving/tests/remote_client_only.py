"""The issue's "done when", run by `nox -s tests_client_only` in a venv that holds only
``neuropod`` and ``neuropod-serving[client]``: a model served by ``neuropod serve``
(from another venv) is loaded by URL and gives the right answer, with no framework
and no server library installed here.

Usage: python remote_client_only.py GRPC_URL HTTP_URL
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np

import neuropod

# Nothing of a framework or of the server side is installed in this venv.
for module in ("onnxruntime", "onnx", "torch", "tensorflow", "starlette", "uvicorn", "prometheus_client", "orjson"):
    assert importlib.util.find_spec(module) is None, f"{module} is installed in the client-only venv"

x = np.array([[1, 2], [3, 4]], np.float32)
y = np.array([[10, 20], [30, 40]], np.float32)
for url in sys.argv[1:]:
    with neuropod.load_neuropod(url) as model:
        out = model.infer({"x": x, "y": y})
        np.testing.assert_array_equal(out["out"], (x + y) * 2)
        print(f"ok: {url}: {model.backend.id} on {model.device}: {out['out'].tolist()}")
        try:
            model.infer({"x": x, "y": y[:1]})
        except neuropod.SpecError as e:
            print(f"ok: checked before sending: {e}")
        else:
            raise AssertionError("a batch mismatch was not refused")
assert "onnxruntime" not in sys.modules
