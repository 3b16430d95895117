"""The original Neuropod's pytorch backend package (eager PyTorch as Python code); see :mod:`neuropod.backends`."""
