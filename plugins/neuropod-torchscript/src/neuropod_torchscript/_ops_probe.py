"""Which ops a torch custom-op library registers, learnt in a fresh interpreter.

torch aborts the whole process (SIGABRT, from the library's static
initializers) when a library defines an op that is already registered ("Tried
to register an operator ... multiple times") or claims, with
``TORCH_LIBRARY(ns, m)``, a namespace another library claimed ("Only a single
TORCH_LIBRARY can be used to register the namespace"). So before a package's
library is loaded into this process, the backend asks what it registers and
whether any of it is here already (:func:`clash`); if so the model runs in a
worker process instead.

What a library registers is learnt by loading it alone in a new interpreter,
where a library that crashes harms nobody::

    python -m neuropod_torchscript._ops_probe LIBRARY

prints one line, ``NEUROPOD_TORCH_OPS {"ops": [...], "namespaces": [...], "torch": "<version>"}``,
and exits 0. ``ops`` are the operators the library added (``ns::name`` or
``ns::name.overload``); ``namespaces`` are the new namespaces it claimed with
``TORCH_LIBRARY`` (a ``TORCH_LIBRARY_FRAGMENT`` claims none). The answer is
kept on disk per library content and torch version
(:func:`neuropod.backend.cached_probe`), so each library is probed once.

This module imports torch only in :func:`main` (the probe) and :func:`clash`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from neuropod import cache
from neuropod.backend import cached_probe
from neuropod.errors import PackageError

#: Seconds a probe may take (importing torch is most of it).
PROBE_TIMEOUT = 180.0

_MARK = "NEUROPOD_TORCH_OPS "


def library_registrations(path: Path, torch_version: str, where: str) -> dict[str, list[str]]:
    """What the library at ``path`` registers: ``{"ops": [...], "namespaces": [...]}``.

    Probed in a subprocess once per library content and torch version.

    :raises PackageError: the library does not load in a fresh process, or the
        probe crashed or ran past :data:`PROBE_TIMEOUT`.
    """
    key = f"{cache.sha256_file(path)}-torch-{torch_version}"
    found = cached_probe("torch-ops", key, lambda: _probe(path, torch_version, where))
    if not (isinstance(found, dict) and all(isinstance(found.get(k), list) for k in ("ops", "namespaces"))):
        found = _probe(path, torch_version, where)  # a cache entry someone else wrote or damaged
    return {k: [str(v) for v in found[k]] for k in ("ops", "namespaces")}


def clash(path: Path, where: str) -> str | None:
    """Why the library at ``path`` cannot be loaded into this process, or None when it can.

    It cannot when an op it defines is registered here already, or when it
    claims a namespace that ops loaded here already use: torch would abort
    the process. Libraries whose content is already loaded here never get
    this far (:func:`neuropod.backend.load_libraries_once` skips them).
    """
    import torch

    found = library_registrations(path, torch.__version__, where)
    present = set(_op_names(torch))
    taken = sorted(set(found["ops"]) & present)
    if taken:
        return (
            f"it defines op(s) {_names(taken)}, which this process already has from another library file, and "
            f"torch {torch.__version__} aborts the process when an op is registered twice"
        )
    in_use = {name.split("::", 1)[0] for name in present}
    claimed = sorted(ns for ns in found["namespaces"] if ns in in_use)
    if claimed:
        return (
            f"it claims the op namespace(s) {_names(claimed)} (TORCH_LIBRARY), which ops already loaded in this "
            f"process use, and torch {torch.__version__} aborts the process when a namespace is claimed twice"
        )
    return None


def _names(names: list[str], most: int = 5) -> str:
    shown = ", ".join(map(repr, names[:most]))
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _op_names(torch: Any) -> list[str]:
    """Every operator registered in this process, as ``ns::name`` or ``ns::name.overload``."""
    names = getattr(torch._C, "_dispatch_get_all_op_names", None)
    if names is not None:
        return [str(n) for n in names()]
    # Older torch: the JIT's view of the same registry.
    return [f"{s.name}.{s.overload_name}" if s.overload_name else s.name for s in torch._C._jit_get_all_schemas()]


def _probe(path: Path, torch_version: str, where: str) -> dict[str, list[str]]:
    what = (
        f"{where}: custom op library {path.name} failed to load in torch {torch_version} "
        "(loaded alone in a fresh Python process to learn which ops it registers)"
    )
    if not sys.executable:
        raise PackageError(f"{what}: this interpreter does not know its own executable (sys.executable is empty)")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "neuropod_torchscript._ops_probe", str(path)],
            capture_output=True, text=True, errors="replace", timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise PackageError(f"{what}: the probe did not finish within {PROBE_TIMEOUT:g} s") from None
    except OSError as e:
        raise PackageError(f"{what}: the probe could not start: {e}") from None
    if done.returncode == 0:
        for line in reversed(done.stdout.splitlines()):
            if line.startswith(_MARK):
                try:
                    found = json.loads(line[len(_MARK) :])
                    return {k: [str(v) for v in found[k]] for k in ("ops", "namespaces")}
                except (ValueError, KeyError, TypeError):
                    break
    if done.returncode < 0:
        try:
            how = f"the probe was killed by {signal.Signals(-done.returncode).name}"
        except ValueError:
            how = f"the probe was killed by signal {-done.returncode}"
        how += "; loading it into this process would have ended it the same way"
    elif done.returncode == 0:
        how = "the probe printed no answer"
    else:
        how = f"the probe exited with code {done.returncode}"
    raise PackageError(f"{what}: {how}:\n{_tail(done.stderr.strip() or done.stdout.strip())}")


def _tail(text: str) -> str:
    """The lines of a probe's output worth reading: torch's ``what():`` line, else the last few."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "what():" in line:  # C++ exceptions that terminate the process: the message, not the stack
            return "\n".join(lines[i : i + 3])[:2000]
    return "\n".join(lines[-10:])[-2000:] or "(no output)"


def main(argv: list[str]) -> int:
    """Load one library and print what it registered."""
    if len(argv) != 1:
        print("usage: python -m neuropod_torchscript._ops_probe LIBRARY", file=sys.stderr)
        return 2
    import torch

    before = set(_op_names(torch))
    namespaces_before = {name.split("::", 1)[0] for name in before}
    try:
        torch.ops.load_library(argv[0])  # type: ignore[no-untyped-call]
    except OSError as e:  # dlopen's message is what matters; anything else shows its traceback
        # torch words it "Could not load this library: <path>" and chains dlopen's reason.
        reason = f" ({e.__cause__})" if e.__cause__ is not None else ""
        print(f"{type(e).__name__}: {e}{reason}", file=sys.stderr)
        return 1
    added = sorted(set(_op_names(torch)) - before)
    new_namespaces = sorted({name.split("::", 1)[0] for name in added} - namespaces_before)
    claimed = [ns for ns in new_namespaces if _claimed(torch, ns)]
    print(_MARK + json.dumps({"ops": added, "namespaces": claimed, "torch": torch.__version__}), flush=True)
    return 0


def _claimed(torch: Any, namespace: str) -> bool:
    """Whether a library claimed ``namespace`` with TORCH_LIBRARY: then nobody else can
    (a second claim from Python is a RuntimeError here, where from a library it aborts)."""
    try:
        library = torch.library.Library(namespace, "DEF")
    except RuntimeError:
        return True
    destroy = getattr(library, "_destroy", None)
    if destroy is not None:
        destroy()
    return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
