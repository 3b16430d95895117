"""Problem specs: the names, dtypes and shapes of a model's tensors.

A spec entry is ``{"name", "dtype", "shape"}``. A shape entry is a
non-negative int (that exact size), ``None`` (any size) or a symbol string
such as ``"batch_size"``; within one call, one symbol has one size across all
inputs and outputs.

Validation is on the per-call path of every model, so each spec is compiled
once into plain tuples and the checks are written to do as little as possible
when a tensor fits. Building a good error message is only done after a check
has failed.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from neuropod.errors import NeuropodError, PackageError, SpecError
from neuropod.strings import BYTES_FORM, kind_of, text_problem, to_bytes_array, to_string_array
from neuropod.tensors import DeviceInputs, TensorFacts, describe, host_array

#: The dtypes a spec can name, and the numpy dtype each one means.
#: ``string`` tensors (text) are numpy unicode arrays or object arrays of ``str``; ``bytes`` tensors
#: (binary data: an image or audio file, a serialized record) are object arrays of ``bytes``.
DTYPES: dict[str, np.dtype[Any] | None] = {
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
    "string": None,
    "bytes": None,
}

Dim = int | str | None

#: The longest tensor name, in UTF-8 bytes: a file name's limit on common file systems.
MAX_NAME_BYTES = 255
#: The rule :func:`tensor_name_problem` enforces, for error messages.
NAME_RULE = (
    f"a tensor name must be non-empty, at most {MAX_NAME_BYTES} UTF-8 bytes, not '.' or '..', and hold no NUL "
    "or other control character ('/', ':' and '.' are fine, as in 'InceptionV3/Predictions/Softmax:0')"
)


_SPEC_KEYS = ("name", "dtype", "shape")


@dataclass(frozen=True, eq=False)
class TensorSpec(Mapping[str, Any]):
    """One named tensor of a model's input or output spec.

    It is also the read-only dict the original Neuropod gave for each entry of
    ``model.inputs`` / ``model.outputs``: ``spec["name"]``, ``dict(spec)``,
    ``spec == {"name": "x", "dtype": "float32", "shape": [None, 2]}`` (the
    shape a list or a tuple), ``spec["shape"]`` a new list each time.
    """

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form used in ``config.json``."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    def describe_shape(self) -> str:
        """The shape as people write it: ``[batch_size, None, 4]``."""
        return "[" + ", ".join("None" if d is None else str(d) for d in self.shape) + "]"

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype} {self.describe_shape()}"

    # --- the original's dict form ---

    def __getitem__(self, key: str) -> Any:
        if key == "name":
            return self.name
        if key == "dtype":
            return self.dtype
        if key == "shape":
            return list(self.shape)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(_SPEC_KEYS)

    def __len__(self) -> int:
        return len(_SPEC_KEYS)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorSpec):
            return (self.name, self.dtype, self.shape) == (other.name, other.dtype, other.shape)
        if isinstance(other, Mapping):
            if len(other) != len(_SPEC_KEYS) or any(k not in other for k in _SPEC_KEYS):
                return False
            shape = other["shape"]
            return (
                other["name"] == self.name
                and other["dtype"] == self.dtype
                and isinstance(shape, (list, tuple))
                and tuple(shape) == self.shape
            )
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash((self.name, self.dtype, self.shape))


def tensor_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a tensor, or None when it can (the rule is :data:`NAME_RULE`)."""
    if not isinstance(name, str):
        return f"it is {kind_of(name)}, not a string"
    if not name:
        return "it is empty"
    if name in (".", ".."):
        return f"{name!r} names a directory"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "it is not valid Unicode (it holds a lone surrogate)"
    if size > MAX_NAME_BYTES:
        return f"it is {size} UTF-8 bytes long"
    for ch in name:
        if unicodedata.category(ch) == "Cc":
            return f"it holds the control character {ch!r}"
    return None


def parse_spec(entries: Any, where: str) -> tuple[TensorSpec, ...]:
    """Read a list of spec entries (from a config or a packager call).

    :param entries: the JSON value, a list of ``{"name", "dtype", "shape"}``.
        :class:`TensorSpec` objects are accepted as they are.
    :param where: how to name the list in errors, e.g. ``"config.json: input_spec"``.
    :raises PackageError: naming the entry and field that is wrong.
    """
    if not isinstance(entries, (list, tuple)):
        raise PackageError(f"{where} must be a list of {{name, dtype, shape}} objects, not {kind_of(entries)}")
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if isinstance(entry, TensorSpec):
            _check_name(entry.name, f"{where}[{i}]")
            spec = entry
        else:
            spec = _parse_entry(entry, f"{where}[{i}]")
        if spec.name in seen:
            raise PackageError(f"{where}[{i}]: tensor name {spec.name!r} appears twice; names must be unique")
        seen.add(spec.name)
        specs.append(spec)
    return tuple(specs)


