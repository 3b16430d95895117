"""Triton's shared-memory extensions on both front ends: the REST routes, the gRPC RPCs, and the
steps an inference request with tensors in shared memory adds (see :mod:`.shm_regions`).

A request without tensors in shared memory never comes here: the front ends check
``InferRequest.shared_memory is not None`` (one attribute) and go their usual way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from neuropod import _json
from neuropod_serving.errors import ProtocolError
from neuropod_serving.protocol.bodies import Body
from neuropod_serving.protocol.inference import InferRequest, build_shared_response
from neuropod_serving.server.registry import ServedModel
from neuropod_serving.server.shm_regions import (
    CUDA,
    ENABLE_HINT,
    SYSTEM,
    Lease,
    SharedMemoryRegistry,
    decode_raw_handle,
)

#: Tensors in shared memory up to this many bytes are copied on the event loop (a thread hop
#: costs more); larger ones in a worker thread, as REST bodies are.
INLINE_BYTES = 64 * 1024


def registry_of(engine: Any) -> SharedMemoryRegistry:
    """The engine's region registry. :raises ProtocolError: the server takes no shared memory."""
    registry: SharedMemoryRegistry | None = getattr(engine, "shared_memory", None)
    if registry is None:
        raise ProtocolError(f"this server takes no tensors in shared memory ({ENABLE_HINT})")
    return registry


def lease(engine: Any, decoded: InferRequest) -> Lease:
    """Hold the regions of ``decoded``'s tensors in shared memory (:meth:`Lease.release` after)."""
    assert decoded.shared_memory is not None
    return registry_of(engine).lease(decoded.shared_memory)


def read_inputs(held: Lease, served: ServedModel, decoded: InferRequest) -> None:
    """Put the inputs in shared memory (copies) into ``decoded.inputs``."""
    decoded.inputs.update(held.read_inputs(served.input_specs))


def rest_body(
    held: Lease, served: ServedModel, decoded: InferRequest, outputs: dict[str, np.ndarray[Any, Any]]
) -> tuple[bytes, int | None]:
    """Write the outputs placed in shared memory and encode the REST answer (those without data)."""
    written = held.write_outputs(outputs)
    binary = decoded.binary_outputs(n for n in outputs if n not in written)
    body: Body = build_shared_response(
        served.name, outputs, written, binary=binary, model_version=served.version, id=decoded.id
    )
    return body.content, body.json_length


def grpc_message(
    held: Lease, served: ServedModel, decoded: InferRequest, outputs: dict[str, np.ndarray[Any, Any]]
) -> bytes:
    """Write the outputs placed in shared memory and serialize the ModelInferResponse."""
    from neuropod_serving.protocol import grpc_codec  # lazy: protobuf, kept out of a REST-only server

    written = held.write_outputs(outputs)
    return grpc_codec.serialize_shared_response(
        served.name, outputs, written, model_version=served.version, id=decoded.id
    )


# -- REST ---------------------------------------------------------------------------------

_PREFIXES = {SYSTEM: "/v2/systemsharedmemory", CUDA: "/v2/cudasharedmemory"}


