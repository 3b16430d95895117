"""The exported JAX program behind a loaded model (imports jax).

A package holds the program ``jax.export`` serialized (``0/data/model.jaxexport``)
and, when the model has weights, one ``.npy`` file per leaf of its parameter
pytree (``0/data/params/``), listed in ``0/config.json`` in the order
``jax.tree_util`` flattens them. The program is called as
``f(params, *inputs)`` (inputs in input-spec order), or ``f(*inputs)`` for a
model without parameters. Its result is a dict keyed by output name, a tuple
or list in output-spec order, or a single array for a spec with one output.

Loading deserializes the program, checks it against the spec and the
device, reads the parameters once onto the device and wraps the call in one
``jax.jit``, so a call is the jitted program's C++ dispatch plus the mapping
of names. Nothing is unpickled: the program is a flatbuffer, the parameters
are ``.npy`` files read with ``allow_pickle=False``, and the parameter
pytree's structure is the one the program itself records.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# JAX takes 75% of a GPU's memory when its CUDA backend starts, leaving little for the other models and
# frameworks a process or host serves (a worker process of the same model would not start). Models
# loaded through Neuropod share the GPU: JAX allocates as it goes unless the user has said otherwise.
# This has effect only if nothing in the process has started JAX's backends before this import.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import numpy as np
from jax import export as jax_export

from neuropod import cache
from neuropod.errors import BackendError, NeuropodError, PackageError, SpecError
from neuropod.package import Package

EXPORT_FILE = "model.jaxexport"
PARAMS_DIR = "params"
#: ``0/config.json``'s ``format``: what this backend writes and reads.
BACKEND_FORMAT = 1

#: Load options this backend accepts (none: the program fixes everything a call does).
LOAD_OPTIONS: dict[str, str] = {}

#: Spec dtypes a JAX program only takes or gives with ``jax_enable_x64`` on.
WIDE_DTYPES = frozenset({"float64", "int64", "uint64"})


def where_of(package: Package) -> str:
    return f"Model {package.name!r} ({package.source})"


def deserialize(data: bytes | bytearray, where: str, what: str) -> Any:
    """``jax.export.deserialize``, with any failure a :class:`PackageError` saying what to do.

    It runs in a short-lived thread of its own: jax 0.10 keeps a caught
    ``TypeError`` in a local of ``core._canonicalize_dimension`` for each
    symbolic dimension it reads, a frame <-> traceback cycle that would keep
    every frame on the caller's stack, and their locals (the loaded model, its
    weights), alive until the garbage collector runs. In a thread, the frames
    held are that thread's only, and they hold nothing of ours.
    """
    box: list[Any] = [bytearray(data)]

    def work() -> None:  # no locals: its frame is one of those kept
        try:
            box.append(jax_export.deserialize(box.pop()))
            _read_all(box[-1])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread, below
            box[:] = [e]

    thread = threading.Thread(target=work, name="neuropod-jax-deserialize")
    thread.start()
    thread.join()
    exported = box.pop()
    if isinstance(exported, BaseException):
        e = exported
        if not isinstance(e, Exception):
            raise e
        # a damaged flatbuffer surfaces as struct.error, IndexError, UnicodeDecodeError...
        raise PackageError(
            f"{where}: {what} is not a program jax {jax.__version__} can read (damaged, truncated, or not written "
            f"by jax.export's serialize()): {type(e).__name__}: {e}. Re-create the package from the model."
        ) from e
    return exported


def _read_all(exported: Any) -> None:
    # Reading the fields checks the rest of the flatbuffer; the StableHLO module is parsed too,
    # so a damaged program fails at load rather than at the first call.
    _ = (exported.in_avals, exported.out_avals, exported.platforms, exported.in_tree, exported.out_tree)
    exported.mlir_module()


def check_calling_convention(exported: Any, where: str) -> None:
    """A program whose calling convention this JAX does not know cannot run; say which JAX can."""
    version = int(exported.calling_convention_version)
    low = jax_export.minimum_supported_calling_convention_version
    high = jax_export.maximum_supported_calling_convention_version
    if not low <= version <= high:
        raise PackageError(
            f"{where}: the program uses jax.export calling convention {version}, and jax {jax.__version__} runs "
            f"{low} to {high}. Run it with a JAX release in the package's platform_version_semver (a backend "
            "environment: neuropod env create jax==VERSION), or export it again with this JAX."
        )


def needs_x64(exported: Any) -> bool:
    """Whether the program takes or gives 64-bit values, which JAX passes only with ``jax_enable_x64``."""
    return any(np.dtype(a.dtype).itemsize == 8 and np.dtype(a.dtype).kind in "iuf" for a in (*exported.in_avals, *exported.out_avals))


def x64_context(on: bool) -> contextlib.AbstractContextManager[Any]:
    """``jax_enable_x64`` for this thread while a 64-bit program is traced or called (JAX's own switch
    is a thread-local context manager, so other code in the process keeps its setting)."""
    return jax.enable_x64(True) if on else contextlib.nullcontext()


def argument_trees(exported: Any, takes_params: bool, where: str) -> tuple[Any, int]:
    """The program's parameter pytree structure (None without parameters) and its number of array inputs.

    ``exported.in_tree`` is ``((arg0, arg1, ...), {kwargs})``; the convention is
    ``(params, *inputs)`` or ``(*inputs)``, positional only.
    """
    args_tree, kwargs_tree = exported.in_tree.children()
    if kwargs_tree.num_leaves:
        raise PackageError(f"{where}: the program takes keyword arguments; Neuropod calls it with positional ones only")
    args = args_tree.children()
    if takes_params:
        if not args:
            raise PackageError(f"{where}: the program takes no arguments, but the package has parameters")
        params_tree, inputs = args[0], args[1:]
    else:
        params_tree, inputs = None, args
    for i, t in enumerate(inputs):
        if t.num_leaves != 1 or t.num_nodes != 1:
            hint = "" if takes_params or i else " (a program that takes the parameters first needs params=)"
            raise PackageError(
                f"{where}: argument {i + int(takes_params)} of the program is a pytree ({t}), not one array: "
                f"Neuropod passes one array per input{hint}"
            )
    return params_tree, len(inputs)


def output_names(out_tree: Any, names: Sequence[str], where: str) -> list[str]:
    """The output name of each leaf of the program's result, in ``jax.tree_util`` order.

    A dict must be keyed by exactly the output spec's names; a tuple or list
    holds the outputs in spec order; a single array is the one output.
    """
    n = out_tree.num_leaves
    shape = jax.tree_util.tree_unflatten(out_tree, list(range(n)))
    listed = ", ".join(map(repr, names)) or "nothing"
    if isinstance(shape, int):
        if len(names) != 1:
            raise PackageError(
                f"{where}: the program returns a single array, but the output spec has {len(names)} outputs "
                f"({listed}); return a dict keyed by output name"
            )
        return [names[0]]
    if isinstance(shape, dict):
        keys = list(shape)
        if any(not isinstance(k, str) for k in keys) or set(keys) != set(names):
            missing = [x for x in names if x not in shape]
            extra = [repr(k) for k in keys if k not in names]
            raise PackageError(
                f"{where}: the program returns a dict with keys {', '.join(map(repr, keys)) or 'none'}, but the "
                f"output spec names {listed}"
                + (f"; missing {', '.join(map(repr, missing))}" if missing else "")
                + (f"; not in the spec {', '.join(extra)}" if extra else "")
            )
        leaves: dict[int, str] = {}
        for key, value in shape.items():
            if not isinstance(value, int):
                raise PackageError(f"{where}: output {key!r} of the program is a pytree ({value!r}), not one array")
            leaves[value] = key
        return [leaves[i] for i in range(n)]
    if isinstance(shape, (tuple, list)):
        if len(shape) != len(names) or not all(isinstance(v, int) for v in shape):
            raise PackageError(
                f"{where}: the program returns a {type(shape).__name__} of {len(shape)} items ({out_tree}), but the "
                f"output spec has {len(names)} outputs ({listed}); a tuple or list must hold one array per output, "
                "in spec order"
            )
        return list(names)
    raise PackageError(
        f"{where}: the program returns {out_tree}; Neuropod reads a dict keyed by output name, a tuple or list in "
        "output-spec order, or a single array"
    )


def _jax_device(device: str, platforms: Sequence[str], where: str) -> Any:
    kind = "cpu" if device == "cpu" else "cuda"
    if kind not in platforms:
        if kind == "cpu":
            hint = "it can run only on a GPU: load it on a machine with an NVIDIA GPU and jax[cuda12] or jax[cuda13]"
        else:
            hint = "load it with device='cpu', or export it again with platforms=('cpu', 'cuda')"
        raise NeuropodError(
            f"{where}: the program was exported for {', '.join(platforms)} only, not for {kind} "
            f"(device {device!r} was asked for); {hint}"
        )
    try:
        found = jax.devices(kind)
    except RuntimeError as e:
        raise NeuropodError(
            f"{where}: device {device!r} was asked for, but jax {jax.__version__} has no {kind} backend here ({e}). "
            "Install jax[cuda12] or jax[cuda13] of the same version, or load with device='cpu'"
        ) from None
    index = 0 if kind == "cpu" else int(device.split(":")[1])
    if index >= len(found):
        raise NeuropodError(f"{where}: device {device!r} was asked for, but JAX sees {len(found)} {kind} device(s)")
    return found[index]


def _read_backend_config(package: Package, where: str) -> tuple[str, list[str] | None]:
    cfg = dict(package.backend_config)
    fmt = cfg.get("format")
    if fmt != BACKEND_FORMAT:
        raise PackageError(
            f"{where}: 0/config.json has format {fmt!r}; this neuropod-jax reads format {BACKEND_FORMAT}. "
            "Upgrade neuropod-jax, or re-create the package"
        )
    export_file = cfg.get("export")
    if not isinstance(export_file, str) or not export_file or "/" in export_file:
        raise PackageError(f"{where}: 0/config.json 'export' must name a file in 0/data/, not {export_file!r}")
    params = cfg.get("params")
    if params is None:
        return export_file, None
    if not isinstance(params, list) or not all(isinstance(p, dict) and isinstance(p.get("file"), str) for p in params):
        raise PackageError(f"{where}: 0/config.json 'params' must be a list of {{'path', 'file'}} objects")
    return export_file, [str(p["file"]) for p in params]


def read_leaf(path: Path, where: str) -> np.ndarray:
    """One parameter leaf, from a ``.npy`` file, never unpickling."""
    try:
        with cache.open_regular(path) as f:
            arr = np.load(f, allow_pickle=False)
    except PackageError as e:
        raise PackageError(f"{where}: cannot read parameter file: {e}") from None
    except (OSError, ValueError, EOFError) as e:
        raise PackageError(f"{where}: parameter file {path.name} is not a readable .npy array: {e}") from None
    if not isinstance(arr, np.ndarray):
        raise PackageError(f"{where}: parameter file {path.name} does not hold one array")
    return arr


class JaxModel:
    """A deserialized exported program, its parameters on the device, and one jitted call."""

    def __init__(self, exported: Any, params: tuple[Any, ...] | None, package: Package, device: Any, where: str):
        config = package.config
        self.name = package.name
        self.where = where
        self.exported = exported
        self.device = device
        params_tree, n_inputs = argument_trees(exported, params is not None, where)
        if n_inputs != len(config.input_spec):
            raise PackageError(
                f"{where}: the program takes {n_inputs} input array(s), but the input spec has "
                f"{len(config.input_spec)} ({', '.join(s.name for s in config.input_spec)})"
            )
        self._input_names = tuple(s.name for s in config.input_spec)
        self._take_inputs = _taker(self._input_names)
        leaf_names = output_names(exported.out_tree, [s.name for s in config.output_spec], where)
        # (name, index of its leaf in the result), in output-spec order: the dict comes back in that order.
        self._outputs = tuple((s.name, leaf_names.index(s.name)) for s in config.output_spec)
        self._x64 = needs_x64(exported)
        self._params = params
        self._call = _jitted_call(exported, params, params_tree, device, self._x64)
        #: ``run(inputs, requested_outputs)``: one call of the program (the ``infer`` hook's work).
        self.run = self._make_run()

    @classmethod
    def load(cls, package: Package, device: str, options: Mapping[str, Any]) -> JaxModel:
        where = where_of(package)
        if options:
            raise NeuropodError(
                f"{where}: unknown JAX load option(s) {', '.join(map(repr, sorted(options)))}; the JAX backend takes "
                "none (the exported program fixes what a call does)"
            )
        if package.config.custom_ops:
            raise PackageError(
                f"{where}: the package lists custom-op libraries ({', '.join(package.config.custom_ops)}), and the "
                "JAX backend loads none: a JAX program's custom calls must be registered by code in the process"
            )
        export_file, param_files = _read_backend_config(package, where)
        path = package.data_dir / export_file
        try:
            with cache.open_regular(path) as f:
                data = f.read()
        except (PackageError, OSError) as e:
            raise PackageError(f"{where}: cannot read the exported program 0/data/{export_file}: {e}") from None
        exported = deserialize(data, where, f"0/data/{export_file}")
        check_calling_convention(exported, where)
        jax_device = _jax_device(device, exported.platforms, where)
        params = None
        if param_files is not None:
            params = _load_params(package, param_files, exported, jax_device, where)
        return cls(exported, params, package, jax_device, where)

    def _make_run(self) -> Callable[[Mapping[str, Any], Sequence[str] | None], dict[str, Any]]:
        """The per-call function, with what it needs bound as closure variables.

        The hot path costs about half a microsecond over the jitted program (see
        bench/bench_jax.py): inputs are taken with ``operator.itemgetter``, and
        the output dict is built by a plain loop (``dict(zip(...))`` or a
        comprehension costs a few hundred nanoseconds more). Outputs are copies:
        the caller's own writable arrays, as with every backend (a JAX buffer read
        through ``np.asarray`` is read-only and keeps the device buffer alive).
        """
        # Nothing here refers back to the model: a dropped model is freed (its device buffers too) with its last
        # reference, not left to the cyclic garbage collector.
        take_inputs, call, outputs, copy = self._take_inputs, self._call, self._outputs, np.array
        name, input_names = self.name, self._input_names
        if len(outputs) == 1:
            ((only, index),) = outputs

            def convert(leaves: Sequence[Any]) -> dict[str, Any]:
                return {only: copy(leaves[index])}

        else:

            def convert(leaves: Sequence[Any]) -> dict[str, Any]:
                out = {}
                for name, i in outputs:
                    out[name] = copy(leaves[i])
                return out

        def run(inputs: Mapping[str, Any], requested: Sequence[str] | None) -> dict[str, Any]:
            try:
                args = take_inputs(inputs)
            except KeyError:
                raise _missing(name, input_names, inputs) from None
            try:
                leaves = call(*args)
            except ValueError as e:
                raise _call_error(name, e) from e
            if requested is None:
                return convert(leaves)
            return {name: copy(leaves[i]) for name, i in outputs if name in requested}

        return run

    def close(self) -> None:
        # Dropping the references frees the device buffers of the parameters and the compiled program.
        self.__dict__.pop("_call", None)
        self.__dict__.pop("run", None)
        self.__dict__.pop("_params", None)
        self.__dict__.pop("exported", None)


def _missing(name: str, input_names: Sequence[str], inputs: Mapping[str, Any]) -> SpecError:
    missing = [n for n in input_names if n not in inputs]
    return SpecError(
        f"Model {name!r} needs input(s) {', '.join(map(repr, missing))}: an exported JAX program takes every input "
        "of its spec"
    )


def _call_error(name: str, e: ValueError) -> NeuropodError:
    text = str(e)
    if "Expected value >= 1 for dimension variable" in text:
        return SpecError(
            f"Model {name!r}: an exported JAX program needs every dynamic dimension (a spec symbol or null) to be "
            f"at least 1, and an input has a size-0 one. JAX said: {text}"
        )
    return BackendError(f"Model {name!r}: the exported JAX program failed: {text}")


def _taker(keys: tuple[Any, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """``lambda c: tuple(c[k] for k in keys)``, at C speed."""
    if len(keys) == 1:
        key = keys[0]
        return lambda c: (c[key],)
    if not keys:
        return lambda c: ()
    return operator.itemgetter(*keys)


def _jitted_call(exported: Any, params: tuple[Any, ...] | None, params_tree: Any, device: Any, x64: bool) -> Callable[..., Any]:
    """``call(*inputs)``: the program in one ``jax.jit``, returning its result's leaves as a list.

    Flattening the result inside the jitted function makes it free per call.
    Inputs are numpy arrays; JAX runs the program where the parameters are.
    A program without parameters is pinned to ``device`` by its input
    sharding, so it runs there whatever JAX's default device is (a process
    may set ``jax_default_device`` to its CPU on a GPU machine), at no cost
    per call.
    """
    call = exported.call
    if params_tree is None:
        jitted = jax.jit(
            lambda *xs: jax.tree_util.tree_leaves(call(*xs)), in_shardings=jax.sharding.SingleDeviceSharding(device)
        )
    else:
        unflatten = jax.tree_util.tree_unflatten
        jitted = jax.jit(lambda leaves, *xs: jax.tree_util.tree_leaves(call(unflatten(params_tree, leaves), *xs)))
    run: Callable[..., Any] = jitted if params is None else functools.partial(jitted, params)
    if x64:
        narrow = run

        def run(*xs: Any) -> Any:
            with jax.enable_x64(True):
                return narrow(*xs)

    return run


def _load_params(package: Package, files: Sequence[str], exported: Any, device: Any, where: str) -> tuple[Any, ...]:
    """The parameter leaves, each checked against the program's argument and put on ``device`` as it is read."""
    params_tree, _ = argument_trees(exported, True, where)
    expected = exported.in_avals[: params_tree.num_leaves]
    if len(files) != len(expected):
        raise PackageError(
            f"{where}: the package has {len(files)} parameter array(s), but the program takes {len(expected)} "
            f"({params_tree})"
        )
    paths = _param_paths(package)
    leaves = []
    for i, (name, aval) in enumerate(zip(files, expected)):
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise PackageError(f"{where}: parameter file {name!r} must be inside 0/data/")
        arr = read_leaf(package.data_dir / rel, where)
        want = tuple(int(d) for d in aval.shape)
        if arr.shape != want or arr.dtype != np.dtype(aval.dtype):
            label = paths[i] if i < len(paths) else f"leaf {i}"
            raise PackageError(
                f"{where}: parameter {label} (0/data/{name}) is {arr.dtype}{list(arr.shape)}, but the program takes "
                f"{np.dtype(aval.dtype)}{list(want)} there"
            )
        with x64_context(arr.dtype.itemsize == 8):
            leaves.append(jax.device_put(arr, device))
        del arr
    return tuple(leaves)


def _param_paths(package: Package) -> list[str]:
    params = package.backend_config.get("params") or []
    return [str(p.get("path", f"leaf {i}")) for i, p in enumerate(params) if isinstance(p, dict)]
