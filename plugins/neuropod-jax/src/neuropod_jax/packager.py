"""``create_jax_neuropod``: package a JAX function, serialized with ``jax.export``, and its weights.

The spec is the one source of dynamic shapes: each spec symbol becomes one
JAX symbolic dimension shared by every input that names it, fixed sizes stay
static, and each ``None`` gets a symbol of its own. The weights (``params``,
any pytree of arrays) are arguments of the exported program, stored as
``.npy`` files beside it, never constants inside it: a large model does not
bloat the program, and new weights do not need a new export.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from packaging.version import InvalidVersion, Version

from neuropod.backend import installed_distribution
from neuropod.create import create_package, package_options
from neuropod.errors import PackageError
from neuropod.plugins import import_framework
from neuropod.spec import TensorSpec, parse_spec
from neuropod.strings import refuse_dtypes
from neuropod_jax import FRAMEWORK_DISTRIBUTIONS, PLATFORM

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from neuropod.create import PackageOptions

PACKAGER = "create_jax_neuropod"
EXPORT_PATH = "0/data/model.jaxexport"
PARAMS_PATH = "0/data/params"
#: The platforms neuropod runs JAX programs on, as ``jax.export`` names them.
DEVICE_PLATFORMS = ("cpu", "cuda")

# Names JAX's symbolic-shape parser reads as operators, not dimension variables.
_JAX_RESERVED = frozenset({"max", "min", "mod", "floordiv", "non_negative"})
_SAFE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def compatible_range(jax_version: str) -> str:
    """The JAX releases that can load a program serialized by ``jax_version``: its default ``platform_version_semver``.

    JAX documents the guarantee ("Compatibility guarantees" in its
    *Exporting and serializing staged-out computations* guide): an exported
    artifact can be compiled and run by a JAX (precisely: a jaxlib) built up
    to **6 months after** the one that exported it (6 months of backward
    compatibility), and by one built up to 3 weeks before it (forward
    compatibility).

    Versions carry no dates, so the range approximates the 6 months by
    release series: the writing release and every later release of its own
    minor series and the next one, ``>=X.Y.Z,<X.(Y+2)``. JAX opens a minor
    series every few months (0.8.3 carries export schema changes from late
    November 2025, 0.10.2 from mid-May 2026), so the next series' releases
    fall within about 6 months of the writer. Older releases are left out:
    3 weeks of forward compatibility covers at most the previous patch
    release, and not reliably. A package that must load elsewhere can name
    its own range (``platform_version_semver=``).
    """
    try:
        v = Version(jax_version)
    except InvalidVersion:
        return "*"
    return f">={v.public},<{v.major}.{v.minor + 2}"


def create_jax_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    fn: Any = None,
    params: Any = None,
    exported: Any = None,
    platforms: Sequence[str] | None = None,
    **options: Unpack[PackageOptions],
) -> Path:
    """Package a JAX function (or an exported program) and its parameters as a Neuropod.

    The calling convention: ``fn(params, *inputs)``, inputs passed
    positionally in input-spec order (``fn(*inputs)`` without ``params``). It
    returns a dict keyed by output name, a tuple or list in output-spec
    order, or one array for a spec with one output. An ``exported`` program
    must follow the same convention.

    :param neuropod_path: where to write the package (must not exist).
    :param model_name: the model's name.
    :param input_spec: list of ``{"name", "dtype", "shape"}``; symbols become
        JAX symbolic dimensions (one per symbol, shared), fixed sizes stay
        static, ``None`` is a free symbol of its own. JAX has no strings.
    :param output_spec: the same, for outputs; checked against what the
        program returns.
    :param fn: a JAX-traceable function, exported here with
        ``jax.export.export(jax.jit(fn), platforms=platforms)``.
    :param params: the weights, any pytree of arrays (dicts, lists, tuples,
        ``None``...), stored as ``.npy`` files in the package and passed as
        the program's first argument.
    :param exported: or a ``jax.export.Exported`` made already (with
        ``params`` when it takes them first); exactly one of ``fn`` and
        ``exported``.
    :param platforms: where the program may run: ``("cpu",)`` (the default
        for ``fn``), ``("cuda",)`` or ``("cpu", "cuda")``. A CUDA export can
        be made on a machine without a GPU.
    :param options: the common keywords of every packager
        (:class:`neuropod.package.PackageOptions`); ``platform_version_semver``
        defaults to the JAX releases that can read the serialization
        (:func:`compatible_range`), ``custom_ops`` is not supported.
    :returns: the path written.
    :raises PackageError: the arguments do not make a package that loads and
        reproduces its test data (also a ``ValueError``).
    """
    opts = package_options(PACKAGER, options)
    where = f"{PACKAGER}: model {model_name!r}"
    if (fn is None) == (exported is None):
        raise PackageError(f"{where}: give exactly one of fn= (a JAX function) or exported= (a jax.export.Exported)")
    if opts["custom_ops"]:
        raise PackageError(
            f"{where}: the JAX backend loads no custom-op libraries; register custom calls in your own code, or use "
            "another platform"
        )
    ins = parse_spec(input_spec, "input_spec")
    outs = parse_spec(output_spec, "output_spec")
    refuse_dtypes(model_name, ins, outs, {"bytes"}, PLATFORM)
    for s in (*ins, *outs):
        if s.dtype == "string":
            raise PackageError(f"{where}: tensor {s.name!r} is a string tensor, and JAX has no strings")

    jax_export = _import_jax()
    # lazy: jax (the runtime imports it), kept out of `import neuropod_jax.packager`
    from neuropod_jax._runtime import argument_trees, needs_x64, output_names

    treedef, flat, paths = _flatten_params(params, where)
    if exported is None:
        if not callable(fn):
            raise PackageError(f"{where}: fn must be a function, not {type(fn).__name__}")
        exported = _export(fn, treedef, flat, ins, outs, _platforms(platforms, where), where)
    elif not isinstance(exported, jax_export.Exported):
        raise PackageError(f"{where}: exported must be a jax.export.Exported, not {type(exported).__name__}")
    elif platforms is not None and tuple(platforms) != tuple(exported.platforms):
        raise PackageError(
            f"{where}: platforms={tuple(platforms)!r}, but the exported program was lowered for "
            f"{tuple(exported.platforms)!r}; leave platforms out, or export again"
        )
    lowered = tuple(str(p) for p in exported.platforms)
    bad = [p for p in lowered if p not in DEVICE_PLATFORMS]
    if bad or not lowered:
        raise PackageError(
            f"{where}: the program was lowered for {lowered!r}; neuropod runs JAX programs on "
            f"{' and '.join(DEVICE_PLATFORMS)}: export with platforms=('cpu',), ('cuda',) or ('cpu', 'cuda')"
        )
    params_tree, n_inputs = argument_trees(exported, params is not None, where)
    if params_tree is not None:
        flat = _match_params(flat, paths, params_tree, exported, where)
    if n_inputs != len(ins):
        raise PackageError(
            f"{where}: the program takes {n_inputs} input array(s) after its parameters, but the input spec has "
            f"{len(ins)} ({', '.join(s.name for s in ins)})"
        )
    n_params = params_tree.num_leaves if params_tree is not None else 0
    leaf_names = output_names(exported.out_tree, [s.name for s in outs], where)
    _check_signature(exported.in_avals[n_params:], dict(zip(leaf_names, exported.out_avals)), ins, outs, where)
    data = bytes(exported.serialize())

    jaxlib = installed_distribution("jaxlib")
    made: dict[str, Any] = {
        "jaxlib": jaxlib[1] if jaxlib else None,
        "calling_convention_version": int(exported.calling_convention_version),
        "lowering_platforms": list(lowered),
        "exported_function": str(exported.fun_name),
        "x64": needs_x64(exported),
    }
    schema = _serialization_schema_version()
    if schema is not None:
        made["serialization_version"] = schema
    if set(lowered) == {"cuda"}:
        requirements: dict[str, Any] | None = {"device": "cuda", "jax_platforms": list(lowered)}
    elif set(lowered) == {"cpu"}:
        requirements = {"device": "cpu", "jax_platforms": list(lowered)}
    else:
        requirements = None
    # A CPU-only program must not be sent to a GPU because inputs default to "GPU" (the original
    # Neuropod's default): its inputs default to the CPU, so resolution keeps it there.
    defaults = {"default_input_tensor_device": "CPU"} if lowered == ("cpu",) else None
    if defaults is not None:
        asked = dict(options.get("input_tensor_device") or {})
        if "default_input_tensor_device" in options:
            asked.setdefault("(default_input_tensor_device)", str(options["default_input_tensor_device"]))
        gpu = sorted(k for k, v in asked.items() if str(v).upper() == "GPU")
        if gpu:
            raise PackageError(
                f"{where}: input_tensor_device asks for GPU inputs ({', '.join(gpu)}), but the program was exported "
                "for the CPU only; export with platforms=('cpu', 'cuda') to let it run on a GPU, or leave "
                "input_tensor_device out"
            )
    backend_config: dict[str, Any] = {"format": 1, "export": Path(EXPORT_PATH).name, "params": None}
    with tempfile.TemporaryDirectory(prefix="neuropod-jax-") as tmp:
        files: dict[str, Any] = {EXPORT_PATH: data}
        if params_tree is not None:
            entries = []
            for i, (leaf, path) in enumerate(zip(flat, paths)):
                name = f"{i:05d}.npy"
                np.save(Path(tmp) / name, leaf, allow_pickle=False)
                entries.append({"path": path, "file": f"params/{name}", "dtype": str(leaf.dtype), "shape": list(leaf.shape)})
            backend_config["params"] = entries
            files[PARAMS_PATH] = Path(tmp)
        return create_package(
            PACKAGER, neuropod_path, model_name, PLATFORM, ins, outs, files=files, options=options,
            backend_config=backend_config, framework_distributions=FRAMEWORK_DISTRIBUTIONS, exported_with=made,
            device_requirements=requirements, default_version_range=compatible_range(_jax_version()),
            defaults=defaults,
        )  # fmt: skip


def _import_jax() -> Any:
    """``jax.export``, or a clear error when jax is not installed."""
    return import_framework("jax.export", PLATFORM, PACKAGER)


def _jax_version() -> str:
    found = installed_distribution(*FRAMEWORK_DISTRIBUTIONS)
    return found[1] if found else "0"


def _serialization_schema_version() -> int | None:
    """The version of ``jax.export``'s serialization schema that wrote the program (JAX keeps it private)."""
    try:
        from jax._src.export import serialization
    except ImportError:
        return None
    value = getattr(serialization, "_SERIALIZATION_VERSION", None)
    return value if isinstance(value, int) else None


