"""``neuropod env``: create, list, prepare, prune and remove backend environments."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, TextIO

from neuropod.cli.output import print_table, safe
from neuropod.errors import NeuropodError


def _env_backends_text(env: Any) -> str:
    return ", ".join(f"{b.id} ({c.describe()})" for b, c in env.backends) or "none"


def print_environments(out: TextIO) -> None:
    """The "Backend environments" section of ``neuropod backends``."""
    from neuropod.envs import list_environments  # lazy: numpy, kept out of `neuropod --help`

    envs = list_environments()
    if not envs:
        return
    print("Backend environments (models they run are loaded in worker processes):", file=out)
    rows = [("backend", "framework", "plugin", "devices", "where")]
    for e in envs:
        if not e.ok:
            rows.append(("-", "", "", "", f"env:{e.name} UNUSABLE: see neuropod env list"))
        rows += [(b.id, b.framework, b.plugin_distribution, c.describe(), b.location) for b, c in e.backends if e.ok]
    print_table(rows, out)


def cmd_env_create(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.envs import create_environment  # lazy: numpy, kept out of `neuropod --help`

    t0 = time.perf_counter()
    env = create_environment(
        args.spec, name=args.name, python=args.python, find_links=args.find_links, replace=args.replace, out=out,
        verbose=args.verbose,
    )
    print(f"Backend environment {env.name!r} ({env.spec}, Python {env.python_version}) "
          f"created in {time.perf_counter() - t0:.0f} s", file=out)
    print(f"  path:     {env.path}", file=out)
    print(f"  backends: {_env_backends_text(env)}", file=out)
    return 0


def cmd_env_list(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.envs import envs_dir, list_environments  # lazy: numpy, kept out of `neuropod --help`

    envs = list_environments()
    if args.json:
        print(json.dumps({"home": str(envs_dir()), "environments": [e.to_dict() for e in envs]}, indent=2), file=out)
        return 0
    if not envs:
        print(f"No backend environments in {envs_dir()} "
              "(create one with: neuropod env create onnx==1.20.1)", file=out)
        return 0
    print(f"Environments in {envs_dir()}:", file=out)
    rows = [("name", "spec", "backends", "python", "path")]
    rows += [(e.name, e.spec or "?", _env_backends_text(e) if e.ok else "UNUSABLE (below)",
              e.python_version or "?", str(e.path)) for e in envs if e.kind == "backend"]
    if len(rows) > 1:
        print_table(rows, out)
    locks = [e for e in envs if e.kind == "lock"]
    if locks:
        if len(rows) > 1:
            print(file=out)
        print("Lock environments (built for packages' requirements.lock; `neuropod env prune` removes unused ones):",
              file=out)
        rows = [("name", "requirements", "python", "last used", "used by")]
        for e in locks:
            users = ", ".join(u["name"] for u in e.used_by[:3]) + (f" +{len(e.used_by) - 3} more" if len(e.used_by) > 3 else "")
            rows.append((e.name, e.spec.removeprefix("lock: ") or "?", e.python_version or "?",
                         (e.last_used or e.created or "?")[:19].replace("T", " "), users or "-"))
        print_table(rows, out)
    for e in envs:
        if not e.ok:
            print(f"{e.name}: {e.problem}", file=out)
    return 0


def cmd_env_prepare(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.envs import lock_environment  # lazy: numpy, kept out of `neuropod --help`
    from neuropod.loader import plan  # lazy: numpy, kept out of `neuropod --help`
    from neuropod.package import read_package  # lazy: numpy, kept out of `neuropod --help`

    for path in args.packages:
        pkg = read_package(path)
        chosen = plan(pkg).raise_if_unresolved()
        lock = pkg.requirements_lock
        if lock is None and not chosen.backend.location.startswith("python:"):
            print(f"{safe(pkg.name)}: needs no environment of its own (runs with {chosen.backend.id}, "
                  f"{chosen.backend.location})", file=out)  # fmt: skip
            continue
        t0 = time.perf_counter()
        env = lock_environment(lock or "", chosen.backend, package_name=pkg.name, package_source=str(pkg.source),
                               out=out, verbose=args.verbose)  # fmt: skip
        print(f"{safe(pkg.name)}: environment {env.name} ready ({env.path}, {time.perf_counter() - t0:.1f} s)", file=out)
    return 0


def cmd_env_prune(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.envs import envs_dir, prune_environments  # lazy: numpy, kept out of `neuropod --help`

    if not args.days >= 0:  # also NaN, which compares false with everything
        raise NeuropodError(f"--days must be a number >= 0, not {args.days:g}")
    gone = prune_environments(args.days, dry_run=args.dry_run)
    verb = "Would remove" if args.dry_run else "Removed"
    for e in gone:
        users = ", ".join(u["name"] for u in e.used_by) or "no package"
        print(f"{verb} {e.name} (last used {(e.last_used or e.created or '?')[:19].replace('T', ' ')} by {users})", file=out)
    print(f"{verb} {len(gone)} lock environment(s) unused for {args.days:g} day(s) in {envs_dir()}", file=out)
    return 0


def cmd_env_remove(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.envs import get_environment, remove_environment  # lazy: numpy, kept out of `neuropod --help`

    env = get_environment(args.name)
    remove_environment(args.name)
    print(f"Removed {env.kind} environment {env.name!r} ({env.path})", file=out)
    return 0
