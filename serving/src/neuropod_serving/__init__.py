"""Serving for Neuropod models over the Open Inference Protocol (KServe v2).

:mod:`neuropod_serving.protocol` is the codec; :mod:`neuropod_serving.server`
is ``neuropod serve`` (REST and gRPC, batching, metrics; the ``[server]``
extra); :mod:`neuropod_serving.client` is remote models,
``load_neuropod("grpc://host:8001/model")`` (the ``[client]`` extra).
Importing this package imports no framework and no server library.
"""

from __future__ import annotations

__version__ = "0.4.0"

__all__ = ["__version__"]
