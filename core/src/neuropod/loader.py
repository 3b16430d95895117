"""The original Neuropod's import path for :func:`load_neuropod`: ``from neuropod.loader import load_neuropod``."""

from neuropod.model import load_neuropod

__all__ = ["load_neuropod"]
