"""Python backend for Neuropod (platform ``python``): models as Python code.

A package holds Python source (``0/code/``), data files (``0/data/``), an
entrypoint (``0/config.json``) and, optionally, the exact requirements it
runs with (``0/requirements.lock``). Loading imports
``<entrypoint_package>.<entrypoint>`` and calls it with the data directory;
it returns the callable that runs the model on keyword numpy arrays.

The backend's version is the Python version: ``platform_version_semver``
ranges such as ``">=3.10"`` or ``"==3.12.*"`` are matched against the running
interpreter (in-process) and the other interpreters on ``PATH``
(``python3.10`` ... ``python3.14``, location ``python:<path>``), whose
models run in a worker from an environment built on that interpreter.

This module imports nothing but the core: the model's code is imported in
:func:`load_model` only.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod import hookimpl
from neuropod.backend import Backend, DeviceCaps
from neuropod.errors import BackendError, NeuropodError

if TYPE_CHECKING:
    import numpy as np

    from neuropod.package import Package

PLATFORM = "python"
#: Interpreter names looked up on PATH besides the running one.
OTHER_PYTHONS = tuple(f"python3.{minor}" for minor in range(10, 15))


def _framework() -> str:
    return sys.implementation.name  # "cpython"


def other_interpreters() -> list[tuple[str, str]]:
    """``(version, path)`` of the interpreters on PATH of another X.Y than the running one.

    Nothing is started to find them: the version is ``X.Y`` from the name
    (``python3.12``), or the full version of a pyenv installation. A pyenv
    shim only answers for the active version, so shims are looked up in
    ``$PYENV_ROOT/versions`` instead (the newest ``X.Y.*`` there).
    """
    running = f"{sys.version_info[0]}.{sys.version_info[1]}"
    found = []
    for name in OTHER_PYTHONS:
        version = name[len("python"):]
        if version == running:
            continue
        path = shutil.which(name)
        if path is None:
            continue
        shims = Path(path).parent
        if shims.name == "shims" and (shims.parent / "versions").is_dir():  # pyenv
            installs = sorted(
                (p for p in (shims.parent / "versions").glob(f"{version}.*/bin/{name}") if os.access(p, os.X_OK)),
                key=lambda p: _release(p.parent.parent.name),
            )
            if not installs:
                continue
            path, version = str(installs[-1]), installs[-1].parent.parent.name
        if os.access(path, os.X_OK):
            found.append((version, path))
    return found


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else -1 for p in text.split("."))


@hookimpl
def supported_versions() -> list[Backend]:
    """This interpreter (in-process), and the other Python versions on PATH (through environments)."""
    backends = [Backend(platform=PLATFORM, version=platform.python_version(), framework=_framework())]
    backends += [
        Backend(platform=PLATFORM, version=version, framework="cpython", location=f"python:{path}")
        for version, path in other_interpreters()
    ]
    return backends


@hookimpl
def device_caps(backend: Backend) -> DeviceCaps | None:
    """The CPU, and any GPU: the model's own code decides what it runs on.

    ``cuda="any"``: no CUDA version of our own. A package that asks for a GPU
    (``input_tensor_device``) on a host with one gets a device, as with the
    original's ``visible_gpu``: in a worker, that GPU is the only one visible
    (as ``cuda:0``); in-process, the code sees what the process sees.
    """
    if backend.platform != PLATFORM:
        return None
    note = "" if backend.location == "in-process" else f"in a worker, on {backend.location[len('python:'):]}"
    return DeviceCaps(cpu=True, cuda="any", note=note)


@hookimpl
def load_model(package: Package, backend: Backend, device: str, options: Mapping[str, Any]) -> Any:
    """Import the package's code in isolation and call its entrypoint with the data directory."""
    if backend.platform != PLATFORM:
        return None
    if options:
        raise NeuropodError(
            f"The python backend takes no load options; got {', '.join(map(repr, sorted(options)))}"
        )
    # lazy: numpy, kept out of `import neuropod_python` (plugin discovery)
    from neuropod_python._runtime import load

    return load(package, device)


@hookimpl
def infer(
    model: Any,
    inputs: Mapping[str, np.ndarray],
    requested_outputs: Sequence[str] | None,
    parameters: Mapping[str, Any] | None = None,
) -> Any:
    """Call the model's function with the inputs as keyword arguments, and the request's
    ``parameters`` as the keyword ``parameters`` when the function takes it (else not at all)."""
    outputs = _call(model, inputs, parameters)
    if type(outputs) is dict and requested_outputs is None:
        ndarray = model.ndarray  # numpy is not imported here: discovery must not import it
        for value in outputs.values():
            if type(value) is not ndarray:
                break
        else:
            return outputs  # the common case: a dict of arrays, all of them wanted
    return model.finish(outputs, requested_outputs)


@hookimpl
def infer_stream(
    model: Any,
    inputs: Mapping[str, np.ndarray],
    requested_outputs: Sequence[str] | None,
    parameters: Mapping[str, Any] | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """A decoupled model: its function is a generator (or returns an iterable) of output
    dicts; each is handed on as it is yielded. The function is called at the first ``next``
    (so its errors come from there, as they do in a worker). Closing the stream closes the
    generator (its ``finally`` runs)."""
    return _responses(model, inputs, parameters, requested_outputs)


def _responses(
    model: Any, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any] | None, requested: Sequence[str] | None
) -> Iterator[dict[str, np.ndarray]]:
    """The model's responses as numpy dicts; its exception as a BackendError with its traceback.
    Closing this closes the model's own generator (its ``finally`` runs)."""
    produced = _call(model, inputs, parameters)
    if isinstance(produced, Mapping) or not hasattr(produced, "__iter__"):
        raise BackendError(
            f"Model {model.name!r} is decoupled, so its function must be a generator that yields dicts of "
            f"outputs (one per response), but it returned {type(produced).__name__}"
        )
    source = iter(produced)
    try:
        while True:
            try:
                outputs = next(source)
            except StopIteration:
                return
            except Exception as e:
                raise BackendError(_raised(model.name, e)) from e
            yield model.finish(outputs, requested)
    finally:
        closer = getattr(source, "close", None)
        if callable(closer):
            closer()


def _call(model: Any, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any] | None) -> Any:
    """The model's function called with the inputs as keyword arguments, and ``parameters`` as the
    keyword ``parameters`` when the function takes it; its exception as a BackendError."""
    try:
        if parameters is not None and model.takes_parameters:
            return model.fn(**inputs, parameters=dict(parameters))
        return model.fn(**inputs)
    except Exception as e:
        raise BackendError(_raised(model.name, e)) from e


def _raised(name: str, e: BaseException) -> str:
    """The model's exception with its traceback, from the model's own frames on."""
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # skip _call's own frame
    text = "".join(traceback.format_exception(type(e), e, tb)).rstrip()
    return f"Model {name!r} raised {type(e).__name__}: {e}\nThe model's traceback:\n{text}"


__all__ = [
    "OTHER_PYTHONS", "PLATFORM", "device_caps", "infer", "infer_stream", "load_model", "other_interpreters",
    "supported_versions",
]  # fmt: skip
