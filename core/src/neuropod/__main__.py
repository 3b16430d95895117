"""``python -m neuropod``: the ``neuropod`` command."""

import sys

from neuropod.cli import main

sys.exit(main())
