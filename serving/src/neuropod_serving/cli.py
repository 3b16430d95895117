"""``neuropod serve PATH...``: serve packages over the Open Inference Protocol (REST and gRPC).

The core's ``neuropod`` command finds this module through the
``neuropod.commands`` entry point and calls :func:`add_arguments` and
:func:`run`. Importing it imports no server library and no framework, so
``neuropod --help`` stays fast; :func:`run` hands the parsed options to
:mod:`neuropod_serving.launch`, which imports them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from neuropod_serving.defaults import (
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_GRPC_STREAMS,
    DEFAULT_MAX_HEAD_BYTES,
    DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_OPEN_STREAMS,
    DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_SEQUENCE_IDLE_US,
    DEFAULT_MAX_SEQUENCES,
    DEFAULT_STREAM_BUFFER,
)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _processes(text: str) -> int:
    if text.strip() == "auto":
        from neuropod_serving.processes import usable_cpus  # lazy: numpy (the server it starts), kept out of --help

        return usable_cpus()
    return _positive(text)


def _non_negative(text: str) -> int:
    if text.strip() == "0":
        return 0
    return _positive(text)


def _port(text: str) -> int:
    value = _positive(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, not {value}")
    return value


def _port_or_off(text: str) -> int:
    if text.strip() == "0":
        return 0
    return _port(text)


def _delay_us(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of microseconds") from None
    if not 0 <= value <= 10_000_000:
        raise argparse.ArgumentTypeError(f"must be 0 to 10,000,000 microseconds (10 s), not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``neuropod serve``."""
    parser.add_argument(
        "paths", nargs="+", metavar="PATH",
        help="a package (directory or zip), or a model repository: a folder of packages, or of model folders "
        "holding numbered versions (MODEL/1/, MODEL/2/); a local path or a URL (s3://, gs://, az://, abfs://)",
    )  # fmt: skip
    parser.add_argument("--http-port", type=_port, default=8000, help="REST port (default 8000)")
    parser.add_argument("--grpc-port", type=_port_or_off, default=8001, help="gRPC port (default 8001; 0: no gRPC)")
    parser.add_argument(
        "--metrics-port", type=_port_or_off, default=8002,
        help="port answering only GET /metrics (default 8002; 0: none; /metrics is on the REST port too)",
    )  # fmt: skip
    parser.add_argument(
        "--version-policy", type=_version_policy, default=None, metavar="POLICY",
        help="which versions of each model to serve: 'latest' (the default), 'latest:N', 'all', or "
        "'specific:V,V' (versions are MODEL/<number>/ folders; a package standing alone is version 1)",
    )  # fmt: skip
    parser.add_argument(
        "--poll-interval", type=_seconds, default=None, metavar="S",
        help="look at the repository every S seconds: load new models and versions (and changed ones), "
        "unload removed ones once their requests finish; a version that fails to load is reported and "
        "replaces nothing. Repository load and unload requests are then refused (default: no polling)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument(
        "--processes", type=_processes, default=1, metavar="N",
        help="serve from N server processes sharing the ports (Linux: SO_REUSEPORT), each with its own copy "
        "of every model, so request handling uses N cores; 'auto': one per usable CPU (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--workers", type=_positive, default=1,
        help="above 1, run each model in N out-of-process workers so CPU-bound models are not held to one GIL; "
        "each run then costs a round trip to a worker (0.1 to 1 ms), more than a quick model's whole run: "
        "to handle more requests, use --processes",
    )  # fmt: skip
    parser.add_argument(
        "--max-batch-size", type=_positive, default=1, metavar="B",
        help="above 1, batch requests to models whose spec has a batch dimension, up to B rows per run (a stateful "
        "model's: one step of each of up to B sequences per run)",
    )  # fmt: skip
    parser.add_argument(
        "--max-queue-delay-us", type=_delay_us, default=0, metavar="D",
        help="with --max-batch-size: wait up to D microseconds after the oldest request for more "
        "to join its batch (default 0: batch what is waiting)",
    )  # fmt: skip
    parser.add_argument(
        "--max-sequence-idle-us", type=_positive, default=DEFAULT_MAX_SEQUENCE_IDLE_US, metavar="US",
        help="a stateful model's sequence idle this many microseconds is ended and its state freed; its next "
        "request without sequence_start is refused (Triton's max_sequence_idle_microseconds; default "
        f"{DEFAULT_MAX_SEQUENCE_IDLE_US:,}, 1 s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-sequences", type=_positive, default=DEFAULT_MAX_SEQUENCES, metavar="N",
        help="sequences of one stateful model live at once; a request starting one more is refused at once "
        f"with 429 (gRPC: RESOURCE_EXHAUSTED) (default {DEFAULT_MAX_SEQUENCES})",
    )  # fmt: skip
    parser.add_argument(
        "--max-concurrent-runs", type=_positive, default=None, metavar="N",
        help=f"runs of one model at once; each model has its own (default {DEFAULT_MAX_CONCURRENT}, "
        "or 2 per --workers when that is more)",
    )  # fmt: skip
    parser.add_argument(
        "--max-queued-requests", type=_non_negative, default=DEFAULT_MAX_QUEUED, metavar="N",
        help="requests of one model that may wait for a run or a batch; more are refused at once with "
        f"429 (gRPC: RESOURCE_EXHAUSTED) (default {DEFAULT_MAX_QUEUED})",
    )  # fmt: skip
    parser.add_argument(
        "--max-grpc-streams", type=_positive, default=DEFAULT_MAX_GRPC_STREAMS, metavar="N",
        help="gRPC ModelStreamInfer and health Watch streams open at once; one more is refused with "
        f"RESOURCE_EXHAUSTED (default {DEFAULT_MAX_GRPC_STREAMS})",
    )  # fmt: skip
    parser.add_argument(
        "--max-open-streams", type=_positive, default=DEFAULT_MAX_OPEN_STREAMS, metavar="N",
        help="streams of one model open at once (a decoupled model's responses, over gRPC or REST); one more "
        f"is refused at once with 429 (gRPC: RESOURCE_EXHAUSTED) (default {DEFAULT_MAX_OPEN_STREAMS})",
    )  # fmt: skip
    parser.add_argument(
        "--stream-buffer", type=_positive, default=DEFAULT_STREAM_BUFFER, metavar="N",
        help="responses a stream's model may run ahead of a client that reads slowly over REST (Server-Sent "
        f"Events) before it waits (default {DEFAULT_STREAM_BUFFER})",
    )  # fmt: skip
    parser.add_argument(
        "--auth-token-file", type=Path, metavar="FILE",
        help="require 'Authorization: Bearer <token>' (the file's first line) on every route except health "
        "(gRPC: the same in 'authorization' metadata)",
    )  # fmt: skip
    parser.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve REST, gRPC and metrics over TLS with this certificate (chain)")
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument(
        "--max-request-bytes", type=_positive, default=DEFAULT_MAX_REQUEST_BYTES, metavar="B",
        help=f"refuse larger request bodies with 413 (gRPC: RESOURCE_EXHAUSTED) (default {DEFAULT_MAX_REQUEST_BYTES:,})",
    )  # fmt: skip
    parser.add_argument(
        "--max-head-bytes", type=_positive, default=DEFAULT_MAX_HEAD_BYTES, metavar="B",
        help=f"refuse REST requests whose request line and headers pass B bytes with 431 (default {DEFAULT_MAX_HEAD_BYTES:,})",
    )  # fmt: skip
    parser.add_argument(
        "--max-headers", type=_positive, default=DEFAULT_MAX_HEADERS, metavar="N",
        help=f"refuse REST requests with more than N headers with 431 (default {DEFAULT_MAX_HEADERS})",
    )  # fmt: skip
    parser.add_argument(
        "--head-timeout", type=_seconds, default=DEFAULT_HEAD_TIMEOUT_S, metavar="S",
        help="close REST connections whose request head is not complete S seconds after it began, "
        f"with 408 (default {DEFAULT_HEAD_TIMEOUT_S:g})",
    )  # fmt: skip
    parser.add_argument(
        "--allow-client-shm", action="store_true",
        help="let clients on this machine register system (POSIX) and CUDA shared memory regions and pass "
        "tensors in them (Triton's shared-memory extensions; off by default: a client could then make the "
        "server read and write any shared memory object this user can open)",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no start-up table and no access log (warnings and errors only)")
    ray = parser.add_argument_group(
        "Ray Serve", "deploy each package as a Ray Serve application (pip install 'neuropod-serving[ray]')"
    )
    ray.add_argument(
        "--ray", action="store_true",
        help="serve through Ray Serve: replicas across the cluster, its HTTP and gRPC proxies on "
        "--http-port and --grpc-port; metrics through Ray's metrics agents",
    )  # fmt: skip
    ray.add_argument(
        "--address", metavar="ADDR",
        help="with --ray: the cluster to join (ray://host:10001, host:6379 or auto; default: start a local one)",
    )  # fmt: skip
    ray.add_argument("--replicas", type=_positive, default=1, metavar="N", help="with --ray: replicas per model (default 1)")
    ray.add_argument(
        "--num-cpus", type=float, metavar="C",
        help="with --ray: CPUs each replica reserves (default: --workers); fractions let small models share a core",
    )  # fmt: skip


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load every package, print the table, and serve until interrupted."""
    from neuropod_serving import launch  # lazy: numpy, Starlette, uvicorn and grpc, kept out of `neuropod --help`

    return launch.run(args, out)


def _version_policy(text: str) -> Any:
    # lazy: numpy (neuropod_serving.server's engine), kept out of `neuropod serve --help`
    from neuropod_serving.server.served_versions import VersionPolicy

    try:
        return VersionPolicy.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a number of seconds above 0, not {text!r}")
    return value
