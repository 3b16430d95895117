"""The original Neuropod's import path for the TensorFlow packager, now in ``neuropod-tensorflow``."""

from neuropod.backends import forward

_NAMES = ("create_tensorflow_neuropod",)
__getattr__ = forward(__name__, "neuropod_tensorflow.packager", _NAMES, "neuropod-tensorflow")
__all__ = list(_NAMES)
