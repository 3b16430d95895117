"""The gRPC transport of remote models: one grpcio channel per server.

Streams (``infer_stream``) go over ``ModelStreamInfer`` with Triton's decoupled semantics, one
request per call: the request asks for an empty final response
(``triton_enable_empty_final_response``), each response is read as it arrives, the one whose
``triton_final_response`` parameter is true is the last, and an ``error_message`` ends the stream
with a :class:`~neuropod.errors.RemoteError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from neuropod.errors import RemoteError
from neuropod_serving.client._errors import looks_like_tls, remote_error, stream_error_code
from neuropod_serving.client._target import Target
from neuropod_serving.protocol import ProtocolError
from neuropod_serving.protocol import grpc_codec as codec
from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb
from neuropod_serving.protocol._wire import encode_varint, wire_fields

_SERVICE = "/inference.GRPCInferenceService/"
#: The response parameter that marks a request's last response (Triton's decoupled semantics).
FINAL_RESPONSE = "triton_final_response"
#: The request parameter that asks for an empty final response when the last one was not marked.
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
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
        #: The model's bytes outputs, whose BYTES are the bytes sent (the loader sets them from the spec).
        self.bytes_outputs: frozenset[str] = frozenset()
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
        # ModelStreamInfer: requests and answers as bytes too (see split_stream_response).
        self._stream_infer = self._channel.stream_stream(_SERVICE + "ModelStreamInfer")
        # Triton's ModelConfig, bytes both ways too: only a decoupled policy is read from it (see decoupled).
        self._model_config = unary(_SERVICE + "ModelConfig")

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
            return codec.deserialize_model_infer_response(data, self.bytes_outputs).outputs
        except ProtocolError as e:
            raise remote_error(target, "protocol", str(e), call="infer") from None

    def decoupled(self, timeout: float | None) -> bool | None:
        """Whether the model's configuration (Triton's ModelConfig RPC) says it is decoupled; None
        when the server does not answer it (not every server has the RPC)."""
        flags = self.config_flags(timeout)
        return None if flags is None else flags[0]

    def config_flags(self, timeout: float | None) -> tuple[bool, bool] | None:
        """Whether the model's configuration says it is decoupled, and whether it has
        ``sequence_batching`` (a stateful model); None when the server does not answer."""
        target = self.target
        request = _string_field(1, target.model) + (_string_field(2, target.version) if target.version else b"")
        try:
            data = self._model_config(request, timeout=timeout, metadata=self._metadata)
            return config_decoupled(data), config_sequence_batching(data)
        except (grpc.RpcError, ProtocolError):
            return None

    def open_stream(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], requested: Sequence[str] | None, timeout: float | None,
        parameters: Mapping[str, Any] | None = None,
    ) -> GrpcStream:  # fmt: skip
        """Send one request on a new ModelStreamInfer call; its responses are read from the
        returned stream (``timeout``: a deadline for the whole call)."""
        target = self.target
        try:
            request = codec.build_model_infer_request(
                target.model, inputs, outputs=requested, model_version=target.version,
                parameters={**(parameters or {}), EMPTY_FINAL_RESPONSE: True},
            ).SerializeToString()  # fmt: skip
        except ProtocolError as e:
            raise remote_error(target, "invalid_argument", f"the inputs cannot be sent: {e}", call="infer_stream") from None
        # One request, then the request side is closed: the server ends the call after its last response.
        call = self._stream_infer(iter((request,)), timeout=timeout, metadata=self._metadata)
        return GrpcStream(self, call, timeout)

    def close(self) -> None:
        self._channel.close()


def _string_field(field: int, value: str) -> bytes:
    """A length-delimited field of a protobuf message on the wire form."""
    raw = value.encode("utf-8")
    return encode_varint(field << 3 | 2) + encode_varint(len(raw)) + raw


class GrpcStream:
    """The responses to one request of a ModelStreamInfer call, as they arrive: iterate it (each
    item a dict of output arrays); :meth:`cancel` ends the call from any thread."""

    def __init__(self, transport: GrpcTransport, call: Any, timeout: float | None) -> None:
        self._transport = transport
        self._call = call
        self._timeout = timeout
        self._cancelled = False
        self._final = False
        self._ended = False

    def __iter__(self) -> GrpcStream:
        return self

    def __next__(self) -> dict[str, np.ndarray[Any, Any]]:
        if self._ended:
            raise StopIteration
        target = self._transport.target
        data = self._read()
        if self._final:  # the last response was marked so: the server ends the call next
            self._ended = True
            self.cancel()
            raise remote_error(target, "protocol", "the server sent a response after the one marked final",
                               call="infer_stream")  # fmt: skip
        try:
            error, answer = split_stream_response(data)
            if not error:
                response = codec.deserialize_model_infer_response(answer, self._transport.bytes_outputs)
        except ProtocolError as e:
            self._ended = True
            self.cancel()
            raise remote_error(target, "protocol", str(e), call="infer_stream") from None
        if error:
            self._ended = True
            self.cancel()
            raise remote_error(target, stream_error_code(error), error, call="infer_stream")
        if response.parameters.get(FINAL_RESPONSE) is True:
            self._final = True
            if not response.outputs:  # the empty final response: the end
                return self.__next__()
        return response.outputs

    def _read(self) -> bytes:
        """The call's next message; StopIteration at its end (or once cancelled)."""
        try:
            return bytes(next(self._call))
        except StopIteration:
            self._ended = True
            raise
        except grpc.RpcError as e:
            self._ended = True
            if self._cancelled:
                raise StopIteration from None
            raise self._transport._error(e, "infer_stream", self._timeout) from None

    def cancel(self) -> None:
        """End the call (the server stops the model's generator); a reader gets the end."""
        self._cancelled = True
        self._call.cancel()


