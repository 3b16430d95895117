"""Message classes generated from the Open Inference Protocol's gRPC proto (package ``inference``).

Import :mod:`.open_inference_grpc_pb2` only where gRPC is used: it imports
protobuf. Its ``inference.*`` messages live in a private descriptor pool, not
protobuf's default one, so tritonclient.grpc's own copies of them (same names)
can be imported in the same process, before or after. The service is
registered by hand in :mod:`neuropod_serving.server.grpc_service`, so no
``_pb2_grpc`` module is shipped. See README.md here for how to regenerate.

:mod:`.triton_config_pb2` holds Triton's model configuration and statistics
messages, from a proto of our own (``triton_config.proto``) wire-compatible
with Triton's, in a private pool of its own too.
"""
