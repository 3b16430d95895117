"""The Triton protocol extensions this server serves: what ServerMetadata lists.

One table for both front ends, so ``GET /v2`` and gRPC ``ServerMetadata`` can
never disagree with what is routed. Clients (tritonclient, perf_analyzer) probe
this list before they use an extension, so an extension is listed on a
protocol only where its routes or RPCs answer.
"""

from __future__ import annotations

from typing import Any

from neuropod_serving.server.metrics import ServerMetrics

REST = "rest"
GRPC = "grpc"
_BOTH = frozenset({REST, GRPC})

#: Every extension served, by Triton's name, and the protocols that serve it.
EXTENSIONS: tuple[tuple[str, frozenset[str]], ...] = (
    # A REST body format; gRPC carries tensors as raw bytes without it.
    ("binary_tensor_data", frozenset({REST})),
    # Top-k answers for a requested output's parameters.classification, on both protocols.
    ("classification", _BOTH),
    ("model_configuration", _BOTH),
    ("model_repository", _BOTH),
    ("statistics", _BOTH),
    ("system_shared_memory", _BOTH),
    ("cuda_shared_memory", _BOTH),
    # Triton's sequence extension: a request's sequence_id / sequence_start / sequence_end make it a
    # step of a stateful model's sequence; "(string_id)": the id may be a string as well as a number.
    ("sequence", _BOTH),
    ("sequence(string_id)", _BOTH),
    # Triton's generate extension (/generate, /generate_stream): REST only, as in Triton. Streams
    # over gRPC (ModelStreamInfer) are part of Triton's service itself, not an extension it lists.
    ("generate", frozenset({REST})),
)

#: Extensions answered only when the engine keeps statistics (its metrics are a ServerMetrics:
#: not on a Ray Serve replica, whose numbers go to Ray's metrics agents).
NEEDS_STATISTICS = frozenset({"statistics"})
#: Extensions whose gRPC methods only ``neuropod serve``'s own gRPC server registers (not a Ray
#: Serve replica's servicer): the repository RPCs and ModelStreamInfer.
SERVER_ONLY = frozenset({"model_repository"})
#: Extensions answered only when the server takes tensors in shared memory (``--allow-client-shm``).
NEEDS_SHARED_MEMORY = frozenset({"system_shared_memory", "cuda_shared_memory"})


def listed(protocol: str, engine: Any) -> list[str]:
    """The extensions ``protocol`` (``"rest"`` or ``"grpc"``) serves for ``engine``, in table order."""
    statistics = isinstance(engine.metrics, ServerMetrics)
    shared_memory = getattr(engine, "shared_memory", None) is not None
    return [
        name
        for name, protocols in EXTENSIONS
        if protocol in protocols
        and (statistics or name not in NEEDS_STATISTICS)
        and (shared_memory or name not in NEEDS_SHARED_MEMORY)
    ]
