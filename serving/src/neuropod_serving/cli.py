"""``neuropod serve PATH...``: serve packages over the Open Inference Protocol (REST).

The core's ``neuropod`` command finds this module through the
``neuropod.commands`` entry point and calls :func:`add_arguments` and
:func:`run`. Importing it imports no server library and no framework, so
``neuropod --help`` stays fast; :func:`run` imports them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from neuropod.errors import NeuropodError

DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _port(text: str) -> int:
    value = _positive(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, not {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``neuropod serve``."""
    parser.add_argument("paths", nargs="+", metavar="PATH", help="a package (directory or zip) or a folder of packages")
    parser.add_argument("--http-port", type=_port, default=8000, help="REST port (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument(
        "--workers", type=_positive, default=1,
        help="above 1, run each model in N out-of-process workers so CPU-bound models are not held to one GIL",
    )  # fmt: skip
    parser.add_argument(
        "--auth-token-file", type=Path, metavar="FILE",
        help="require 'Authorization: Bearer <token>' (the file's first line) on every route except health",
    )  # fmt: skip
    parser.add_argument(
        "--max-request-bytes", type=_positive, default=DEFAULT_MAX_REQUEST_BYTES, metavar="B",
        help=f"refuse larger request bodies with 413 (default {DEFAULT_MAX_REQUEST_BYTES:,})",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no start-up table and no access log")


def read_token(path: Path) -> str:
    """The bearer token in ``path``: its first line, without surrounding whitespace.

    :raises NeuropodError: the file cannot be read or holds no token.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NeuropodError(f"--auth-token-file {path}: cannot read it ({e})") from None
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise NeuropodError(f"--auth-token-file {path} is empty; put the token on its first line")
    return token


def startup_table(registry: object) -> str:
    """One row per model: name, platform, backend, device and inputs."""
    from neuropod_serving.server import ModelRegistry

    assert isinstance(registry, ModelRegistry)
    rows = [("MODEL", "PLATFORM", "BACKEND", "DEVICE", "INPUTS")]
    for served in registry:
        m = served.model
        inputs = ", ".join(f"{s.name}: {s.dtype}{list(s.shape)}".replace("'", "") for s in m.inputs)
        rows.append((m.name, m.platform, m.backend.id, m.device, inputs))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r[:4], widths)), r[4]]).rstrip() for r in rows)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load every package, print the table, and serve until interrupted."""
    out = out or sys.stdout
    token = read_token(args.auth_token_file) if args.auth_token_file is not None else None
    from neuropod_serving.server import ModelRegistry, create_app

    # Models load before the port opens: a bad package fails the start, not the first request.
    registry = ModelRegistry.load(args.paths, workers=args.workers)
    try:
        import uvicorn

        app = create_app(registry, auth_token=token, max_request_bytes=args.max_request_bytes)
        if not args.quiet:
            print(startup_table(registry), file=out)
            auth = "bearer token required" if token else "no authentication"
            print(f"serving {len(registry)} model(s) on http://{args.host}:{args.http_port}/v2 ({auth})", file=out, flush=True)
        uvicorn.run(
            app,
            host=args.host,
            port=args.http_port,
            log_level="warning" if args.quiet else "info",
            access_log=not args.quiet,
        )
    finally:
        registry.close()
    return 0
