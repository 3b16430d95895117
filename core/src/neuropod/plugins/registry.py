"""The plugin manager and its record of plugins: loading the ``neuropod.backends`` entry points once
(each on its own, a failure recorded and warned about, never breaking the others), registering and
unregistering plugins, and listing what they offer (backends, health, distributions).
The rules users see are in :mod:`neuropod.plugins`."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import importlib_metadata
import pluggy

from neuropod import hookspecs
from neuropod._version import __version__
from neuropod.backend import DIST_INFO, Backend
from neuropod.plugins.compat import core_range, core_satisfies

ENTRY_POINT_GROUP = "neuropod.backends"


class PluginWarning(UserWarning):
    """A plugin could not be loaded or misbehaved and was skipped."""


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that was skipped, and why."""

    name: str
    distribution: str
    error: str
    #: The ``neuropod`` range the plugin's distribution requires, when known.
    core_range: str | None = None

    def __str__(self) -> str:
        return f"plugin {self.name!r} from {self.distribution}: {self.error}"


@dataclass(frozen=True)
class PluginInfo:
    """A plugin that loaded."""

    name: str
    distribution: str
    module: str
    #: The ``neuropod`` range the plugin's distribution requires ("" if it names
    #: none), or None when unknown (registered in code).
    core_range: str | None = None


class _State:
    def __init__(self) -> None:
        self.pm: pluggy.PluginManager | None = None
        self.failures: list[PluginFailure] = []
        self.infos: dict[str, PluginInfo] = {}
        self.backends: list[Backend] | None = None
        self.lock = threading.RLock()


_state = _State()


