"""Tensors of text and of raw bytes: the two spec dtypes numpy has no fixed element type for.

``string`` tensors hold text: numpy unicode arrays, or object arrays of ``str``.
``bytes`` tensors hold binary data (an image or audio file, a serialized
record): object arrays whose elements are all Python ``bytes``.

A numpy ``S`` array is not a bytes tensor: numpy pads its elements with NUL
bytes and drops trailing ones when it gives them back (``np.array([b"a\\0"])[0]
== b"a"``), so binary data in it may already be cut short, without a word.
:func:`to_bytes_array` builds a bytes tensor from the original ``bytes`` objects.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from neuropod.errors import NeuropodError

if TYPE_CHECKING:
    from neuropod.spec import TensorSpec

#: The spec dtypes whose tensors are numpy object (or unicode) arrays rather than arrays of one numpy dtype.
TEXT_DTYPES = frozenset({"string", "bytes"})

#: How a bytes tensor is held, for error messages.
BYTES_FORM = "an object array of bytes (neuropod.spec.to_bytes_array([b'...', ...]))"


def blank(dtype: str) -> str | bytes:
    """The empty element of a ``string`` (``""``) or ``bytes`` (``b""``) tensor, to fill one with."""
    return b"" if dtype == "bytes" else ""


def text_problem(arr: np.ndarray, dtype: str, name: str, kind: str) -> tuple[str, str] | None:
    """Why ``arr`` does not fit a ``string`` or ``bytes`` spec entry, as (sentence, detail); None when it does.

    :param kind: ``"input"`` or ``"output"``, for the message.
    """
    k = arr.dtype.kind
    if dtype == "bytes":
        if k == "O":
            for item in arr.flat:
                if not isinstance(item, bytes):
                    hint = "; encode text first, or declare the tensor as string" if isinstance(item, str) else ""
                    return (
                        f"Tensor {name!r} in the {kind} spec is expected to hold bytes (a bytes tensor), "
                        f"but an element is {kind_of(item)} ({item!r:.40})", f"{BYTES_FORM}{hint}",
                    )  # fmt: skip
            return None
        hint = ("; a numpy 'S' array drops trailing NUL bytes, so build the tensor from the bytes objects themselves"
                if k == "S" else "")  # fmt: skip
        return (
            f"Tensor {name!r} in the {kind} spec is expected to be of type bytes, but was of type {arr.dtype}",
            f"{BYTES_FORM}{hint}",
        )
    if k == "U":
        return None
    if k == "O":
        for item in arr.flat:
            if type(item) is not str and not isinstance(item, str):
                return (
                    f"Tensor {name!r} in the {kind} spec is expected to hold str (a string tensor), "
                    f"but an element is {kind_of(item)} ({item!r:.40})", "",
                )  # fmt: skip
        return None
    hint = "; decode bytes to str first" if k == "S" else ""
    return (
        f"Tensor {name!r} in the {kind} spec is expected to be of type string, but was of type {arr.dtype}",
        f"a numpy unicode array or an object array of str{hint}",
    )


def to_string_array(values: Any) -> np.ndarray:
    """Turn a sequence or array of str (or bytes, decoded as UTF-8) into a string tensor.

    A numpy unicode array, or an object array of str when an element ends
    with a NUL character: numpy's unicode dtype pads with NULs and drops
    trailing ones, so only an object array gives those strings back exactly.
    """
    arr = np.asarray(values, dtype=object)
    flat = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in arr.flat]
    if not flat:
        return np.zeros(arr.shape, dtype="<U1")
    if any(s.endswith("\0") for s in flat):
        exact = np.empty(len(flat), dtype=object)
        exact[:] = flat
        return exact.reshape(arr.shape)
    return np.array(flat, dtype=str).reshape(arr.shape)


def to_bytes_array(values: Any) -> np.ndarray:
    """Turn a (nested) sequence or array of bytes into a bytes tensor: an object array of ``bytes``.

    ``bytearray``, ``memoryview`` and other bytes-like elements are copied into
    ``bytes``. Text is refused (encode it first, or use a ``string`` tensor).
    From a numpy ``S`` array the elements come as numpy gives them, without
    their trailing NUL bytes.

    :raises TypeError: an element is not bytes-like.
    """
    if isinstance(values, (bytes, bytearray, memoryview)):
        values = [values]  # one element, not a sequence of ints
        shape: tuple[int, ...] = ()
    else:
        arr = np.asarray(values, dtype=object) if not isinstance(values, np.ndarray) else values
        shape = arr.shape
        values = arr.ravel().tolist() if arr.dtype.kind == "S" else list(arr.flat)
    flat: list[bytes] = []
    for value in values:
        if isinstance(value, bytes):
            flat.append(bytes(value) if type(value) is not bytes else value)
        elif isinstance(value, (bytearray, memoryview)):
            flat.append(bytes(value))
        else:
            raise TypeError(
                f"to_bytes_array: an element is {kind_of(value)} ({value!r:.40}), not bytes"
                + (
                    "; encode text first (e.g. text.encode('utf-8')), or use a string tensor"
                    if isinstance(value, str)
                    else ""
                )
            )
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(shape)


def refuse_dtypes(
    model: str, inputs: Iterable[TensorSpec], outputs: Iterable[TensorSpec], dtypes: Collection[str], backend: str
) -> None:
    """For a backend's packager and load hook: refuse a model with a tensor of a dtype the backend cannot take
    (``bytes`` for every backend but python and tensorflow), before the framework sees it.

    :param model: the model's name, for the message.
    :param backend: the backend's name, for the message (``"onnx"``).
    :raises NeuropodError: naming the model, the tensors and their dtype, and the backends that take them.
    """
    found = [(kind, s) for kind, specs in (("input", inputs), ("output", outputs)) for s in specs if s.dtype in dtypes]
    if found:
        names = ", ".join(f"{kind} {s.name!r} ({s.dtype})" for kind, s in found)
        kinds = sorted({s.dtype for _, s in found})
        instead = "; use the python or tensorflow backend" if kinds == ["bytes"] else ""
        raise NeuropodError(
            f"Model {model!r}: backend {backend} cannot take {' or '.join(kinds)} tensors ({names}){instead}"
        )


def kind_of(value: Any) -> str:
    """A value's kind as messages name it: its type's name, or ``null`` for None."""
    return "null" if value is None else type(value).__name__


__all__ = ["BYTES_FORM", "TEXT_DTYPES", "blank", "kind_of", "refuse_dtypes", "text_problem", "to_bytes_array", "to_string_array"]
