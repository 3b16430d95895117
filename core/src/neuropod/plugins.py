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

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import importlib_metadata
import pluggy

from neuropod import hookspecs
from neuropod._version import __version__
from neuropod.backend import DIST_INFO, Backend, DeviceCaps
from neuropod.errors import NoBackendError, PluginNotInstalledError

ENTRY_POINT_GROUP = "neuropod.backends"
PACKAGER_GROUP = "neuropod.packagers"

#: The wheel that provides each platform we know of, for "pip install" hints.
KNOWN_PLATFORMS = {
    "onnx": "neuropod-onnx",
    "torchscript": "neuropod-torchscript",
    "tensorflow": "neuropod-tensorflow",
    "keras": "neuropod-tensorflow",
    "tensorrt": "neuropod-tensorrt",
    "python": "neuropod-python",
    "torch_export": "neuropod-torch",
    "aoti": "neuropod-torch",
    "jax": "neuropod-jax",
}
#: Platforms a package can name ("keras" above is a packager's name; its packages say "tensorflow").
_RUNNABLE_PLATFORMS = sorted(set(KNOWN_PLATFORMS) - {"keras"})
#: What to install when a platform's plugin is there but its framework is not.
KNOWN_FRAMEWORKS = {
    "onnx": "'neuropod-onnx[cpu]' (or 'neuropod-onnx[gpu]' for NVIDIA GPUs; or install onnxruntime or "
            "onnxruntime-gpu yourself)",
    "torchscript": "torch",
    "tensorflow": "'neuropod-tensorflow[cpu]' (or 'neuropod-tensorflow[gpu]', or any tensorflow distribution)",
    "keras": "'neuropod-tensorflow[cpu]' (or 'neuropod-tensorflow[gpu]', or any tensorflow distribution)",
    "tensorrt": "'neuropod-tensorrt[tensorrt]' (TensorRT needs an NVIDIA GPU)",
    "torch_export": "torch",
    "aoti": "torch (the release the package was compiled with)",
    "jax": "jax ('jax[cuda12]' or 'jax[cuda13]' for NVIDIA GPUs)",
}


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


def _dist_label(ep: Any) -> str:
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


# A Requires-Dist header for the core: "neuropod", maybe extras, then a
# specifier (maybe in parentheses), maybe a marker. "neuropod-onnx" does not match.
_REQUIRES_CORE = re.compile(
    r"Requires-Dist:\s*neuropod\s*(?:\[[^\]]*\])?\s*\(?(?P<spec>(?:[<>=!~][^;()]*)?)\)?\s*(?:;(?P<marker>.*))?",
    re.IGNORECASE,
)
_SIMPLE_CLAUSE = re.compile(r"(?P<op>>=|<=|==|!=|>|<)(?P<version>\d+(?:\.\d+)*)")
_COMPARE: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


def core_range(dist: Any) -> str | None:
    """The ``neuropod`` range a distribution requires (``">=0.4,<0.5"``), ``""``
    when it names none, or None when its metadata cannot be read.

    Reads the ``Requires-Dist`` lines of its METADATA directly: parsing the
    whole file with the email package would cost a third of listing backends.
    Requirements under an extra do not count.
    """
    try:
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    except Exception:  # noqa: BLE001 - unreadable metadata is "unknown", not an error
        return None
    for line in text.splitlines():
        if not line.strip():
            break  # the headers end at the first blank line; the description follows
        m = _REQUIRES_CORE.fullmatch(line.strip())
        if m and "extra" not in (m["marker"] or ""):
            return m["spec"].replace(" ", "")
    return ""


def core_satisfies(spec: str | None, version: str = __version__) -> bool:
    """Whether ``version`` of the core is in a plugin's required range (an empty or unknown range admits it)."""
    if not spec:
        return True
    clauses = spec.split(",")
    matches = [_SIMPLE_CLAUSE.fullmatch(c) for c in clauses]
    if re.fullmatch(r"\d+(\.\d+)*", version) and all(matches):
        # The usual ">=0.4,<0.5" without importing packaging.specifiers (15 ms).
        def release(v: str) -> tuple[int, ...]:
            parts = [int(p) for p in v.split(".")]
            return tuple(parts + [0] * (4 - len(parts)))

        return all(_COMPARE[m["op"]](release(version), release(m["version"])) for m in matches if m)
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        return SpecifierSet(spec).contains(version, prereleases=True)
    except InvalidSpecifier:
        return True  # pip would not have installed it; let the import decide


