"""Finding a packager (``create_<platform>_neuropod``) among the installed plugins."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import importlib_metadata

from neuropod.errors import PluginNotInstalledError
from neuropod.plugins.hints import install_hint
from neuropod.plugins.registry import dist_label

PACKAGER_GROUP = "neuropod.packagers"


def packager(name: str) -> Callable[..., Any]:
    """Find ``create_<platform>_neuropod`` among the installed plugins."""
    for ep in importlib_metadata.entry_points(group=PACKAGER_GROUP):
        if ep.name == name:
            try:
                func: Callable[..., Any] = ep.load()
            except Exception as e:
                raise PluginNotInstalledError(
                    f"{name} is provided by {dist_label(ep)}, which failed to import: {type(e).__name__}: {e}"
                ) from e
            return func
    platform = name[len("create_") : -len("_neuropod")]
    raise PluginNotInstalledError(f"{name} needs the {platform!r} backend plugin: {install_hint(platform)}")


def packager_names() -> Sequence[str]:
    return sorted(ep.name for ep in importlib_metadata.entry_points(group=PACKAGER_GROUP))
