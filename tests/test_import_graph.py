"""The import graph of our own packages stays a set of layers that read top-down.

Checked here, for the core (``core/src/neuropod``), neuropod-serving (``serving/src/neuropod_serving``)
and every backend plugin (``plugins/*/src/<package>``), by reading their source with :mod:`ast`
(nothing of theirs is imported, so a broken module cannot hide a problem):

1. No import circle among our own modules. An import inside a function counts (it runs, and it ties
   the two modules together all the same); an import under ``if TYPE_CHECKING:`` does not (a type-only
   back-reference from a lower module to a higher one is allowed). Imports in the ``else:`` branch of
   such a block do run, and count.
2. An import of one of our own modules inside a function (``neuropod.*`` imported from serving or a
   plugin included) has a ``# lazy: <what it keeps out, and why>`` comment on its line or on the line
   just above: the only reason to import our own code late is to keep a heavy third-party library
   (numpy, grpc, starlette, uvicorn, a framework, fsspec...) or an optional extra out of an import.
3. No library file is over :data:`LINE_LIMIT` lines unless :data:`LARGE_FILES` names it with the one
   idea it holds.
4. ``neuropod serve --help`` imports none of the server libraries (grpc, starlette, uvicorn).
   (``python -c "import neuropod"`` importing no numpy is checked by
   ``core/tests/test_model.py::test_import_neuropod_imports_no_framework_or_numpy``.)

What an import statement depends on (:func:`import_targets`), as Python runs it:

- ``import a.b.c`` depends on the module ``a.b.c``. Python also runs ``a/__init__.py`` and
  ``a/b/__init__.py`` first, but those are not counted as the importer's dependencies: a package's
  ``__init__.py`` that re-exports its submodules (its public face) would otherwise be in a circle with
  every submodule that names a sibling by its full dotted path, which is the usual way to write it.
- ``from p import n`` depends on ``p.n`` when that is one of our modules (a submodule is imported),
  else on ``p`` itself (``n`` is a name defined in, or re-exported by, ``p/__init__.py``).
- Relative imports are resolved against the importing module's package: in ``a/b/m.py`` (or
  ``a/b/__init__.py``), ``from . import x`` is ``from a.b import x``, ``from .m2 import y`` is
  ``from a.b.m2 import y`` and ``from .. import z`` is ``from a import z``.
- Only the longest of our modules that a dotted name starts with counts (``from neuropod.spec import
  TensorSpec`` depends on ``neuropod.spec``); imports of anything else are not part of this graph.

Run this file alone (``nox -s imports`` does): ``pytest tests/test_import_graph.py``. The same session
runs import-linter's contracts (``.importlinter``) as a second opinion on the rules between packages.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Library files may have at most this many lines.
LINE_LIMIT = 600

#: Files allowed over LINE_LIMIT, path from the repository root -> the one idea the file holds.
#: Keep it short: a file lands here only when splitting it would cut one idea in two.
LARGE_FILES: dict[str, str] = {}

#: At most this many files may be allowed over the limit, in the whole project.
LARGE_FILES_MAX = 5

#: Which third-party libraries ``neuropod serve --help`` must not import.
SERVER_LIBRARIES = ("grpc", "starlette", "uvicorn")

LAZY_COMMENT = re.compile(r"#\s*lazy:\s*\S")


# --- reading the source --------------------------------------------------------------------------


def source_packages(root: Path = ROOT) -> list[Path]:
    """The top-level package directories checked: the core's, serving's and every plugin's."""
    candidates = [root / "core" / "src" / "neuropod", root / "serving" / "src" / "neuropod_serving"]
    for src in sorted(root.glob("plugins/*/src")):
        candidates += sorted(p for p in src.iterdir() if (p / "__init__.py").is_file())
    return [p for p in candidates if (p / "__init__.py").is_file()]


