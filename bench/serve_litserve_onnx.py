"""LitServe serving ONNX models with onnxruntime, the way its documentation shows (for bench_serve.py).

    python serve_litserve_onnx.py --port P MODEL=PATH.onnx ...

Runs inside a venv holding litserve and onnxruntime (bench_serve.py's
``--litserve-venv``). Each model is a ``LitAPI`` at ``/predict/MODEL``: LitServe's
own JSON API, not the Open Inference Protocol, since that is what its users
write. A request is a JSON object of input name to nested lists
(``{"x": [[0.1, 0.2]], "y": [[0.3, 0.4]]}``), decoded with one ``np.asarray``
per input; the answer is ``{"OUTPUT": nested lists}``. LitServe's defaults
otherwise: one inference worker process per model on the CPU, fed by the API
server process through queues, no batching.
"""

from __future__ import annotations

import argparse
from typing import Any

import litserve as ls
import numpy as np
import onnxruntime as ort


class OnnxAPI(ls.LitAPI):
    """One onnxruntime session per inference worker."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(api_path=f"/predict/{name}")
        self.path = path

    def setup(self, device: str) -> None:
        self.session = ort.InferenceSession(self.path, providers=["CPUExecutionProvider"])
        self.output = self.session.get_outputs()[0].name

    # Unannotated, as LitServe's examples write it: it reads the request's type from the annotation.
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        return {name: np.asarray(value, dtype=np.float32) for name, value in request.items()}

    def predict(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run([self.output], inputs)[0]

    def encode_response(self, output: np.ndarray) -> dict[str, Any]:
        return {self.output: output.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("models", nargs="+", metavar="MODEL=PATH")
    args = parser.parse_args()
    apis = [OnnxAPI(*m.split("=", 1)) for m in args.models]
    server = ls.LitServer(apis, accelerator="cpu")
    server.run(host="127.0.0.1", port=args.port, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
