"""The reference pages cannot drift from the code (datasette's test_docs is the model):
the CLI reference is what the argument parsers say, every command and option has help text,
and the API reference documents every public name and every installed packager."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(DOCS / "_ext"))

import cli_reference  # noqa: E402


def test_cli_reference_is_generated_from_the_parsers() -> None:
    committed = cli_reference.PAGE.read_text(encoding="utf-8")
    assert committed == cli_reference.markdown(), (
        "docs/reference/cli.md is stale: run `python docs/_ext/cli_reference.py` (with neuropod-serving installed)"
    )


def test_serve_is_documented_with_its_options() -> None:
    names = [name for name, _help, _parser in cli_reference.commands()]
    assert "serve" in names, "the docs environment must have neuropod-serving[server], or serve is not documented"


@pytest.mark.parametrize("name", [n for n, _h, _p in cli_reference.commands()])
def test_every_command_and_option_has_help(name: str) -> None:
    (help_text, parser) = next((h, p) for n, h, p in cli_reference.commands() if n == name)
    assert help_text and not help_text.startswith("("), f"neuropod {name} has no help text"
    missing = [a.option_strings or a.dest for a in cli_reference.options(parser) if not a.help]
    assert not missing, f"neuropod {name}: these arguments have no help text: {missing}"
    page = cli_reference.PAGE.read_text(encoding="utf-8")
    section = page.split(f"## `neuropod {name}`", 1)[1].split("\n## ", 1)[0]
    for action in cli_reference.options(parser):
        for option in action.option_strings:
            assert f"`{option}" in section, f"{option} of neuropod {name} is not in its section of cli.md"
    assert isinstance(parser, argparse.ArgumentParser)


API = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
DOCUMENTED = set(re.findall(r"^\.\. auto\w+:: ([\w.]+)", API, re.M))


def test_every_public_name_of_neuropod_is_in_the_api_reference() -> None:
    import neuropod

    public = {f"neuropod.{n}" for n in neuropod.__all__ if not n.startswith("_")}
    assert public - DOCUMENTED == set(), "add these to docs/reference/api.md"


def test_every_packager_of_our_plugins_is_in_the_api_reference() -> None:
    """Every packager the repository's plugins register (not an outside one, such as the example's)."""
    import importlib_metadata

    ours = {p.name for p in (DOCS.parent / "plugins").iterdir() if (p / "pyproject.toml").is_file()}
    found = [ep for ep in importlib_metadata.entry_points(group="neuropod.packagers") if ep.dist and ep.dist.name in ours]
    assert {ep.dist.name for ep in found if ep.dist} == ours, "the docs environment must have every plugin installed"
    for ep in found:
        func = ep.load()
        assert f"{func.__module__}.{func.__qualname__}" in DOCUMENTED, f"add {ep.name} to docs/reference/api.md"


def test_every_documented_name_exists() -> None:
    import importlib

    for dotted in DOCUMENTED:
        module, _, attr = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), f"api.md documents {dotted}, which does not exist"
