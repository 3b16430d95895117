r"""The ``neuropod`` command.

::

    neuropod backends                 installed backends, devices, failed plugins
    neuropod inspect PKG|URL          name, platform, range, spec, files (a remote model: spec, servers)
    neuropod explain PKG|URL [--host F]  which backend would run it, and why not the others
    neuropod test PKG                 run the package's bundled test data (a URL has none: an error)
    neuropod infer PKG|URL --input x=x.npy [--output-dir DIR]
    neuropod compare A B [C ...]      one problem's implementations side by side: agreement, speed, memory
                                      (--json FILE, --html FILE; exit 1 when one disagrees)
    neuropod demo [PLATFORM] [--dir DIR]  package a small model, explain, run it
    neuropod env create SPEC          a backend environment (e.g. onnx==1.20.1); env list, env remove NAME,
                                      env prepare PACKAGE (build the environment its requirements need),
                                      env prune [--days N] (lock environments no package used for N days)
    neuropod cache verify [--repair]  re-hash every extracted zip package against its record; check downloads
    neuropod cache prune [--days N]   remove packages downloaded by URL that no load used for N days (and
                                      what interrupted downloads and removals left)
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
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from neuropod._version import __version__
from neuropod.cli.backends import cmd_backends
from neuropod.cli.cache import cmd_cache_prune, cmd_cache_verify
from neuropod.cli.compare import add_compare
from neuropod.cli.demo import cmd_demo
from neuropod.cli.env import cmd_env_create, cmd_env_list, cmd_env_prepare, cmd_env_prune, cmd_env_remove
from neuropod.cli.inspect import cmd_explain, cmd_inspect
from neuropod.cli.output import EXIT_ERROR, describe_os_error, one_line, safe, safe_stream
from neuropod.cli.output import EXIT_TEST_FAILED as EXIT_TEST_FAILED
from neuropod.cli.plugin_commands import KNOWN_PLUGIN_COMMANDS as KNOWN_PLUGIN_COMMANDS
from neuropod.cli.plugin_commands import KNOWN_PLUGIN_HELP as KNOWN_PLUGIN_HELP
from neuropod.cli.plugin_commands import add_plugin_commands
from neuropod.cli.run import cmd_infer, cmd_test
from neuropod.cli.run import output_file_name as output_file_name
from neuropod.errors import NeuropodError

# --- entry point ----------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors printed safely (argv may hold lone surrogates or controls)."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if message:
            safe_stream(file or sys.stderr).write(message)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {safe(message)}\n")


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

    s = sub.add_parser("infer", help="run a package (or a remote model) on inputs from .npy files (a stateful one: one step of a new sequence)")
    s.add_argument("package", help="a package (a path, or a URL: s3://, gs://, az://, https://...zip), or a remote "
                   "model's URL (grpc://host:8001/model, http://...)")
    s.add_argument("--input", "-i", action="append", default=[], metavar="NAME=FILE.npy", required=True,
                   help="an input tensor from a .npy file")
    s.add_argument("--output", "-o", action="append", default=[], metavar="NAME", help="only these outputs")
    s.add_argument("--output-dir", help="write each output to DIR/NAME.npy ('/' in a name as %%2F)")
    s.add_argument("--stream", action="store_true",
                   help="print each response as it arrives (a decoupled model answers with any number; others, "
                   "once); with --output-dir, response N goes to DIR/N/NAME.npy. A decoupled model always streams")
    token_arg(s)
    resolution_args(s)
    s.set_defaults(func=cmd_infer)

    add_compare(sub)

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
    c = cache_sub.add_parser("prune", help="remove the packages downloaded by URL that no load has used for --days days, "
                             "and what interrupted downloads and removals left (partial downloads and .trash- folders "
                             "untouched for an hour)")  # fmt: skip
    c.add_argument("--days", type=float, default=30, help="unused for at least this many days (default 30)")
    c.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    c.set_defaults(func=cmd_cache_prune)

    add_plugin_commands(sub, argv)
    return p


def _fetch_package_urls(args: argparse.Namespace) -> None:
    """Download the packages named by URL (``s3://``, ``gs://``, ``az://``, an https zip) into the
    cache, each argument then the local copy (see :mod:`neuropod.storage`); what is downloaded is
    said on stderr."""
    from neuropod import storage  # lazy: numpy, kept out of `neuropod --help`

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
        args.argv = argv
    except SystemExit as e:  # a usage error (printed), --help or --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_ERROR)
    out = safe_stream(out or sys.stdout)
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
        return _fail(args, describe_os_error(e))
    except (UnicodeError, MemoryError, RecursionError) as e:
        return _fail(args, f"{type(e).__name__}: {one_line(str(e))}")
    except ValueError as e:
        # A bad value the user gave (a remote URL, a number out of range): its message is written
        # for them, and Python's class name in front of it says nothing more.
        return _fail(args, one_line(str(e)) or "a value is not valid (run again with --debug for the traceback)")
    except Exception as e:  # noqa: BLE001  # a bug: still one line, and how to get the traceback
        return _fail(args, f"unexpected {type(e).__name__}: {one_line(str(e))} "
                     "(a bug in neuropod or a plugin: run again with --debug and report the traceback)")


def _fail(args: argparse.Namespace, message: str) -> int:
    err = safe_stream(sys.stderr)
    debug = traceback.format_exc() if args.debug else ""
    if ":/" in message + debug:  # no URL's user, password nor query (a presigned URL's signature), whoever worded it
        from neuropod.storage.urls import redact  # lazy: neuropod.storage imports numpy, kept out of `neuropod --help`

        message, debug = redact(message), redact(debug)
    err.write(debug)
    # A NeuropodError may span lines (a table of candidates); everything else in it is escaped.
    print(f"neuropod {args.command}: error: {message}", file=err)
    return EXIT_ERROR
