"""``neuropod backends``: installed backends, plugins, devices and backend environments."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TextIO

from neuropod._version import __version__
from neuropod.cli.env import print_environments
from neuropod.cli.output import print_table


def cmd_backends(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod import plugins  # lazy: pluggy and the plugin registry, kept out of `neuropod --help`
    from neuropod.backend import backend_record  # lazy: the plugin registry's backends, kept out of `neuropod --help`
    from neuropod.devices import load_host, local_host  # lazy: numpy, kept out of `neuropod --help`
    from neuropod.envs import list_environments  # lazy: numpy, kept out of `neuropod --help`
    from neuropod.plugins import pip_install  # lazy: pluggy and the plugin registry, kept out of `neuropod --help`

    backends = plugins.installed_backends()
    caps = {b: plugins.backend_caps(b) for b in backends}
    host = load_host(args.host) if args.host else local_host()
    failures = plugins.plugin_failures()
    warnings_ = [f"{b.id}: {caps[b].warning}" for b in backends if caps[b].warning]
    builds = _framework_builds({b.framework for b in backends})
    if args.json:
        data = {
            "neuropod": __version__,
            "python": sys.executable,
            "backends": [backend_record(b, caps[b]) for b in backends],
            "host": host.to_dict(),
            "warnings": warnings_,
            "failed_plugins": [{"name": f.name, "distribution": f.distribution, "error": f.error} for f in failures],
            "plugins": [h.to_dict() for h in plugins.plugin_health()],
            # Backends of the backend environments (neuropod.envs), apart from this environment's own.
            "environments": [e.to_dict() for e in list_environments()],
            "framework_builds": builds,
        }
        print(json.dumps(data, indent=2), file=out)
        return 0
    print(f"neuropod {__version__} on Python {sys.version.split()[0]} ({sys.executable})", file=out)
    if backends:
        print("Backends:", file=out)
        rows = [("backend", "framework", "plugin", "devices")]
        rows += [(b.id, b.framework, b.plugin_distribution, caps[b].describe()) for b in backends]
        print_table(rows, out)
        for name, build in builds.items():
            print(f"  {name} {build['version']}: {build['build']}", file=out)
    else:

        install = pip_install("'neuropod-onnx[cpu]'")
        print(f"Backends: none installed (for example: {install})", file=out)
    for text in warnings_:
        print(f"warning: {text}", file=out)
    infos = {i.name for i in plugins.plugin_infos()}
    idle = sorted(infos - {b.plugin for b in backends})
    if idle:
        print(f"Plugins with no framework installed: {', '.join(idle)}", file=out)
    _print_plugin_health(out)
    print_environments(out)
    print(f"Host: {host.name}", file=out)
    print(host.describe(), file=out)
    if failures:
        print("Plugins that failed to load:", file=out)
        for f in failures:
            print(f"  {f}", file=out)
    return 0


def _framework_builds(frameworks: set[str]) -> dict[str, dict[str, str]]:
    """Which build of a framework is installed, where that decides whether it can use a GPU: for
    torch, ``"CPU build"`` or ``"CUDA 13.0 build"``, read from ``torch/version.py`` without importing torch."""
    import importlib.util
    from importlib import metadata

    builds: dict[str, dict[str, str]] = {}
    if "torch" in frameworks:
        try:
            spec = importlib.util.find_spec("torch")
            text = Path(spec.origin).with_name("version.py").read_text() if spec and spec.origin else ""
            version = metadata.version("torch")
        except (OSError, ImportError, ValueError, metadata.PackageNotFoundError):
            return builds
        found = {k: v for k, v in re.findall(r"^(cuda|hip)\s*(?::[^=]*)?=\s*'([^']+)'", text, re.M)}
        if "cuda" in found:
            build = f"CUDA {found['cuda']} build"
        elif "hip" in found:
            build = f"ROCm (HIP {found['hip']}) build"
        else:
            build = "CPU build (it cannot use a GPU; a CUDA build can)"
        builds["torch"] = {"version": version, "build": build}
    return builds


def _print_plugin_health(out: TextIO) -> None:
    from neuropod import plugins  # lazy: pluggy and the plugin registry, kept out of `neuropod --help`

    health = plugins.plugin_health()
    if not health:
        return
    print("Plugins:", file=out)
    rows = [("plugin", "distribution", "version", "requires neuropod", f"ok for {__version__}", "state")]
    for h in health:
        needs = h.core_range if h.core_range else ("(any)" if h.core_range == "" else "(unknown)")
        rows.append((h.name, h.distribution, h.version, needs, "yes" if h.core_ok else "NO", h.state.split("\n")[0]))
    print_table(rows, out)
