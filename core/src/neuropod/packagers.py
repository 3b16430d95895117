"""``create_<platform>_neuropod`` functions, found among the installed plugins.

``from neuropod.packagers import create_onnx_neuropod`` works when
``neuropod-onnx`` is installed (it registers the function under the
``neuropod.packagers`` entry-point group) and otherwise raises a
:class:`~neuropod.errors.PluginNotInstalledError` saying what to install.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from neuropod.plugins import packager, packager_names

_PACKAGER = re.compile(r"create_(\w+)_neuropod")


def __getattr__(name: str) -> Callable[..., Any]:
    if not _PACKAGER.fullmatch(name):
        raise AttributeError(f"module 'neuropod.packagers' has no attribute {name!r}")
    func = packager(name)
    globals()[name] = func
    return func


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(packager_names()))
