"""Ray and Ray Serve (the ``[ray]`` extra), or an error that says how to install them."""

from __future__ import annotations

from neuropod.errors import PluginNotInstalledError

try:
    import ray
    from ray import serve
except ImportError as e:  # pragma: no cover - the extra is missing
    raise PluginNotInstalledError(
        f"neuropod_serving.ray needs Ray Serve ({e.name or 'ray'} is not installed): "
        "pip install 'neuropod-serving[ray]'"
    ) from None

__all__ = ["ray", "serve"]