def module_name(package: Path, path: Path) -> str:
    """The dotted module name of ``path``, a file inside the top-level package directory ``package``."""
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(packages: Iterable[Path]) -> dict[str, Path]:
    """Every module of ``packages``, by dotted name."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            modules[module_name(package, path)] = path
    return modules


@dataclass(frozen=True)
class Import:
    """One import statement of one of our modules by another."""

    importer: str
    target: str
    path: Path
    line: int
    in_function: bool
    lazy: bool  # a ``# lazy:`` comment on the statement or on the line just above it

    def where(self, root: Path = ROOT) -> str:
        """``file:line`` of the statement, relative to ``root`` when it is inside it."""
        try:
            shown = self.path.relative_to(root)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}"


def _is_type_checking(test: ast.expr) -> bool:
    """True for ``if TYPE_CHECKING:`` and ``if typing.TYPE_CHECKING:`` (any module prefix)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _import_statements(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that runs, with whether it is inside a function (or lambda).

    The body of an ``if TYPE_CHECKING:`` is skipped, its ``else:`` branch is not."""

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children: list[ast.AST] = list(node.orelse)
        else:
            children = list(ast.iter_child_nodes(node))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in children:
            yield from visit(child, inside)

    yield from visit(tree, False)


def _comment_lines(source: str) -> dict[int, str]:
    """Line number -> the comment on that line (real comments only, not ``#`` inside strings)."""
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    return comments


def _has_lazy_comment(node: ast.stmt, comments: dict[int, str], lines: list[str]) -> bool:
    """A ``# lazy: ...`` comment on the statement's lines, or alone on the line just above it."""
    last = node.end_lineno or node.lineno
    if any(LAZY_COMMENT.search(comments.get(n, "")) for n in range(node.lineno, last + 1)):
        return True
    above = node.lineno - 1
    return (
        above >= 1 and lines[above - 1].lstrip().startswith("#") and bool(LAZY_COMMENT.search(comments.get(above, "")))
    )


def _own_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest of our modules that the dotted ``name`` is or starts with; None if none is."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
                   modules: dict[str, Path]) -> list[str]:  # fmt: skip
    """Which of our modules an import statement in module ``importer`` depends on (see the module docstring).

    ``is_package``: the importer is a package's ``__init__.py`` (relative imports start from it, not
    from its parent)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer.split(".") if is_package else importer.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    targets: list[str] = []
    for name in names:
        target = _own_module(name, modules)
        if target is not None and target != importer and target not in targets:
            targets.append(target)
    return targets


def read_imports(modules: dict[str, Path], unreadable: list[str] | None = None) -> list[Import]:
    """Every import of one of ``modules`` by another, read from their source.

    A file that does not parse is left out, and its error appended to ``unreadable`` (or raised
    when that is None)."""
    imports: list[Import] = []
    for importer, path in modules.items():
        source = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(source, filename=str(path))
        except SyntaxError as e:
            if unreadable is None:
                raise
            unreadable.append(f"{e.filename}:{e.lineno}: {e.msg}")
            continue
        comments = _comment_lines(source)
        lines = source.splitlines()
        for node, in_function in _import_statements(tree):
            for target in import_targets(node, importer, path.name == "__init__.py", modules):
                lazy = in_function and _has_lazy_comment(node, comments, lines)
                imports.append(Import(importer, target, path, node.lineno, in_function, lazy))
    return imports


# --- what is wrong with a graph ------------------------------------------------------------------


@dataclass
class Graph:
    """Our modules and the imports between them."""

    modules: dict[str, Path]
    imports: list[Import] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)  # files that do not parse: file:line: error

    @classmethod
    def read(cls, packages: Iterable[Path]) -> Graph:
        """The graph of ``packages`` (top-level package directories), read from source."""
        modules = find_modules(packages)
        unreadable: list[str] = []
        imports = read_imports(modules, unreadable)
        return cls(modules, imports, unreadable)

    def circles(self) -> list[list[str]]:
        """The import circles: each set of modules that import one another round (strongly
        connected components of more than one module), each sorted, in a stable order."""
        edges: dict[str, set[str]] = {m: set() for m in self.modules}
        for imp in self.imports:
            edges[imp.importer].add(imp.target)
        return [sorted(c) for c in _strongly_connected(edges) if len(c) > 1]

    def circle_report(self, circle: list[str], root: Path = ROOT) -> str:
        """The modules of ``circle`` and every import between two of them (file:line): cutting the
        right ones (usually those marked "inside a function") breaks the circle."""
        members = set(circle)
        lines = [f"import circle of {len(circle)} modules: {', '.join(circle)}"]
        for imp in sorted(self.imports, key=lambda i: (i.importer, i.line)):
            if imp.importer in members and imp.target in members:
                late = " (inside a function)" if imp.in_function else ""
                lines.append(f"    {imp.where(root)}: {imp.importer} imports {imp.target}{late}")
        return "\n".join(lines)

    def unmarked_late_imports(self) -> list[Import]:
        """Imports of our own modules inside a function without a ``# lazy:`` comment."""
        return [i for i in self.imports if i.in_function and not i.lazy]


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative (no recursion limit), in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components


def _line_count(path: Path) -> int:
    with path.open(encoding="utf-8") as f:
        return sum(1 for _ in f)


# --- the checks over this repository -------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> Graph:
    packages = source_packages()
    assert len(packages) >= 9, f"expected the core, serving and seven plugins under {ROOT}, found {packages}"
    return Graph.read(packages)


def test_every_module_parses(graph: Graph) -> None:
    if graph.unreadable:
        pytest.fail("these files do not parse, so their imports are not checked:\n" + "\n".join(graph.unreadable),
                    pytrace=False)  # fmt: skip


def test_no_import_circles(graph: Graph) -> None:
    circles = graph.circles()
    if circles:
        pytest.fail(
            f"{len(circles)} import circle(s) among our own modules. Break each one: move what the lower module "
            "needs from the higher one into a module below both, and keep type-only back-references under "
            "`if TYPE_CHECKING:`.\n\n" + "\n\n".join(graph.circle_report(c) for c in circles),
            pytrace=False,
        )


def test_own_imports_inside_functions_say_why(graph: Graph) -> None:
    by_statement: dict[str, list[str]] = {}
    for i in graph.unmarked_late_imports():
        by_statement.setdefault(i.where(), []).append(i.target)
    if by_statement:
        pytest.fail(
            f"{len(by_statement)} import(s) of our own modules inside a function without a `# lazy:` comment. "
            "Move each to the top of its file; or, if it is there only to keep a heavy library (numpy, grpc, "
            "starlette, uvicorn, a framework, fsspec...) or an optional extra out of an import, say so on its "
            "line or the line above: `# lazy: <which library>, <why it must stay out>`.\n"
            + "\n".join(f"    {where}: imports {', '.join(targets)}" for where, targets in by_statement.items()),
            pytrace=False,
        )


def test_library_files_are_not_too_long(graph: Graph) -> None:
    too_long = []
    for path in sorted(set(graph.modules.values())):
        lines = _line_count(path)
        relative = path.relative_to(ROOT).as_posix()
        if lines > LINE_LIMIT and relative not in LARGE_FILES:
            too_long.append(f"    {relative}: {lines} lines")
    if too_long:
        pytest.fail(
            f"{len(too_long)} library file(s) over {LINE_LIMIT} lines. Split each by the ideas it holds into "
            "modules named for them; if a file holds one idea that would be cut in two, add it to LARGE_FILES "
            f"in {Path(__file__).name} with that idea.\n" + "\n".join(too_long),
            pytrace=False,
        )


def test_allowed_large_files_are_few_and_still_large() -> None:
    assert len(LARGE_FILES) <= LARGE_FILES_MAX, f"LARGE_FILES holds {len(LARGE_FILES)} files; at most {LARGE_FILES_MAX}"
    stale = [f for f in LARGE_FILES if not (ROOT / f).is_file() or _line_count(ROOT / f) <= LINE_LIMIT]
    assert not stale, f"LARGE_FILES names files that are gone or no longer over {LINE_LIMIT} lines: remove {stale}"
    vague = [f for f, idea in LARGE_FILES.items() if not idea.strip()]
    assert not vague, f"LARGE_FILES entries without the idea the file holds: {vague}"


def _imported_modules(stderr: str) -> set[str]:
    """Module names from ``python -X importtime``'s report (``import time: self | cumulative | name``)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":  # the header line
                names.add(name)
    return names


def test_serve_help_imports_no_server_library() -> None:
    if importlib.util.find_spec("neuropod_serving") is None:
        pytest.skip("neuropod-serving is not installed: `neuropod serve` is not there to check")
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "neuropod", "serve", "--help"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), (
        f"`neuropod serve --help` failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    )
    imported = _imported_modules(proc.stderr)
    assert imported, "python -X importtime reported no imports: cannot tell what `neuropod serve --help` imports"
    heavy = sorted(m for m in imported if m.split(".")[0] in SERVER_LIBRARIES)
    assert not heavy, (
        f"`neuropod serve --help` imports {heavy}: the server libraries belong inside the code that starts "
        "the server, so that the help (and a typo in an option) answers at once."
    )


# --- the checker itself, on small packages written for the purpose -------------------------------


def _write_package(root: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (path inside the package -> source) as the package ``root``; returns ``root``."""
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    return root


def test_checker_finds_a_circle_closed_inside_a_function(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path / "pkg", {
        "__init__.py": "",
        "low.py": "def f():\n    from pkg.high import g  # lazy: a reason that does not excuse a circle\n    return g\n",
        "high.py": "from pkg import low\n\ndef g():\n    return low.f\n",
    })  # fmt: skip
    g = Graph.read([pkg])
    assert g.circles() == [["pkg.high", "pkg.low"]]
    report = g.circle_report(["pkg.high", "pkg.low"], root=tmp_path)
    assert "pkg/low.py:2: pkg.low imports pkg.high (inside a function)" in report
    assert "pkg/high.py:1: pkg.high imports pkg.low" in report


def test_checker_ignores_type_checking_back_references(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path / "pkg", {
        "__init__.py": "",
        "low.py": (
            "import typing\nfrom typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pkg.high import G\n"
            "if typing.TYPE_CHECKING:\n    import pkg.high\nelse:\n    import pkg.other\n"
        ),
        "high.py": "from pkg.low import *\n",
        "other.py": "",
    })  # fmt: skip
    g = Graph.read([pkg])
    assert g.circles() == []
    assert {(i.importer, i.target) for i in g.imports} == {("pkg.high", "pkg.low"), ("pkg.low", "pkg.other")}


def test_checker_accepts_a_lazy_comment_on_the_line_or_just_above(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path / "pkg", {
        "__init__.py": "",
        "heavy.py": "",
        "use.py": (
            "def a():\n    from pkg import heavy  # lazy: numpy, kept out of `import pkg`\n"
            "def b():\n    # lazy: numpy, kept out of `import pkg`\n    from pkg import heavy\n"
            "def c():\n    from pkg import heavy  # not a reason\n"
            "def d():\n    x = '# lazy: inside a string'\n    from pkg import heavy\n"
            "def e():\n    from pkg import (  # lazy: numpy, in a parenthesised import\n        heavy,\n    )\n"
        ),
    })  # fmt: skip
    late = Graph.read([pkg]).unmarked_late_imports()
    assert sorted(i.line for i in late) == [7, 10]


def test_checker_resolves_relative_and_dotted_imports(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path / "pkg", {
        "__init__.py": "from . import sub\nfrom .sub import deep\n",
        "top.py": "NAME = 1\n",
        "sub/__init__.py": "from . import deep\nfrom .. import top\nfrom .deep import thing\n",
        "sub/deep.py": "from .. import NAME\nfrom ..top import NAME as N2\nimport pkg.sub.leaf\nthing = 1\n",
        "sub/leaf.py": "from pkg.sub import thing\n",
    })  # fmt: skip
    edges = {(i.importer, i.target) for i in Graph.read([pkg]).imports}
    assert edges == {
        ("pkg", "pkg.sub"),  # from . import sub: a submodule
        ("pkg", "pkg.sub.deep"),  # from .sub import deep
        ("pkg.sub", "pkg.sub.deep"),  # from . import deep, from .deep import thing
        ("pkg.sub", "pkg.top"),  # from .. import top
        ("pkg.sub.deep", "pkg"),  # from .. import NAME: a name of pkg/__init__.py
        ("pkg.sub.deep", "pkg.top"),
        ("pkg.sub.deep", "pkg.sub.leaf"),  # import pkg.sub.leaf: the module, not its parents
        ("pkg.sub.leaf", "pkg.sub"),  # from pkg.sub import thing: a name of the package
    }
    g = Graph.read([pkg])
    assert ["pkg", "pkg.sub", "pkg.sub.deep", "pkg.sub.leaf"] in g.circles()


def test_checker_links_packages_to_each_other(tmp_path: Path) -> None:
    core = _write_package(tmp_path / "core", {"__init__.py": "", "spec.py": ""})
    plugin = _write_package(tmp_path / "core_plugin", {
        "__init__.py": "def load():\n    from core.spec import X\n    import numpy\n",
    })  # fmt: skip
    g = Graph.read([core, plugin])
    assert [(i.importer, i.target, i.in_function) for i in g.imports] == [("core_plugin", "core.spec", True)]
