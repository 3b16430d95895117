"""Loading a package's Python code in isolation, and the handle ``infer`` calls.

Each package's code is imported under its own module names with ``0/code``
first on ``sys.path``; afterwards those modules are taken out of
``sys.modules`` again (and whatever they shadowed is put back). The model's
functions keep their modules through their globals, so two packages whose
code has the same names (the same ``entrypoint_package``, a ``helpers``
module each) live side by side in one process. One limit follows: code that
imports its *own* modules at call time, rather than at import time, finds
them gone in-process; such a model should load with ``use_ope=True``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from neuropod.errors import BackendError, NeuropodError, PackageError
from neuropod.package import Package

CODE_DIR = "code"
#: Keys of ``0/config.json``.
ENTRYPOINT_PACKAGE, ENTRYPOINT = "entrypoint_package", "entrypoint"

# Imports change process-wide state (sys.path, sys.modules): one package at a time.
_IMPORT_LOCK = threading.RLock()
_SUFFIXES = (".py", ".pyc", ".so", ".pyd")


def entrypoint_of(package: Package) -> tuple[str, str]:
    """``(entrypoint_package, entrypoint)`` from the package's ``0/config.json``."""
    where = f"Model {package.name!r} ({package.source})"
    config = package.backend_config
    if not config:
        raise PackageError(f"{where}: 0/config.json is missing; a python package names its entrypoint there")
    values = []
    for key in (ENTRYPOINT_PACKAGE, ENTRYPOINT):
        value = config.get(key)
        if not isinstance(value, str) or not value:
            raise PackageError(f"{where}: 0/config.json has no {key!r} (a non-empty string), it has {sorted(config)}")
        if not all(part.isidentifier() for part in value.split(".")) or (key == ENTRYPOINT and "." in value):
            raise PackageError(f"{where}: 0/config.json's {key} {value!r} is not a Python "
                               f"{'module path' if key == ENTRYPOINT_PACKAGE else 'name'}")  # fmt: skip
        values.append(value)
    return values[0], values[1]


def _top_level_names(code_dir: Path) -> set[str]:
    """The module and package names ``code_dir`` provides at its top level."""
    names: set[str] = set()
    try:
        entries = list(os.scandir(code_dir))
    except OSError:
        return names
    for entry in entries:
        stem = entry.name.split(".", 1)[0]
        if entry.is_dir() and entry.name.isidentifier():
            names.add(entry.name)
        elif entry.name.endswith(_SUFFIXES) and stem.isidentifier():
            names.add(stem)
    return names


def _owned(names: set[str]) -> list[str]:
    return [k for k in list(sys.modules) if k.split(".", 1)[0] in names]


def import_isolated(code_dir: Path, module_name: str, where: str, ops_dir: Path | None = None) -> Any:
    """Import ``module_name`` from ``code_dir`` and take the code's modules back out of ``sys.modules``.

    :param ops_dir: a directory of extension modules (the package's custom
        ops) that is on the import path too, after ``code_dir``.
    :raises PackageError: ``module_name`` is not in the code.
    :raises BackendError: importing it raised; the message has the code's traceback.
    """
    dirs = [code_dir] + ([ops_dir] if ops_dir is not None and ops_dir.is_dir() else [])
    with _IMPORT_LOCK:
        names = {n for d in dirs for n in _top_level_names(d)} | {module_name.split(".", 1)[0]}
        shadowed = {k: sys.modules.pop(k) for k in _owned(names)}
        entries = [str(d) for d in dirs]
        sys.path[:0] = entries
        importlib.invalidate_caches()
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                have = sorted(_top_level_names(code_dir)) or ["nothing"]
                raise PackageError(
                    f"{where}: entrypoint_package {module_name!r} is not in the package's code "
                    f"(0/code has: {', '.join(have)})"
                ) from None
            raise BackendError(_import_failed(where, module_name, e)) from e
        except Exception as e:
            raise BackendError(_import_failed(where, module_name, e)) from e
        finally:
            for entry in entries:
                try:
                    sys.path.remove(entry)
                except ValueError:
                    pass  # the code removed it itself
            for k in _owned(names):
                del sys.modules[k]
            sys.modules.update(shadowed)


