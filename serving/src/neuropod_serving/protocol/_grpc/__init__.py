"""Message classes generated from the Open Inference Protocol's gRPC proto (package ``inference``).

Import :mod:`.open_inference_grpc_pb2` only where gRPC is used: it imports
protobuf. Its ``inference.*`` messages live in a private descriptor pool, not
protobuf's default one, so tritonclient.grpc's own copies of them (same names)
can be imported in the same process, before or after. The service is
registered by hand in :mod:`neuropod_serving.server.grpc_service`, so no
``_pb2_grpc`` module is shipped. See README.md here for how to regenerate.

:mod:`.triton_repository_pb2` holds the messages of Triton's repository RPCs
and ModelStreamInfer's answer, from our own ``triton_repository.proto``
(wire-compatible with Triton's), in a private pool of its own as well.
"""
