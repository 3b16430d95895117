"""The inputs every candidate runs on: the baseline's bundled test data, ``.npz`` files, or
inputs generated from the baseline's spec with a fixed seed.

Also the batches of the throughput measurement: the first input set's rows repeated along the
batch axis (the one symbol every input has first) up to each batch size.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from neuropod.errors import NeuropodError, SpecError
from neuropod.spec import SpecValidator, TensorSpec

#: The size of a symbol (or a ``None`` dimension) that ``--dims`` does not give, in generated inputs.
DEFAULT_SIZE = 2

InputSet = dict[str, np.ndarray]


def parse_dims(values: Iterable[str], spec: Sequence[TensorSpec]) -> dict[str, int]:
    """``--dims batch_size=8`` values, checked against the symbols of ``spec``."""
    symbols = spec_symbols(spec)
    out: dict[str, int] = {}
    for text in values:
        name, eq, size = text.partition("=")
        if not eq or not name:
            raise NeuropodError(f"--dims {text!r} must be SYMBOL=SIZE (e.g. batch_size=8)")
        if name not in symbols:
            known = ", ".join(sorted(symbols)) or "none: every dimension is fixed"
            raise NeuropodError(f"--dims {text!r}: the baseline's inputs have no symbol {name!r}; its symbols: {known}")
        out[name] = whole_number("--dims", text, size)
    return out


def parse_batch_sizes(text: str) -> list[int]:
    """``--batch-sizes 1,8,32``: the sizes in order (none for ``''``)."""
    return [whole_number("--batch-sizes", text, part) for part in (p.strip() for p in text.split(",")) if part]


def whole_number(option: str, given: str, part: str) -> int:
    """``part`` of an option's value ``given`` as a whole number of at least 1; a
    :class:`NeuropodError` naming the option, its value and the bad part otherwise."""
    try:
        n = int(part)
    except ValueError:
        n = 0
    if n < 1:
        raise NeuropodError(f"{option} {given!r}: {part!r} is not a whole number of at least 1")
    return n


def spec_symbols(spec: Sequence[TensorSpec]) -> set[str]:
    return {d for t in spec for d in t.shape if isinstance(d, str)}


def generate(spec: Sequence[TensorSpec], count: int, dims: Mapping[str, int], seed: int) -> list[InputSet]:
    """``count`` input sets drawn from ``spec`` with ``seed``: floats from a standard normal, integers
    from 0 to 9 (unsigned too), booleans even, strings short ASCII words, bytes short random bytes."""
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(count):
        one: InputSet = {}
        for t in spec:
            shape = tuple(d if isinstance(d, int) else dims.get(d, DEFAULT_SIZE) if isinstance(d, str) else DEFAULT_SIZE
                          for d in t.shape)  # fmt: skip
            one[t.name] = _draw(rng, t.dtype, shape)
        sets.append(one)
    return sets


def _draw(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    if dtype.startswith(("int", "uint")):
        return rng.integers(0, 10, size=shape).astype(dtype)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    out = np.empty(shape, dtype=object)
    for index in np.ndindex(*shape):
        n = int(rng.integers(1, 9))
        if dtype == "bytes":
            out[index] = rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
        else:
            out[index] = "".join(rng.choice(letters, size=n))
    return out


def read_npz(path: str | os.PathLike[str]) -> InputSet:
    """One input set from a ``.npz`` file (``numpy.savez``), without pickles."""
    shown = os.fspath(path)
    if not os.path.exists(shown):
        raise NeuropodError(f"--inputs {shown}: no such file")
    try:
        data = np.load(shown, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise NeuropodError(f"--inputs {shown} is not a readable .npz archive without pickles: {e}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):  # a .npy: one array, no names
        raise NeuropodError(f"--inputs {shown} is a .npy file (one unnamed array); give a .npz archive of every "
                            "input (numpy.savez(FILE, x=..., y=...))")  # fmt: skip
    try:
        with data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise NeuropodError(f"--inputs {shown} is not a readable .npz archive without pickles: {e}") from None


def check_sets(sets: Sequence[InputSet], spec: Sequence[TensorSpec], source: str) -> None:
    """Every set has exactly the spec's inputs, each of its dtype and shape (a clear error before anything
    runs, not every candidate failing on them)."""
    names = {t.name for t in spec}
    validator = SpecValidator("the baseline", spec, [])
    for i, one in enumerate(sets):
        where = source if len(sets) == 1 else f"{source}, set {i + 1}"
        missing, extra = names - one.keys(), one.keys() - names
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"misses {', '.join(sorted(missing))}")
            if extra:
                parts.append(f"has {', '.join(sorted(extra))}, which the baseline does not take")
            raise NeuropodError(f"The inputs of {where} {' and '.join(parts)}; the baseline's inputs: "
                                f"{', '.join(sorted(names))}")  # fmt: skip
        try:
            validator.check_inputs(one)
        except SpecError as e:
            raise NeuropodError(f"The inputs of {where} do not fit the baseline's spec: {e}") from None


def batch_axis(spec: Sequence[TensorSpec]) -> str | None:
    """The batch symbol: the symbol every input has as its first dimension (None if there is none)."""
    firsts = {t.shape[0] if t.shape else None for t in spec}
    if len(firsts) == 1:
        (first,) = firsts
        if isinstance(first, str):
            return first
    return None


def batch_of(one: InputSet, size: int) -> InputSet:
    """``one``'s rows repeated (or cut) along the first axis to ``size`` rows."""
    out = {}
    for name, arr in one.items():
        rows = arr.shape[0] if arr.ndim else 0
        if rows == 0:
            raise NeuropodError(f"Input {name!r} has no rows to make a batch of {size} from")
        out[name] = np.take(arr, np.arange(size) % rows, axis=0)
    return out


