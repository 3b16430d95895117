"""The plugin author docs cannot drift from the hook specification
(datasette's test_docs): each hook has a page quoting its exact signature
and naming the conformance tests that exercise it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from neuropod import hookspecs
from neuropod.testing import hooks_covered

ROOT = Path(__file__).resolve().parents[2]
HOOK_DOCS = ROOT / "docs" / "reference" / "hooks"
HOOKS = sorted(name for name, f in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(f, "neuropod_spec"))

pytestmark = pytest.mark.skipif(not HOOK_DOCS.is_dir(), reason=f"docs not found at {HOOK_DOCS} (an installed core)")


def rendered_signature(name: str) -> str:
    """``def load_model(package: Package, ...) -> Any:`` as the spec declares it."""
    sig = inspect.signature(getattr(hookspecs, name))  # annotations stay strings: no TYPE_CHECKING imports needed
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"def {name}({params}) -> {sig.return_annotation}:"


def test_every_hook_has_a_page_and_no_page_is_stale() -> None:
    pages = {p.stem for p in HOOK_DOCS.glob("*.md") if p.name != "index.md"}
    assert pages == set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_page_quotes_the_exact_signature(hook: str) -> None:
    text = (HOOK_DOCS / f"{hook}.md").read_text()
    assert rendered_signature(hook) in text
    assert text.startswith(f"# `{hook}`")
    for section in ("## Arguments", "## Returns", "## Example"):
        assert section in text, f"{hook}.md has no {section!r} section"
    for param in inspect.signature(getattr(hookspecs, hook)).parameters:
        assert f"`{param}`" in text, f"{hook}.md does not describe argument {param!r}"


@pytest.mark.parametrize("hook", HOOKS)
def test_page_names_the_conformance_tests_of_its_hook(hook: str) -> None:
    text = (HOOK_DOCS / f"{hook}.md").read_text()
    named = set(re.findall(r"`(test_\w+)`", text))
    exercising = {test for test, hooks in hooks_covered().items() if hook in hooks}
    assert named == exercising


def test_index_links_every_page() -> None:
    index = (HOOK_DOCS / "index.md").read_text()
    for hook in HOOKS:
        assert f"({hook}.md)" in index


def test_example_blocks_compile() -> None:
    for page in HOOK_DOCS.glob("*.md"):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            if not block.lstrip().startswith("def "):  # the bare signature is not a full function
                compile(block, str(page), "exec")


def test_tutorial_files_are_the_example_project() -> None:
    """Every file the tutorial has you create is, byte for byte, the example's."""
    tutorial = (ROOT / "docs" / "how-to" / "write-a-backend.md").read_text()
    example = ROOT / "examples" / "neuropod-numpy-backend"
    found = re.findall(r"Create `([^`]+)`:\n\n(````|```)\w*\n(.*?)\2\n", tutorial, re.S)
    blocks = {rel: body for rel, _fence, body in found}
    shipped = {str(p.relative_to(example)) for p in example.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert set(blocks) == shipped
    for rel, body in blocks.items():
        assert body == (example / rel).read_text(), f"the tutorial's {rel} differs from {example / rel}"
