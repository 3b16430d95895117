"""``neuropod demo``: package a small model with a plugin's demo, explain its resolution and run it."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import importlib_metadata

from neuropod.cli.inspect import cmd_inspect
from neuropod.cli.output import fmt_array, short
from neuropod.errors import NeuropodError, PluginNotInstalledError, SpecError


def _build_demo(build: Any, work: Path, *, keep: bool, overwrite: bool) -> tuple[Path, Any, Any]:
    """Run a demo's builder into ``work``. A kept directory (``--dir``) gets the package through a
    hidden directory beside it, so that a package left there by an earlier run is replaced only with
    ``--overwrite``, and only by a complete one."""
    from neuropod.package import replace_package  # lazy: numpy, kept out of `neuropod --help`

    if not keep:
        built: tuple[Path, Any, Any] = build(work)
        return built
    work.mkdir(parents=True, exist_ok=True)
    new_dir = Path(tempfile.mkdtemp(prefix=".neuropod-demo-", dir=work))
    try:
        new, inputs, bad_inputs = build(new_dir)
        path = work / Path(new).relative_to(new_dir)
        if os.path.lexists(path):
            if not overwrite:
                raise NeuropodError(
                    f"--dir {short(str(work))} already holds {path.name} (from an earlier run?): pass --overwrite to "
                    "replace it, or choose another --dir"
                )
            replace_package(Path(new), path)
        else:
            Path(new).rename(path)
    finally:
        shutil.rmtree(new_dir, ignore_errors=True)
    return path, inputs, bad_inputs


def _default_demo(demos: dict[str, Any]) -> str:
    """The demo ``neuropod demo`` runs without a platform: onnx's, else the first, preferring a
    plugin whose framework is installed (a plugin without it says what to install)."""
    from neuropod import plugins  # lazy: pluggy and the plugin registry, kept out of `neuropod --help`

    runnable = {b.plugin_distribution.split(" ")[0] for b in plugins.installed_backends()}
    order = sorted(demos, key=lambda n: (n != "onnx", n))
    return next((n for n in order if getattr(demos[n].dist, "name", None) in runnable), order[0])


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.loader import load_neuropod, plan  # lazy: numpy, kept out of `neuropod --help`
    from neuropod.package import read_package  # lazy: numpy, kept out of `neuropod --help`
    from neuropod.plugins import pip_install  # lazy: pluggy and the plugin registry, kept out of `neuropod --help`

    demos = {ep.name: ep for ep in importlib_metadata.entry_points(group="neuropod.demos")}
    if not demos:
        install = pip_install("'neuropod-onnx[cpu]'")
        raise PluginNotInstalledError(f"neuropod demo needs a backend plugin with a demo: {install}")
    name = args.platform or _default_demo(demos)
    if name not in demos:
        raise NeuropodError(f"No demo for platform {name!r}; installed demos: {', '.join(sorted(demos))}")
    build = demos[name].load()
    with tempfile.TemporaryDirectory(prefix="neuropod-demo-") as tmp:
        work = Path(args.dir) if args.dir else Path(tmp)
        print(f"1. Packaging a small {name} model into {work}", file=out)
        t0 = time.perf_counter()
        path, inputs, bad_inputs = _build_demo(build, work, keep=bool(args.dir), overwrite=args.overwrite)
        print(f"   wrote {path} in {(time.perf_counter() - t0) * 1e3:.0f} ms", file=out)
        print("\n2. The package:", file=out)
        cmd_inspect(argparse.Namespace(package=path, no_verify=False, json=False), out)
        print("\n3. Resolution on this machine:", file=out)
        print(plan(read_package(path)).explain(), file=out)
        print("\n4. Inference:", file=out)
        t0 = time.perf_counter()
        with load_neuropod(path) as model:
            print(f"   loaded {model!r} in {(time.perf_counter() - t0) * 1e3:.0f} ms", file=out)
            outputs = model.infer(inputs)
            for k, v in inputs.items():
                print(f"   input  {k}: {fmt_array(v)}", file=out)
            for k, v in outputs.items():
                print(f"   output {k}: {fmt_array(v)}", file=out)
            print("\n5. Inputs that break the spec give a clear error:", file=out)
            try:
                model.infer(bad_inputs)
            except SpecError as e:
                print(f"   SpecError: {e}", file=out)
    return 0
