"""The original Neuropod's import path for the TorchScript packager, now in ``neuropod-torchscript``."""

from neuropod.backends import forward

_NAMES = ("create_torchscript_neuropod",)
__getattr__ = forward(__name__, "neuropod_torchscript.packager", _NAMES, "neuropod-torchscript")
__all__ = list(_NAMES)
