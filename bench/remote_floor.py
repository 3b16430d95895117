"""The transport floor for bench_remote.py: bare gRPC and REST echo endpoints that move bytes, no model.

    python bench/remote_floor.py --http-port P [--grpc-port G] [--one-write] --bodies DIR

``DIR`` holds, per case, the exact response bodies ``neuropod serve`` sent for
the case's request (``CASE.grpc`` and ``CASE.rest``, captured by the bench)
and ``CASE.rest-header``: the ``Inference-Header-Content-Length`` that came
with the REST one. A call to the case answers those bytes:

* gRPC: grpcio's threaded server (as ``neuropod serve`` runs it), one
  generic unary method per case, ``/floor.Echo/CASE``, with identity
  serializers: the request arrives as ``bytes`` and is dropped, the stored
  response goes back as ``bytes``; no protobuf on either side.
* REST: one Starlette route, ``POST /floor/CASE``, on uvicorn with httptools
  and uvloop (no access log): reads the whole body, answers the stored bytes.
  With ``--one-write``, uvicorn runs neuropod serve's own httptools protocol
  (``neuropod_serving.server.http.OneWriteProtocol``: the response head goes
  out with the body) instead of its stock one: on a 6.9 MB answer the stock
  protocol took about twice as long here, so a floor on it would not be a
  floor for the large cases.

The process sets the same GIL switch interval as ``neuropod serve`` (a
process setting, not part of the transport), so the floor is not slower for
want of it.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

HEADER_LENGTH = "inference-header-content-length"
#: neuropod serve's (neuropod_serving.server.launcher.GIL_SWITCH_S), copied: without --one-write this file imports nothing of ours.
GIL_SWITCH_S = 0.0001


def read_bodies(folder: Path) -> tuple[dict[str, bytes], dict[str, tuple[bytes, str]]]:
    """The stored responses: gRPC by case, and REST by case with its header length."""
    grpc_bodies = {p.stem: p.read_bytes() for p in folder.glob("*.grpc")}
    rest = {p.stem: (p.read_bytes(), (folder / f"{p.stem}.rest-header").read_text().strip()) for p in folder.glob("*.rest")}
    if not grpc_bodies and not rest:
        raise SystemExit(f"remote_floor: no *.grpc or *.rest bodies in {folder}")
    return grpc_bodies, rest


def rest_app(bodies: dict[str, tuple[bytes, str]]) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": True})

    async def echo(request: Request) -> Response:
        await request.body()
        content, header = bodies[request.path_params["case"]]
        return Response(content, media_type="application/octet-stream", headers={HEADER_LENGTH: header})

    return Starlette(routes=[Route("/v2/health/ready", ready, methods=["GET"]), Route("/floor/{case}", echo, methods=["POST"])])


def start_grpc(port: int, bodies: dict[str, bytes]) -> Any:
    import grpc

    def answer(content: bytes) -> Any:
        return grpc.unary_unary_rpc_method_handler(lambda request, context: content)

    handlers = {case: answer(content) for case, content in bodies.items()}
    server = grpc.server(
        futures.ThreadPoolExecutor(16),
        options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)],
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Echo", handlers),))
    # As neuropod serve does: registered methods skip the per-call lookup by name (grpcio >= 1.62).
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers("floor.Echo", handlers)
    if server.add_insecure_port(f"127.0.0.1:{port}") != port:
        raise SystemExit(f"remote_floor: cannot listen on 127.0.0.1:{port} (gRPC)")
    server.start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, default=0, help="0: no gRPC")
    parser.add_argument("--one-write", action="store_true", help="uvicorn with neuropod serve's OneWriteProtocol")
    parser.add_argument("--bodies", type=Path, required=True, help="folder of CASE.grpc, CASE.rest, CASE.rest-header")
    args = parser.parse_args()
    grpc_bodies, rest_bodies = read_bodies(args.bodies)
    sys.setswitchinterval(GIL_SWITCH_S)

    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.http_port))
    sock.listen(128)
    http: Any = "httptools"
    if args.one_write:
        from neuropod_serving.server.http import OneWriteProtocol as http
    config = uvicorn.Config(rest_app(rest_bodies), http=http, access_log=False, log_level="warning", lifespan="off")

    async def serve() -> None:
        grpc_server = start_grpc(args.grpc_port, grpc_bodies) if args.grpc_port else None
        try:
            await uvicorn.Server(config).serve(sockets=[sock])
        finally:
            if grpc_server is not None:
                await asyncio.to_thread(grpc_server.stop(grace=1).wait)

    try:
        import uvloop
    except ImportError:  # as neuropod serve: uvloop when installed
        asyncio.run(serve())
    else:
        uvloop.run(serve())


if __name__ == "__main__":
    main()
