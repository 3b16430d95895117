"""``neuropod inspect`` and ``neuropod explain``: what a package (or a remote model) is, and which
backend would run it; the URL commands' ``--auth-token-file``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, TextIO

from neuropod.cli.output import EXIT_TEST_FAILED, describe_os_error, print_table, safe, short
from neuropod.errors import NeuropodError, RemoteError
from neuropod.remote import is_remote

# The most of an --auth-token-file that is read.
_TOKEN_FILE_LIMIT = 64 * 1024


def print_spec(inputs: Sequence[Any], outputs: Sequence[Any], out: TextIO, devices: Any = None) -> None:
    """The Inputs and Outputs tables (name, dtype, shape, input device) and the symbols they share."""
    for title, specs in (("Inputs", inputs), ("Outputs", outputs)):
        print(f"{title}:", file=out)
        rows = [(safe(s.name), s.dtype, safe(s.describe_shape()), safe((devices or {}).get(s.name, ""))) for s in specs]
        print_table(rows or [("(none)", "", "", "")], out)
    symbols = sorted({d for s in (*inputs, *outputs) for d in s.shape if isinstance(d, str)})
    if symbols:
        print(f"Symbols:   {safe(', '.join(symbols))} (one size per call across inputs and outputs)", file=out)


def read_token(path: str) -> str:
    """The bearer token in ``--auth-token-file``: the file's first line, as ``neuropod serve`` reads its own."""
    try:
        with open(path, "rb") as f:
            data = f.read(_TOKEN_FILE_LIMIT + 1)  # bounded: the path may be /dev/zero or a disk image
        if len(data) > _TOKEN_FILE_LIMIT:
            raise NeuropodError(f"--auth-token-file '{short(path)}' is larger than {_TOKEN_FILE_LIMIT // 1024} KiB; "
                                "it should hold the token on its first line")  # fmt: skip
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = describe_os_error(e) if isinstance(e, OSError) else f"not UTF-8 text ({e.reason})"
        raise NeuropodError(f"--auth-token-file '{short(path)}' cannot be read: {reason}") from None
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise NeuropodError(f"--auth-token-file '{short(path)}' is empty; put the token on its first line")
    return token


def remote_options(args: argparse.Namespace) -> dict[str, Any]:
    """``load_neuropod`` options from the URL commands' flags (``--auth-token-file``)."""

    path = getattr(args, "auth_token_file", None)
    if path is None:
        return {}
    if not is_remote(args.package):
        raise NeuropodError(f"--auth-token-file applies to a remote model's URL (grpc://host:8001/model), "
                            f"not to the package {short(args.package)}")  # fmt: skip
    return {"auth_token": read_token(path)}


def _load_remote(args: argparse.Namespace) -> Any:
    from neuropod.loader import load_neuropod  # lazy: numpy, kept out of `neuropod --help`

    return load_neuropod(args.package, check_ready=False, **remote_options(args))


def _server_line(state: dict[str, Any]) -> str:
    """One server of a remote model as the CLI shows it."""
    if "error" in state:
        return f"{safe(state['url'])}: {safe(state['error'])}"
    parts = [f"{'live' if state.get('live') else 'NOT live'}, model {'ready' if state.get('ready') else 'NOT ready'}"]
    if state.get("name"):
        parts.append(f"server {safe(state['name'])} {safe(state.get('version', ''))}".rstrip())
    if state.get("backend"):
        parts.append(f"runs on {safe(state['backend'])} on {safe(state.get('device') or '?')}")
    return f"{safe(state['url'])}: " + "; ".join(parts)


def _inspect_remote(args: argparse.Namespace, out: TextIO) -> int:
    with _load_remote(args) as model:
        _print_remote(model, args, out)
    return 0


