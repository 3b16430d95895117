"""The core's version, at the bottom of the package: modules read it here, never from ``neuropod/__init__.py``."""

__version__ = "0.4.0"