def _parse_entry(entry: Any, where: str) -> TensorSpec:
    if not isinstance(entry, Mapping):
        raise PackageError(f"{where} must be an object with name, dtype and shape, not {kind_of(entry)}")
    unknown = sorted(set(entry) - {"name", "dtype", "shape"}, key=str)
    if unknown:
        raise PackageError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}; allowed: name, dtype, shape")
    for field in ("name", "dtype", "shape"):
        if field not in entry:
            raise PackageError(f"{where} is missing {field!r}")
    name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
    if not isinstance(name, str) or not name:
        raise PackageError(f"{where}.name must be a non-empty string, not {_show(name)}")
    _check_name(name, where)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise PackageError(f"{where} ({name!r}): dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, (list, tuple)):
        raise PackageError(f"{where} ({name!r}): shape must be a list, not {kind_of(shape)}")
    dims: list[Dim] = []
    for j, dim in enumerate(shape):
        if isinstance(dim, np.integer):  # packager callers often pass numpy sizes
            dim = int(dim)
        ok = (
            dim is None
            or (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0)
            or (isinstance(dim, str) and dim.isidentifier())
        )
        if not ok:
            raise PackageError(
                f"{where} ({name!r}): shape[{j}] is {dim!r}; a dim is a size >= 0, "
                "null for any size, or a symbol name such as \"batch_size\""
            )
        dims.append(dim)
    return TensorSpec(name, dtype, tuple(dims))


def _check_name(name: str, where: str) -> None:
    problem = tensor_name_problem(name)
    if problem is not None:
        raise PackageError(f"{where}.name {_show(name)} is not a valid tensor name: {problem}; {NAME_RULE}")


def _show(value: object) -> str:
    # Bounded, so a 100 kB name does not become a 100 kB message.
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- validation -----------------------------------------------------------

# A compiled spec entry: (name, numpy dtype or None for strings, ndim,
# ((axis, size), ...) fixed dims, ((axis, symbol), ...) symbolic dims, spec).
_Compiled = tuple[str, "np.dtype[Any] | None", int, tuple[tuple[int, int], ...], tuple[tuple[int, str], ...], TensorSpec]
Bindings = dict[str, tuple[int, str]]


class SpecValidator:
    """Checks one model's tensors against its input and output specs.

    Built once per loaded model; :meth:`check_inputs` and
    :meth:`check_outputs` are called on every inference.

    :param shared_symbols: a symbol has one size across inputs and outputs
        (our rule, the default). False checks inputs and outputs separately,
        as the original Neuropod did: packages it wrote may reuse a symbol
        name on the output side with another meaning.
    """

    def __init__(
        self,
        model_name: str,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        *,
        shared_symbols: bool = True,
    ):
        self.model_name = model_name
        self._inputs = {s.name: _compile(s) for s in inputs}
        self._outputs = {s.name: _compile(s) for s in outputs}
        self.shared_symbols = shared_symbols
        # Checks compiled for this model's specs, for the calls every model gets most: numpy
        # arrays of every tensor, each fitting. They say only "fits" or "look closer", and the
        # general checks below, which say what is wrong, take every other call.
        self._fast_inputs = _fast_check(inputs, "inputs")
        self._fast_outputs = _fast_check(outputs, "outputs")
        #: Given an input's name and a GPU tensor's facts, why this model cannot take it (None: it can).
        #: The loaded model sets it; without one, GPU tensors are refused.
        self.device_policy: Callable[[str, TensorFacts], str | None] = _no_device_tensors

    def check_inputs(self, tensors: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], Bindings]:
        """Validate the inputs of one call.

        :returns: the inputs as C-contiguous numpy arrays (the same objects
            when they already were; the caller's own dict when nothing had
            to change, so backends must not modify it; a numpy scalar such
            as ``np.float32(1)`` becomes a 0-d array, another framework's CPU
            tensor a numpy array sharing its memory), and the symbol sizes
            they set, for :meth:`check_outputs`. Tensors on a GPU that
            :attr:`device_policy` lets through stay as they are, in a
            :class:`~neuropod.tensors.DeviceInputs` dict.
        :raises SpecError: for an unknown name or a tensor that does not fit.
        """
        if type(tensors) is dict and self._fast_inputs is not None:
            fast: Bindings | None = self._fast_inputs(tensors, {})
            if fast is not None:
                return tensors, fast
        if not isinstance(tensors, Mapping):
            raise SpecError(
                f"Inputs of model {self.model_name!r} must be a dict of name -> numpy array, not {kind_of(tensors)}"
            )
        bindings: Bindings = {}
        specs = self._inputs
        replaced: dict[str, np.ndarray] = {}
        on_device = False
        for name, arr in tensors.items():
            compiled = specs.get(name)
            if compiled is None:
                raise SpecError(
                    f"Tensor name(s) {name!r} are not found in the input spec; model {self.model_name!r} has no "
                    "input named " + repr(name) + "; its inputs are: " + ", ".join(str(c[5]) for c in specs.values())
                )
            if type(arr) is not np.ndarray:
                if isinstance(arr, np.generic):  # a numpy scalar: a 0-d tensor
                    arr = replaced[name] = np.asarray(arr)
                elif not isinstance(arr, np.ndarray) and (facts := describe(arr)) is not None:
                    if facts.device == "cpu":  # another framework's CPU tensor: numpy shares its memory
                        if isinstance(facts.dtype, str):  # bfloat16...: numpy has no such type, and no spec names one
                            _check_facts(facts, compiled, bindings, "input", self.model_name)
                        arr = replaced[name] = host_array(arr, facts)
                    else:  # on a GPU: checked from its metadata and passed on as it is
                        refused = self.device_policy(name, facts) if facts.on_gpu else "no backend takes tensors on that device"
                        if refused:
                            _refuse_device(name, facts, refused, self.model_name)
                        _check_facts(facts, compiled, bindings, "input", self.model_name)
                        on_device = True
                        continue
            elif compiled[1] is None and arr.dtype.kind == "S" and compiled[5].dtype == "string":
                # Bytes for a string tensor, as the original Neuropod took them: UTF-8 text.
                arr = replaced[name] = _decode_utf8(arr, compiled[5], self.model_name)
            _check(arr, compiled, bindings, "input", self.model_name)
            if not arr.flags.c_contiguous:
                replaced[name] = np.ascontiguousarray(arr)
        # The common case passes the caller's dict through: no new dict per call.
        if not replaced and type(tensors) is dict and not on_device:
            return tensors, bindings
        out = DeviceInputs(tensors) if on_device else dict(tensors)
        out.update(replaced)
        return out, bindings

    def check_outputs(
        self,
        tensors: Mapping[str, Any],
        bindings: Bindings,
        requested: Iterable[str] | None = None,
        on_device: bool = False,
        partial: bool = False,
    ) -> None:
        """Validate what a backend returned, with the symbol sizes the inputs set.

        A numpy scalar (what some frameworks give for a 0-d output) is
        replaced in ``tensors`` by a 0-d array, so ``tensors`` must be the
        backend's own dict, not the caller's.

        :param requested: the outputs the caller asked for; all of the spec's
            outputs when None. Each must be present.
        :param on_device: the caller asked for outputs on the GPU
            (``output_device``): the backend's own tensors are checked from
            their metadata. Otherwise every output must be a numpy array.
        :param partial: one response of a decoupled model: outputs may be missing (those
            present are checked as usual).
        :raises SpecError: for a missing, unexpected or misfitting output.
        """
        specs = self._outputs
        if not self.shared_symbols:
            bindings = {}
        # A misfit found halfway may leave an output's own symbol bound, to that output's
        # size: the general checks then find it bound as they would have bound it.
        fast = self._fast_outputs
        if requested is None and fast is not None and type(tensors) is dict and fast(tensors, bindings) is not None:
            return
        for name, arr in tensors.items():
            compiled = specs.get(name)
            if compiled is None:
                raise SpecError(
                    f"Tensor name(s) {name!r} are not found in the output spec: model {self.model_name!r} returned "
                    f"a tensor {name!r} that is not in its output spec ({', '.join(specs)})"
                )
            if type(arr) is not np.ndarray:
                if isinstance(arr, np.generic):
                    arr = np.asarray(arr)
                    tensors[name] = arr  # type: ignore[index]
                elif on_device and not isinstance(arr, np.ndarray) and (facts := describe(arr)) is not None:
                    # output_device: the backend's own tensor on the GPU, checked from its metadata.
                    _check_facts(facts, compiled, bindings, "output", self.model_name)
                    continue
            _check(arr, compiled, bindings, "output", self.model_name)
        if (len(tensors) != len(specs) or requested is not None) and not partial:
            wanted = specs if requested is None else requested
            missing = [n for n in wanted if n not in tensors]
            if missing:
                raise SpecError(
                    f"Model {self.model_name!r} did not return output(s) {', '.join(map(repr, missing))} "
                    f"(returned: {', '.join(map(repr, tensors)) or 'nothing'})"
                )

    def check_requested(self, requested: Iterable[str]) -> list[str]:
        """Check that every requested output name is in the output spec.

        A single ``str`` is one name (never split into characters).

        :raises TypeError: ``requested`` is not a str or an iterable of str.
        :raises SpecError: a name is not in the output spec.
        """
        if isinstance(requested, str):
            names = [requested]
        elif isinstance(requested, (bytes, bytearray, Mapping)) or not isinstance(requested, Iterable):
            raise TypeError(
                f"requested_outputs must be a list of output names (str), not {kind_of(requested)}: "
                f"write e.g. requested_outputs=[{next(iter(self._outputs), 'name')!r}]"
            )
        else:
            names = list(requested)
            for n in names:
                if not isinstance(n, str):
                    raise TypeError(f"requested_outputs must hold output names (str), but holds {kind_of(n)} {_show(n)}")
        unknown = [n for n in names if n not in self._outputs]
        if unknown:
            raise SpecError(
                f"Requested output(s) {', '.join(map(repr, unknown))} of model {self.model_name!r} "
                f"are not in its output spec; its outputs are: {', '.join(map(repr, self._outputs))}"
            )
        return names


