"""The Open Inference Protocol's gRPC service on Ray Serve's gRPC proxy."""

from __future__ import annotations

from typing import Any

import grpc

from neuropod_serving.server.grpc_service import METHODS, SERVICE

#: What goes in ``grpc_options.grpc_servicer_functions`` (Serve config YAML or :class:`ray.serve.config.gRPCOptions`)
#: so that Ray Serve's gRPC proxy speaks the Open Inference Protocol's ``inference.GRPCInferenceService``.
GRPC_SERVICER = "neuropod_serving.ray.add_inference_servicer"
#: The streaming RPC served besides :data:`~neuropod_serving.server.grpc_service.METHODS`.
STREAM_METHOD = "ModelStreamInfer"


def add_inference_servicer(servicer: Any, server: Any) -> None:
    """Register ``inference.GRPCInferenceService`` on Ray Serve's gRPC proxy (:data:`GRPC_SERVICER`).

    The proxy replaces each method's behaviour with a call to the deployment
    method of the same name; it keeps the (absent) request parser, so requests
    reach replicas as their bytes and are parsed there, by the same code as
    ``neuropod serve``'s. ``ModelStreamInfer`` is a bidirectional stream: the
    proxy hands its requests to the replica's generator as they arrive and sends
    each answer as it is yielded.
    """

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name, None) or _unbound(name)) for name in METHODS
    }
    # A bidirectional stream: the proxy passes its requests to the replica's generator as they come.
    handlers[STREAM_METHOD] = grpc.stream_stream_rpc_method_handler(
        getattr(servicer, STREAM_METHOD, None) or _unbound(STREAM_METHOD)
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _unbound(name: str) -> Any:
    def rpc(request: Any, context: Any) -> Any:
        raise NotImplementedError(f"{name} is answered by Ray Serve's proxy")

    return rpc
