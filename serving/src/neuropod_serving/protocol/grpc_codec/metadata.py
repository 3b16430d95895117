"""ModelMetadataResponse messages <-> the REST model metadata body."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from neuropod import _json
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol.metadata import DTYPE_PARAMETER, SHAPE_PARAMETER

#: gRPC metadata key under which a neuropod server's ModelMetadata reply carries
#: the exact spec shapes (symbol names), as JSON ``{"inputs": {name: shape},
#: "outputs": {...}, "parameters": {...}, "bytes": {"inputs": [name...], "outputs": [...]}}``
#: (``bytes``: the BYTES tensors of raw bytes, REST's ``neuropod_dtype``): the proto's TensorMetadata has no
#: ``parameters`` field for ``neuropod_shape`` as REST has (nor has its
#: ModelMetadataResponse for the model's own ``parameters``), and other clients
#: ignore a trailer they do not know.
SHAPES_METADATA_KEY = "neuropod-shapes"


def model_metadata_response(metadata: Mapping[str, Any]) -> pb.ModelMetadataResponse:
    """The ModelMetadataResponse of a REST model metadata body (``ServedModel.metadata``).

    Each tensor's ``parameters`` (``neuropod_shape``) has no place in the
    proto's TensorMetadata; :func:`shapes_metadata` carries it beside the reply.
    """
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=metadata["name"],
        versions=metadata.get("versions", []),
        platform=metadata.get("platform", ""),
        inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in metadata.get("inputs", [])],
        outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in metadata.get("outputs", [])],
    )


def shapes_metadata(metadata: Mapping[str, Any]) -> str:
    """The value of the :data:`SHAPES_METADATA_KEY` trailer for a REST model metadata body:
    each tensor's exact spec shape, which the proto's TensorMetadata cannot hold,
    and the model-level ``parameters`` (which the proto's ModelMetadataResponse lacks)."""
    shapes: dict[str, Any] = {
        key: {t["name"]: _json.loads(t["parameters"][SHAPE_PARAMETER]) for t in metadata.get(key, [])
              if SHAPE_PARAMETER in (t.get("parameters") or {})}
        for key in ("inputs", "outputs")
    }  # fmt: skip
    if metadata.get("parameters"):
        shapes["parameters"] = metadata["parameters"]  # the model's, e.g. which backend runs it
    raw = {
        key: [t["name"] for t in metadata.get(key, []) if (t.get("parameters") or {}).get(DTYPE_PARAMETER) == "bytes"]
        for key in ("inputs", "outputs")
    }
    if raw["inputs"] or raw["outputs"]:
        shapes["bytes"] = raw
    return json.dumps(shapes, separators=(",", ":"))


def model_metadata_from_response(response: pb.ModelMetadataResponse, shapes: str | None = None) -> dict[str, Any]:
    """The REST form of a ModelMetadataResponse, ready for
    :func:`~neuropod_serving.protocol.metadata.specs_from_model_metadata`.

    :param shapes: the :data:`SHAPES_METADATA_KEY` trailer, when the server sent
        one (a neuropod server): each tensor gets its ``neuropod_shape`` back,
        so the exact spec (symbol names) is rebuilt. Without it, -1 dims mean
        any size.
    :raises ProtocolError: ``shapes`` is not the JSON a neuropod server sends.
    """
    exact: dict[str, Any] = {"inputs": {}, "outputs": {}}
    parameters: dict[str, Any] | None = None
    raw: dict[str, Any] = {"inputs": [], "outputs": []}
    if shapes is not None:
        try:
            parsed = _json.loads(shapes)
        except ValueError as e:
            raise ProtocolError(f"the {SHAPES_METADATA_KEY} trailer is not JSON ({e})") from None
        if not isinstance(parsed, dict) or not all(isinstance(parsed.get(k, {}), dict) for k in exact):
            raise ProtocolError(f"the {SHAPES_METADATA_KEY} trailer must be an object of inputs and outputs")
        exact.update({k: parsed.get(k, {}) for k in exact})
        if isinstance(parsed.get("parameters"), dict):
            parameters = parsed["parameters"]
        marked = parsed.get("bytes", {})
        if not isinstance(marked, dict) or not all(isinstance(marked.get(k, []), list) for k in raw):
            raise ProtocolError(f"the {SHAPES_METADATA_KEY} trailer's 'bytes' must be an object of input and output names")
        raw.update({k: marked.get(k, []) for k in raw})

    def tensor(t: pb.ModelMetadataResponse.TensorMetadata, key: str) -> dict[str, Any]:
        out: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if t.name in exact[key]:
            out["parameters"] = {SHAPE_PARAMETER: json.dumps(exact[key][t.name])}
        if t.name in raw[key]:
            out.setdefault("parameters", {})[DTYPE_PARAMETER] = "bytes"
        return out

    out: dict[str, Any] = {
        "name": response.name,
        "versions": list(response.versions),
        "platform": response.platform,
        "inputs": [tensor(t, "inputs") for t in response.inputs],
        "outputs": [tensor(t, "outputs") for t in response.outputs],
    }
    if parameters is not None:
        out["parameters"] = parameters
    return out
