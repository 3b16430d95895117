"""What a stateful model declares in its package: the state the runtime carries from one request of a
sequence to the next (:class:`StatePair`, ``state_spec`` in ``config.json``) and the inputs the
runtime fills with a sequence's flags and id (:class:`SequenceControl`, ``sequence_controls``).

Both are Triton's ideas (a model configuration's ``sequence_batching`` ``state`` and
``control_input`` blocks) on a Neuropod spec: the state input and output and the control inputs are
ordinary tensors of the model's input and output specs, which callers never send or see. How
sequences run is :mod:`neuropod.sequences`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from neuropod.errors import NeuropodError, PackageError
from neuropod.spec import DTYPES, Dim, TensorSpec
from neuropod.strings import TEXT_DTYPES, blank

#: The kinds of control input, as Triton names them: 1 on a sequence's first request (START), on
#: its last (END), on every request that holds a sequence's step (READY: always 1 here, as a batch
#: holds only live steps); CORRID is the sequence's id.
CONTROL_KINDS = (
    "CONTROL_SEQUENCE_START",
    "CONTROL_SEQUENCE_READY",
    "CONTROL_SEQUENCE_END",
    "CONTROL_SEQUENCE_CORRID",
)
#: ``initial_state`` of a state that starts as zeros (empty strings for a string state).
ZERO = "zero"
#: Where a package keeps a state's initial value given as an array: ``0/state/initial_<i>.npy``.
STATE_DIR = "0/state"


@dataclass(frozen=True)
class StatePair:
    """One state a stateful model carries between the requests of a sequence: output
    ``output_name`` of one request is input ``input_name`` of the next.

    ``shape`` is one sequence's state (concrete dims); a model whose spec leads with a batch
    symbol normally has a leading 1 here, and a batch of sequences stacks their states along
    it. ``initial_state`` is :data:`ZERO` or a package-relative ``.npy`` file (``data_file``).
    """

    input_name: str
    output_name: str
    dtype: str
    shape: tuple[int, ...]
    initial_state: str = ZERO

    def to_dict(self) -> dict[str, Any]:
        """The JSON form in ``config.json``."""
        initial: Any = ZERO if self.initial_state == ZERO else {"data_file": self.initial_state}
        return {
            "input_name": self.input_name,
            "output_name": self.output_name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "initial_state": initial,
        }

    def __str__(self) -> str:
        start = "zeros" if self.initial_state == ZERO else self.initial_state
        return f"{self.output_name} -> {self.input_name}: {self.dtype} {list(self.shape)} (starts as {start})"


@dataclass(frozen=True)
class SequenceControl:
    """A model input the runtime fills for each request of a sequence (see :data:`CONTROL_KINDS`)."""

    name: str
    kind: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind}

    def __str__(self) -> str:
        return f"{self.name}: {self.kind}"


def parse_state_spec(
    value: Any, input_spec: Iterable[TensorSpec], output_spec: Iterable[TensorSpec], where: str
) -> tuple[StatePair, ...]:
    """Check ``state_spec`` (``config.json``, or the packaging keyword): a list of objects
    ``{"input_name", "output_name", "dtype", "shape", "initial_state"}``. ``dtype`` defaults to the
    state input's, ``shape`` to the input's with a leading symbol as 1 (every other dim must then be
    fixed), ``initial_state`` to ``"zero"``; a ``{"data_file": path}`` initial state names a
    ``.npy`` file in the package. Absent or null: none.

    :raises PackageError: naming the entry and what is wrong: an input or output the spec lacks, a
        dtype or shape that does not fit them, a name used twice.
    """
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise PackageError(
            f"{where} must be a list of state pairs ({{'input_name', 'output_name', ...}}), not {value!r:.80}"
        )
    inputs = {s.name: s for s in input_spec}
    outputs = {s.name: s for s in output_spec}
    pairs: list[StatePair] = []
    for i, entry in enumerate(value):
        here = f"{where}[{i}]"
        if isinstance(entry, StatePair):
            entry = entry.to_dict()
        if not isinstance(entry, Mapping):
            raise PackageError(f"{here} must be an object with input_name and output_name, not {entry!r:.80}")
        unknown = set(entry) - {"input_name", "output_name", "dtype", "shape", "initial_state"}
        if unknown:
            raise PackageError(
                f"{here}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; a state pair has input_name, "
                "output_name, dtype, shape and initial_state"
            )
        in_name, out_name = entry.get("input_name"), entry.get("output_name")
        if in_name not in inputs:
            raise PackageError(
                f"{here}: input_name {in_name!r} is not an input of the model; the state input is an ordinary "
                f"input of its spec (its inputs are: {', '.join(inputs) or '(none)'})"
            )
        if out_name not in outputs:
            raise PackageError(
                f"{here}: output_name {out_name!r} is not an output of the model; the state output is an "
                f"ordinary output of its spec (its outputs are: {', '.join(outputs) or '(none)'})"
            )
        in_spec, out_spec = inputs[in_name], outputs[out_name]
        dtype = entry.get("dtype", in_spec.dtype)
        if dtype not in DTYPES:
            raise PackageError(f"{here}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        for spec, side in ((in_spec, "input"), (out_spec, "output")):
            if spec.dtype != dtype:
                raise PackageError(
                    f"{here}: the state is {dtype}, but {side} {spec.name!r} is {spec.dtype} in the spec; "
                    "the state input and output must have the state's dtype"
                )
        shape = _state_shape(entry.get("shape"), in_spec, here)
        for spec, side in ((in_spec, "input"), (out_spec, "output")):
            problem = _misfit(shape, spec.shape)
            if problem:
                raise PackageError(
                    f"{here}: state shape {list(shape)} does not fit {side} {spec.name!r} "
                    f"{spec.describe_shape()}: {problem}"
                )
        pairs.append(StatePair(in_name, out_name, dtype, shape, _initial(entry.get("initial_state", ZERO), here)))
    for attr in ("input_name", "output_name"):
        names = [getattr(p, attr) for p in pairs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PackageError(f"{where}: {attr} {twice[0]!r} is in more than one state pair")
    return tuple(pairs)


def parse_sequence_controls(value: Any, input_spec: Iterable[TensorSpec], where: str) -> tuple[SequenceControl, ...]:
    """Check ``sequence_controls``: a list of ``{"name": input, "kind": one of CONTROL_KINDS}``,
    each naming an input of the spec at most once, each kind at most once. START, READY and END
    are numbers or bools (0 or 1 in the input's dtype); CORRID is an integer input (numeric
    sequence ids) or a string input (string ids). Absent or null: none.

    :raises PackageError: naming the entry and what is wrong.
    """
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise PackageError(f"{where} must be a list of {{'name', 'kind'}} objects, not {value!r:.80}")
    inputs = {s.name: s for s in input_spec}
    controls: list[SequenceControl] = []
    for i, entry in enumerate(value):
        here = f"{where}[{i}]"
        if isinstance(entry, SequenceControl):
            entry = entry.to_dict()
        if not isinstance(entry, Mapping) or set(entry) != {"name", "kind"}:
            raise PackageError(f"{here} must be an object with exactly 'name' and 'kind', not {entry!r:.80}")
        name, kind = entry["name"], entry["kind"]
        if kind not in CONTROL_KINDS:
            raise PackageError(f"{here}: kind {kind!r} is not one of {', '.join(CONTROL_KINDS)}")
        spec = inputs.get(name)
        if spec is None:
            raise PackageError(
                f"{here}: {name!r} is not an input of the model; a control is an ordinary input of its spec, "
                f"filled by the runtime (its inputs are: {', '.join(inputs) or '(none)'})"
            )
        if kind == "CONTROL_SEQUENCE_CORRID":
            if spec.dtype in ("bool", "bytes") or spec.dtype.startswith("float"):
                raise PackageError(
                    f"{here}: the sequence id input {name!r} is {spec.dtype}; it must be an integer type "
                    "(uint64, int64...) for numeric ids, or string for string ids"
                )
        elif spec.dtype in TEXT_DTYPES:
            raise PackageError(
                f"{here}: {kind} input {name!r} is a {spec.dtype} tensor; it must be a number or bool (0 or 1)"
            )
        if any(isinstance(d, int) and d != 1 for d in spec.shape[1:]) or (
            spec.shape and isinstance(spec.shape[0], int) and spec.shape[0] != 1
        ):
            raise PackageError(
                f"{here}: control input {name!r} is {spec.describe_shape()}; a control holds one value per "
                "sequence: shape [], [1], or [batch, 1]"
            )
        controls.append(SequenceControl(name, kind))
    for attr in ("name", "kind"):
        values = [getattr(c, attr) for c in controls]
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise PackageError(f"{where}: {attr} {twice[0]!r} is in more than one control")
    return tuple(controls)


def check_state_names(state: Iterable[StatePair], controls: Iterable[SequenceControl], where: str) -> None:
    """A state input cannot also be a control input."""
    taken = {p.input_name for p in state}
    for c in controls:
        if c.name in taken:
            raise PackageError(f"{where}: input {c.name!r} is both a state input and a {c.kind} control")


def _state_shape(value: Any, spec: TensorSpec, where: str) -> tuple[int, ...]:
    if value is None:
        dims: list[int] = []
        for i, d in enumerate(spec.shape):
            if isinstance(d, int):
                dims.append(d)
            elif i == 0:
                dims.append(1)
            else:
                raise PackageError(
                    f"{where}: give the state's shape: input {spec.name!r} is {spec.describe_shape()}, and only a "
                    "leading batch dim can be taken as 1"
                )
        return tuple(dims)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise PackageError(f"{where}: shape must be a list of ints >= 0, not {value!r:.80}")
    dims = list(value)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise PackageError(f"{where}: shape must be a list of ints >= 0 (one sequence's state), not {dims!r:.80}")
    return tuple(dims)


def _misfit(shape: tuple[int, ...], dims: tuple[Dim, ...]) -> str | None:
    if len(shape) != len(dims):
        return f"{len(shape)} dims against {len(dims)}"
    for i, (have, want) in enumerate(zip(shape, dims)):
        if isinstance(want, int) and have != want:
            return f"dim {i} is {have}, the spec says {want}"
    return None


def _initial(value: Any, where: str) -> str:
    if value == ZERO:
        return ZERO
    if isinstance(value, Mapping) and set(value) == {"data_file"} and isinstance(value["data_file"], str):
        path = value["data_file"]
        parts = path.split("/")
        if not path.endswith(".npy") or path.startswith("/") or ".." in parts or "\\" in path:
            raise PackageError(f"{where}: initial_state data_file {path!r} must be a .npy file inside the package")
        return path
    raise PackageError(
        f'{where}: initial_state must be "zero" or {{"data_file": "0/state/....npy"}} (a packager also takes '
        f"an array), not {value!r:.80}"
    )


def batch_symbol(
    inputs: Mapping[str, TensorSpec], outputs: Mapping[str, TensorSpec], pairs: Sequence[StatePair]
) -> str | None:
    """The symbol (or None dim, as ``"?"``) that leads every input, output and state of a stateful
    model, along which a call stacks sequences; None when there is none (then a call runs one
    sequence). :func:`why_not_batched` says why."""
    return None if why_not_batched(inputs, outputs, pairs) else _lead(next(iter(inputs.values()), None))


def why_not_batched(
    inputs: Mapping[str, TensorSpec], outputs: Mapping[str, TensorSpec], pairs: Sequence[StatePair]
) -> str | None:
    """Why a stateful model's calls cannot stack sequences (None: they can)."""
    specs = [*inputs.values(), *outputs.values()]
    if not specs:
        return "it has no tensors"
    lead = _lead(specs[0])
    if lead is None:
        return f"{specs[0].name!r} {specs[0].describe_shape()} does not lead with a batch symbol"
    for spec in specs[1:]:
        if _lead(spec) != lead:
            return f"{spec.name!r} {spec.describe_shape()} does not lead with the batch symbol {specs[0].shape[0]!r}"
    for pair in pairs:
        if not pair.shape or pair.shape[0] < 1:
            return f"state {pair.input_name!r} {list(pair.shape)} has no leading batch dim"
    return None


