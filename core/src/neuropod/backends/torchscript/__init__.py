"""The original Neuropod's torchscript backend package; see :mod:`neuropod.backends`."""