def _print_remote(model: Any, args: argparse.Namespace, out: TextIO) -> None:
    """What ``inspect URL`` prints (``--json``: as JSON)."""
    status = model.status() if hasattr(model, "status") else []
    if args.json:
        data = {
            "name": model.name,
            "platform": model.platform,
            "urls": list(getattr(model, "urls", [args.package])),
            "backend": model.backend.id,
            "input_spec": [s.to_dict() for s in model.inputs],
            "output_spec": [s.to_dict() for s in model.outputs],
            "servers": status,
        }
        print(json.dumps(data, indent=2, default=str), file=out)
        return
    print(f"Model:     {safe(model.name)} at {safe(args.package)}", file=out)
    print(f"Platform:  {safe(model.platform or '(the server does not say)')}", file=out)
    print(f"Runs on:   {safe(model.backend.id)} on {safe(model.device)} ({safe(model.backend.location)})", file=out)
    print_spec(model.inputs, model.outputs, out)
    print("Servers:", file=out)
    for state in status:
        print(f"  {_server_line(state)}", file=out)


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.package import read_package  # lazy: numpy, kept out of `neuropod --help`
    from neuropod.resolve import describe_range  # lazy: numpy, kept out of `neuropod --help`

    if is_remote(args.package):
        return _inspect_remote(args, out)
    remote_options(args)  # refuses --auth-token-file for a package
    pkg = read_package(args.package, verify=not args.no_verify)
    cfg = pkg.config
    if args.json:
        data = cfg.to_dict()
        data["files"] = pkg.files()
        data["manifest"] = "checked" if pkg.manifest is not None else "none (Neuropod 0.3 package)"
        if cfg.pipeline is not None:
            data["pipeline"]["levels"] = [list(level) for level in _pipeline_levels(pkg)]
        print(json.dumps(data, indent=2), file=out)
        return 0
    extracted = f" (extracted to {safe(pkg.root)})" if pkg.root != pkg.source else ""
    url = getattr(args, "package_url", None)
    if url is not None:  # downloaded: where it came from first
        extracted = f" (downloaded to {safe(pkg.source)}{', extracted to ' + safe(pkg.root) if extracted else ''})"
    print(f"Package:   {safe(url or pkg.source)}{extracted}", file=out)
    print(f"Name:      {safe(cfg.name)}", file=out)
    print(f"Platform:  {safe(cfg.platform)}", file=out)
    print(f"Versions:  {safe(describe_range(cfg.platform_version_semver))}", file=out)
    if cfg.exported_with:
        made = ", ".join(f"{safe(k)} {safe(v)}" for k, v in cfg.exported_with.items())
        print(f"Made with: {made}", file=out)
    if cfg.device_requirements:
        print(f"Needs:     {json.dumps(dict(cfg.device_requirements))}", file=out)
    print_spec(cfg.input_spec, cfg.output_spec, out, cfg.input_tensor_device)
    if cfg.decoupled:
        print("Responses: any number per request (decoupled: run it with infer_stream)", file=out)
    if cfg.state_spec or cfg.sequence_controls:
        print("Sequences: stateful (run it in sequences; callers never send or see the tensors below)", file=out)
        for pair in cfg.state_spec:
            print(f"  state    {safe(str(pair))}", file=out)
        for control in cfg.sequence_controls:
            print(f"  control  {safe(str(control))}", file=out)
    if cfg.pipeline is not None:
        _print_pipeline(pkg, out)
    if cfg.custom_ops:
        print(f"Custom ops: {safe(', '.join(cfg.custom_ops))}", file=out)
    manifest = "checked" if pkg.manifest is not None and not args.no_verify else (
        "not checked" if pkg.manifest is not None else "none (a Neuropod 0.3 package)"
    )
    print(f"Manifest:  {manifest}", file=out)
    print("Test data: " + ("yes" if pkg.has_test_data else "no"), file=out)
    lock = pkg.requirements_lock
    if lock is not None:
        from neuropod.envs import lock_lines  # lazy: numpy, kept out of `neuropod --help`

        pins = lock_lines(lock)
        shown = ", ".join(safe(p.split(" --hash", 1)[0]) for p in pins[:6]) + (f", +{len(pins) - 6} more" if len(pins) > 6 else "")
        print(f"Requires:  {len(pins)} pinned ({shown or 'none'}); runs in a worker from an environment built from "
              "0/requirements.lock", file=out)  # fmt: skip
    print("Files:", file=out)
    for f in pkg.files():
        size = (pkg.root / f).stat().st_size
        print(f"  {safe(f)}  ({size:,} bytes)", file=out)
    return 0


def _pipeline_levels(pkg: Any) -> tuple[tuple[str, ...], ...]:
    from neuropod.pipespec import step_levels  # lazy: with the package reader, kept out of `neuropod --help`

    return step_levels(pkg.config.pipeline.steps, str(pkg.source))