def _lead(spec: TensorSpec | None) -> str | None:
    if spec is None or not spec.shape or isinstance(spec.shape[0], int):
        return None
    return "?" if spec.shape[0] is None else str(spec.shape[0])


def initial_state(pair: StatePair, root: Any, model_name: str) -> np.ndarray:
    """One sequence's initial value of a state (read-only: a step never edits it)."""
    dtype = DTYPES[pair.dtype]
    if pair.initial_state == ZERO:
        if dtype is None:  # empty strings, or empty bytes
            array = np.full(pair.shape, blank(pair.dtype), dtype=object)
        else:
            array = np.zeros(pair.shape, dtype=dtype)
    else:
        path = root / pair.initial_state
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise NeuropodError(
                f"model {model_name!r}: cannot read the initial state of {pair.input_name!r} from {pair.initial_state}: {e}"
            ) from None
        if array.shape != pair.shape or (dtype is not None and array.dtype != dtype):
            raise NeuropodError(
                f"model {model_name!r}: the initial state of {pair.input_name!r} in {pair.initial_state} is "
                f"{array.dtype} {list(array.shape)}, not {pair.dtype} {list(pair.shape)}"
            )
    array.flags.writeable = False
    return array


__all__ = [
    "CONTROL_KINDS",
    "STATE_DIR",
    "ZERO",
    "SequenceControl",
    "StatePair",
    "batch_symbol",
    "check_state_names",
    "initial_state",
    "parse_sequence_controls",
    "parse_state_spec",
    "why_not_batched",
]
