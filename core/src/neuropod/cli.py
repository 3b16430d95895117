r"""The ``neuropod`` command.

::

    neuropod backends                 installed backends, devices, failed plugins
    neuropod inspect PKG|URL          name, platform, range, spec, files (a remote model: spec, servers)
    neuropod explain PKG|URL [--host F]  which backend would run it, and why not the others
    neuropod test PKG                 run the package's bundled test data (a URL has none: an error)
    neuropod infer PKG|URL --input x=x.npy [--output-dir DIR]
    neuropod demo [PLATFORM] [--dir DIR]  package a small model, explain, run it
    neuropod env create SPEC          a backend environment (e.g. onnx==1.20.1); env list, env remove NAME,
                                      env prepare PACKAGE (build the environment its requirements need),
                                      env prune [--days N] (lock environments no package used for N days)
    neuropod cache verify [--repair]  re-hash every extracted zip package against its record; check downloads
    neuropod cache prune [--days N]   remove packages downloaded by URL that no load used for N days
    neuropod serve PKG...             an Open Inference Protocol server (from neuropod-serving)

A URL command (inspect, explain, infer) takes ``--auth-token-file FILE`` for
a server that requires a bearer token (``neuropod serve --auth-token-file``).

Every :class:`~neuropod.errors.NeuropodError` (and any ``OSError``,
``ValueError`` or other exception that escapes a command) ends the command
with one error on stderr and exit status 2; no traceback unless ``--debug``
is given. Text that comes from a package (names, platform, file names) is
printed with control characters, bidirectional-text controls and lone
surrogates escaped (``\x1b``, ``\u202e``, ``\udcff``), so a package cannot
write to the terminal; ``--json`` output is ASCII (``json.dumps`` escapes).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO, cast

from neuropod import __version__
from neuropod.errors import NeuropodError

EXIT_ERROR = 2
EXIT_TEST_FAILED = 1

# What a terminal would act on instead of showing: C0/C1 controls, bidirectional-text
# controls (they reorder what follows, "Trojan Source"), line/paragraph separators, and
# lone surrogates (from undecodable bytes in argv or file names; no encoder takes them).
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Paths in OSError messages are shortened to this many characters.
_PATH_LIMIT = 200
# The most of an --auth-token-file that is read.
_TOKEN_FILE_LIMIT = 64 * 1024


def _safe(text: object, keep: str = "") -> str:
    r"""``text`` as it can be printed: unsafe characters (see ``_UNSAFE``) become
    ``\xNN`` / ``\uNNNN`` escapes, except those in ``keep`` (e.g. ``"\n"`` for
    our own multi-line output)."""
    text = str(text)
    if text.isprintable():  # the common case; isprintable() is False for every unsafe character
        return text

    def escape(m: re.Match[str]) -> str:
        ch = m.group()
        if ch in keep:
            return ch
        if ch in _SHORT_ESCAPES:
            return _SHORT_ESCAPES[ch]
        return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"

    return _UNSAFE.sub(escape, text)


class _SafeWriter(io.TextIOBase):
    """A text stream that cannot be made to fail or to drive the terminal by what is printed:
    unsafe characters are escaped (newlines and tabs kept), and characters the stream's
    encoding lacks are written as backslash escapes instead of raising ``UnicodeEncodeError``."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream

    def write(self, text: str) -> int:
        text = _safe(text, keep="\n\t")
        try:
            self._stream.write(text)
        except UnicodeEncodeError:
            encoding = getattr(self._stream, "encoding", None) or "ascii"
            self._stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        return len(text)

    def flush(self) -> None:
        # Also called when this wrapper is garbage-collected, perhaps after the stream it wraps was closed.
        if not getattr(self._stream, "closed", False):
            self._stream.flush()

    def writable(self) -> bool:
        return True


def _safe_stream(stream: TextIO) -> TextIO:
    return stream if isinstance(stream, _SafeWriter) else cast(TextIO, _SafeWriter(stream))


