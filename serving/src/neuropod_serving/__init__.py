"""Serving for Neuropod models over the Open Inference Protocol (KServe v2).

The protocol codec (:mod:`neuropod_serving.protocol`) and the REST half of
``neuropod serve`` (:mod:`neuropod_serving.server`) exist so far; gRPC,
batching and the remote-model client are not built yet. Importing this
package imports no framework and no server library.
"""

from __future__ import annotations

__version__ = "0.4.0"

__all__ = ["__version__"]
