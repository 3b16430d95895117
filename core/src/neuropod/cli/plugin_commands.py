"""Commands other distributions add to ``neuropod`` (``serve``) through the ``neuropod.commands``
entry point group."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, TextIO

import importlib_metadata

from neuropod.cli.output import one_line
from neuropod.errors import NeuropodError, PluginNotInstalledError

#: Commands other distributions add through the ``neuropod.commands`` entry
#: point group, and what to install when one is missing.
KNOWN_PLUGIN_COMMANDS = {"serve": "'neuropod-serving[server]'"}
KNOWN_PLUGIN_HELP = {"serve": "serve packages over the Open Inference Protocol (Triton's and KServe's clients)"}


def _plugin_commands() -> dict[str, Any]:
    """Entry points of the ``neuropod.commands`` group, by command name (listed, not loaded)."""

    return {ep.name: ep for ep in importlib_metadata.entry_points(group="neuropod.commands")}


def _invoked_command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line: the first argument that is not a global option."""
    return next((a for a in argv if not a.startswith("-")), None)


def add_plugin_commands(sub: Any, argv: Sequence[str]) -> None:
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
    from neuropod.plugins import pip_install  # lazy: pluggy and the plugin registry, kept out of `neuropod --help`

    def fail(args: argparse.Namespace, out: TextIO) -> int:
        raise PluginNotInstalledError(
            f"`neuropod {name}` comes with another distribution: {pip_install(KNOWN_PLUGIN_COMMANDS[name])}"
        )

    return fail


def _broken_command(name: str, dist: str, error: Exception) -> Any:
    def fail(args: argparse.Namespace, out: TextIO) -> int:
        raise NeuropodError(
            f"`neuropod {name}` from {dist} failed to load: {type(error).__name__}: {one_line(str(error))}. "
            f"Reinstall {dist}, or run with --debug for the traceback."
        ) from error

    return fail