def _platforms(platforms: Sequence[str] | None, where: str) -> tuple[str, ...]:
    if platforms is None:
        return ("cpu",)
    if isinstance(platforms, str):
        platforms = (platforms,)
    chosen = tuple(str(p).lower() for p in platforms)
    bad = [p for p in chosen if p not in DEVICE_PLATFORMS]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise PackageError(
            f"{where}: platforms={tuple(platforms)!r}; neuropod runs JAX programs on {' and '.join(DEVICE_PLATFORMS)}: "
            "give ('cpu',), ('cuda',) or ('cpu', 'cuda')"
        )
    return chosen


def _flatten_params(params: Any, where: str) -> tuple[Any, list[np.ndarray], list[str]]:
    """The parameters' tree structure and leaves (as numpy arrays) with their key paths (``['layers'][0]['w']``)."""
    if params is None:
        return None, [], []
    import jax

    try:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    except Exception as e:
        raise PackageError(f"{where}: params is not a JAX pytree: {type(e).__name__}: {e}") from e
    leaves, paths = [], []
    for path, leaf in pairs:
        label = jax.tree_util.keystr(path) or "params"
        try:
            arr = np.asarray(leaf)
        except Exception as e:
            raise PackageError(f"{where}: parameter {label} is {type(leaf).__name__}, not an array: {e}") from e
        if arr.dtype.kind not in "biuf":
            raise PackageError(f"{where}: parameter {label} is {arr.dtype} ({type(leaf).__name__}), not a numeric array")
        leaves.append(arr)
        paths.append(label)
    return treedef, leaves, paths