def _fast_check(specs: Sequence[TensorSpec], what: str) -> Callable[[dict[str, Any], Bindings], Bindings | None] | None:
    """A check of one call's tensors written for these specs: the bindings, or None for "look closer".

    It passes a dict holding exactly the specs' tensors, each a C-contiguous
    numpy array of its spec's dtype and shape, symbols agreeing with each
    other and with ``bindings`` (which it fills in); for anything else it
    returns None and the caller runs the general checks. Generated as Python
    source (the way :mod:`dataclasses` writes ``__init__``), so a call runs a
    few straight lines instead of a loop of calls per tensor. None when the
    specs hold a string or bytes tensor (those need the general checks every time).
    """
    if not specs or any(DTYPES[s.dtype] is None for s in specs):
        return None
    env: dict[str, Any] = {"ndarray": np.ndarray}
    lines = [f"def check_{what}(t, b):", f"    if len(t) != {len(specs)}:", "        return None", "    try:"]
    lines += [f"        a{i} = t[{s.name!r}]" for i, s in enumerate(specs)]
    lines += ["    except KeyError:", "        return None"]
    for i, s in enumerate(specs):
        env[f"D{i}"] = DTYPES[s.dtype]
        head = f"    if type(a{i}) is not ndarray or a{i}.dtype is not D{i} or not a{i}.flags.c_contiguous"
        if all(isinstance(dim, int) for dim in s.shape):  # a fixed shape: one tuple comparison
            lines += [f"{head} or a{i}.shape != {tuple(s.shape)!r}:", "        return None"]
            continue
        lines += [f"{head}:", "        return None", f"    s{i} = a{i}.shape"]
        conditions = [f"len(s{i}) != {len(s.shape)}"]
        conditions += [f"s{i}[{axis}] != {dim}" for axis, dim in enumerate(s.shape) if isinstance(dim, int)]
        lines += [f"    if {' or '.join(conditions)}:", "        return None"]
        for axis, dim in enumerate(s.shape):
            if isinstance(dim, str):
                lines += [
                    f"    bound = b.get({dim!r})",
                    "    if bound is None:",
                    f"        b[{dim!r}] = (s{i}[{axis}], {s.name!r})",
                    f"    elif bound[0] != s{i}[{axis}]:",
                    "        return None",
                ]
    lines.append("    return b")
    exec("\n".join(lines), env)  # our own source: names and symbols enter only as repr() literals
    check: Callable[[dict[str, Any], Bindings], Bindings | None] = env[f"check_{what}"]
    return check


