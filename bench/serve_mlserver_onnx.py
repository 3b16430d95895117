"""An MLServer runtime that runs an ONNX model with onnxruntime (MLServer ships none for ONNX).

Used by bench_serve.py only, inside MLServer's own venv: ``model-settings.json``
names ``serve_mlserver_onnx.OnnxRuntime`` as its implementation and
``parameters.uri`` the ``.onnx`` file. It does what MLServer's own runtimes
(sklearn, xgboost) do: decode every input with ``NumpyCodec``, run, and
encode every output with ``NumpyCodec``. The session gets onnxruntime's
default options, as neuropod's ONNX backend does when given none.
"""

from __future__ import annotations

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxRuntime(MLModel):
    """One ``InferenceSession`` per model (per parallel worker when MLServer runs them)."""

    async def load(self) -> bool:
        path = await get_model_uri(self._settings, wellknown_filenames=["model.onnx"])
        self._session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self._output_names = [o.name for o in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        wanted = [o.name for o in payload.outputs] if payload.outputs else self._output_names
        results = self._session.run(wanted, feeds)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            id=payload.id,
            outputs=[NumpyCodec.encode_output(n, r) for n, r in zip(wanted, results)],
        )
