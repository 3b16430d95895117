"""The original Neuropod's tensorflow backend package; see :mod:`neuropod.backends`."""