def _compile(spec: TensorSpec) -> _Compiled:
    fixed = tuple((i, d) for i, d in enumerate(spec.shape) if isinstance(d, int))
    symbols = tuple((i, d) for i, d in enumerate(spec.shape) if isinstance(d, str))
    return (spec.name, DTYPES[spec.dtype], len(spec.shape), fixed, symbols, spec)


# The messages start with the original Neuropod's own sentence for the same
# fault ("Tensor 'x' in the input spec is expected to have 2 dimensions, but
# had 1"), so logs matched against its words still match; what we know more
# (the model, the spec, the whole shape) follows in parentheses.


def _check(arr: Any, compiled: _Compiled, bindings: Bindings, kind: str, model: str) -> None:
    name, dtype, spec = compiled[0], compiled[1], compiled[5]
    if type(arr) is not np.ndarray and not isinstance(arr, np.ndarray):
        _fail(
            f"Tensor {name!r} in the {kind} spec is expected to be a numpy array of {spec.dtype}, "
            f"but was {kind_of(arr)}", model,
        )  # fmt: skip
    if dtype is None:
        problem = text_problem(arr, spec.dtype, name, kind)
        if problem is not None:
            _fail(problem[0], model, problem[1])
    elif arr.dtype != dtype:
        _fail(f"Tensor {name!r} in the {kind} spec is expected to be of type {spec.dtype}, but was of type {arr.dtype}", model)
    _check_dims(arr.shape, compiled, bindings, kind, model)


