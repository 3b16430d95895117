"""README.md's table of `neuropod` commands cannot drift from the argument parser (datasette's
test_docs): every command and subcommand the parser has is a line of the table, and every line
of the table is a command the parser has."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from neuropod.cli import _parser

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.skipif(not README.is_file(), reason=f"README not found at {README} (an installed core)")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def parser_commands() -> set[str]:
    """``backends``, ``env create``, ``cache verify``, ``serve``...: each command the parser runs."""
    commands = set()
    for name, sub in _subparsers(_parser()).items():
        nested = _subparsers(sub)
        commands |= {f"{name} {n}" for n in nested} if nested else {name}
    return commands


def readme_commands() -> set[str]:
    """The commands of the table under "## The `neuropod` command": in each line's usage column,
    the words after ``neuropod`` up to the first argument (upper case, an option, an optional part)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## The `neuropod` command", 1)[1]
    table = re.search(r"```\n(.*?)```", section, re.S)
    assert table, "no ``` block after the heading"
    commands = set()
    for line in table.group(1).splitlines():
        if not line.startswith("neuropod "):
            continue
        words = []
        usage = re.split(r"\s{2,}", line)[0]  # the description column starts after two spaces
        for word in usage.split()[1:]:
            if not re.fullmatch(r"[a-z][a-z-]*", word):
                break
            words.append(word)
        commands.add(" ".join(words))
    return commands


def test_every_command_of_the_parser_is_in_the_readme_table() -> None:
    documented = readme_commands()
    assert parser_commands() - documented == set(), "add these to README.md's table of commands"
    assert documented - parser_commands() == set(), "README.md's table names commands the parser does not have"


def test_the_readers_see_the_table_they_need() -> None:
    """The reading is sound: the table has the commands a new user starts with, and lines with
    arguments are cut at the first one."""
    documented = readme_commands()
    assert {"backends", "inspect", "demo", "env prepare", "env prune", "serve"} <= documented
    assert not any(c.endswith(("PKG", "--json")) for c in documented)
