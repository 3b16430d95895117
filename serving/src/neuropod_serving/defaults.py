"""The server's default limits, in one place: the CLI's options, the engine, the REST and gRPC front
ends and the Ray deployment all read them from here.

Imports nothing, so ``neuropod serve --help`` can show them without importing numpy, Starlette or gRPC.
"""

from __future__ import annotations

#: The body of one request, in bytes (then 413 / RESOURCE_EXHAUSTED).
DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20
#: The request line and headers of one REST request, in bytes (then 431).
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
#: Headers in one REST request (then 431).
DEFAULT_MAX_HEADERS = 100
#: Seconds a REST request head may take from its first byte (or from the connection) to its end (then 408).
DEFAULT_HEAD_TIMEOUT_S = 15.0
#: Runs of one model at once when not configured: as many as the thread pool
#: every model shared before (2 per OPE worker, at least 4).
DEFAULT_MAX_CONCURRENT = 4
#: Requests of one model that may wait for a run (or a batch) when not configured;
#: one more is refused at once (HTTP 429, gRPC RESOURCE_EXHAUSTED).
DEFAULT_MAX_QUEUED = 64
#: gRPC streams (ModelStreamInfer and Health Watch) open at once when not configured.
DEFAULT_MAX_GRPC_STREAMS = 64
#: Streams (``infer_stream``, gRPC ModelStreamInfer requests of a model) of one model open at once
#: when not configured; one more is refused at once (HTTP 429, gRPC RESOURCE_EXHAUSTED).
DEFAULT_MAX_OPEN_STREAMS = 256
#: Responses a stream's model may run ahead of a client that reads slowly; then the model's generator
#: waits (backpressure), so a slow reader holds at most this many responses in the server.
DEFAULT_STREAM_BUFFER = 16
#: Microseconds a stateful model's sequence may sit idle before its state is freed (Triton's
#: ``max_sequence_idle_microseconds``, whose default this is: 1 s).
DEFAULT_MAX_SEQUENCE_IDLE_US = 1_000_000
#: Sequences of one stateful model live at once; starting one more is refused at once (HTTP 429,
#: gRPC RESOURCE_EXHAUSTED).
DEFAULT_MAX_SEQUENCES = 1024
