"""The floors for bench_stream.py: a bare gRPC stream and a bare Server-Sent Events endpoint, no model.

    python bench/stream_floor.py --grpc-port P      grpcio's threaded server, ModelStreamInfer
    python bench/stream_floor.py --http-port P      Starlette on uvicorn, POST /v2/models/{m}/infer_stream

Each runs in a process of its own. Both answer the request bench_stream.py sends
its decoupled model (inputs ``COUNT`` int32 [1], ``DELAY`` uint32 [1]) with
COUNT responses, each holding ``OUT`` int32 [1] and ``IDX`` uint32 [1] (both the
response's index), ``DELAY`` microseconds apart: what the model does, with the
least a server can do around it.

* gRPC: ``inference.GRPCInferenceService/ModelStreamInfer`` (a bidirectional
  stream) on grpcio's threaded server, as ``neuropod serve`` runs it. Each
  request is parsed (``ModelInferRequest``), each response built as a
  ``ModelInferResponse`` from two numpy arrays (``raw_output_contents``, the
  parameter ``triton_final_response`` false), serialized, and put in a
  ``ModelStreamInferResponse`` on the wire form (no second serialization);
  with the request parameter ``triton_enable_empty_final_response`` an empty
  response with ``triton_final_response`` true ends the request, as Triton's
  decoupled models do. ``--gil-switch-us`` sets Python's GIL switch interval
  (bench_stream.py runs a second gRPC floor at ``neuropod serve``'s).
* SSE: one Starlette route on uvicorn (uvloop, httptools, no access log): the
  body parsed with orjson, then a ``StreamingResponse`` whose generator yields
  one ``data: {json}\\n\\n`` event per response, the JSON an OIP infer response
  (``outputs`` with ``data`` lists) made by orjson.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np

MODEL = "stream"
FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def grpc_handler(workers: int) -> Any:
    import grpc

    from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb

    def model_stream_infer(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        for data in requests:
            request = pb.ModelInferRequest.FromString(data)
            named = {t.name: raw for t, raw in zip(request.inputs, request.raw_input_contents)}
            count = int(np.frombuffer(named["COUNT"], np.int32)[0])
            delay = int(np.frombuffer(named["DELAY"], np.uint32)[0]) / 1e6
            empty_final = EMPTY_FINAL in request.parameters and request.parameters[EMPTY_FINAL].bool_param
            for i in range(count):
                if delay:
                    time.sleep(delay)
                reply = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
                for name, datatype, array in (
                    ("OUT", "INT32", np.array([i], np.int32)),
                    ("IDX", "UINT32", np.array([i], np.uint32)),
                ):
                    out = reply.outputs.add()
                    out.name, out.datatype = name, datatype
                    out.shape.append(1)
                    reply.raw_output_contents.append(array.tobytes())
                reply.parameters[FINAL].bool_param = False
                body = reply.SerializeToString()
                yield b"\x12" + _varint(len(body)) + body  # ModelStreamInferResponse.infer_response
            if empty_final:
                reply = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
                reply.parameters[FINAL].bool_param = True
                body = reply.SerializeToString()
                yield b"\x12" + _varint(len(body)) + body

    def server_ready(request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=True)

    return grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(model_stream_infer),
            "ServerReady": grpc.unary_unary_rpc_method_handler(
                server_ready, request_deserializer=pb.ServerReadyRequest.FromString,
                response_serializer=pb.ServerReadyResponse.SerializeToString,
            ),
        },
    )  # fmt: skip


def serve_grpc(port: int, workers: int) -> None:
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(workers))
    server.add_generic_rpc_handlers((grpc_handler(workers),))
    if server.add_insecure_port(f"127.0.0.1:{port}") != port:
        raise SystemExit(f"stream_floor: cannot listen on 127.0.0.1:{port} (gRPC)")
    server.start()
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(grace=1).wait()


def sse_app() -> Any:
    import orjson
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": True})

    async def infer_stream(request: Request) -> Response:
        model = request.path_params["model"]
        header = orjson.loads(await request.body())
        named = {t["name"]: t["data"] for t in header["inputs"]}
        count, delay = int(named["COUNT"][0]), int(named["DELAY"][0]) / 1e6

        async def events() -> AsyncIterator[bytes]:
            for i in range(count):
                if delay:
                    await asyncio.sleep(delay)
                out, idx = np.array([i], np.int32), np.array([i], np.uint32)
                answer = {
                    "model_name": model,
                    "model_version": "1",
                    "outputs": [
                        {"name": "OUT", "datatype": "INT32", "shape": [1], "data": out.tolist()},
                        {"name": "IDX", "datatype": "UINT32", "shape": [1], "data": idx.tolist()},
                    ],
                }
                yield b"data: " + orjson.dumps(answer) + b"\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v2/health/ready", ready, methods=["GET"]),
            Route("/v2/models/{model}/infer_stream", infer_stream, methods=["POST"]),
        ]
    )


def serve_sse(port: int) -> None:
    import uvicorn

    config = uvicorn.Config(sse_app(), host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                            access_log=False, log_level="warning", lifespan="off")  # fmt: skip
    uvicorn.Server(config).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--grpc-port", type=int, help="serve ModelStreamInfer on this port (grpcio, threaded)")
    side.add_argument("--http-port", type=int, help="serve /v2/models/{m}/infer_stream as SSE on this port")
    parser.add_argument(
        "--grpc-threads", type=int, default=128, help="the gRPC server's threads: one per open stream (default 128)"
    )
    parser.add_argument(
        "--gil-switch-us", type=float, help="Python's GIL switch interval in microseconds (default: Python's, 5 ms)"
    )
    args = parser.parse_args()
    if args.gil_switch_us:
        sys.setswitchinterval(args.gil_switch_us / 1e6)
    if args.grpc_port:
        serve_grpc(args.grpc_port, args.grpc_threads)
    else:
        serve_sse(args.http_port)


if __name__ == "__main__":
    main()
