"""Facts learnt by running code in a fresh interpreter, where a crash harms nobody.

Some facts a backend needs can only be learnt by doing something that may end
the process doing it: which ops a custom-op library registers is known only
by loading it, and a library that defines an op this process already has
makes torch abort (SIGABRT from its static initializers). So backends ask a
new interpreter::

    python -m neuropod.probe MODULE:FUNCTION ARG...

imports ``MODULE``, calls ``FUNCTION(*ARGs)`` and prints its JSON answer on
one marked line; :func:`run_probe` starts it and turns every way it can go
wrong (a crash, a signal, a timeout, no answer) into a :class:`PackageError`
that says what was being learnt. A function that fails in a way it
understands raises :class:`ProbeFailure` with a message worth showing.
Answers that never change for a file's content are kept on disk with
:func:`neuropod.backend.cached_probe`.

The torch plugins (TorchScript, torch.export and AOTInductor) share one
custom-op check, :func:`load_torch_libraries`, here rather than in either of
them. It imports torch only when called, like everything in this module.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from neuropod.backend import cached_probe, load_libraries_once
from neuropod.errors import PackageError

#: Seconds a probe may take by default (importing a framework is most of it).
PROBE_TIMEOUT = 180.0

_MARK = "NEUROPOD_PROBE_ANSWER "


class ProbeFailure(Exception):
    """Raised by a probe function for a failure it can explain; its message is shown as it is."""


def run_probe(
    target: str,
    args: Sequence[str],
    what: str,
    *,
    timeout: float = PROBE_TIMEOUT,
    env: Mapping[str, str] | None = None,
    clean_output: Callable[[str], str] | None = None,
) -> Any:
    """Run ``target`` (``"module:function"``) on ``args`` in a fresh interpreter and return its answer.

    :param what: what the probe is for, as the start of an error message
        (``"Model 'm': custom op library libops.so failed to load in torch 2.13.0"``).
    :param env: variables to set in the probe's environment (e.g. a
        framework's log level). Wherever this process found ``neuropod`` and
        the target's top-level package, the probe finds them too.
    :param clean_output: given the probe's stderr, the part worth showing
        (a framework's log noise removed); of that, a C++ ``what():`` line
        is shown, else the last lines.
    :raises PackageError: the probe failed, crashed, ran past ``timeout``
        seconds or printed no answer.
    """
    if not sys.executable:
        raise PackageError(f"{what}: this interpreter does not know its own executable (sys.executable is empty)")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "neuropod.probe", target, *args],
            capture_output=True, text=True, errors="replace", timeout=timeout, stdin=subprocess.DEVNULL,
            env=_probe_env(target, env),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise PackageError(f"{what}: the probe did not finish within {timeout:g} s") from None
    except OSError as e:
        raise PackageError(f"{what}: the probe could not start: {e}") from None
    if done.returncode == 0:
        for line in reversed(done.stdout.splitlines()):
            if line.startswith(_MARK):
                try:
                    return json.loads(line[len(_MARK) :])
                except ValueError:
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
    stderr = clean_output(done.stderr) if clean_output is not None else done.stderr
    said = _tail(stderr).strip() or _tail(done.stdout).strip() or "(no output)"
    raise PackageError(f"{what}: {how}:\n{said}")


def _probe_env(target: str, extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    # Where this process found neuropod and the target's package (a path added at run time,
    # say), the probe looks too; appended, so nothing the environment resolves is shadowed.
    found = []
    for name in ("neuropod", target.split(":", 1)[0].split(".", 1)[0]):
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None)
        if origin:  # a package's __init__.py sits one level deeper than a module's file
            found.append(str(Path(origin).resolve().parents[1 if hasattr(module, "__path__") else 0]))
    paths = [*env.get("PYTHONPATH", "").split(os.pathsep), *found]
    env["PYTHONPATH"] = os.pathsep.join(p for p in dict.fromkeys(paths) if p)
    return env


def _tail(text: str) -> str:
    """The lines of a probe's output worth reading: a C++ exception's ``what():`` line, else the last few."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "what():" in line:  # a C++ exception that ended the process: its message, not the stack
            return "\n".join(lines[i : i + 3])[:2000]
    return "\n".join(lines[-15:])[-2000:]


def main(argv: list[str]) -> int:
    """``python -m neuropod.probe MODULE:FUNCTION ARG...``: print ``FUNCTION(*ARGs)`` as marked JSON."""
    if not argv or ":" not in argv[0]:
        print("usage: python -m neuropod.probe MODULE:FUNCTION [ARG...]", file=sys.stderr)
        return 2
    module, _, function = argv[0].partition(":")
    probe = getattr(importlib.import_module(module), function)
    try:
        answer = probe(*argv[1:])
    except ProbeFailure as e:
        print(str(e), file=sys.stderr)
        return 1
    print(_MARK + json.dumps(answer), flush=True)
    return 0


# --- torch custom-op libraries (the TorchScript and torch.export/AOTInductor backends) --------------


def load_torch_libraries(paths: Sequence[Path], where: str) -> None:
    """``torch.ops.load_library`` each library once per process per file content.

    torch aborts the whole process when a library defines an op that is
    already registered ("Tried to register an operator ... multiple times")
    or claims, with ``TORCH_LIBRARY(ns, m)``, a namespace another library
    claimed. So before a library is loaded here, what it registers is learnt
    in a fresh interpreter (once per library content and torch version) and
    compared with this process's ops; on a clash
    :class:`~neuropod.errors.InProcessConflictError` is raised and the model
    runs in a worker process instead (:func:`neuropod.backend.load_libraries_once`).
    """
    if not paths:
        return
    import torch

    load_libraries_once(
        paths, torch.ops.load_library, f"torch {torch.__version__}", where,
        clash=lambda path: torch_ops_clash(path, where),
    )  # fmt: skip


def torch_library_registrations(path: Path, torch_version: str, where: str) -> dict[str, list[str]]:
    """What the torch library at ``path`` registers: ``{"ops": [...], "namespaces": [...]}``.

    ``ops`` are the operators it adds (``ns::name`` or ``ns::name.overload``);
    ``namespaces`` the new namespaces it claims with ``TORCH_LIBRARY`` (a
    ``TORCH_LIBRARY_FRAGMENT`` claims none). Learnt in a fresh interpreter,
    once per library content and torch version.

    :raises PackageError: the library does not load in a fresh process, or
        the probe crashed or ran past :data:`PROBE_TIMEOUT`.
    """
    # lazy: numpy (the cache reads JSON through neuropod._json), kept out of `python -m neuropod.probe`'s fresh interpreter
    from neuropod import cache

    def probe() -> Any:
        what = (
            f"{where}: custom op library {path.name} failed to load in torch {torch_version} "
            "(loaded alone in a fresh Python process to learn which ops it registers)"
        )
        return run_probe("neuropod.probe:_torch_registrations", [str(path)], what)

    def valid(found: Any) -> bool:
        return isinstance(found, dict) and all(isinstance(found.get(k), list) for k in ("ops", "namespaces"))

    found = cached_probe("torch-ops", f"{cache.sha256_file(path)}-torch-{torch_version}", probe, valid)
    return {k: [str(v) for v in found[k]] for k in ("ops", "namespaces")}


def torch_ops_clash(path: Path, where: str) -> str | None:
    """Why the torch library at ``path`` cannot be loaded into this process, or None when it can.

    It cannot when an op it defines is registered here already, or when it
    claims a namespace that ops loaded here already use: torch would abort
    the process. Libraries whose content is already loaded here never get
    this far (:func:`neuropod.backend.load_libraries_once` skips them).
    """
    import torch

    found = torch_library_registrations(path, torch.__version__, where)
    present = set(_torch_op_names(torch))
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


def _torch_op_names(torch: Any) -> list[str]:
    """Every operator registered in this process, as ``ns::name`` or ``ns::name.overload``."""
    names = getattr(torch._C, "_dispatch_get_all_op_names", None)
    if names is not None:
        return [str(n) for n in names()]
    # Older torch: the JIT's view of the same registry.
    return [f"{s.name}.{s.overload_name}" if s.overload_name else s.name for s in torch._C._jit_get_all_schemas()]


def _torch_registrations(library: str) -> dict[str, Any]:
    """The probe: load one library and say what it registered (runs in the fresh interpreter)."""
    import torch

    before = set(_torch_op_names(torch))
    namespaces_before = {name.split("::", 1)[0] for name in before}
    try:
        torch.ops.load_library(library)  # type: ignore[no-untyped-call]
    except OSError as e:  # dlopen's message is what matters; anything else shows its traceback
        # torch words it "Could not load this library: <path>" and chains dlopen's reason.
        reason = f" ({e.__cause__})" if e.__cause__ is not None else ""
        raise ProbeFailure(f"{type(e).__name__}: {e}{reason}") from None
    added = sorted(set(_torch_op_names(torch)) - before)
    new_namespaces = sorted({name.split("::", 1)[0] for name in added} - namespaces_before)
    claimed = [ns for ns in new_namespaces if _claimed(torch, ns)]
    return {"ops": added, "namespaces": claimed}


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


__all__ = [
    "PROBE_TIMEOUT",
    "ProbeFailure",
    "load_torch_libraries",
    "run_probe",
    "torch_library_registrations",
    "torch_ops_clash",
]

if __name__ == "__main__":
    # Run as the importable module, so a probe function's ProbeFailure is the class main() catches.
    from neuropod.probe import main as _main

    sys.exit(_main(sys.argv[1:]))
