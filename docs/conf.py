"""Sphinx configuration: the site is Markdown (MyST) so Sybil can run every
example of the same files; ``nox -s docs`` builds it with warnings as errors."""

from __future__ import annotations

import neuropod

project = "Neuropod for Python"
author = "the Neuropod for Python authors"
copyright = "2026, the Neuropod for Python authors"
release = neuropod.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_ext", "tests"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4  # [text](page.md#a-heading) links resolve, and a wrong anchor is a warning
suppress_warnings: list[str] = []

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}

html_theme = "furo"
html_title = f"Neuropod for Python {release}"
html_static_path = ["_static"]