def _fail(name: str, distribution: str, error: str, core: str | None = None) -> None:
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
        label = _dist_label(ep)
        if pm.has_plugin(ep.name):
            _fail(ep.name, label, "another plugin already uses this entry-point name")
            continue
        core = core_range(ep.dist) if ep.dist is not None else None
        if not core_satisfies(core):
            dist_name = label.rsplit(" ", 1)[0]
            _fail(
                ep.name, label,
                f"requires neuropod{core}, but this is neuropod {__version__}: install a release of {dist_name} "
                f"made for neuropod {__version__}, or a neuropod in {core}",
                core,
            )  # fmt: skip
            continue
        try:
            module = ep.load()
        except Exception as e:  # noqa: BLE001 - a plugin's import can fail in any way
            _fail(ep.name, label, f"import failed: {type(e).__name__}: {e}", core)
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
        _fail(name, distribution, str(e), core_range)
        return False
    unknown = [c.name for c in (pm.get_hookcallers(plugin) or []) if not c.has_spec()]
    if unknown:
        pm.unregister(plugin)
        _fail(name, distribution, f"implements hooks that do not exist: {', '.join(unknown)}", core_range)
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
            _fail(impl.plugin_name, dist, f"supported_versions failed: {type(e).__name__}: {e}")
            continue
        backends.extend(b.with_origin(impl.plugin_name, dist) for b in found)
    _state.backends = backends
    return list(backends)


def _impl(hook_name: str, plugin: str) -> Callable[..., Any]:
    """The function implementing ``hook_name`` in one plugin, called with
    only the arguments it declares."""
    pm = get_plugin_manager()
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        if impl.plugin_name == plugin:
            func, argnames = impl.function, tuple(impl.argnames)

            def call(func: Callable[..., Any] = func, argnames: tuple[str, ...] = argnames, **kwargs: Any) -> Any:
                return func(**{k: kwargs[k] for k in argnames})

            call.function = func  # type: ignore[attr-defined]
            call.argnames = argnames  # type: ignore[attr-defined]
            # Arguments declared with a default (``parameters=None``): passed only when there are some.
            call.kwargnames = tuple(getattr(impl, "kwargnames", ()))  # type: ignore[attr-defined]
            return call
    raise NoBackendError(f"Plugin {plugin!r} does not implement the {hook_name!r} hook")


def bound_hook(hook_name: str, backend: Backend) -> Callable[..., Any]:
    """The implementation of a hook in the plugin that offers ``backend``.

    :raises NoBackendError: ``backend`` lives elsewhere (a backend
        environment, a described host): its plugin in this process would run
        this environment's framework, not that one's.
    """
    if backend.location != "in-process":
        raise NoBackendError(
            f"Backend {backend.id} lives in {backend.location}, not in this process; "
            "it runs in a worker process started from there (load_neuropod does that)"
        )
    return _impl(hook_name, backend.plugin)


_INFER_ARGS = ("model", "inputs", "requested_outputs")
#: The ``infer`` hook's arguments when an implementation takes ``output_device`` too, in this order.
INFER_ARGS_WITH_DEVICE = (*_INFER_ARGS, "output_device")


def infer_caller(impl: Any) -> Callable[[Any, Any, Any], Any]:
    """A plugin's ``infer`` implementation (from :func:`bound_hook`) as ``call(model, inputs, requested_outputs)``.

    Hooks grow by adding arguments and a plugin may take any of them, so this
    passes each what it takes (``output_device`` as None: numpy outputs), with
    no per-call work for the common signatures.
    """
    fn, args = impl.function, tuple(impl.argnames)
    if args == _INFER_ARGS:
        return fn  # type: ignore[no-any-return]
    if args == INFER_ARGS_WITH_DEVICE:
        # A partial, not a lambda: no Python frame of ours between the model and the plugin.
        return functools.partial(fn, output_device=None)

    def call(model: Any, inputs: Any, requested: Any) -> Any:
        values = {"model": model, "inputs": inputs, "requested_outputs": requested, "output_device": None,
                  "parameters": None}  # fmt: skip
        return fn(**{k: values[k] for k in args})

    return call


def parameters_caller(impl: Any) -> Callable[[Any, Any, Any, Any], Any] | None:
    """A plugin's ``infer`` implementation as ``call(model, inputs, requested_outputs, parameters)``
    when it takes ``parameters`` (request parameters for the model), else None."""
    fn = impl.function
    declared = (*impl.argnames, *getattr(impl, "kwargnames", ()))
    if "parameters" not in declared:
        return None
    takes_device = "output_device" in declared

    def call(model: Any, inputs: Any, requested: Any, parameters: Any) -> Any:
        if takes_device:
            return fn(
                model=model, inputs=inputs, requested_outputs=requested, output_device=None, parameters=parameters
            )
        return fn(model=model, inputs=inputs, requested_outputs=requested, parameters=parameters)

    return call


def backend_caps(backend: Backend) -> DeviceCaps:
    """What ``backend`` can run on; CPU only if its plugin does not say.

    Asked of the plugin that reported the backend even when the backend runs
    elsewhere (e.g. the python plugin's other interpreters): ``device_caps``
    reads metadata only, never the framework.
    """
    try:
        caps = _impl("device_caps", backend.plugin)(backend=backend)
    except NoBackendError:
        return DeviceCaps(cpu=True, note="plugin does not report device_caps")
    except Exception as e:  # noqa: BLE001 - as above
        info = _state.infos.get(backend.plugin)
        _fail(backend.plugin, info.distribution if info else "(unknown)", f"device_caps failed: {e}")
        return DeviceCaps(cpu=False, note=f"device_caps failed: {e}")
    return caps if isinstance(caps, DeviceCaps) else DeviceCaps(cpu=True)


