"""Finding backend plugins: entry points, allow and block lists, failures.

Plugins are loaded once, lazily, by :func:`get_plugin_manager`. Each entry
point is loaded on its own; one that fails (import error, hook with no spec,
a hook that raises while listing its backends) is skipped with a
:class:`PluginWarning` naming its distribution and version, and recorded so
``neuropod backends`` can show it. It never breaks the other plugins.

Environment variables, by entry-point name (e.g. ``onnx``):

* ``NEUROPOD_PLUGINS=onnx,torchscript`` loads only those plugins.
* ``NEUROPOD_DISABLE_PLUGINS=tensorflow`` loads all but those.

A plugin whose distribution requires a ``neuropod`` range that this core's
version is not in (its ``Requires-Dist``) is skipped before it is imported,
with that reason, instead of failing at call time.
"""

from neuropod.plugins.compat import core_range, core_satisfies
from neuropod.plugins.hints import KNOWN_FRAMEWORKS as KNOWN_FRAMEWORKS
from neuropod.plugins.hints import (
    KNOWN_PLATFORMS,
    import_framework,
    install_hint,
    pip_install,
    source_checkout,
)
from neuropod.plugins.hooks import INFER_ARGS_WITH_DEVICE as INFER_ARGS_WITH_DEVICE
from neuropod.plugins.hooks import backend_caps, bound_hook
from neuropod.plugins.hooks import infer_caller as infer_caller
from neuropod.plugins.hooks import parameters_caller as parameters_caller
from neuropod.plugins.hooks import stream_caller as stream_caller
from neuropod.plugins.packager_lookup import PACKAGER_GROUP, packager
from neuropod.plugins.packager_lookup import packager_names as packager_names
from neuropod.plugins.registry import (
    ENTRY_POINT_GROUP,
    PluginFailure,
    PluginHealth,
    PluginInfo,
    PluginWarning,
    get_plugin_manager,
    installed_backends,
    plugin_failures,
    plugin_health,
    plugin_infos,
    register,
    reset,
    unregister,
)
from neuropod.plugins.registry import plugin_distributions as plugin_distributions

__all__ = [
    "ENTRY_POINT_GROUP",
    "KNOWN_PLATFORMS",
    "PACKAGER_GROUP",
    "PluginFailure",
    "PluginHealth",
    "PluginInfo",
    "PluginWarning",
    "backend_caps",
    "bound_hook",
    "core_range",
    "core_satisfies",
    "get_plugin_manager",
    "import_framework",
    "install_hint",
    "pip_install",
    "source_checkout",
    "stream_caller",
    "installed_backends",
    "packager",
    "plugin_failures",
    "plugin_health",
    "plugin_infos",
    "register",
    "reset",
    "unregister",
]
