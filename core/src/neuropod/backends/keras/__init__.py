"""The original Neuropod's keras backend package; see :mod:`neuropod.backends`."""