def _names_from_env(var: str) -> set[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return {n.strip() for n in value.split(",") if n.strip()}


def dist_label(ep: Any) -> str:
    """``"<distribution> <version>"`` of an entry point's distribution."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "an unknown distribution"
    # The .dist-info folder name says it without parsing METADATA (which
    # costs the email package's import: a third of listing backends).
    folder = getattr(getattr(dist, "_path", None), "name", "")
    m = DIST_INFO.fullmatch(folder)
    if m:
        return f"{m['name'].replace('_', '-')} {m['version']}"
    return f"{dist.name} {dist.version}"


def record_failure(name: str, distribution: str, error: str, core: str | None = None) -> None:
    failure = PluginFailure(name, distribution, error, core)
    _state.failures.append(failure)
    warnings.warn(f"Neuropod skipped {failure}", PluginWarning, stacklevel=3)


def get_plugin_manager() -> pluggy.PluginManager:
    """The plugin manager with every allowed, working plugin registered."""
    pm = _state.pm
    if pm is not None:
        return pm
    with _state.lock:
        if _state.pm is None:
            pm = pluggy.PluginManager("neuropod")
            pm.add_hookspecs(hookspecs)
            _load_entry_points(pm)
            pm.check_pending()
            _state.pm = pm
        return _state.pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    allow = _names_from_env("NEUROPOD_PLUGINS")
    block = _names_from_env("NEUROPOD_DISABLE_PLUGINS") or set()
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        if (allow is not None and ep.name not in allow) or ep.name in block:
            continue
        label = dist_label(ep)
        if pm.has_plugin(ep.name):
            record_failure(ep.name, label, "another plugin already uses this entry-point name")
            continue
        core = core_range(ep.dist) if ep.dist is not None else None
        if not core_satisfies(core):
            dist_name = label.rsplit(" ", 1)[0]
            record_failure(
                ep.name, label,
                f"requires neuropod{core}, but this is neuropod {__version__}: install a release of {dist_name} "
                f"made for neuropod {__version__}, or a neuropod in {core}",
                core,
            )  # fmt: skip
            continue
        try:
            module = ep.load()
        except Exception as e:  # noqa: BLE001 - a plugin's import can fail in any way
            record_failure(ep.name, label, f"import failed: {type(e).__name__}: {e}", core)
            continue
        register(module, ep.name, label, pm=pm, core_range=core)


def register(
    plugin: object,
    name: str,
    distribution: str = "(registered in code)",
    *,
    pm: pluggy.PluginManager | None = None,
    core_range: str | None = None,
) -> bool:
    """Register a plugin object by hand (tests, embedded backends).

    :param core_range: the ``neuropod`` range its distribution requires, if known.

    :returns: whether it was registered; a plugin with an unknown hook or a
        bad signature is skipped with a :class:`PluginWarning`.
    """
    pm = pm or get_plugin_manager()
    try:
        pm.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as e:
        record_failure(name, distribution, str(e), core_range)
        return False
    unknown = [c.name for c in (pm.get_hookcallers(plugin) or []) if not c.has_spec()]
    if unknown:
        pm.unregister(plugin)
        record_failure(name, distribution, f"implements hooks that do not exist: {', '.join(unknown)}", core_range)
        return False
    module = getattr(plugin, "__name__", type(plugin).__name__)
    _state.infos[name] = PluginInfo(name, distribution, module, core_range)
    _state.backends = None
    return True


def unregister(name: str) -> None:
    """Remove a plugin registered with :func:`register`."""
    pm = get_plugin_manager()
    if pm.has_plugin(name):
        pm.unregister(name=name)
    _state.infos.pop(name, None)
    _state.backends = None


def reset() -> None:
    """Forget every plugin; the next call loads them again (for tests)."""
    with _state.lock:
        _state.pm = None
        _state.failures = []
        _state.infos = {}
        _state.backends = None


def plugin_failures() -> list[PluginFailure]:
    """The plugins that were skipped, and why."""
    get_plugin_manager()
    return list(_state.failures)


def plugin_infos() -> list[PluginInfo]:
    """The plugins that loaded."""
    get_plugin_manager()
    return list(_state.infos.values())


def plugin_info(name: str) -> PluginInfo | None:
    """The plugin called ``name`` if it loaded, without loading the plugins."""
    return _state.infos.get(name)


def installed_backends() -> list[Backend]:
    """Every backend the loaded plugins can run in this environment."""
    pm = get_plugin_manager()
    if _state.backends is not None:
        return list(_state.backends)
    backends: list[Backend] = []
    for impl in pm.hook.supported_versions.get_hookimpls():
        info = _state.infos.get(impl.plugin_name)
        dist = info.distribution if info else "(unknown)"
        try:
            found = impl.function()
            if not isinstance(found, (list, tuple)) or not all(isinstance(b, Backend) for b in found):
                raise TypeError(f"supported_versions returned {found!r}, not a list of neuropod.Backend")
        except Exception as e:  # noqa: BLE001 - a broken plugin must not break the others
            record_failure(impl.plugin_name, dist, f"supported_versions failed: {type(e).__name__}: {e}")
            continue
        backends.extend(b.with_origin(impl.plugin_name, dist) for b in found)
    _state.backends = backends
    return list(backends)


@dataclass(frozen=True)
class PluginHealth:
    """One plugin as ``neuropod backends`` shows it."""

    name: str
    distribution: str
    version: str
    #: The ``neuropod`` range its distribution requires ("" none, None unknown).
    core_range: str | None
    #: Whether this core's version is in that range.
    core_ok: bool
    #: ``"loaded"``, ``"loaded, no framework installed"`` or ``"skipped: <why>"``.
    state: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "distribution": self.distribution, "version": self.version,
            "requires_neuropod": self.core_range, "core_satisfies": self.core_ok, "state": self.state,
        }  # fmt: skip


def plugin_health() -> list[PluginHealth]:
    """Every plugin that loaded or was skipped: distribution, version, core range and state."""
    running = {b.plugin for b in installed_backends()}
    found: dict[str, PluginHealth] = {}
    for info in plugin_infos():
        dist, _, version = info.distribution.rpartition(" ")
        state = "loaded" if info.name in running else "loaded, no framework installed"
        found[info.name] = PluginHealth(
            info.name, dist or info.distribution, version, info.core_range, core_satisfies(info.core_range), state
        )
    for f in plugin_failures():
        if f.name in found and found[f.name].state.startswith("loaded"):
            found[f.name] = replace(found[f.name], state=f"failed: {f.error}")
            continue
        dist, _, version = f.distribution.rpartition(" ")
        found[f.name] = PluginHealth(
            f.name, dist or f.distribution, version, f.core_range, core_satisfies(f.core_range), f"skipped: {f.error}"
        )
    return sorted(found.values(), key=lambda h: h.name)


def plugin_distributions() -> Mapping[str, str]:
    """Entry-point name to ``"<distribution> <version>"`` for every loaded plugin."""
    return {i.name: i.distribution for i in plugin_infos()}