@functools.cache
def source_checkout() -> Path | None:
    """The Neuropod checkout the core was installed from (``pip install ./core``), or None."""
    import urllib.parse
    import urllib.request

    try:
        text = importlib_metadata.distribution("neuropod").read_text("direct_url.json")
        url = json.loads(text or "{}").get("url", "")
    except Exception:  # noqa: BLE001 - no record, or not one we understand: no checkout
        return None
    if not isinstance(url, str) or not url.startswith("file:"):
        return None
    core = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
    root = core.parent
    return root if (core / "pyproject.toml").is_file() and (root / "plugins").is_dir() else None


_OUR_REQUIREMENT = re.compile(r"'?\b(neuropod-[a-z]+)(\[[a-z0-9,]+\])?'?(?=[\s,;)]|$)")


def pip_install(requirements: str) -> str:
    """``pip install REQUIREMENTS``, for an error's hint.

    Our wheels are named as on a package index, except when the core was
    installed from a checkout of the Neuropod repository: then each of ours
    is that checkout's folder (``pip install '/src/neuropod/plugins/neuropod-onnx[cpu]'``),
    which works as written where a bare name would not.
    """
    root = source_checkout()
    if root is not None:

        def local(match: re.Match[str]) -> str:
            name, extras = match.group(1), match.group(2) or ""
            folder = root / ("serving" if name == "neuropod-serving" else f"plugins/{name}")
            return f"'{folder}{extras}'" if (folder / "pyproject.toml").is_file() else match.group(0)

        requirements = _OUR_REQUIREMENT.sub(local, requirements)
    return f"pip install {requirements}"


def install_hint(platform: str) -> str:
    """What to install to run a platform."""
    dist = KNOWN_PLATFORMS.get(platform)
    plugin = _state.infos.get(platform)  # plugins are named for the platform they run
    idle = plugin is not None and not any(b.plugin == platform for b in installed_backends())
    if plugin is not None and idle and platform in KNOWN_FRAMEWORKS:
        return f"{plugin.distribution} is installed, but its framework is not: {pip_install(KNOWN_FRAMEWORKS[platform])}"
    if dist:
        return pip_install(dist)
    return (
        f"no known Neuropod plugin runs platform {platform!r} (known: {', '.join(sorted(_RUNNABLE_PLATFORMS))}); "
        "install the plugin that provides it"
    )


def import_framework(
    module: str, platform: str, needed_by: str, importer: Callable[[], Any] | None = None
) -> Any:
    """Import a backend's framework for a packager or demo, or say what installs it.

    Plugins import their framework only when a function needs it; this is
    that import, so a user who installed a plugin without its framework (e.g.
    ``neuropod-onnx`` without its ``[cpu]`` extra) reads what to install
    instead of a ``ModuleNotFoundError``. Call it first and then import as
    usual (``import torch``) where the framework's types matter to a checker.

    :param module: the module to import, e.g. ``"onnxruntime"`` or ``"jax.export"``.
    :param platform: the platform it runs, for the install hint (``"onnx"``).
    :param needed_by: what needs it, for the message (``"create_onnx_neuropod"``).
    :param importer: imports it instead of :func:`importlib.import_module` (e.g. quietly).
    :returns: the imported module.
    :raises PluginNotInstalledError: the module is missing, or is installed and fails to import.
    """
    try:
        return importer() if importer is not None else importlib.import_module(module)
    except ImportError as e:
        hint = KNOWN_FRAMEWORKS.get(platform, module)
        top = module.split(".")[0]
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == top:
            raise PluginNotInstalledError(f"{needed_by} needs {top}, which is not installed: {pip_install(hint)}") from e
        raise PluginNotInstalledError(
            f"{needed_by} needs {top}, which is installed but failed to import ({type(e).__name__}: "
            f"{' '.join(str(e).split())}); reinstall it: {pip_install(hint)}"
        ) from e


def packager(name: str) -> Callable[..., Any]:
    """Find ``create_<platform>_neuropod`` among the installed plugins."""
    for ep in importlib_metadata.entry_points(group=PACKAGER_GROUP):
        if ep.name == name:
            try:
                func: Callable[..., Any] = ep.load()
            except Exception as e:
                raise PluginNotInstalledError(
                    f"{name} is provided by {_dist_label(ep)}, which failed to import: {type(e).__name__}: {e}"
                ) from e
            return func
    platform = name[len("create_") : -len("_neuropod")]
    raise PluginNotInstalledError(f"{name} needs the {platform!r} backend plugin: {install_hint(platform)}")


def packager_names() -> Sequence[str]:
    return sorted(ep.name for ep in importlib_metadata.entry_points(group=PACKAGER_GROUP))


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
    "installed_backends",
    "packager",
    "plugin_failures",
    "plugin_health",
    "plugin_infos",
    "register",
    "reset",
    "unregister",
]
