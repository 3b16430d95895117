"""The original Neuropod's import path for the Keras packager, now in ``neuropod-tensorflow``."""

from neuropod.backends import forward

_NAMES = ("create_keras_neuropod", "infer_keras_input_spec", "infer_keras_output_spec")
__getattr__ = forward(__name__, "neuropod_tensorflow.packager", _NAMES, "neuropod-tensorflow")
__all__ = list(_NAMES)
