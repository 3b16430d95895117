"""``neuropod serve``: the model registry, the engine (batching, threads,
metrics) and the Open Inference Protocol front ends (REST app, gRPC servicer).

Importing this package imports no server library: :func:`create_app` imports
Starlette when called, so the CLI can load models (and fail fast on a bad
package) before paying for the web stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from neuropod_serving.defaults import DEFAULT_MAX_REQUEST_BYTES
from neuropod_serving.errors import ModelBusyError, RequestTimeoutError, UnknownModelError
from neuropod_serving.server.admission import ModelLimits
from neuropod_serving.server.batching import BatchPolicy, batch_symbol
from neuropod_serving.server.engine import Engine
from neuropod_serving.server.lifecycle import ModelServing
from neuropod_serving.server.registry import (
    MODEL_VERSION,
    ModelRegistry,
    ModelSettings,
    RepositoryEntry,
    ServedModel,
    find_packages,
    is_package,
)
from neuropod_serving.server.served_versions import VersionPolicy

if TYPE_CHECKING:
    from starlette.types import ASGIApp


def create_app(
    engine: Engine,
    *,
    auth_token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> ASGIApp:
    """The Starlette app serving ``engine``'s models; see :func:`neuropod_serving.server.app.create_app`."""
    from neuropod_serving.server.app import create_app as create  # lazy: starlette, imported when an app is made

    return create(engine, auth_token=auth_token, max_request_bytes=max_request_bytes)


__all__ = [
    "BatchPolicy",
    "DEFAULT_MAX_REQUEST_BYTES",
    "Engine",
    "RepositoryEntry",
    "batch_symbol",
    "MODEL_VERSION",
    "ModelBusyError",
    "ModelLimits",
    "ModelServing",
    "ModelRegistry",
    "ModelSettings",
    "RequestTimeoutError",
    "ServedModel",
    "UnknownModelError",
    "VersionPolicy",
    "create_app",
    "find_packages",
    "is_package",
]