def split_stream_response(data: bytes) -> tuple[str, bytes]:
    """A serialized ModelStreamInferResponse as ``(error_message, infer_response)``: read on the
    wire form (two length-delimited fields), so that this client registers no message of its own
    in protobuf's pool for it (tritonclient's would clash) and the response is parsed once.

    :raises ProtocolError: the bytes are not such a message.
    """
    fields = wire_fields(data, "ModelStreamInferResponse")
    error, answer = fields.get(1, b""), fields.get(2, b"")
    if not isinstance(error, bytes) or not isinstance(answer, bytes):
        raise ProtocolError("a ModelStreamInferResponse's fields are not length-delimited")
    try:
        return error.decode("utf-8"), answer
    except UnicodeDecodeError:
        raise ProtocolError("a ModelStreamInferResponse's error_message is not UTF-8") from None


def config_decoupled(data: bytes) -> bool:
    """Whether a serialized ModelConfigResponse says ``model_transaction_policy { decoupled: true }``
    (Triton's field numbers: config 1, model_transaction_policy 19, decoupled 1), read on the wire
    form as :func:`split_stream_response` reads its message.

    :raises ProtocolError: the bytes are not such a message.
    """
    config = wire_fields(data, "ModelConfigResponse").get(1, b"")
    policy = wire_fields(config, "ModelConfig").get(19, b"") if isinstance(config, bytes) else b""
    decoupled = wire_fields(policy, "ModelTransactionPolicy").get(1, 0) if isinstance(policy, bytes) else 0
    return decoupled == 1


def config_sequence_batching(data: bytes) -> bool:
    """Whether a serialized ModelConfigResponse's config has ``sequence_batching`` (Triton's field
    13 of ModelConfig): the model is stateful.

    :raises ProtocolError: the bytes are not such a message.
    """
    config = wire_fields(data, "ModelConfigResponse").get(1, b"")
    return isinstance(config, bytes) and 13 in wire_fields(config, "ModelConfig")
