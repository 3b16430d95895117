"""The gRPC transport of remote models: one grpcio channel per server."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from neuropod.errors import RemoteError
from neuropod_serving.client._errors import looks_like_tls, remote_error
from neuropod_serving.client._target import Target
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.protocol import grpc_codec as codec
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb

_SERVICE = "/inference.GRPCInferenceService/"
# No size limits of our own (grpcio's default refuses answers over 4 MiB);
# keep-alive pings find a dead connection while it is idle, without traffic
# of ours; the server may refuse pings more often than its own policy allows,
# so only send them every 30 s and only with calls in flight.
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.enable_retries", 0),  # the pool retries, on another server when it has one
]


class GrpcTransport:
    """Calls to one server for one model over a grpcio channel (thread-safe; grpcio multiplexes calls)."""

    def __init__(
        self,
        target: Target,
        *,
        auth_token: str | None = None,
        root_certificates: bytes | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        self.target = target
        options = list(_CHANNEL_OPTIONS)
        if target.tls:
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(target.address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target.address, options=options)
        # "application": Ray Serve's gRPC proxy routes a call by it when it serves several
        # applications (`neuropod serve --ray` names each after its model); other servers ignore it.
        printable = target.model.isascii() and target.model.isprintable()
        metadata: tuple[tuple[str, str], ...] = (("application", target.model),) if printable else ()
        if auth_token:
            metadata += (("authorization", f"Bearer {auth_token}"),)
        self._metadata = metadata
        unary = self._channel.unary_unary
        # Requests and answers of ModelInfer are bytes: the codec writes and reads the wire form itself.
        self._infer = unary(_SERVICE + "ModelInfer")

        def method(name: str, request: Any, response: Any) -> Any:
            return unary(_SERVICE + name, request_serializer=request.SerializeToString,
                         response_deserializer=response.FromString)  # fmt: skip

        self._model_metadata = method("ModelMetadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse)
        self._model_ready = method("ModelReady", pb.ModelReadyRequest, pb.ModelReadyResponse)
        self._server_live = method("ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse)
        self._server_metadata = method("ServerMetadata", pb.ServerMetadataRequest, pb.ServerMetadataResponse)

    def _error(self, e: grpc.RpcError, call: str, timeout: float | None) -> RemoteError:
        code = e.code() if hasattr(e, "code") else None
        details = (e.details() if hasattr(e, "details") else None) or str(e)
        name = code.name.lower() if code is not None else "unknown"
        if name == "unavailable" and looks_like_tls(details):
            name = "tls"
        return remote_error(self.target, name, details, call=call, timeout=timeout)

    def metadata(self, timeout: float | None) -> dict[str, Any]:
        """The model's metadata in its REST form (with the exact shapes when the server sends them)."""
        request = pb.ModelMetadataRequest(name=self.target.model, version=self.target.version or "")
        try:
            response, call = self._model_metadata.with_call(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, "model metadata", timeout) from None
        extra = dict(call.trailing_metadata() or ()).get(codec.SHAPES_METADATA_KEY)
        try:
            return codec.model_metadata_from_response(response, extra if isinstance(extra, str) else None)
        except ProtocolError as e:
            raise remote_error(self.target, "protocol", str(e), call="model metadata") from None

    def ready(self, timeout: float | None) -> bool:
        request = pb.ModelReadyRequest(name=self.target.model, version=self.target.version or "")
        try:
            return bool(self._model_ready(request, timeout=timeout, metadata=self._metadata).ready)
        except grpc.RpcError as e:
            raise self._error(e, "model ready", timeout) from None

    def server(self, timeout: float | None) -> dict[str, Any]:
        """Whether the server is live, and its name, version and extensions."""
        try:
            live = bool(self._server_live(pb.ServerLiveRequest(), timeout=timeout).live)
            meta = self._server_metadata(pb.ServerMetadataRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, "server metadata", timeout) from None
        return {"live": live, "name": meta.name, "version": meta.version, "extensions": list(meta.extensions)}

    def infer(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], requested: Sequence[str] | None, timeout: float | None,
        parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:  # fmt: skip
        target = self.target
        try:
            if parameters:
                request = codec.build_model_infer_request(
                    target.model, inputs, outputs=requested, model_version=target.version, parameters=parameters
                ).SerializeToString()
            else:
                request = codec.serialize_model_infer_request(
                    target.model, inputs, outputs=requested, model_version=target.version
                )
        except ProtocolError as e:
            raise remote_error(target, "invalid_argument", f"the inputs cannot be sent: {e}", call="infer") from None
        try:
            data = self._infer(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, "infer", timeout) from None
        try:
            return codec.deserialize_model_infer_response(data).outputs
        except ProtocolError as e:
            raise remote_error(target, "protocol", str(e), call="infer") from None

    def close(self) -> None:
        self._channel.close()


