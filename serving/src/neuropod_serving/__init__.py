"""Serving for Neuropod models over the Open Inference Protocol (KServe v2).

Only the protocol codec (:mod:`neuropod_serving.protocol`) exists so far;
``neuropod serve`` and the remote-model client are not built yet. Importing
this package imports no framework and no server library.
"""

from __future__ import annotations

__version__ = "0.4.0"

__all__ = ["__version__"]
