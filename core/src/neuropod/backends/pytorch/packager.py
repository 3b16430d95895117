"""The original Neuropod's import path for the PyTorch packager, now in ``neuropod-python``."""

from neuropod.backends import forward

_NAMES = ("create_pytorch_neuropod",)
__getattr__ = forward(__name__, "neuropod_python.packager", _NAMES, "neuropod-python")
__all__ = list(_NAMES)
