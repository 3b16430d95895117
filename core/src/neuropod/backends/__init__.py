"""The original Neuropod's import paths for its packagers (``neuropod.backends.<name>.packager``).

They live in the backend plugins now; these modules forward to them, so
``from neuropod.backends.keras.packager import infer_keras_input_spec`` keeps
working when ``neuropod-tensorflow`` is installed and otherwise raises a
:class:`~neuropod.errors.PluginNotInstalledError` saying what to install.
Importing them imports no framework.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from neuropod.errors import PluginNotInstalledError
from neuropod.plugins import pip_install


def forward(module: str, target: str, names: tuple[str, ...], distribution: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that takes ``names`` from the plugin module ``target``."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        try:
            found = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name is None or not target.startswith(e.name):
                raise
            raise PluginNotInstalledError(
                f"{module}.{name} is part of the {distribution} plugin, which is not installed: "
                f"{pip_install(distribution)}"
            ) from None
        return getattr(found, name)

    return __getattr__
