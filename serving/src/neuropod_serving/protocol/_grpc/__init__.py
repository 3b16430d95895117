"""Message classes generated from the Open Inference Protocol's gRPC proto (package ``inference``),
and from our own ``triton_shm.proto`` (Triton's shared-memory messages, wire-compatible).

Import :mod:`.open_inference_grpc_pb2` (or :mod:`.triton_config_pb2`, :mod:`.triton_shm_pb2`)
only where gRPC is used: it imports protobuf. Their ``inference.*`` messages live in private
descriptor pools, not protobuf's default one, so tritonclient.grpc's own copies of them (same
names) can be imported in the same process, before or after. The service is registered by hand
in :mod:`neuropod_serving.server.grpc_service`, so no ``_pb2_grpc`` module is shipped. See
README.md here for how to regenerate.

:mod:`.triton_config_pb2` holds Triton's model configuration and statistics messages and
:mod:`.triton_shm_pb2` its shared-memory messages, each from a proto of our own
(``triton_config.proto``, ``triton_shm.proto``) wire-compatible with Triton's, each in a
private pool of its own.

:mod:`.triton_repository_pb2` holds the messages of Triton's repository RPCs
and ModelStreamInfer's answer, from our own ``triton_repository.proto``
(wire-compatible with Triton's), in a private pool of its own as well.

:mod:`.grpc_health_pb2` holds gRPC's health checking messages (``grpc.health.v1``), from our
own ``grpc_health.proto`` (wire-compatible with gRPC's ``health.proto``), in a private pool
of its own: the server's health service needs no other package for them.
"""