def save_sets(path: Path, sets: Sequence[Mapping[str, Any]]) -> None:
    """Input or output sets for a worker process, without pickles (strings as unicode, bytes padded
    with their lengths)."""
    arrays = {}
    for i, one in enumerate(sets):
        for name, arr in one.items():
            arrays.update(_encode(f"{i}/{name}", np.asarray(arr)))
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stubs read **kwds as allow_pickle


def load_sets(path: Path) -> list[InputSet]:
    sets: dict[int, InputSet] = {}
    with np.load(path, allow_pickle=False) as data:
        for key in data.files:
            kind, _, rest = key.partition(":")
            index, _, name = rest.partition("/")
            one = sets.setdefault(int(index), {})
            if kind == "a":
                one[name] = data[key]
            elif kind in ("s", "b"):
                one[name] = _unpadded(data[key], data[f"n:{rest}"])
    return [sets[i] for i in sorted(sets)]


def _unpadded(padded: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """numpy's fixed-width strings and bytes lose their trailing NULs: the saved lengths put them back."""
    pad = b"\0" if padded.dtype.kind == "S" else "\0"
    flat = [v.ljust(n, pad)[:n] for v, n in zip(padded.ravel().tolist(), lengths.ravel().tolist())]
    arr = np.empty(len(flat), dtype=object)
    arr[:] = flat
    return arr.reshape(padded.shape)


def _encode(key: str, arr: np.ndarray) -> dict[str, np.ndarray]:
    if arr.dtype.kind != "O" and arr.dtype.kind not in "SU":
        return {f"a:{key}": arr}
    flat = arr.ravel().tolist()
    if any(isinstance(v, bytes) for v in flat):
        width = max((len(b) for b in flat), default=0) or 1
        return {f"b:{key}": np.array(flat, dtype=f"S{width}").reshape(arr.shape),
                f"n:{key}": np.array([len(b) for b in flat], dtype=np.int64).reshape(arr.shape)}  # fmt: skip
    return {f"s:{key}": np.asarray(arr.tolist(), dtype=str).reshape(arr.shape),
            f"n:{key}": np.array([len(str(s)) for s in flat], dtype=np.int64).reshape(arr.shape)}  # fmt: skip
