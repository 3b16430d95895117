"""Remote models: ``load_neuropod("grpc://host:8001/model")`` and lists of such URLs.

The core only recognises a URL and hands it to the handler registered for
its scheme in the ``neuropod.remotes`` entry-point group: neuropod-serving
registers ``grpc``, ``grpcs``, ``http`` and ``https``; a company can add its
own scheme the same way. A handler is a callable ``handler(urls, **options)``
returning a :class:`~neuropod.model.NeuropodModel`. Without one, loading
says which distribution to install. The core gains no dependency.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from neuropod.errors import NeuropodError, PackageError, PluginNotInstalledError

if TYPE_CHECKING:
    from neuropod.model import NeuropodModel

ENTRY_POINT_GROUP = "neuropod.remotes"
#: Schemes neuropod-serving's client handles (named in the install hint).
CLIENT_SCHEMES = ("grpc", "grpcs", "http", "https")
INSTALL_HINT = "pip install 'neuropod-serving[client]'"

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# load_neuropod's arguments that mean nothing for a model on a server, with their defaults.
_LOCAL_ONLY = {"device": None, "backend": None, "use_ope": False, "workers": 1, "restart": False}


def scheme(value: object) -> str | None:
    """The lower-case scheme when ``value`` is a URL string (``"grpc"``), else None."""
    if isinstance(value, str):
        m = _SCHEME.match(value)
        if m:
            return m.group(1).lower()
    return None


def is_remote(value: object) -> bool:
    """Whether ``load_neuropod`` should treat ``value`` as remote: a URL, or a non-empty list or tuple of them."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(scheme(v) is not None for v in value)
    return scheme(value) is not None


def _handlers() -> dict[str, Any]:
    import importlib_metadata

    return {ep.name.lower(): ep for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)}


def load_remote(urls: str | Sequence[str], **arguments: Any) -> NeuropodModel:
    """Load a remote model through its scheme's handler (``load_neuropod`` calls this for URLs).

    :raises PluginNotInstalledError: no handler for the scheme is installed.
    :raises PackageError: the scheme is unknown although neuropod-serving's schemes are installed
        (a mistyped URL); the message lists the known schemes.
    :raises ValueError: an argument that only local models take was given.
    """
    for name, default in _LOCAL_ONLY.items():
        if arguments.get(name, default) != default:
            raise ValueError(
                f"{name}={arguments[name]!r} does not apply to a remote model: the server chooses how it runs "
                f"(see `neuropod serve --help`)"
            )
    arguments = {k: v for k, v in arguments.items() if k not in _LOCAL_ONLY and k != "verify"}
    if arguments.get("timeout", 0) is None:
        del arguments["timeout"]
    url_list = [urls] if isinstance(urls, str) else list(urls)
    schemes = sorted({scheme(u) or "" for u in url_list})
    handlers = _handlers()
    missing = [s for s in schemes if s not in handlers]
    if missing and set(CLIENT_SCHEMES) <= set(handlers):
        # Nothing to install: a scheme nobody handles is a mistyped URL (grpcc://, htp://).
        url = next(u for u in url_list if scheme(u) == missing[0])
        import difflib  # only for a misspelt scheme's suggestion

        close = difflib.get_close_matches(missing[0], sorted(handlers), n=1)
        raise PackageError(
            f"Model URL {url!r:.200}: unknown scheme {missing[0]}://; the known schemes are "
            f"{', '.join(sorted(handlers))}" + (f" (did you mean {close[0]}://?)" if close else "")
        )
    if missing:
        known = [s for s in missing if s in CLIENT_SCHEMES]
        from neuropod.plugins import pip_install  # lazy: pluggy and the plugin registry, kept out of `neuropod --help`

        install = pip_install("'neuropod-serving[client]'")
        hint = install if known else (
            "installed schemes: " + (", ".join(sorted(handlers)) or "none") + f"; for {', '.join(CLIENT_SCHEMES)}: {install}"
        )  # fmt: skip
        raise PluginNotInstalledError(f"No handler for {missing[0]}:// model URLs is installed: {hint}")
    targets = {handlers[s].value for s in schemes}
    if len(targets) > 1:
        raise NeuropodError(f"The URLs' schemes {', '.join(schemes)} are handled by different plugins; load them apart")
    handler = handlers[schemes[0]].load()
    model: NeuropodModel = handler(url_list if not isinstance(urls, str) else urls, **arguments)
    return model


__all__ = ["CLIENT_SCHEMES", "ENTRY_POINT_GROUP", "INSTALL_HINT", "is_remote", "load_remote", "scheme"]
