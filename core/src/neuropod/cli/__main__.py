"""``python -m neuropod.cli``: the ``neuropod`` command (as ``python -m neuropod``)."""

import sys

from neuropod.cli import main

sys.exit(main())
