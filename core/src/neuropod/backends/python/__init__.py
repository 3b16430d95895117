"""The original Neuropod's python backend package; see :mod:`neuropod.backends`."""