def _check_facts(facts: TensorFacts, compiled: _Compiled, bindings: Bindings, kind: str, model: str) -> None:
    """:func:`_check` for a tensor on a device: dtype and shape from its metadata, nothing copied."""
    name, dtype, _, _, _, spec = compiled
    where = f"a {facts.framework} tensor on {facts.device}"
    if dtype is None:
        held = BYTES_FORM if spec.dtype == "bytes" else "numpy unicode arrays or object arrays of str"
        _fail(
            f"Tensor {name!r} in the {kind} spec is expected to be of type {spec.dtype}, but was {where}", model,
            f"{spec.dtype} tensors are {held}, in host memory",
        )  # fmt: skip
    if facts.dtype != dtype:
        _fail(f"Tensor {name!r} in the {kind} spec is expected to be of type {spec.dtype}, but was of type "
              f"{facts.dtype} ({where})", model)  # fmt: skip
    _check_dims(facts.shape, compiled, bindings, kind, model)


def _refuse_device(name: str, facts: TensorFacts, reason: str, model: str) -> NoReturn:
    raise NeuropodError(
        f"Input {name!r} of model {model!r} is a {facts.framework} tensor on {facts.device}, which this call cannot "
        f"take: {reason}"
    )


def _no_device_tensors(name: str, facts: TensorFacts) -> str:
    return "this model takes numpy arrays (or CPU tensors) only"


def _check_dims(shape: tuple[int, ...], compiled: _Compiled, bindings: Bindings, kind: str, model: str) -> None:
    name, _, ndim, fixed, symbols, spec = compiled
    if len(shape) != ndim:
        _fail(
            f"Tensor {name!r} in the {kind} spec is expected to have {ndim} dimensions, but had {len(shape)}",
            model, f"spec {spec.describe_shape()}, shape {tuple(shape)}",
        )  # fmt: skip
    for axis, size in fixed:
        if shape[axis] != size:
            _fail(
                f"Dim {axis} of tensor {name!r} in the {kind} spec is expected to be of size {size}, "
                f"but was of size {shape[axis]}", model, f"shape {tuple(shape)}",
            )  # fmt: skip
    for axis, symbol in symbols:
        size = shape[axis]
        bound = bindings.get(symbol)
        if bound is None:
            bindings[symbol] = (size, name)
        elif bound[0] != size:
            source = "this tensor" if bound[1] == name else f"tensor {bound[1]!r}"
            _fail(
                f"All dims with symbol {symbol!r} should be the same size. Dim {axis} of tensor {name!r} in the "
                f"{kind} spec was expected to be of size {bound[0]} (from {source}), but was of size {size}", model,
            )  # fmt: skip


def _decode_utf8(arr: np.ndarray, spec: TensorSpec, model: str) -> np.ndarray:
    try:
        return np.char.decode(arr, "utf-8")
    except UnicodeDecodeError as e:
        _fail(
            f"Tensor {spec.name!r} in the input spec is expected to be of type string, but holds bytes that are "
            f"not UTF-8 text ({e.reason} at byte {e.start})", model,
        )  # fmt: skip


def _fail(sentence: str, model: str, detail: str = "") -> NoReturn:
    raise SpecError(f"{sentence} (model {model!r}{': ' + detail if detail else ''})")


__all__ = [
    "DTYPES",
    "MAX_NAME_BYTES",
    "NAME_RULE",
    "Dim",
    "SpecValidator",
    "TensorSpec",
    "parse_spec",
    "tensor_name_problem",
    "to_bytes_array",
    "to_string_array",
]
