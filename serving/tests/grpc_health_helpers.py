"""What the gRPC health tests share: grpcio-health-checking's own client stub (as Kubernetes' gRPC
probes and grpc_health_probe call the protocol) over a channel, its calls, and ``neuropod serve``
with a bearer token (which health needs not). Skips the importing module without grpcio or
grpcio-health-checking."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
health_pb2_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")

from neuropod.testing import Served, served  # noqa: E402

#: SERVING, NOT_SERVING, SERVICE_UNKNOWN...
Status = health_pb2.HealthCheckResponse


@contextlib.contextmanager
def health_stub(target: str, options: list[tuple[str, Any]] | None = None) -> Iterator[Any]:
    """A ``HealthStub`` on an insecure channel to ``target`` (``host:port``), closed when the ``with`` ends."""
    with grpc.insecure_channel(target, options=options) as channel:
        yield health_pb2_grpc.HealthStub(channel)


def request(service: str) -> Any:
    return health_pb2.HealthCheckRequest(service=service)


def check(stub: Any, service: str) -> int:
    """The status a ``Check`` of ``service`` answers (a ``grpc.RpcError`` for an error)."""
    return int(stub.Check(request(service), timeout=10).status)


def watch(stub: Any, service: str, timeout: float = 10) -> list[int]:
    """Every status a ``Watch`` of ``service`` answers, until the server ends the stream."""
    return [int(r.status) for r in stub.Watch(request(service), timeout=timeout)]


@contextlib.contextmanager
def served_with_token(models: Path, token: str) -> Iterator[Served]:
    """``neuropod serve models --auth-token-file <a file beside models holding token>``."""
    (models.parent / "token").write_text(token)
    with served(models, options=["--auth-token-file", str(models.parent / "token")]) as s:
        yield s