def _import_failed(where: str, module_name: str, e: BaseException) -> str:
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()
    return f"{where}: importing entrypoint_package {module_name!r} raised {type(e).__name__}: {e}\n{text}"


class PythonModel:
    """The model's callable and what ``infer`` needs around it."""

    __slots__ = ("fn", "name", "output_names", "takes_parameters")
    ndarray = np.ndarray  # for the infer hook's type check

    def __init__(self, fn: Any, name: str, output_names: Sequence[str], input_names: Sequence[str] = ()):
        self.fn = fn
        self.name = name
        self.output_names = tuple(output_names)
        #: Whether request parameters go to ``fn`` (as the keyword ``parameters``).
        self.takes_parameters = takes_parameters(fn, input_names)

    def finish(self, outputs: Any, requested: Sequence[str] | None) -> dict[str, np.ndarray]:
        """The outputs as a dict of numpy arrays (requested ones only): torch tensors and ``__array__``
        objects are converted; anything else is a BackendError naming the output."""
        if not isinstance(outputs, Mapping):
            raise BackendError(
                f"Model {self.name!r} returned {type(outputs).__name__}, not a dict of output name to numpy array "
                f"(outputs: {', '.join(self.output_names)})"
            )
        names = outputs if requested is None else [k for k in requested if k in outputs]
        return {k: self._array(k, outputs[k]) for k in names}

    def _array(self, key: str, value: Any) -> np.ndarray:
        if isinstance(value, np.ndarray):
            return value
        if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, maybe on a GPU, maybe with grad
            value = value.detach().cpu().numpy()
        elif isinstance(value, np.generic) or hasattr(value, "__array__"):
            value = np.asarray(value)
        else:
            raise BackendError(
                f"Model {self.name!r} returned output {key!r} as {type(value).__name__}; outputs must be numpy "
                "arrays (or torch tensors, or objects with __array__)"
            )
        if not isinstance(value, np.ndarray):
            raise BackendError(f"Model {self.name!r}: output {key!r} did not convert to a numpy array")
        return value

    def close(self) -> None:
        self.fn = None


def load(package: Package, device: str) -> PythonModel:
    """Import the entrypoint, call it with the data directory, and return the model's handle."""
    del device  # the model's code decides where it runs
    where = f"Model {package.name!r} ({package.source})"
    module_name, function = entrypoint_of(package)
    code_dir = package.root / "0" / CODE_DIR
    if not code_dir.is_dir():
        raise PackageError(f"{where}: the package has no 0/{CODE_DIR} directory with the model's code")
    module = import_isolated(code_dir, module_name, where, package.root / "0" / "ops")
    entry = getattr(module, function, None)
    if entry is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise PackageError(
            f"{where}: entrypoint {function!r} is not defined in entrypoint_package {module_name!r} "
            f"({getattr(module, '__file__', '?')}; its functions: {', '.join(public) or 'none'})"
        )
    if not callable(entry):
        raise PackageError(f"{where}: entrypoint {module_name}.{function} is a {type(entry).__name__}, not a function")
    try:
        fn = entry(str(package.data_dir))
    except NeuropodError:
        raise
    except Exception as e:
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()
        raise BackendError(f"{where}: entrypoint {module_name}.{function}(data_root) raised {type(e).__name__}: {e}\n{text}") from e
    if not callable(fn):
        raise BackendError(
            f"{where}: entrypoint {module_name}.{function}(data_root) returned {type(fn).__name__}, not a callable "
            "that takes the inputs as keyword arrays"
        )
    return PythonModel(
        fn, package.name, [s.name for s in package.config.output_spec], [s.name for s in package.config.input_spec]
    )


def takes_parameters(fn: Any, input_names: Sequence[str]) -> bool:
    """Whether the model function ``fn`` takes request parameters: it names a parameter
    ``parameters`` (keyword-only or not) and no input of the model has that name. A function
    with only ``**kwargs`` gets inputs alone: parameters there would look like an input."""
    if "parameters" in input_names:
        return False
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    param = signature.parameters.get("parameters")
    return param is not None and param.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


__all__ = ["ENTRYPOINT", "ENTRYPOINT_PACKAGE", "PythonModel", "entrypoint_of", "import_isolated", "load"]
