"""Remote models: ``neuropod.load_neuropod("grpc://host:8001/model")``.

The core finds :func:`load` through the ``neuropod.remotes`` entry points
(one per URL scheme: grpc, grpcs, http, https) and returns what it returns:
a :class:`RemoteModel`, which is a :class:`~neuropod.model.NeuropodModel`
like any other. Its spec is rebuilt from the server's model metadata, inputs
are checked against it before anything is sent (the same ``SpecError`` as a
local model), tensors travel as raw bytes, and every transport or server
fault is a :class:`~neuropod.errors.RemoteError` naming the URL.

A decoupled model (the server says so: ``model.decoupled``) streams with
``model.infer_stream(inputs)``: gRPC ``ModelStreamInfer`` or REST ``infer_stream``
(Server-Sent Events), each response as it arrives (:mod:`.remote_stream`).

No server is trusted: sizes an answer announces cost memory only as their
bytes arrive, shapes must match the data sent with them, outputs are checked
against the output spec (a misfit is a RemoteError naming the server, code
``protocol``), ``timeout=`` is a deadline for the whole call on both
transports, and a token sent without TLS to a host that is not loopback
warns (:class:`PlainTextTokenWarning`, once per server and process).

The far end is any Open Inference Protocol server: ``neuropod serve``,
Triton, MLServer, KServe. A neuropod server also sends each tensor's exact
spec shape (symbol names) and says which backend and device run the model;
from other servers, -1 dims become ``None`` (any size).

Needs ``pip install 'neuropod-serving[client]'`` (grpcio and protobuf; the
REST transport is Python's own ``http.client``). Importing this package
imports neither; the gRPC transport is imported when a ``grpc://`` model is loaded.
"""

from __future__ import annotations

from neuropod.errors import RemoteError
from neuropod_serving.client._errors import RemoteSequenceError, RemoteSequenceLimitError
from neuropod_serving.client.loading import PlainTextTokenWarning, load, schemes
from neuropod_serving.client.remote_model import RemoteBackend, RemoteModel

__all__ = [
    "PlainTextTokenWarning",
    "RemoteBackend",
    "RemoteError",
    "RemoteModel",
    "RemoteSequenceError",
    "RemoteSequenceLimitError",
    "load",
    "schemes",
]