def _short(text: object, limit: int = _PATH_LIMIT) -> str:
    """A path or value for a message: safe, and at most ``limit`` characters (the middle elided)."""
    text = _safe(text)
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-(limit // 2):]}"


def _describe_os_error(e: OSError) -> str:
    """An ``OSError`` in one line, with its file names shortened (a 5000-character path stays readable)."""
    if e.strerror and e.filename is not None:
        files = f"'{_short(_fs_text(e.filename))}'"
        if e.filename2 is not None:
            files += f" -> '{_short(_fs_text(e.filename2))}'"
        return f"{e.strerror}: {files}"
    return _one_line(str(e) or type(e).__name__)


def _show(value: object, limit: int = 100) -> str:
    """A value quoted for a message (``repr`` escapes every unsafe character), at most ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fs_text(name: object) -> str:
    return os.fsdecode(name) if isinstance(name, (str, bytes)) else str(name)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _print_table(rows: Sequence[Sequence[str]], out: TextIO, indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)


def _fmt_array(arr: Any, limit: int = 6) -> str:
    import numpy as np

    a = np.asarray(arr)
    body = np.array2string(a, threshold=limit * 2, edgeitems=limit // 2, separator=", ")
    body = " ".join(body.split())
    return f"{a.dtype.name if a.dtype.kind not in 'UO' else 'string'} {list(a.shape)} {body}"


# --- commands -------------------------------------------------------------


def cmd_backends(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod import plugins
    from neuropod.backend import backend_record
    from neuropod.devices import load_host, local_host
    from neuropod.envs import list_environments

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
        _print_table(rows, out)
        for name, build in builds.items():
            print(f"  {name} {build['version']}: {build['build']}", file=out)
    else:
        from neuropod.plugins import pip_install

        install = pip_install("'neuropod-onnx[cpu]'")
        print(f"Backends: none installed (for example: {install})", file=out)
    for text in warnings_:
        print(f"warning: {text}", file=out)
    infos = {i.name for i in plugins.plugin_infos()}
    idle = sorted(infos - {b.plugin for b in backends})
    if idle:
        print(f"Plugins with no framework installed: {', '.join(idle)}", file=out)
    _print_plugin_health(out)
    _print_environments(out)
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
    from neuropod import plugins

    health = plugins.plugin_health()
    if not health:
        return
    print("Plugins:", file=out)
    rows = [("plugin", "distribution", "version", "requires neuropod", f"ok for {__version__}", "state")]
    for h in health:
        needs = h.core_range if h.core_range else ("(any)" if h.core_range == "" else "(unknown)")
        rows.append((h.name, h.distribution, h.version, needs, "yes" if h.core_ok else "NO", h.state.split("\n")[0]))
    _print_table(rows, out)


def _print_spec(inputs: Sequence[Any], outputs: Sequence[Any], out: TextIO, devices: Any = None) -> None:
    """The Inputs and Outputs tables (name, dtype, shape, input device) and the symbols they share."""
    for title, specs in (("Inputs", inputs), ("Outputs", outputs)):
        print(f"{title}:", file=out)
        rows = [(_safe(s.name), s.dtype, _safe(s.describe_shape()), _safe((devices or {}).get(s.name, ""))) for s in specs]
        _print_table(rows or [("(none)", "", "", "")], out)
    symbols = sorted({d for s in (*inputs, *outputs) for d in s.shape if isinstance(d, str)})
    if symbols:
        print(f"Symbols:   {_safe(', '.join(symbols))} (one size per call across inputs and outputs)", file=out)


def _read_token(path: str) -> str:
    """The bearer token in ``--auth-token-file``: the file's first line, as ``neuropod serve`` reads its own."""
    try:
        with open(path, "rb") as f:
            data = f.read(_TOKEN_FILE_LIMIT + 1)  # bounded: the path may be /dev/zero or a disk image
        if len(data) > _TOKEN_FILE_LIMIT:
            raise NeuropodError(f"--auth-token-file '{_short(path)}' is larger than {_TOKEN_FILE_LIMIT // 1024} KiB; "
                                "it should hold the token on its first line")  # fmt: skip
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = _describe_os_error(e) if isinstance(e, OSError) else f"not UTF-8 text ({e.reason})"
        raise NeuropodError(f"--auth-token-file '{_short(path)}' cannot be read: {reason}") from None
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise NeuropodError(f"--auth-token-file '{_short(path)}' is empty; put the token on its first line")
    return token


def _remote_options(args: argparse.Namespace) -> dict[str, Any]:
    """``load_neuropod`` options from the URL commands' flags (``--auth-token-file``)."""
    from neuropod.remote import is_remote

    path = getattr(args, "auth_token_file", None)
    if path is None:
        return {}
    if not is_remote(args.package):
        raise NeuropodError(f"--auth-token-file applies to a remote model's URL (grpc://host:8001/model), "
                            f"not to the package {_short(args.package)}")  # fmt: skip
    return {"auth_token": _read_token(path)}


def _load_remote(args: argparse.Namespace) -> Any:
    from neuropod.model import load_neuropod

    return load_neuropod(args.package, check_ready=False, **_remote_options(args))


def _server_line(state: dict[str, Any]) -> str:
    """One server of a remote model as the CLI shows it."""
    if "error" in state:
        return f"{_safe(state['url'])}: {_safe(state['error'])}"
    parts = [f"{'live' if state.get('live') else 'NOT live'}, model {'ready' if state.get('ready') else 'NOT ready'}"]
    if state.get("name"):
        parts.append(f"server {_safe(state['name'])} {_safe(state.get('version', ''))}".rstrip())
    if state.get("backend"):
        parts.append(f"runs on {_safe(state['backend'])} on {_safe(state.get('device') or '?')}")
    return f"{_safe(state['url'])}: " + "; ".join(parts)


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
    print(f"Model:     {_safe(model.name)} at {_safe(args.package)}", file=out)
    print(f"Platform:  {_safe(model.platform or '(the server does not say)')}", file=out)
    print(f"Runs on:   {_safe(model.backend.id)} on {_safe(model.device)} ({_safe(model.backend.location)})", file=out)
    _print_spec(model.inputs, model.outputs, out)
    print("Servers:", file=out)
    for state in status:
        print(f"  {_server_line(state)}", file=out)


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.package import read_package
    from neuropod.remote import is_remote
    from neuropod.resolve import describe_range

    if is_remote(args.package):
        return _inspect_remote(args, out)
    _remote_options(args)  # refuses --auth-token-file for a package
    pkg = read_package(args.package, verify=not args.no_verify)
    cfg = pkg.config
    if args.json:
        data = cfg.to_dict()
        data["files"] = pkg.files()
        data["manifest"] = "checked" if pkg.manifest is not None else "none (Neuropod 0.3 package)"
        print(json.dumps(data, indent=2), file=out)
        return 0
    extracted = f" (extracted to {_safe(pkg.root)})" if pkg.root != pkg.source else ""
    url = getattr(args, "package_url", None)
    if url is not None:  # downloaded: where it came from first
        extracted = f" (downloaded to {_safe(pkg.source)}{', extracted to ' + _safe(pkg.root) if extracted else ''})"
    print(f"Package:   {_safe(url or pkg.source)}{extracted}", file=out)
    print(f"Name:      {_safe(cfg.name)}", file=out)
    print(f"Platform:  {_safe(cfg.platform)}", file=out)
    print(f"Versions:  {_safe(describe_range(cfg.platform_version_semver))}", file=out)
    if cfg.exported_with:
        made = ", ".join(f"{_safe(k)} {_safe(v)}" for k, v in cfg.exported_with.items())
        print(f"Made with: {made}", file=out)
    if cfg.device_requirements:
        print(f"Needs:     {json.dumps(dict(cfg.device_requirements))}", file=out)
    _print_spec(cfg.input_spec, cfg.output_spec, out, cfg.input_tensor_device)
    if cfg.custom_ops:
        print(f"Custom ops: {_safe(', '.join(cfg.custom_ops))}", file=out)
    manifest = "checked" if pkg.manifest is not None and not args.no_verify else (
        "not checked" if pkg.manifest is not None else "none (a Neuropod 0.3 package)"
    )
    print(f"Manifest:  {manifest}", file=out)
    print("Test data: " + ("yes" if pkg.has_test_data else "no"), file=out)
    lock = pkg.requirements_lock
    if lock is not None:
        from neuropod.envs import lock_lines

        pins = lock_lines(lock)
        shown = ", ".join(_safe(p.split(" --hash", 1)[0]) for p in pins[:6]) + (f", +{len(pins) - 6} more" if len(pins) > 6 else "")
        print(f"Requires:  {len(pins)} pinned ({shown or 'none'}); runs in a worker from an environment built from "
              "0/requirements.lock", file=out)  # fmt: skip
    print("Files:", file=out)
    for f in pkg.files():
        size = (pkg.root / f).stat().st_size
        print(f"  {_safe(f)}  ({size:,} bytes)", file=out)
    return 0


#: RemoteError codes that mean no server could run a call to the model (``explain URL`` exits 1).
_NOT_SERVED = ("unavailable", "not_found", "deadline_exceeded")


def cmd_explain(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.errors import RemoteError
    from neuropod.model import plan
    from neuropod.package import read_package
    from neuropod.remote import is_remote

    if is_remote(args.package):
        given = [flag for flag, value in (("--host", args.host), ("--device", args.device), ("--backend", args.backend))
                 if value is not None]  # fmt: skip
        if given:
            raise NeuropodError(f"{', '.join(given)} apply to local packages; the server of {_short(args.package)} "
                                "chooses how its model runs")  # fmt: skip
        try:
            model = _load_remote(args)
        except RemoteError as e:
            # No server could be asked for the model, or none knows it: explain's "nothing can run
            # it" (exit 1). A refused token, TLS or a server that breaks the protocol stay errors.
            if e.code not in _NOT_SERVED:
                raise
            print(_safe(e), file=out)
            print("No server has the model ready: calls would fail.", file=out)
            return EXIT_TEST_FAILED
        with model:
            if not args.quiet_spec:
                _print_remote(model, argparse.Namespace(package=args.package, json=False), out)
                print(file=out)
            if not hasattr(model, "status"):
                print(f"Remote model {_safe(model.name)}: loaded; the handler of this URL's scheme reports "
                      "no per-server status", file=out)  # fmt: skip
                return 0
            status = model.status()
        ready = [s for s in status if s.get("ready")]
        print(f"Remote model {_safe(model.name)}: served by {len(ready)} of {len(status)} server(s)", file=out)
        for state in status:
            print(f"  {'->' if state.get('ready') else '  '} {_server_line(state)}", file=out)
        if not ready:
            print("No server has the model ready: calls would fail.", file=out)
        return 0 if ready else EXIT_TEST_FAILED

    _remote_options(args)  # refuses --auth-token-file for a package
    pkg = read_package(args.package)
    if not args.quiet_spec:
        args_inspect = argparse.Namespace(package=args.package, no_verify=False, json=False,
                                          package_url=getattr(args, "package_url", None))  # fmt: skip
        cmd_inspect(args_inspect, out)
        print(file=out)
    resolution = plan(pkg, device=args.device, backend=args.backend, host=args.host)
    print(resolution.explain(), file=out)
    return 0 if resolution.chosen is not None else EXIT_TEST_FAILED


def cmd_test(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.model import run_test_data
    from neuropod.remote import is_remote

    if is_remote(args.package):
        raise NeuropodError(
            f"{_short(args.package)} is a remote model; `neuropod test` runs the test data bundled in a package "
            "file or directory, which a server does not send. Test the package where it is served "
            "(neuropod test PKG), or run the remote model on your inputs: neuropod infer URL --input NAME=FILE.npy"
        )
    report = run_test_data(
        args.package, trust_pickle=args.trust_pickle, device=args.device, backend=args.backend,
        rtol=args.rtol, atol=args.atol,
    )
    print(f"Model {report.model!r} with {_safe(report.backend)} on {report.device}", file=out)
    for name, arr in report.inputs.items():
        print(f"  input  {_safe(name)}: {_fmt_array(arr)}", file=out)
    for name, arr in report.outputs.items():
        print(f"  output {_safe(name)}: {_fmt_array(arr)}", file=out)
    if report.expected is None:
        print("No expected outputs are bundled: the model ran, nothing was compared.", file=out)
        return 0
    if report.passed:
        print(f"PASSED: {len(report.expected)} output(s) match the expected values", file=out)
        return 0
    print("FAILED:", file=out)
    for m in report.mismatches:
        print(f"  {_safe(m)}", file=out)
    return EXIT_TEST_FAILED


def _load_input(spec: str) -> tuple[str, Any]:
    import numpy as np

    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise NeuropodError(f"--input '{_short(spec)}' must be NAME=FILE.npy")
    where = f"--input {_short(name)}: {_short(path)}"
    try:
        # allow_pickle=False also keeps numpy's bound on the header size (a huge header is a ValueError).
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise NeuropodError(f"--input {_short(name)}: no such file {_short(path)}") from None
    except OSError as e:
        raise NeuropodError(f"{where} cannot be read: {_describe_os_error(e)}") from None
    except EOFError:  # an empty file, or /dev/null
        raise NeuropodError(f"{where} is empty; expected a .npy file (numpy.save)") from None
    except MemoryError as e:  # a header that claims an array larger than memory
        raise NeuropodError(f"{where} is too large to load: {_one_line(str(e))}") from None
    except ValueError as e:
        raise NeuropodError(f"{where} is not a readable .npy file without pickles: {_one_line(str(e))}") from None
    if not isinstance(arr, np.ndarray):  # np.load opens a .npz as an archive of arrays
        arr.close()
        raise NeuropodError(f"{where} is a .npz archive; give one .npy file per input (NAME=FILE.npy)")
    return name, arr


def _output_dir(path: str) -> Path:
    """Make ``--output-dir`` (before the model is loaded, so a bad one fails fast)."""
    out_dir = Path(path)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NeuropodError(f"--output-dir '{_short(path)}' exists and is not a directory") from None
    except OSError as e:
        raise NeuropodError(f"--output-dir '{_short(path)}' cannot be created: {_describe_os_error(e)}") from None
    return out_dir.resolve()


def output_file_name(name: str) -> str:
    """The file ``neuropod infer --output-dir`` writes output ``name`` to: ``NAME.npy``, with
    ``%``, ``/`` and ``\\`` written as ``%25``, ``%2F`` and ``%5C`` (tensor names may hold
    them: ``InceptionV3/Predictions/Softmax:0`` is ``InceptionV3%2FPredictions%2FSoftmax:0.npy``)."""
    return name.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C") + ".npy"


def _output_file(out_dir: Path, name: str, model: str) -> Path:
    """Where output ``name`` is written: a file directly in ``out_dir``, whatever the name."""
    from neuropod.spec import NAME_RULE, tensor_name_problem

    problem = tensor_name_problem(name)
    target = out_dir / output_file_name(name)
    if problem is None and len(target.name.encode("utf-8")) > 255:
        problem = f"its file name {_short(target.name)} is longer than the 255 bytes a file name may be"
    if problem is None and target.resolve().parent != out_dir:  # e.g. an existing link out of the directory
        problem = f"{_short(target)} leads out of the directory"
    if problem is not None:
        raise NeuropodError(
            f"Output {_show(name)} of model {_show(model)} cannot be written to --output-dir "
            f"'{_short(out_dir)}': {problem}; {NAME_RULE}"
        )
    return target


def cmd_infer(args: argparse.Namespace, out: TextIO) -> int:
    import numpy as np

    from neuropod.model import load_neuropod

    inputs = dict(_load_input(s) for s in args.input)
    out_dir = _output_dir(args.output_dir) if args.output_dir else None
    with load_neuropod(args.package, device=args.device, backend=args.backend, **_remote_options(args)) as model:
        outputs = model.infer(inputs, requested_outputs=args.output or None)
        where = model.backend.location if model.backend.location.startswith("remote") else ""
        print(f"Model {model.name!r} with {_safe(model.backend.id)} on {model.device}"
              + (f" ({_safe(where)})" if where else ""), file=out)  # fmt: skip
        if out_dir is not None:
            # Every path is checked before the first file is written.
            targets = {name: _output_file(out_dir, name, model.name) for name in outputs}
    if out_dir is None:
        for name, arr in outputs.items():
            print(f"  {_safe(name)}: {_fmt_array(arr)}", file=out)
        return 0
    for name, arr in outputs.items():
        if arr.dtype.kind == "O":
            arr = np.asarray(arr.tolist(), dtype=str)
        try:
            np.save(targets[name], arr, allow_pickle=False)
        except OSError as e:
            raise NeuropodError(f"Cannot write output {_show(name)}: {_describe_os_error(e)}") from None
        print(f"  wrote {_safe(targets[name])}: {_fmt_array(arr)}", file=out)
    return 0


def _build_demo(build: Any, work: Path, *, keep: bool, overwrite: bool) -> tuple[Path, Any, Any]:
    """Run a demo's builder into ``work``. A kept directory (``--dir``) gets the package through a
    hidden directory beside it, so that a package left there by an earlier run is replaced only with
    ``--overwrite``, and only by a complete one."""
    from neuropod.package import replace_package

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
                    f"--dir {_short(str(work))} already holds {path.name} (from an earlier run?): pass --overwrite to "
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
    from neuropod import plugins

    runnable = {b.plugin_distribution.split(" ")[0] for b in plugins.installed_backends()}
    order = sorted(demos, key=lambda n: (n != "onnx", n))
    return next((n for n in order if getattr(demos[n].dist, "name", None) in runnable), order[0])


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    import importlib_metadata

    from neuropod.errors import PluginNotInstalledError, SpecError
    from neuropod.model import load_neuropod, plan
    from neuropod.package import read_package

    demos = {ep.name: ep for ep in importlib_metadata.entry_points(group="neuropod.demos")}
    if not demos:
        from neuropod.plugins import pip_install

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
                print(f"   input  {k}: {_fmt_array(v)}", file=out)
            for k, v in outputs.items():
                print(f"   output {k}: {_fmt_array(v)}", file=out)
            print("\n5. Inputs that break the spec give a clear error:", file=out)
            try:
                model.infer(bad_inputs)
            except SpecError as e:
                print(f"   SpecError: {e}", file=out)
    return 0


def _env_backends_text(env: Any) -> str:
    return ", ".join(f"{b.id} ({c.describe()})" for b, c in env.backends) or "none"


def _print_environments(out: TextIO) -> None:
    """The "Backend environments" section of ``neuropod backends``."""
    from neuropod.envs import list_environments

    envs = list_environments()
    if not envs:
        return
    print("Backend environments (models they run are loaded in worker processes):", file=out)
    rows = [("backend", "framework", "plugin", "devices", "where")]
    for e in envs:
        if not e.ok:
            rows.append(("-", "", "", "", f"env:{e.name} UNUSABLE: see neuropod env list"))
        rows += [(b.id, b.framework, b.plugin_distribution, c.describe(), b.location) for b, c in e.backends if e.ok]
    _print_table(rows, out)


def cmd_env_create(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.envs import create_environment

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
    from neuropod.envs import envs_dir, list_environments

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
        _print_table(rows, out)
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
        _print_table(rows, out)
    for e in envs:
        if not e.ok:
            print(f"{e.name}: {e.problem}", file=out)
    return 0


def cmd_env_prepare(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.envs import lock_environment
    from neuropod.model import plan
    from neuropod.package import read_package

    for path in args.packages:
        pkg = read_package(path)
        chosen = plan(pkg).raise_if_unresolved()
        lock = pkg.requirements_lock
        if lock is None and not chosen.backend.location.startswith("python:"):
            print(f"{_safe(pkg.name)}: needs no environment of its own (runs with {chosen.backend.id}, "
                  f"{chosen.backend.location})", file=out)  # fmt: skip
            continue
        t0 = time.perf_counter()
        env = lock_environment(lock or "", chosen.backend, package_name=pkg.name, package_source=str(pkg.source),
                               out=out, verbose=args.verbose)  # fmt: skip
        print(f"{_safe(pkg.name)}: environment {env.name} ready ({env.path}, {time.perf_counter() - t0:.1f} s)", file=out)
    return 0


def cmd_env_prune(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.envs import envs_dir, prune_environments

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
    from neuropod.envs import get_environment, remove_environment

    env = get_environment(args.name)
    remove_environment(args.name)
    print(f"Removed {env.kind} environment {env.name!r} ({env.path})", file=out)
    return 0


def cmd_cache_verify(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod import storage
    from neuropod.package import cache_dir, verify_cache

    found = False
    for what, where, problems, again in (
        ("Package cache", cache_dir() / "packages", verify_cache(repair=args.repair), "each zip is extracted again"),
        ("Download cache", storage.downloads_dir(), storage.verify_downloads(repair=args.repair),
         "each package is downloaded again"),
    ):  # fmt: skip
        if not problems:
            print(f"{what} {where}: every entry matches its record", file=out)
            continue
        found = True
        print(f"{what} {where}: {len(problems)} problem(s):", file=out)
        for line in problems:
            print(f"  {line}", file=out)
        if args.repair:
            print(f"Removed what was wrong; {again} the next time it is loaded.", file=out)
        else:
            print(f"Run `neuropod cache verify --repair` to remove them ({again} when next loaded).", file=out)
    return EXIT_TEST_FAILED if found and not args.repair else 0


def cmd_cache_prune(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod import storage

    if not args.days >= 0:  # also NaN, which compares false with everything
        raise NeuropodError(f"--days must be a number >= 0, not {args.days:g}")
    gone = storage.prune_downloads(args.days, dry_run=args.dry_run)
    verb = "Would remove" if args.dry_run else "Removed"
    for path, url, size in gone:
        print(f"{verb} {url or path} ({size:,} bytes, {path})", file=out)
    total = sum(size for _, _, size in gone)
    print(f"{verb} {len(gone)} download(s) unused for {args.days:g} day(s), {total:,} bytes, from "
          f"{storage.downloads_dir()}", file=out)  # fmt: skip
    return 0


# --- commands from other distributions -------------------------------------

#: Commands other distributions add through the ``neuropod.commands`` entry
#: point group, and what to install when one is missing.
KNOWN_PLUGIN_COMMANDS = {"serve": "'neuropod-serving[server]'"}
KNOWN_PLUGIN_HELP = {"serve": "serve packages over the Open Inference Protocol (Triton's and KServe's clients)"}


def _plugin_commands() -> dict[str, Any]:
    """Entry points of the ``neuropod.commands`` group, by command name (listed, not loaded)."""
    import importlib_metadata

    return {ep.name: ep for ep in importlib_metadata.entry_points(group="neuropod.commands")}


def _invoked_command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line: the first argument that is not a global option."""
    return next((a for a in argv if not a.startswith("-")), None)


def _add_plugin_commands(sub: Any, argv: Sequence[str]) -> None:
    """A subparser per plugin command; only the invoked one's module is imported (to add its arguments).

    A command's module provides ``add_arguments(parser)`` and ``run(args) -> int``.
    """
    found = _plugin_commands()
    invoked = _invoked_command(argv)
    for name in sorted(set(found) | set(KNOWN_PLUGIN_COMMANDS)):
        if name in sub.choices:  # a plugin cannot replace a built-in command
            continue
        ep = found.get(name)
        if ep is None:
            s = sub.add_parser(name, help=f"{KNOWN_PLUGIN_HELP[name]} (needs: pip install {KNOWN_PLUGIN_COMMANDS[name]})")
            s.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            s.set_defaults(func=_missing_command(name))
            continue
        dist = getattr(ep.dist, "name", None) or "a plugin"
        about = f"{KNOWN_PLUGIN_HELP[name]} " if name in KNOWN_PLUGIN_HELP else ""
        s = sub.add_parser(name, help=f"{about}(from {dist})", description=f"neuropod {name}, {about}from {dist}")
        if name != invoked:
            continue
        try:
            module = ep.load()
            module.add_arguments(s)
        except Exception as e:  # noqa: BLE001 - a broken plugin must not break the other commands
            s.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            s.set_defaults(func=_broken_command(name, dist, e))
            continue
        s.set_defaults(func=lambda args, out, run=module.run: run(args))


def _missing_command(name: str) -> Any:
    def fail(args: argparse.Namespace, out: TextIO) -> int:
        from neuropod.errors import PluginNotInstalledError
        from neuropod.plugins import pip_install

        raise PluginNotInstalledError(
            f"`neuropod {name}` comes with another distribution: {pip_install(KNOWN_PLUGIN_COMMANDS[name])}"
        )

    return fail


def _broken_command(name: str, dist: str, error: Exception) -> Any:
    def fail(args: argparse.Namespace, out: TextIO) -> int:
        raise NeuropodError(
            f"`neuropod {name}` from {dist} failed to load: {type(error).__name__}: {_one_line(str(error))}. "
            f"Reinstall {dist}, or run with --debug for the traceback."
        ) from error

    return fail


# --- entry point ----------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors printed safely (argv may hold lone surrogates or controls)."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if message:
            _safe_stream(file or sys.stderr).write(message)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {_safe(message)}\n")


def _parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    p = _Parser(prog="neuropod", description="Run machine-learning models from any framework.")
    p.add_argument("--version", action="version", version=f"neuropod {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (for bug reports)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("backends", help="list installed backends, devices and failed plugins")
    s.add_argument("--host", help="describe this host file's devices instead of this machine's")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_backends)

    def token_arg(s: argparse.ArgumentParser) -> None:
        s.add_argument("--auth-token-file", metavar="FILE", help="for a URL: send the bearer token on this file's "
                       "first line (as `neuropod serve --auth-token-file` requires it)")  # fmt: skip

    s = sub.add_parser("inspect", help="show a package's name, platform, range, spec and files (or a remote model's)")
    s.add_argument("package", help="a package (a path, or a URL: s3://, gs://, az://, https://...zip), or a remote "
                   "model's URL (grpc://host:8001/model, http://...)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--no-verify", action="store_true", help="do not check the manifest")
    token_arg(s)
    s.set_defaults(func=cmd_inspect)

    def resolution_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("--device", help="force 'cpu' or 'cuda:N'")
        s.add_argument("--backend", help="pin a backend, e.g. 'onnx==1.31.1'")

    s = sub.add_parser("explain", help="show which backend would run a package here, and why not the others "
                                       "(for a URL: which servers have it ready)")
    s.add_argument("package", help="a package (a path, or a URL: s3://, gs://, az://, https://...zip), or a remote "
                   "model's URL (grpc://host:8001/model, http://...)")
    s.add_argument("--host", help="plan for the machine described in this JSON file")
    s.add_argument("--quiet-spec", action="store_true", help="print only the resolution")
    token_arg(s)
    resolution_args(s)
    s.set_defaults(func=cmd_explain)

    s = sub.add_parser("test", help="run the package's bundled test data and compare")
    s.add_argument("package", help="a package file or directory, or its URL (s3://, gs://, az://, https://...zip; a "
                   "remote model has no bundled test data)")
    s.add_argument("--trust-pickle", action="store_true", help="allow reading an old test_data.pkl (runs code!)")
    s.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance of the comparison (default 1e-5)")
    s.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance of the comparison (default 1e-6)")
    resolution_args(s)
    s.set_defaults(func=cmd_test)

    s = sub.add_parser("infer", help="run a package (or a remote model) on inputs from .npy files")
    s.add_argument("package", help="a package (a path, or a URL: s3://, gs://, az://, https://...zip), or a remote "
                   "model's URL (grpc://host:8001/model, http://...)")
    s.add_argument("--input", "-i", action="append", default=[], metavar="NAME=FILE.npy", required=True,
                   help="an input tensor from a .npy file")
    s.add_argument("--output", "-o", action="append", default=[], metavar="NAME", help="only these outputs")
    s.add_argument("--output-dir", help="write each output to DIR/NAME.npy ('/' in a name as %%2F)")
    token_arg(s)
    resolution_args(s)
    s.set_defaults(func=cmd_infer)

    s = sub.add_parser("demo", help="package a small model, explain the resolution and run it")
    s.add_argument("platform", nargs="?", help="which plugin's demo (default: onnx)")
    s.add_argument("--dir", help="keep the demo package in this directory")
    s.add_argument("--overwrite", action="store_true", help="replace the package an earlier run left in --dir")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("env", help="backend environments: other framework versions, each in its own Python environment")
    env_sub = s.add_subparsers(dest="env_command", required=True, metavar="ENV_COMMAND")
    e = env_sub.add_parser("create", help="create an environment with the core, a plugin and a pinned framework")
    e.add_argument("spec", metavar="SPEC", help="PLATFORM==VERSION, e.g. onnx==1.20.1 or onnx==1.20.*")
    e.add_argument("--name", help="its name (default: PLATFORM-VERSION)")
    e.add_argument("--python", help="the interpreter to base it on (default: this one)")
    e.add_argument("--find-links", action="append", default=[], metavar="DIR",
                   help="also look for wheels here (e.g. dist/ from `nox -s build`); repeatable")
    e.add_argument("--replace", action="store_true", help="replace an environment of the same name")
    e.add_argument("--verbose", "-v", action="store_true", help="show pip's output, not only a line per step")
    e.set_defaults(func=cmd_env_create)
    e = env_sub.add_parser("list", help="the environments, what each offers, and where it is")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(func=cmd_env_list)
    e = env_sub.add_parser("prepare", help="build the lock environments packages need, without loading them "
                           "(e.g. while building a container image)")
    e.add_argument("packages", nargs="+", metavar="PACKAGE", help="a package (or its URL) whose requirements.lock to "
                   "build")
    e.add_argument("--verbose", "-v", action="store_true", help="show pip's output, not only a line per step")
    e.set_defaults(func=cmd_env_prepare)
    e = env_sub.add_parser("prune", help="remove the lock environments no package has used for --days days")
    e.add_argument("--days", type=float, default=30, help="unused for at least this many days (default 30)")
    e.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    e.set_defaults(func=cmd_env_prune)
    e = env_sub.add_parser("remove", help="delete an environment")
    e.add_argument("name", metavar="NAME", help="the environment's name, as `neuropod env list` shows it")
    e.set_defaults(func=cmd_env_remove)

    s = sub.add_parser("cache", help="the cache of extracted zip packages and of packages downloaded by URL")
    cache_sub = s.add_subparsers(dest="cache_command", required=True, metavar="CACHE_COMMAND")
    c = cache_sub.add_parser("verify", help="re-hash every extracted file against the record of the zip it came "
                             "from, and check every download's files against its record")  # fmt: skip
    c.add_argument("--repair", action="store_true", help="remove bad entries (they are extracted or downloaded "
                   "again when needed)")  # fmt: skip
    c.set_defaults(func=cmd_cache_verify)
    c = cache_sub.add_parser("prune", help="remove the packages downloaded by URL that no load has used for --days days")
    c.add_argument("--days", type=float, default=30, help="unused for at least this many days (default 30)")
    c.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    c.set_defaults(func=cmd_cache_prune)

    _add_plugin_commands(sub, argv)
    return p


def _fetch_package_urls(args: argparse.Namespace) -> None:
    """Download the packages named by URL (``s3://``, ``gs://``, ``az://``, an https zip) into the
    cache, each argument then the local copy (see :mod:`neuropod.storage`); what is downloaded is
    said on stderr."""
    from neuropod import storage

    urls = [v for v in [getattr(args, "package", None), *(getattr(args, "packages", None) or [])]
            if storage.is_package_url(v)]  # fmt: skip
    if not urls:
        return
    logger = logging.getLogger("neuropod.storage")
    if not any(getattr(h, "_neuropod_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("neuropod: %(message)s"))
        handler._neuropod_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    #: Local copy -> URL, for messages: a downloaded package is named by its URL.
    args.package_urls = {}
    if storage.is_package_url(getattr(args, "package", None)):
        args.package_url = storage.shown(args.package)
        args.package = str(storage.fetch(args.package))
        args.package_urls[args.package] = args.package_url
    if getattr(args, "packages", None):
        local = []
        for p in args.packages:
            if storage.is_package_url(p):
                copy = str(storage.fetch(p))
                args.package_urls[copy] = storage.shown(p)
                p = copy
            local.append(p)
        args.packages = local


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the ``neuropod`` command and return its exit status.

    An error ends the command with one message on stderr (``neuropod CMD: error: ...``) and exit
    status 2, a usage error with argparse's usage and status 2; ``--debug`` adds the traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser(argv).parse_args(argv)
    except SystemExit as e:  # a usage error (printed), --help or --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_ERROR)
    out = _safe_stream(out or sys.stdout)
    try:
        _fetch_package_urls(args)
        return int(args.func(args, out))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `neuropod backends | head` closes the pipe early; that is not an error.
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115
        return 0
    except NeuropodError as e:
        if getattr(e, "code", None) == "unauthenticated" and getattr(args, "auth_token_file", None) is None:
            return _fail(args, f"{e}; pass the token with --auth-token-file FILE")
        message = str(e)
        for copy, url in getattr(args, "package_urls", {}).items():  # a downloaded package: named by its URL
            message = message.replace(copy, url)
        return _fail(args, message)
    except OSError as e:
        return _fail(args, _describe_os_error(e))
    except (UnicodeError, MemoryError, RecursionError) as e:
        return _fail(args, f"{type(e).__name__}: {_one_line(str(e))}")
    except ValueError as e:
        # A bad value the user gave (a remote URL, a number out of range): its message is written
        # for them, and Python's class name in front of it says nothing more.
        return _fail(args, _one_line(str(e)) or "a value is not valid (run again with --debug for the traceback)")
    except Exception as e:  # noqa: BLE001  # a bug: still one line, and how to get the traceback
        return _fail(args, f"unexpected {type(e).__name__}: {_one_line(str(e))} "
                     "(a bug in neuropod or a plugin: run again with --debug and report the traceback)")


def _fail(args: argparse.Namespace, message: str) -> int:
    err = _safe_stream(sys.stderr)
    if args.debug:
        traceback.print_exc(file=err)
    # A NeuropodError may span lines (a table of candidates); everything else in it is escaped.
    print(f"neuropod {args.command}: error: {message}", file=err)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