class _Symbols:
    """The JAX dimension variables for an input spec: one per spec symbol (shared), one per ``None``."""

    def __init__(self, ins: Sequence[TensorSpec]):
        self.names: dict[str, str] = {}  # JAX name -> what it is, for messages
        self.of_symbol: dict[str, str] = {}  # spec symbol -> JAX name
        used = {d for s in ins for d in s.shape if isinstance(d, str) and self._safe(d)}
        slots: list[tuple[int, int, str]] = []
        counter = 0

        def fresh(prefix: str) -> str:
            nonlocal counter
            while True:
                name = f"{prefix}{counter}"
                counter += 1
                if name not in used:
                    used.add(name)
                    return name

        for i, s in enumerate(ins):
            for k, d in enumerate(s.shape):
                if isinstance(d, str):
                    if d not in self.of_symbol:
                        name = d if self._safe(d) else fresh("_s")
                        self.of_symbol[d] = name
                        self.names[name] = f"symbol {d!r}"
                    slots.append((i, k, self.of_symbol[d]))
                elif d is None:
                    name = fresh("_free")
                    self.names[name] = f"dim {k} of input {s.name!r} (null in the spec)"
                    slots.append((i, k, name))
        self._slots = slots

    @staticmethod
    def _safe(symbol: str) -> bool:
        return bool(_SAFE_NAME.fullmatch(symbol)) and symbol not in _JAX_RESERVED

    def shapes(self, ins: Sequence[TensorSpec]) -> list[tuple[Any, ...]]:
        from jax import export as jax_export

        order = list(self.names)
        dims = dict(zip(order, jax_export.symbolic_shape(", ".join(order)))) if order else {}
        shapes: list[list[Any]] = [list(s.shape) for s in ins]
        for i, k, name in self._slots:
            shapes[i][k] = dims[name]
        return [tuple(s) for s in shapes]

    def mentioned(self, text: str) -> list[str]:
        """The spec symbols (and null dims) whose JAX names ``text`` mentions."""
        return [what for name, what in self.names.items() if re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", text)]

    def translate(self, text: str) -> str:
        """``text`` with generated JAX names replaced by what they stand for."""
        for name, what in self.names.items():
            if name.startswith("_"):
                text = re.sub(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", f"<{what}>", text)
        return text


def _export(
    fn: Any, treedef: Any, leaves: Sequence[np.ndarray], ins: Sequence[TensorSpec], outs: Sequence[TensorSpec],
    platforms: tuple[str, ...], where: str,
) -> Any:  # fmt: skip
    """``jax.export`` of ``fn`` with the spec's shapes (and the parameters' first, when there are any)."""
    import jax
    from jax import export as jax_export

    # lazy: jax (the runtime imports it), kept out of `import neuropod_jax.packager`
    from neuropod_jax._runtime import x64_context

    symbols = _Symbols(ins)
    # 64-bit spec dtypes need JAX's 64-bit mode while tracing; otherwise the function is traced as
    # the caller's JAX runs it (float64 numpy weights then become float32, as jax.numpy would make them).
    wide = any(s.dtype in ("float64", "int64", "uint64") for s in (*ins, *outs))
    with x64_context(wide):
        struct: Any = jax.ShapeDtypeStruct  # untyped in jax's stubs
        args: list[Any] = [struct(shape, np.dtype(s.dtype)) for s, shape in zip(ins, symbols.shapes(ins))]
        if treedef is not None:
            args.insert(0, jax.tree_util.tree_unflatten(treedef, [struct(a.shape, a.dtype) for a in leaves]))
        try:
            return jax_export.export(jax.jit(fn), platforms=platforms)(*args)
        except Exception as e:
            raise _export_error(e, symbols, where) from e


def _export_error(e: Exception, symbols: _Symbols, where: str) -> PackageError:
    text = symbols.translate(str(e).strip().split("\n--------------------")[0].rstrip(". "))
    named = symbols.mentioned(str(e))
    if named:
        what = f"the spec's {', '.join(named)}"
        advice = (
            "The function must work for every size of a spec symbol (and of a null dim); if it only works for one "
            "size, make that dim a fixed size in the spec; if two symbols must be equal, make them one symbol"
        )
    else:
        what = "the spec's shapes"
        advice = "Check that the function runs on inputs of the spec's dtypes and shapes"
    return PackageError(f"{where}: jax.export could not export fn with {what}: {type(e).__name__}: {text}. {advice}")


def _match_params(
    leaves: list[np.ndarray], paths: list[str], params_tree: Any, exported: Any, where: str
) -> list[np.ndarray]:
    """The leaves, checked against the program's parameter argument and given its dtypes."""
    avals = exported.in_avals[: params_tree.num_leaves]
    if len(leaves) != len(avals):
        raise PackageError(
            f"{where}: params has {len(leaves)} array(s), but the program's first argument takes "
            f"{len(avals)} ({params_tree})"
        )
    out = []
    for leaf, path, aval in zip(leaves, paths, avals):
        want_dtype = np.dtype(aval.dtype)
        want_shape = tuple(aval.shape)
        if not all(isinstance(d, int) for d in want_shape):
            raise PackageError(f"{where}: the program's parameter {path} has a symbolic shape {want_shape}; parameters have fixed shapes")
        if leaf.shape != want_shape:
            raise PackageError(
                f"{where}: parameter {path} has shape {list(leaf.shape)}, but the program takes {list(want_shape)}"
            )
        if leaf.dtype != want_dtype:
            # JAX without 64-bit mode reads float64/int64 values as float32/int32; nothing else is converted.
            narrowed = leaf.dtype.itemsize == 8 and want_dtype.kind == leaf.dtype.kind and want_dtype.itemsize == 4
            if not narrowed:
                raise PackageError(f"{where}: parameter {path} is {leaf.dtype}, but the program takes {want_dtype}")
            leaf = leaf.astype(want_dtype)
        out.append(leaf)
    return out


def _dim_text(d: Any) -> str:
    return str(d) if isinstance(d, int) else f"'{d}'"


def _check_signature(
    in_avals: Sequence[Any], out_avals: Mapping[str, Any], ins: Sequence[TensorSpec], outs: Sequence[TensorSpec],
    where: str,
) -> None:
    """The program's input and output shapes and dtypes against the spec, naming the tensor and dim that differ."""
    bound: dict[str, str] = {}  # spec symbol -> the program's expression for it
    owner: dict[str, str] = {}  # the program's expression -> the spec symbol it stands for (inputs)

    def check(kind: str, spec: TensorSpec, aval: Any) -> None:
        shape, dtype = tuple(aval.shape), np.dtype(aval.dtype)
        head = f"{where}: {kind} {spec.name!r} is {spec.dtype} {spec.describe_shape()} in the spec"
        if dtype != np.dtype(spec.dtype):
            raise PackageError(f"{head}, but the program {'takes' if kind == 'input' else 'gives'} {dtype}")
        if len(shape) != len(spec.shape):
            raise PackageError(f"{head}, but the program's has {len(shape)} dims ({', '.join(map(_dim_text, shape))})")
        for k, (want, got) in enumerate(zip(spec.shape, shape)):
            static = isinstance(got, int)
            if isinstance(want, int):
                if not static or got != want:
                    raise PackageError(f"{head}, but dim {k} of the program's is {_dim_text(got)}, not {want}")
            elif want is None:
                if kind == "input" and static:
                    raise PackageError(f"{head}: dim {k} is null (any size), but the program takes only {got}")
            else:
                text = str(got)
                if kind == "input" and static:
                    raise PackageError(
                        f"{head}: dim {k} is symbol {want!r}, but the program takes only size {got} there; make the "
                        "dim that size in the spec, or export with a symbolic dimension"
                    )
                if want in bound and bound[want] != text:
                    raise PackageError(
                        f"{head}: dim {k} is symbol {want!r}, which the program has as '{bound[want]}' elsewhere, "
                        f"but as {_dim_text(got)} here"
                    )
                if kind == "input" and owner.get(text, want) != want:
                    raise PackageError(
                        f"{head}: dim {k} is symbol {want!r}, but the program ties it to symbol {owner[text]!r} "
                        f"(both are '{text}'); give the two dims one symbol in the spec"
                    )
                bound[want] = text
                if kind == "input":
                    owner[text] = want

    for spec, aval in zip(ins, in_avals):
        check("input", spec, aval)
    for spec in outs:
        check("output", spec, out_avals[spec.name])


__all__ = ["compatible_range", "create_jax_neuropod"]
