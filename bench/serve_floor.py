"""The floor for bench_serve.py: bare REST and gRPC inference endpoints with no model.

    python bench/serve_floor.py --http-port P [--grpc-port G] --output MODEL=OUTPUT ...

What a server cannot do with less: the REST side is one Starlette route on
uvicorn (uvloop + httptools, no access log) that reads the body, parses the
JSON header and makes numpy arrays of the binary tensors (Triton's binary
tensor extension), and answers with a binary response of the same size and
shape as neuropod serve's (the first input's bytes as the model's output).
A request without that header is plain OIP JSON: orjson parses it, numpy makes
an array of each input's ``data`` (:func:`json_inputs`), and the answer is the
first input as JSON ``data`` (:func:`json_response`).
The gRPC side does the same on grpcio with the project's generated
``inference.*`` messages: parse ``ModelInferRequest``, arrays from
``raw_input_contents``, reply with ``raw_output_contents``; by default on
grpcio's threaded server (16 threads) beside the uvloop event loop, as
``neuropod serve`` runs them, or with ``--grpc-kind asyncio`` on grpc.aio in
that loop.

``--processes N`` (REST only) forks N server processes after the listening
socket is made, all accepting on it: what ``uvicorn --workers N`` does, without
its supervisor process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
from typing import Any

import numpy as np

HEADER_LENGTH = "inference-header-content-length"
# The datatypes the benchmark sends.
_DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8}


def json_inputs(body: bytes) -> tuple[dict[str, Any], list[np.ndarray]]:
    """A plain JSON request's header and its inputs as arrays: orjson, then one numpy conversion per input."""
    import orjson

    header = orjson.loads(body)
    arrays = [np.asarray(t["data"], dtype=_DTYPES[t["datatype"]]).reshape(t["shape"]) for t in header["inputs"]]
    return header, arrays


def json_response(model: str, output: str, header: dict[str, Any], arrays: list[np.ndarray]) -> bytes:
    """The JSON answer to a plain JSON request: the first input as the model's output, as JSON ``data``."""
    import orjson

    first = header["inputs"][0]
    out = {
        "model_name": model,
        "model_version": "1",
        "outputs": [{"name": output, "datatype": first["datatype"], "shape": list(arrays[0].shape),
                     "data": arrays[0].ravel().tolist()}],
    }  # fmt: skip
    return orjson.dumps(out)


def rest_app(outputs: dict[str, str]) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": True})

    async def infer(request: Request) -> Response:
        model = request.path_params["model"]
        body = await request.body()
        length = request.headers.get(HEADER_LENGTH)
        if length is None:
            header, arrays = json_inputs(body)
            return Response(json_response(model, outputs[model], header, arrays), media_type="application/json")
        n = int(length)
        header = json.loads(body[:n])
        view = memoryview(body)[n:]
        arrays, offset = [], 0
        for t in header["inputs"]:
            size = t["parameters"]["binary_data_size"]
            arrays.append(np.frombuffer(view[offset : offset + size], dtype=_DTYPES[t["datatype"]]).reshape(t["shape"]))
            offset += size
        first = header["inputs"][0]
        raw = arrays[0].tobytes()
        out = {
            "model_name": model,
            "model_version": "1",
            "outputs": [{"name": outputs[model], "datatype": first["datatype"], "shape": list(arrays[0].shape),
                         "parameters": {"binary_data_size": len(raw)}}],
        }  # fmt: skip
        head = json.dumps(out, separators=(",", ":")).encode()
        return Response(head + raw, media_type="application/octet-stream", headers={HEADER_LENGTH: str(len(head))})

    return Starlette(
        routes=[Route("/v2/health/ready", ready, methods=["GET"]), Route("/v2/models/{model}/infer", infer, methods=["POST"])]
    )


def _grpc_handler(outputs: dict[str, str], asynchronous: bool) -> Any:
    import grpc

    from neuropod_serving.protocol._grpc import open_inference_grpc_pb2 as pb

    def model_infer(request: Any, context: Any) -> Any:
        arrays = [
            np.frombuffer(raw, dtype=_DTYPES[t.datatype]).reshape(tuple(t.shape))
            for t, raw in zip(request.inputs, request.raw_input_contents)
        ]
        reply = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        out = reply.outputs.add()
        out.name = outputs[request.model_name]
        out.datatype = request.inputs[0].datatype
        out.shape.extend(arrays[0].shape)
        reply.raw_output_contents.append(arrays[0].tobytes())
        return reply

    def server_ready(request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=True)

    def unary(fn: Any, req: Any, resp: Any) -> Any:
        if asynchronous:
            sync_fn = fn

            async def fn(request: Any, context: Any) -> Any:
                return sync_fn(request, context)

        return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                   response_serializer=resp.SerializeToString)  # fmt: skip

    return grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {
            "ModelInfer": unary(model_infer, pb.ModelInferRequest, pb.ModelInferResponse),
            "ServerReady": unary(server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
        },
    )


async def start_grpc(port: int, outputs: dict[str, str], kind: str) -> Any:
    """The bare gRPC endpoint: grpcio's threaded server (as neuropod serve uses) or its asyncio one."""
    import grpc

    if kind == "threads":
        from concurrent import futures

        server = grpc.server(futures.ThreadPoolExecutor(16))
    else:
        server = grpc.aio.server()
    server.add_generic_rpc_handlers((_grpc_handler(outputs, kind == "asyncio"),))
    if server.add_insecure_port(f"127.0.0.1:{port}") != port:
        raise SystemExit(f"serve_floor: cannot listen on 127.0.0.1:{port} (gRPC)")
    started = server.start()
    if started is not None:
        await started
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, default=0, help="0: no gRPC")
    parser.add_argument("--grpc-kind", choices=("threads", "asyncio"), default="threads",
                        help="grpcio's threaded server (as neuropod serve's) or its asyncio one")  # fmt: skip
    parser.add_argument("--processes", type=int, default=1, help="REST server processes sharing the socket (default 1)")
    parser.add_argument("--output", action="append", default=[], metavar="MODEL=OUTPUT",
                        help="the output name answered for MODEL (repeat per model)")  # fmt: skip
    args = parser.parse_args()
    outputs = dict(o.split("=", 1) for o in args.output)
    if args.processes > 1 and args.grpc_port:
        parser.error("--processes is for the REST side alone: give --grpc-port 0")

    import uvicorn
    import uvloop

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.http_port))
    sock.listen(2048)
    children = []
    for _ in range(args.processes - 1):
        pid = os.fork()
        if pid == 0:
            children = []
            break
        children.append(pid)
    config = uvicorn.Config(rest_app(outputs), http="httptools", access_log=False, log_level="warning", lifespan="off")

    async def serve() -> None:
        grpc_server = await start_grpc(args.grpc_port, outputs, args.grpc_kind) if args.grpc_port else None
        try:
            await uvicorn.Server(config).serve(sockets=[sock])
        finally:
            if grpc_server is not None:
                stopped = grpc_server.stop(grace=1)
                if args.grpc_kind == "asyncio":
                    await stopped
                else:
                    await asyncio.to_thread(stopped.wait)

    try:
        uvloop.run(serve())
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGINT)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


if __name__ == "__main__":
    main()
