"""``neuropod serve``: the model registry and the Open Inference Protocol REST app.

Importing this package imports no server library: :func:`create_app` imports
Starlette when called, so the CLI can load models (and fail fast on a bad
package) before paying for the web stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from neuropod_serving.server.registry import (
    MODEL_VERSION,
    ModelRegistry,
    ServedModel,
    UnknownModelError,
    find_packages,
    is_package,
)

if TYPE_CHECKING:
    from starlette.types import ASGIApp

DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20


def create_app(
    registry: ModelRegistry,
    *,
    auth_token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> ASGIApp:
    """The Starlette app serving ``registry``; see :func:`neuropod_serving.server.app.create_app`."""
    from neuropod_serving.server.app import create_app as create

    return create(registry, auth_token=auth_token, max_request_bytes=max_request_bytes)


__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "MODEL_VERSION",
    "ModelRegistry",
    "ServedModel",
    "UnknownModelError",
    "create_app",
    "find_packages",
    "is_package",
]
