"""Message classes generated from the Open Inference Protocol's gRPC proto (package ``inference``).

Import :mod:`.open_inference_grpc_pb2` only where gRPC is used: it imports
protobuf and registers ``inference.*`` messages in protobuf's default pool,
where tritonclient.grpc's own copies of them would clash. The service is
registered by hand in :mod:`neuropod_serving.server.grpc_service`, so no
``_pb2_grpc`` module is shipped. See README.md here for how to regenerate.
"""