def routes(engine: Any, read_body: Callable[[Any], Awaitable[bytes]]) -> list[Any]:
    """The REST routes of both extensions (status, register, unregister), for Starlette.

    :param read_body: reads a request's whole body within the server's limit.
    """
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def body_object(request: Request, what: str) -> dict[str, Any]:
        data = await read_body(request)
        if not data.strip():
            return {}
        try:
            value = _json.loads(data.decode("utf-8"))  # bounded in depth and size before parsing
        except (UnicodeDecodeError, ValueError) as e:
            raise ProtocolError(f"a {what} request body is a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ProtocolError(f"a {what} request body is a JSON object, not {type(value).__name__}")
        return value

    def handlers(kind: str) -> list[Route]:
        prefix = _PREFIXES[kind]
        words = "system shared memory" if kind == SYSTEM else "CUDA shared memory"

        async def status(request: Request) -> Response:
            registry = registry_of(engine)
            return JSONResponse(registry.status(kind, request.path_params.get("region", "")))

        async def register(request: Request) -> Response:
            registry = registry_of(engine)
            name = request.path_params["region"]
            body = await body_object(request, f"{words} register")
            if kind == SYSTEM:
                await run_in_threadpool(
                    registry.register_system, name, body.get("key"), body.get("offset", 0), body.get("byte_size")
                )
            else:
                handle = decode_raw_handle(body.get("raw_handle"), name)
                await run_in_threadpool(
                    registry.register_cuda, name, handle, body.get("device_id", 0), body.get("byte_size")
                )
            return JSONResponse({})

        async def unregister(request: Request) -> Response:
            registry = registry_of(engine)
            await read_body(request)
            await run_in_threadpool(registry.unregister, kind, request.path_params.get("region", ""))
            return JSONResponse({})

        return [
            Route(f"{prefix}/status", status, methods=["GET"]),
            Route(f"{prefix}/region/{{region}}/status", status, methods=["GET"]),
            Route(f"{prefix}/region/{{region}}/register", register, methods=["POST"]),
            Route(f"{prefix}/unregister", unregister, methods=["POST"]),
            Route(f"{prefix}/region/{{region}}/unregister", unregister, methods=["POST"]),
        ]

    return [*handlers(SYSTEM), *handlers(CUDA)]


# -- gRPC ---------------------------------------------------------------------------------


class SharedMemoryRpcs:
    """The six shared-memory RPCs of GRPCInferenceService (a base of the servicer)."""

    engine: Any

    def system_shared_memory_status(self, request: Any, context: Any) -> Any:
        # lazy: protobuf, kept out of a REST-only server
        from neuropod_serving.protocol._grpc import triton_shm_pb2 as shm_pb

        response = shm_pb.SystemSharedMemoryStatusResponse()
        for entry in registry_of(self.engine).status(SYSTEM, request.name):
            region = response.regions[entry["name"]]
            region.name, region.key = entry["name"], entry["key"]
            region.offset, region.byte_size = entry["offset"], entry["byte_size"]
        return response

    def system_shared_memory_register(self, request: Any, context: Any) -> Any:
        # lazy: protobuf, kept out of a REST-only server
        from neuropod_serving.protocol._grpc import triton_shm_pb2 as shm_pb

        registry_of(self.engine).register_system(request.name, request.key, request.offset, request.byte_size)
        return shm_pb.SystemSharedMemoryRegisterResponse()

    def system_shared_memory_unregister(self, request: Any, context: Any) -> Any:
        # lazy: protobuf, kept out of a REST-only server
        from neuropod_serving.protocol._grpc import triton_shm_pb2 as shm_pb

        registry_of(self.engine).unregister(SYSTEM, request.name)
        return shm_pb.SystemSharedMemoryUnregisterResponse()

    def cuda_shared_memory_status(self, request: Any, context: Any) -> Any:
        # lazy: protobuf, kept out of a REST-only server
        from neuropod_serving.protocol._grpc import triton_shm_pb2 as shm_pb

        response = shm_pb.CudaSharedMemoryStatusResponse()
        for entry in registry_of(self.engine).status(CUDA, request.name):
            region = response.regions[entry["name"]]
            region.name, region.device_id, region.byte_size = entry["name"], entry["device_id"], entry["byte_size"]
        return response

    def cuda_shared_memory_register(self, request: Any, context: Any) -> Any:
        # lazy: protobuf, kept out of a REST-only server
        from neuropod_serving.protocol._grpc import triton_shm_pb2 as shm_pb

        registry_of(self.engine).register_cuda(request.name, request.raw_handle, request.device_id, request.byte_size)
        return shm_pb.CudaSharedMemoryRegisterResponse()

    def cuda_shared_memory_unregister(self, request: Any, context: Any) -> Any:
        # lazy: protobuf, kept out of a REST-only server
        from neuropod_serving.protocol._grpc import triton_shm_pb2 as shm_pb

        registry_of(self.engine).unregister(CUDA, request.name)
        return shm_pb.CudaSharedMemoryUnregisterResponse()


__all__ = [
    "INLINE_BYTES",
    "SharedMemoryRpcs",
    "grpc_message",
    "lease",
    "read_inputs",
    "registry_of",
    "rest_body",
    "routes",
]
