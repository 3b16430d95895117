"""Bounds on what a zip package may unpack to: ``NEUROPOD_MAX_PACKAGE_BYTES`` and
``NEUROPOD_MAX_PACKAGE_FILES``, and the check of a limit given as an argument."""

from __future__ import annotations

import os
import re
from typing import Any

from neuropod.errors import PackageError

#: Default bound on a zip package's uncompressed size (``NEUROPOD_MAX_PACKAGE_BYTES``):
#: a guard against zip bombs, not a quota.
DEFAULT_MAX_PACKAGE_BYTES = 32 * 2**30
#: Default bound on the number of members of a zip package (``NEUROPOD_MAX_PACKAGE_FILES``).
DEFAULT_MAX_PACKAGE_FILES = 100_000


def _limit_from_env(var: str, default: int, unit: str) -> int:
    text = os.environ.get(var, "")
    if not text.strip():
        return default
    if re.fullmatch(r"[0-9]+", text.strip()) and int(text) > 0:
        return int(text)
    raise PackageError(
        f"{var} must be a whole number of {unit} greater than 0 (default {default}), not {text!r}; "
        "fix or unset it"
    )


def max_package_bytes() -> int:
    """The bound on a zip's uncompressed size: ``NEUROPOD_MAX_PACKAGE_BYTES``, default 32 GiB."""
    return _limit_from_env("NEUROPOD_MAX_PACKAGE_BYTES", DEFAULT_MAX_PACKAGE_BYTES, "bytes")


def max_package_files() -> int:
    """The bound on a zip's member count: ``NEUROPOD_MAX_PACKAGE_FILES``, default 100000."""
    return _limit_from_env("NEUROPOD_MAX_PACKAGE_FILES", DEFAULT_MAX_PACKAGE_FILES, "files")


def check_limit_argument(name: str, value: Any) -> None:
    """Refuse a limit argument that is not None or a positive int, naming it."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be greater than 0, not {value}")