def _print_pipeline(pkg: Any, out: TextIO) -> None:
    """A pipeline package's steps: each step's model and where it is (its package's platform, or
    the URL of the server that runs it), its tensor maps, and the levels the steps run in."""
    from neuropod.package import read_package  # lazy: numpy, kept out of `neuropod --help`
    from neuropod.resolve import describe_range  # lazy: numpy, kept out of `neuropod --help`

    spec = pkg.config.pipeline
    inflight = f"; at most {spec.max_inflight_requests} requests inside at once" if spec.max_inflight_requests else ""
    print(f"Pipeline:  {len(spec.steps)} steps{inflight}", file=out)
    for step in spec.steps:
        if step.url is not None:
            where = f"served at {safe(step.url)}"
        else:
            try:
                config = read_package(pkg.root / step.package, verify=False).config
                versions = describe_range(config.platform_version_semver)
                where = f"platform {safe(config.platform)}, versions {safe(versions)} ({safe(step.package)})"
            except NeuropodError as e:
                where = f"unreadable package {safe(step.package)}: {safe(e)}"
        print(f"  step {safe(step.name)}: model {safe(step.model_name)}, {where}", file=out)
        ins = ", ".join(f"{safe(k)} <- {safe(v)}" for k, v in step.input_map.items())
        outs = ", ".join(f"{safe(k)} -> {safe(v)}" for k, v in step.output_map.items())
        print(f"    inputs:  {ins or '(none)'}", file=out)
        print(f"    outputs: {outs or '(none)'}", file=out)
    try:
        levels = " | ".join(", ".join(safe(n) for n in level) for level in _pipeline_levels(pkg))
    except NeuropodError as e:
        levels = f"none: {safe(e)}"
    print(f"Levels:    {levels} (steps of one level run side by side)", file=out)


#: RemoteError codes that mean no server could run a call to the model (``explain URL`` exits 1).
_NOT_SERVED = ("unavailable", "not_found", "deadline_exceeded")


def cmd_explain(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.loader import plan  # lazy: numpy, kept out of `neuropod --help`
    from neuropod.package import read_package  # lazy: numpy, kept out of `neuropod --help`

    if is_remote(args.package):
        given = [flag for flag, value in (("--host", args.host), ("--device", args.device), ("--backend", args.backend))
                 if value is not None]  # fmt: skip
        if given:
            raise NeuropodError(f"{', '.join(given)} apply to local packages; the server of {short(args.package)} "
                                "chooses how its model runs")  # fmt: skip
        try:
            model = _load_remote(args)
        except RemoteError as e:
            # No server could be asked for the model, or none knows it: explain's "nothing can run
            # it" (exit 1). A refused token, TLS or a server that breaks the protocol stay errors.
            if e.code not in _NOT_SERVED:
                raise
            print(safe(e), file=out)
            print("No server has the model ready: calls would fail.", file=out)
            return EXIT_TEST_FAILED
        with model:
            if not args.quiet_spec:
                _print_remote(model, argparse.Namespace(package=args.package, json=False), out)
                print(file=out)
            if not hasattr(model, "status"):
                print(f"Remote model {safe(model.name)}: loaded; the handler of this URL's scheme reports "
                      "no per-server status", file=out)  # fmt: skip
                return 0
            status = model.status()
        ready = [s for s in status if s.get("ready")]
        print(f"Remote model {safe(model.name)}: served by {len(ready)} of {len(status)} server(s)", file=out)
        for state in status:
            print(f"  {'->' if state.get('ready') else '  '} {_server_line(state)}", file=out)
        if not ready:
            print("No server has the model ready: calls would fail.", file=out)
        return 0 if ready else EXIT_TEST_FAILED

    remote_options(args)  # refuses --auth-token-file for a package
    pkg = read_package(args.package)
    if not args.quiet_spec:
        args_inspect = argparse.Namespace(package=args.package, no_verify=False, json=False,
                                          package_url=getattr(args, "package_url", None))  # fmt: skip
        cmd_inspect(args_inspect, out)
        print(file=out)
    resolution = plan(pkg, device=args.device, backend=args.backend, host=args.host)
    print(resolution.explain(), file=out)
    return 0 if resolution.chosen is not None else EXIT_TEST_FAILED
